"""Validation of the arguments of :func:`fa_lab.attention`.

Every check raises ``ValueError`` or ``TypeError`` with a message that names the
argument, what it got and what it needs, so that a learner never meets a bare
index error deep inside a kernel.
"""
from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_INPUT_DTYPE = torch.float8_e4m3fn  # already-quantized inputs, with flash-attn's descales
MAX_HEAD_DIM = 256


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_qkv(q, k, v, dtypes=SUPPORTED_DTYPES) -> None:
    """Check q: (B, H, Nq, d), k and v: (B, Hkv, Nk, d) with H a multiple of Hkv, as the API in
    docs/design.md states. dtypes: those accepted (references add float64)."""
    check_tensors(q, k, v, "(batch, heads, seqlen, head_dim)", empty_ok=False, dtypes=dtypes)
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has batch {t.shape[0]} but q has batch {q.shape[0]}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v has seqlen {v.shape[2]} but k has seqlen {k.shape[2]}; they must match")
    check_heads(q.shape[1], k.shape[1], v.shape[1])
    check_head_dims(q.shape[3], k.shape[3], v.shape[3])


def check_tensors(q, k, v, layout: str, empty_ok: bool, dtypes=SUPPORTED_DTYPES) -> None:
    """Types, dimension count (that of ``layout``), dtypes and devices of q, k, v."""
    ndim = layout.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions {layout}, got {t.ndim} dimensions "
                             f"with shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            names = [str(d).removeprefix("torch.") for d in dtypes]
            raise TypeError(f"{name} has dtype {t.dtype}; attention needs {', '.join(names[:-1])} or {names[-1]}")
        if t.numel() == 0 and not (empty_ok and t.shape[0] == 0 and all(t.shape[1:])):
            raise ValueError(f"{name} is empty ({_describe(t)}); every dimension must be >= 1")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; all three must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all three must match")


def check_heads(heads: int, heads_k: int, heads_v: int) -> None:
    """Grouped-query attention: k and v share a head count that divides q's."""
    if heads_v != heads_k:
        raise ValueError(f"v has {heads_v} heads but k has {heads_k}; they must match")
    if heads % heads_k:
        raise ValueError(f"k and v have {heads_k} heads but q has {heads}: grouped-query attention needs "
                         "the query heads to be a multiple of the key/value heads")


def check_head_dims(head_dim: int, head_dim_k: int, head_dim_v: int) -> None:
    for name, dim in (("k", head_dim_k), ("v", head_dim_v)):
        if dim != head_dim:
            raise ValueError(f"{name} has head_dim {dim} but q has head_dim {head_dim}; they must match")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim is {head_dim}; at most {MAX_HEAD_DIM} is supported")


def resolve_scale(scale, head_dim: int) -> float:
    """Return the softmax scale: ``scale`` if given, else ``head_dim ** -0.5``."""
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    return float(scale)


def check_block_size(name: str, value) -> int:
    """Check a tile size argument (a positive int)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_flag(name: str, value) -> bool:
    """A True/False argument (causal, return_lse): refuse anything else, which would otherwise pass for its truth
    value."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_options(head_dim: int, causal, scale, window, softcap) -> tuple[bool, float, tuple[int, int], float]:
    """(causal, scale, window, softcap) of an attention call, checked: the scale resolved, the mask in
    :func:`fa_lab.block_info.canonical_mask`'s form, the soft cap a float (0.0: off)."""
    from .block_info import canonical_mask
    from .score_mods import check_softcap

    scale = resolve_scale(scale, head_dim)
    causal, window = canonical_mask(check_flag("causal", causal), window)
    return causal, scale, window, check_softcap(softcap)



def check_fp8_inputs(q, k, v, descales, impl: str) -> bool:
    """Whether q, k, v come already quantized: float8_e4m3fn with descales = (q_descale, k_descale,
    v_descale), each float32 (batch, heads_kv), flash-attn's convention (x = x8 * descale), for
    ``impl="triton_hopper_fp8"``. False when none is e4m3 and no descale is given; anything in between is
    an error. Descale values are checked (finite, > 0) on the CPU only: a read of a GPU tensor would make
    every call wait for the GPU."""
    names = ("q_descale", "k_descale", "v_descale")
    given = [name for name, d in zip(names, descales) if d is not None]
    in_fp8 = [name for name, t in (("q", q), ("k", k), ("v", v))
              if isinstance(t, torch.Tensor) and t.dtype == FP8_INPUT_DTYPE]
    if not given and not in_fp8:
        return False
    if len(in_fp8) < 3:
        raise TypeError(f"{', '.join(given) if given else ', '.join(in_fp8) + ' in float8_e4m3fn'}: already "
                        f"quantized inputs need q, k and v all in float8_e4m3fn with q_descale, k_descale and "
                        f"v_descale (flash-attn's convention); got {', '.join(in_fp8) or 'none'} in float8_e4m3fn")
    if len(given) < 3:
        missing = [name for name in names if name not in given]
        raise ValueError(f"float8_e4m3fn q, k, v need q_descale, k_descale and v_descale, float32 (batch, "
                         f"heads_kv) each; {', '.join(missing)} missing")
    if impl != "triton_hopper_fp8":
        raise ValueError(f"float8_e4m3fn inputs run with impl='triton_hopper_fp8' only, got impl={impl!r}")
    check_qkv(q, k, v, dtypes=(FP8_INPUT_DTYPE,))
    shape = (q.shape[0], k.shape[1])
    for name, d in zip(names, descales):
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(d).__name__}")
        if d.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {d.dtype}")
        if tuple(d.shape) != shape:
            raise ValueError(f"{name} must have shape (batch, heads_kv) = {shape}, got {tuple(d.shape)}")
        if d.device != q.device:
            raise ValueError(f"{name} is on {d.device} but q is on {q.device}")
        if not d.is_cuda and not (torch.isfinite(d) & (d > 0)).all():
            raise ValueError(f"{name} must be finite and positive")
    return True
