"""Validation of the arguments of :func:`fa_lab.attention`.

Every check raises ``ValueError`` or ``TypeError`` with a message that names the
argument, what it got and what it needs, so that a learner never meets a bare
index error deep inside a kernel.
"""
from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_qkv(q, k, v) -> None:
    """Check q: (B, H, Nq, d), k and v: (B, Hkv, Nk, d) as the API in docs/design.md states."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, heads, seqlen, head_dim), "
                f"got {t.ndim} dimensions with shape {tuple(t.shape)}"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; attention needs float32, float16 or bfloat16"
            )
        if t.numel() == 0:
            raise ValueError(f"{name} is empty ({_describe(t)}); every dimension must be >= 1")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; all three must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all three must match")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has batch {t.shape[0]} but q has batch {q.shape[0]}")
        if t.shape[1] != q.shape[1]:
            raise ValueError(
                f"{name} has {t.shape[1]} heads but q has {q.shape[1]}; grouped-query attention "
                "(fewer key/value heads) is not supported yet, so the head counts must be equal"
            )
        if t.shape[3] != q.shape[3]:
            raise ValueError(
                f"{name} has head_dim {t.shape[3]} but q has head_dim {q.shape[3]}; they must match"
            )
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v has seqlen {v.shape[2]} but k has seqlen {k.shape[2]}; they must match")
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim is {q.shape[3]}; at most {MAX_HEAD_DIM} is supported")


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
