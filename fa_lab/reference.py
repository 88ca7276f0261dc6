"""Naive attention that materializes S and P, and the float64 reference.

``naive_attention`` is the baseline the course measures: it writes the
(Nq, Nk) score matrix S and the probability matrix P in the input dtype, exactly
as frameworks did before FlashAttention. ``reference_attention`` upcasts to
float64 (the ground truth of every test).
"""
from __future__ import annotations

import torch

from .block_info import BlockInfo


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bottom-right aligned causal mask, (Nq, Nk) bool, True where a key is visible.

    Query ``i`` sees key ``j`` when ``j <= i + seqlen_k - seqlen_q``, as in
    flash-attn >= 2.1 (:class:`fa_lab.block_info.BlockInfo` owns the rule). With Nq > Nk
    the first ``Nq - Nk`` rows see nothing.
    """
    return BlockInfo(seqlen_q, seqlen_k, causal=True).mask(device=device)


def softmax_with_lse(s: torch.Tensor):
    """Safe softmax along the last dim, returning (P, lse); rows of all -inf give P = 0, lse = -inf.

    s: (..., Nq, Nk). lse: (..., Nq), natural log, same dtype as s.
    """
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a fully masked row has max -inf
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(l)).squeeze(-1)  # log(0) = -inf for a row that sees no key
    p = p / torch.where(l == 0, torch.ones_like(l), l)
    return p, lse


def naive_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """Standard attention in the dtype of q: S = scale * q k^T, P = softmax(S), O = P v.

    q: (B, H, Nq, d), k, v: (B, H, Nk, d). Returns (out: (B, H, Nq, d) in q.dtype,
    lse: (B, H, Nq) float32). Autograd differentiates it directly.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    p, lse = softmax_with_lse(s)
    return torch.matmul(p.to(v.dtype), v), lse.float()


def reference_attention(q, k, v, causal: bool = False, scale: float | None = None,
                        upcast: bool = True, reorder_ops: bool = False):
    """The ground truth: attention in float64 (``upcast``), as in flash-attn's tests.

    ``reorder_ops`` scales q before the product instead of S after it, which
    changes the rounding order (useful to measure how much rounding alone moves
    the result). Returns (out, lse) in float64 when ``upcast`` (else in q.dtype, lse float32).
    """
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if reorder_ops:
        s = torch.matmul(q * scale, k.transpose(-2, -1))
    else:
        s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    p, lse = softmax_with_lse(s)
    out = torch.matmul(p.to(v.dtype), v)
    return out, (lse if upcast else lse.float())
