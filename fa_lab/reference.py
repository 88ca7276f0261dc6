"""Naive attention that materializes S and P, and the float64 reference.

``naive_attention`` is the baseline the course measures: it writes the
(Nq, Nk) score matrix S and the probability matrix P in the input dtype, exactly
as frameworks did before FlashAttention. ``reference_attention`` upcasts to
float64 (the ground truth of every test).
"""
from __future__ import annotations

import torch

from .block_info import BlockInfo
from .score_mods import modify_scores


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


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, N, d) -> (B, heads, N, d): query head h reads key/value head h // (heads // Hkv),
    flash-attn's and SDPA's (enable_gqa) convention. A copy; autograd sums the gradient over each group."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def attention_scores(q, k, scale: float, causal: bool = False, window=(-1, -1), softcap: float = 0.0,
                     alibi_slopes=None) -> torch.Tensor:
    """The (B, H, Nq, Nk) scores in q's dtype: scale * q k^T, soft-capped, ALiBi added
    (:mod:`fa_lab.score_mods`), -inf where the mask hides a key. alibi_slopes: (B, H) or None."""
    k = expand_kv(k, q.shape[1])
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    info = BlockInfo(q.shape[-2], k.shape[-2], causal, tuple(window))
    if softcap or alibi_slopes is not None:
        rows = torch.arange(info.seqlen_q, device=q.device)[:, None]
        cols = torch.arange(info.seqlen_k, device=q.device)[None, :]
        slopes = None if alibi_slopes is None else alibi_slopes.expand(q.shape[0], q.shape[1])[..., None, None]
        s = modify_scores(s, softcap, slopes, rows, cols, info.offset)
    if info.masked:
        s = s.masked_fill(~info.mask(device=q.device), float("-inf"))
    return s


def naive_attention(q, k, v, causal: bool = False, scale: float | None = None, *, window=(-1, -1),
                    softcap: float = 0.0, alibi_slopes=None):
    """Standard attention in the dtype of q: S = scale * q k^T, P = softmax(S), O = P v.

    q: (B, H, Nq, d), k, v: (B, Hkv, Nk, d) with H a multiple of Hkv. window, softcap,
    alibi_slopes: as :func:`fa_lab.attention`. Returns (out: (B, H, Nq, d) in q.dtype,
    lse: (B, H, Nq) float32). Autograd differentiates it directly.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = attention_scores(q, k, scale, causal, window, softcap, alibi_slopes)
    p, lse = softmax_with_lse(s)
    return torch.matmul(p.to(v.dtype), expand_kv(v, q.shape[1])), lse.float()


def reference_attention(q, k, v, causal: bool = False, scale: float | None = None,
                        upcast: bool = True, reorder_ops: bool = False, *, window=(-1, -1),
                        softcap: float = 0.0, alibi_slopes=None):
    """The ground truth: attention in float64 (``upcast``), as in flash-attn's tests.

    ``reorder_ops`` scales q before the product instead of S after it, which
    changes the rounding order (useful to measure how much rounding alone moves
    the result). Options as :func:`naive_attention` (ALiBi slopes are upcast too).
    Returns (out, lse) in float64 when ``upcast`` (else in q.dtype, lse float32).
    """
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
        alibi_slopes = None if alibi_slopes is None else alibi_slopes.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if reorder_ops:
        s = attention_scores(q * scale, k, 1.0, causal, window, softcap, alibi_slopes)
    else:
        s = attention_scores(q, k, scale, causal, window, softcap, alibi_slopes)
    p, lse = softmax_with_lse(s)
    out = torch.matmul(p.to(v.dtype), expand_kv(v, q.shape[1]))
    return out, (lse if upcast else lse.float())
