"""flash-attn 2's varlen entry points served by flash-attn-4's kernels, for a peer that calls flash-attn 2
on a machine that has only flash-attn-4: fla-core's MoBA (``fla.ops.moba``) imports
``flash_attn.flash_attn_varlen_func`` and ``flash_attn.flash_attn_interface._flash_attn_varlen_forward`` /
``_flash_attn_varlen_backward``, and the H200 here has flash-attn-4 (whose SM90 kernels are FA3's design,
faster than flash-attn 2's), not flash-attn 2. Benchmarking only.

What differs from flash-attn 2: ``cu_seqlens`` are cast to int32 (flash-attn-4 takes nothing else); the
backward is never the deterministic one (the caller's ``deterministic`` is ignored: flash-attn 2's
deterministic dQ is the slower, so the peer can only gain); dropout, ALiBi and returning the softmax are
refused.
"""
from __future__ import annotations

import sys
import types

FA2 = "flash-attn 2"
FA4_THROUGH_FA2_API = "flash-attn-4 through flash-attn 2's varlen API (fa_lab.bench.fa2_api)"


def _window(size: int):
    return None if size is None or size < 0 else size


def varlen_api(fa4) -> dict:
    """The three flash-attn 2 functions, as closures over flash-attn-4's ``flash_attn.cute.interface``."""

    def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                       softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                       alibi_slopes=None, return_softmax=False, **_):
        """(out (total_q, H, d), lse (H, total_q) float32, None, None), as flash-attn 2 returns them."""
        if dropout_p or alibi_slopes is not None or return_softmax:
            raise NotImplementedError("the flash-attn-4 shim has no dropout, ALiBi or returned softmax")
        out, lse = fa4._flash_attn_fwd(
            q, k, v, cu_seqlens_q=cu_seqlens_q.int(), cu_seqlens_k=cu_seqlens_k.int(), max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, softcap=softcap or None,
            window_size_left=_window(window_size_left), window_size_right=_window(window_size_right),
            return_lse=True)[:2]
        return out, lse, None, None

    def varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, window_size_left=-1,
                        window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None,
                        **_):
        """Writes dq, dk, dv (flash-attn 2's in-place contract) and returns them."""
        if dropout_p or alibi_slopes is not None:
            raise NotImplementedError("the flash-attn-4 shim has no dropout or ALiBi")
        fa4._flash_attn_bwd(
            q, k, v, out, dout, softmax_lse, softmax_scale=softmax_scale, causal=causal, softcap=softcap,
            window_size_left=_window(window_size_left), window_size_right=_window(window_size_right),
            cu_seqlens_q=cu_seqlens_q.int(), cu_seqlens_k=cu_seqlens_k.int(), max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, dq=dq, dk=dk, dv=dv)
        return dq, dk, dv, None

    return {"_flash_attn_varlen_forward": varlen_forward, "_flash_attn_varlen_backward": varlen_backward,
            "flash_attn_varlen_func": fa4.flash_attn_varlen_func}


def install_fa2_varlen_api() -> str | None:
    """Make ``flash_attn.flash_attn_interface`` importable: flash-attn 2's own when installed, else the
    functions of :func:`varlen_api` over flash-attn-4. Returns which (:data:`FA2` or
    :data:`FA4_THROUGH_FA2_API`), or None when neither package is there. Call it before the peer's first
    import (fla's MoBA looks the functions up when its module is imported)."""
    if getattr(sys.modules.get("flash_attn.flash_attn_interface"), "served_by_fa4", False):
        return FA4_THROUGH_FA2_API
    try:
        import flash_attn.flash_attn_interface  # noqa: F401
        return FA2
    except ImportError:
        pass
    try:
        import flash_attn
        from flash_attn.cute import interface as fa4
    except ImportError:
        return None
    module = types.ModuleType("flash_attn.flash_attn_interface")
    module.served_by_fa4 = True
    for name, function in varlen_api(fa4).items():
        setattr(module, name, function)
    sys.modules[module.__name__] = module
    flash_attn.flash_attn_interface = module
    flash_attn.flash_attn_varlen_func = module.flash_attn_varlen_func
    return FA4_THROUGH_FA2_API
