"""Triton kernels and their launchers: the lazy entry of impl "triton", "triton_hopper", "triton_hopper_fp8"
(and of the sparse kernels that :mod:`fa_lab.sparse` runs with impl="triton", and the linear-attention
kernels of :mod:`fa_lab.linear`).

:mod:`.portable` holds the plain-Triton kernels (any CUDA GPU, and the CPU interpreter),
:mod:`.hopper` the Gluon FA3 kernel for sm_90 and the Hopper impls, :mod:`.common` what they share.

Triton reads ``TRITON_INTERPRET`` when a function is decorated with
``@triton.jit``, its own library functions (``tl.max``, ``tl.sum``, ...) included,
which are decorated when triton is first imported. So ``import fa_lab`` switches
the interpreter on for a machine without CUDA (:func:`use_interpreter_without_gpu`)
before anything imports triton, and triton itself is imported lazily here: a
learner never sets an environment variable.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys

import torch


def use_interpreter_without_gpu() -> None:
    """Set TRITON_INTERPRET=1 when no CUDA GPU is present (a value the user set wins)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def load_triton():
    """Import triton, turning the interpreter on first when no CUDA GPU is present.

    Raises ImportError with set-up advice when Triton is not installed (it publishes
    Linux wheels only), and RuntimeError when triton was imported before the
    interpreter could be switched on.
    """
    global _LOADED
    if _LOADED is not None and not interpreting():  # (every launch path calls this: keep it short)
        return _LOADED
    imported_before = "triton" in sys.modules
    use_interpreter_without_gpu()
    try:
        triton = importlib.import_module("triton")
    except ImportError as exc:  # pragma: no cover - depends on the platform
        raise ImportError(
            "impl='triton' needs Triton, which publishes Linux wheels only. On macOS or "
            "Windows run the course in WSL, a Linux container or a hosted notebook "
            "(see README.md, 'Running the Triton chapters')."
        ) from exc
    if interpreting() and imported_before:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(triton.language.standard.max, InterpretedFunction):
            raise RuntimeError(
                "triton was imported before the Triton interpreter was switched on, so its kernels "
                "cannot run on this CPU. Restart the Python kernel and import fa_lab before triton, "
                "or set TRITON_INTERPRET=1 before importing triton."
            )
    if interpreting():
        from .interpreter_fixes import patch_bfloat16, patch_descriptor_reduce
        interpreter_module = importlib.import_module("triton.runtime.interpreter")
        patch_bfloat16(interpreter_module)
        patch_descriptor_reduce(interpreter_module)
    else:
        _LOADED = triton
    return triton


_LOADED = None  # triton, once load_triton has imported it for compiled kernels


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_attention(q, k, v, causal, scale, **configs):
    """Differentiable Triton attention: returns (out, lse). See :mod:`fa_lab.kernels.portable.attention`."""
    load_triton()
    from .portable.attention import triton_attention as run
    return run(q, k, v, causal, scale, **configs)


def triton_backward_from_lse(q, k, v, out, lse, grad_out, causal, scale):
    """The Triton backward of one call given its (merged) out and LSE: (dq, dk, dv).
    See :mod:`fa_lab.kernels.portable.attention`."""
    load_triton()
    from .portable.attention import triton_backward_from_lse as run
    return run(q, k, v, out, lse, grad_out, causal, scale)


def triton_varlen_attention(q, k, v, cu_q, cu_k, bounds, causal, scale, *options, hopper: bool = False):
    """Differentiable Triton attention of a packed batch. See :mod:`fa_lab.kernels.portable.attention`;
    hopper: the forward and backward of impl="triton_hopper"
    (:func:`fa_lab.kernels.hopper.attention.hopper_varlen_forward` and ``hopper_varlen_backward``)."""
    load_triton()
    from .portable.attention import triton_varlen_attention as run
    forward_fn = backward_fn = None
    if hopper:
        from .hopper.attention import hopper_varlen_backward as backward_fn
        from .hopper.attention import hopper_varlen_forward as forward_fn
    return run(q, k, v, cu_q, cu_k, bounds, causal, scale, *options, forward_fn=forward_fn, backward_fn=backward_fn)


def triton_decode(*args, **kwargs):
    """Split-KV decoding over a (paged) KV cache. See :mod:`fa_lab.kernels.portable.decode`."""
    load_triton()
    from .portable.decode import triton_decode as run
    return run(*args, **kwargs)


def triton_block_select_attention(q, k, v, block_indices, block_k, causal=False, scale=None, *, block_q=1,
                                  name="block_indices"):
    """Differentiable attention over selected key blocks (NSA's selected branch, block-sparse attention):
    returns (out, lse); ``name``: the selection's argument name in error messages. See
    :mod:`fa_lab.kernels.portable.sparse_select`."""
    load_triton()
    from .portable.sparse_select import triton_block_select_attention as run
    return run(q, k, v, block_indices, block_k, causal, scale, block_q=block_q, name=name)


def triton_nsa_importance(q, k_cmp, lse_cmp, block_cmp, block_sel, scale, top_n=0):
    """NSA's selection scores (:func:`fa_lab.sparse.nsa_importance`) from q (B, H, N, d), the compressed keys and
    the compressed branch's lse, without materializing its probabilities: float32 (B, H_kv, N, selection blocks);
    with top_n > 0 the selection itself (:func:`fa_lab.sparse.nsa_select`), int64 (B, H_kv, N, top_n), the scores
    never stored. See :mod:`fa_lab.kernels.portable.nsa_importance`."""
    load_triton()
    from .common import check_triton_inputs
    from .portable.nsa_importance import triton_nsa_importance as run
    check_triton_inputs(q)
    return run(q, k_cmp, lse_cmp, block_cmp, block_sel, scale, top_n)


def triton_nsa_compressed(q, k_cmp, v_cmp, block_cmp, scale):
    """NSA's compressed branch (:func:`fa_lab.sparse.nsa_compressed_attention`) on impl="triton_hopper"'s dense
    kernels, q read and O written in place through strided views: (out (B, H, N, d), lse (B, H, N) float32),
    differentiable. See :mod:`fa_lab.kernels.hopper.nsa_compressed`."""
    load_triton()
    from .common import check_triton_inputs
    from .hopper.nsa_compressed import CompressedAttention
    check_triton_inputs(q)
    return CompressedAttention.apply(q, k_cmp, v_cmp, block_cmp, scale)


def triton_nsa_gate_mix(gates, out_cmp, out_sel, out_win):
    """NSA's gated sum of its three branches (B, H, N, d) in one pass, differentiable. See
    :mod:`fa_lab.kernels.portable.nsa_gate`."""
    load_triton()
    from .portable.nsa_gate import triton_nsa_gate_mix as run
    return run(gates, out_cmp, out_sel, out_win)


def triton_moba_gate(q, pooled, block, top_k):
    """MoBA's selection (:func:`fa_lab.sparse.moba_gate`) from q (B, H, N, d) and the blocks' mean keys
    (B, H_kv, blocks, d) float32, in one kernel: int64 (B, H, N, top_k), or None past the kernel's limit on
    blocks (the caller then scores in PyTorch). See :mod:`fa_lab.kernels.portable.moba`."""
    load_triton()
    from .common import check_triton_inputs
    from .portable.moba import GATE_BLOCKS
    from .portable.moba import triton_moba_gate as run
    check_triton_inputs(q)
    return run(q, pooled, block, top_k) if pooled.shape[2] <= GATE_BLOCKS else None


def triton_moba_attention(q, k, v, select, block, scale):
    """Differentiable MoBA (its two passes on chapter 05's kernels, merged by their LSE): returns (out, lse).
    select: () -> the gate's selection (B, H, N, top_k), called once the first pass is queued.
    On sm_90 the passes run on impl="triton_hopper"'s Gluon FA3 kernels, elsewhere on the portable ones.
    See :mod:`fa_lab.kernels.portable.moba`."""
    load_triton()
    from .common import check_triton_inputs
    from .hopper import attention as hopper
    from .portable.moba import MobaFunction, PassKernels
    check_triton_inputs(q)
    kernels = PassKernels()
    if hopper.uses_gluon(q, hopper.HopperOptions()):
        own, past = hopper.MOBA_PASS_OPTIONS
        kernels = PassKernels(functools.partial(hopper.hopper_forward, options=own), hopper.hopper_backward,
                              functools.partial(hopper.hopper_varlen_forward, hopper=past),
                              hopper.hopper_varlen_backward)
    return MobaFunction.apply(q, k, v, select, block, scale, kernels)


def triton_chunk_linear_attention(q, k, v, g, initial_state, scale, chunk_size):
    """Chunkwise linear attention / simple GLA / GLA, h and o passes: returns (o, final_state).
    See :mod:`fa_lab.kernels.portable.linear_chunk`."""
    load_triton()
    from .portable.linear_chunk import triton_chunk_linear_attention as run
    return run(q, k, v, g, initial_state, scale, chunk_size)


def triton_chunk_delta_rule(q, k, v, beta, g, initial_state, scale, chunk_size):
    """The chunkwise (gated) delta rule: the WY factors, the h and o passes in Triton; returns (o, final_state).
    See :mod:`fa_lab.kernels.portable.linear_delta`."""
    load_triton()
    from .portable.linear_delta import triton_chunk_delta_rule as run
    return run(q, k, v, beta, g, initial_state, scale, chunk_size)


def triton_fused_recurrent(q, k, v, g, beta, initial_state, scale):
    """The recurrence token by token, state in registers (decode; beta: the delta rule): returns
    (o, final_state). See :mod:`fa_lab.kernels.portable.linear_recurrent`."""
    load_triton()
    from .portable.linear_recurrent import triton_fused_recurrent as run
    return run(q, k, v, g, beta, initial_state, scale)


def triton_hopper_attention(q, k, v, causal, scale, **options):
    """The FlashAttention-3-style forward and backward. See :mod:`fa_lab.kernels.hopper.attention`."""
    load_triton()
    from .hopper.attention import triton_hopper_attention as run
    return run(q, k, v, causal, scale, **options)


def triton_hopper_fp8_attention(q, k, v, causal, scale, **options):
    """The FP8 forward (inference only). See :mod:`fa_lab.kernels.hopper.fp8_attention`."""
    load_triton()
    from .hopper.fp8_attention import triton_hopper_fp8_attention as run
    return run(q, k, v, causal, scale, **options)


def triton_hopper_fp8_prequantized(q8, k8, v8, descales, causal, scale, **options):
    """The FP8 forward on inputs already in e4m3 with per-head descales. See
    :func:`fa_lab.kernels.hopper.fp8_attention.triton_hopper_fp8_prequantized`."""
    load_triton()
    from .hopper.fp8_attention import triton_hopper_fp8_prequantized as run
    return run(q8, k8, v8, descales, causal, scale, **options)
