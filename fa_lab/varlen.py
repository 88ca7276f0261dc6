"""Packed variable-length batches, flash-attn's ``flash_attn_varlen_func`` layout.

Sequence ``b`` of a batch owns rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` of the packed
``q: (total_q, heads, d)`` and ``k, v: (total_k, heads_kv, d)``: no padding is stored and
none is computed. Masks (causal, windows) are bottom-right aligned inside each sequence,
and a sequence may be empty. The output is packed the same way; the LSE is
``(heads, total_q)`` float32, as flash-attn returns it.

:func:`attention_varlen` with ``impl="triton"`` launches each kernel once for the whole batch:
every program takes one tile of one sequence from a schedule built over the sequences' tiles
(:func:`fa_lab.kernels.portable.attention.varlen_schedule`). ``impl="triton_hopper"`` runs the same
portable kernels (the Gluon forward takes no packed batch): one Gluon launch per sequence was half
as fast (docs/experiments/interfaces.md). The other impls run each sequence through the dense impl
on views of the packed tensors. Either way nothing is padded, and
gradients flow to the packed inputs.
"""
from __future__ import annotations

import torch

from . import impls
from .inputs import check_head_dims, check_heads, check_options, check_tensors
from .score_mods import check_alibi_slopes


def check_cu_seqlens(cu_seqlens, name: str, total: int, device) -> list[int]:
    """The boundaries of ``cu_seqlens`` (int32 (batch + 1,), from 0, non-decreasing, ending at
    ``total``, on ``device``) as a list of ints."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (as flash-attn takes it), got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor of batch + 1 offsets, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != torch.device(device):
        raise ValueError(f"{name} is on {cu_seqlens.device} but q is on {device}; they must match")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[0]}")
    steps = [b - a for a, b in zip(bounds, bounds[1:])]
    if any(step < 0 for step in steps):
        where = next(i for i, step in enumerate(steps) if step < 0)
        raise ValueError(f"{name} must be non-decreasing, but {name}[{where + 1}] = {bounds[where + 1]} < "
                         f"{name}[{where}] = {bounds[where]}")
    if bounds[-1] != total:
        raise ValueError(f"{name} ends at {bounds[-1]} but the packed tensor holds {total} tokens")
    return bounds


def _check_max_seqlen(max_seqlen, name: str, lengths: list[int]) -> None:
    longest = max(lengths, default=0)
    if max_seqlen is None:
        return
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"{name} must be an int or None, got {type(max_seqlen).__name__}")
    if max_seqlen < longest:
        raise ValueError(f"{name} is {max_seqlen} but the longest sequence has {longest} tokens; "
                         "a smaller max_seqlen would silently drop tokens")


def _check_packed(q, k, v) -> None:
    """q: (total_q, H, d), k, v: (total_k, Hkv, d); a total may be 0."""
    check_tensors(q, k, v, "(total_tokens, heads, head_dim)", empty_ok=True)
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"v holds {v.shape[0]} tokens but k holds {k.shape[0]}; they must match")
    check_heads(q.shape[1], k.shape[1], v.shape[1])
    check_head_dims(q.shape[2], k.shape[2], v.shape[2])


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     causal: bool = False, scale: float | None = None, impl: str = "torch",
                     return_lse: bool = False, window=(-1, -1), softcap: float = 0.0, alibi_slopes=None):
    """Attention over a packed batch of sequences of different lengths.

    q: (total_q, heads, d); k, v: (total_k, heads_kv, d); cu_seqlens_q, cu_seqlens_k: int32
    (batch + 1,). max_seqlen_*: optional, at least the longest length. alibi_slopes: float32
    (heads,) or (batch, heads). Other arguments as :func:`fa_lab.attention`. Returns out
    (total_q, heads, d) or (out, lse) with lse (heads, total_q) float32, detached.
    """
    _check_packed(q, k, v)
    causal, scale, window, softcap = check_options(q.shape[-1], causal, scale, window, softcap)
    bounds_q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device)
    bounds_k = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], q.device)
    if len(bounds_q) != len(bounds_k):
        raise ValueError(f"cu_seqlens_q describes {len(bounds_q) - 1} sequences but cu_seqlens_k "
                         f"{len(bounds_k) - 1}; they must match")
    batch, heads = len(bounds_q) - 1, q.shape[1]
    lengths_q = [b - a for a, b in zip(bounds_q, bounds_q[1:])]
    _check_max_seqlen(max_seqlen_q, "max_seqlen_q", lengths_q)
    _check_max_seqlen(max_seqlen_k, "max_seqlen_k", [b - a for a, b in zip(bounds_k, bounds_k[1:])])
    slopes = check_alibi_slopes(alibi_slopes, batch, heads, q.device)
    if impl not in impls.IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, impls.IMPLS))}; got {impl!r}")
    if impl in ("triton", "triton_hopper"):  # one launch per kernel: the kernels walk each sequence's tiles
        from .kernels import triton_varlen_attention
        out, lse = triton_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, (bounds_q, bounds_k), causal,
                                           scale, window, softcap, slopes)
        return (out, lse.detach()) if return_lse else out
    outs, lses = [], []
    for b in range(batch):
        (q0, q1), (k0, k1) = bounds_q[b:b + 2], bounds_k[b:b + 2]
        if q1 == q0:
            continue
        if k1 == k0:  # no key at all: zeros and lse = -inf, as for any row that sees no key
            outs.append(q.new_zeros(q1 - q0, heads, q.shape[2]))
            lses.append(torch.full((heads, q1 - q0), float("-inf"), device=q.device))
            continue
        dense = [t[a:e].transpose(0, 1)[None] for t, (a, e) in ((q, (q0, q1)), (k, (k0, k1)), (v, (k0, k1)))]
        out, lse = impls.run(*dense, causal, scale, impl, window, softcap,
                             None if slopes is None else slopes[b:b + 1])
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs) if outs else q.new_zeros(0, heads, q.shape[2])
    lse = torch.cat(lses, dim=1) if lses else torch.zeros(heads, 0, device=q.device)
    return (out, lse.detach()) if return_lse else out
