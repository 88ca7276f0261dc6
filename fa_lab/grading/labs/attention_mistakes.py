"""Attention and online softmax, right and with the mistakes learners typically make.

A judge runs these on the inputs of a failing case; when the learner's outputs
match a mistake's, the diagnosis names that mistake. Masks, scales and the
backward do not depend on tiling, so they are computed whole, in float64. The
online softmax streams block by block, in float32 like the learner's code, because
its mistakes depend on where the blocks end and on where exp overflows.
Learner code may not call this module (the grader treats it as a solution).
"""
from __future__ import annotations

import torch

from ...block_info import causal_visible
from ...reference import softmax_with_lse


def causal_mask_with_offset(seqlen_q: int, seqlen_k: int, offset: int) -> torch.Tensor:
    """(Nq, Nk) bool: query i sees key j when j <= i + offset.

    offset = Nk - Nq is the course's bottom-right mask; 0 is top-left; +1 / -1 are
    the off-by-one masks.
    """
    return causal_visible(torch.arange(seqlen_q)[:, None], torch.arange(seqlen_k)[None, :], offset)


def scores(q, k, scale: float, mask) -> torch.Tensor:
    """S = scale * q k^T in float64, -inf where ``mask`` (Nq, Nk) is False. (B, H, Nq, Nk)."""
    s = torch.matmul(q.double(), k.double().transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def attention(q, k, v, scale: float, mask):
    """Exact attention under any mask: (out (B, H, Nq, d), lse (B, H, Nq)), float64."""
    p, lse = softmax_with_lse(scores(q, k, scale, mask))
    return torch.matmul(p, v.double()), lse


def stream_softmax(score_blocks, value_blocks=None, *, rescale_l=True, rescale_acc=True, flip=False,
                   guard=True, running_max=True, subtract_max=True, dtype=torch.float32):
    """Fold score blocks (..., Bc_j) into (m, l, acc) as FlashAttention does, or with one mistake.

    value_blocks: (..., Bc_j, d) per block, or None (acc is then None).
    rescale_l / rescale_acc=False: the old sum / accumulator is not multiplied by alpha.
    flip: alpha = exp(m_new - m_old) instead of exp(m_old - m_new).
    guard=False: a row whose max is still -inf gives exp(-inf - (-inf)) = NaN.
    running_max=False: m is the max of the latest block only.
    subtract_max=False: exp(s) summed directly (and nothing is rescaled).
    dtype: the precision of the stream; float32 by default, as the lab asks, so that exp
    overflows (and gives inf and NaN) exactly where the learner's would.
    Returns m, l: (...,) and acc: (..., d) or None, in dtype.
    """
    first = score_blocks[0]
    m = torch.full(first.shape[:-1], float("-inf"), dtype=dtype)
    l = torch.zeros(first.shape[:-1], dtype=dtype)
    acc = None if value_blocks is None else torch.zeros((*first.shape[:-1], value_blocks[0].shape[-1]),
                                                        dtype=dtype)
    for j, block in enumerate(score_blocks):
        block = block.to(dtype)
        m_new = torch.maximum(m, block.amax(dim=-1)) if running_max else block.amax(dim=-1)
        m_used = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new) if guard else m_new
        if subtract_max:
            alpha = torch.exp(m_used - m) if flip else torch.exp(m - m_used)
            p = torch.exp(block - m_used[..., None])
        else:
            alpha, p = torch.ones_like(m), torch.exp(block)
        l = (alpha * l if rescale_l else l) + p.sum(dim=-1)
        if value_blocks is not None:
            pv = torch.matmul(p, value_blocks[j].to(dtype))
            acc = (alpha[..., None] * acc if rescale_acc else acc) + pv
        m = m_new
    return m, l, acc


def tiled_forward(q, k, v, scale: float, mask, block_k: int, normalize: bool = True, **mistakes):
    """The forward over key blocks of ``block_k``: (out (B, H, Nq, d), lse (B, H, Nq)).

    mistakes: the keyword arguments of :func:`stream_softmax` (float32 unless its
    dtype says otherwise); normalize=False leaves out unnormalized (acc, not acc / l).
    """
    s = scores(q, k, scale, mask)
    seqlen_k = k.shape[-2]
    starts = range(0, seqlen_k, block_k)
    m, l, acc = stream_softmax([s[..., j:j + block_k] for j in starts],
                               [v[..., j:j + block_k, :] for j in starts], **mistakes)
    out = acc / torch.where(l == 0, torch.ones_like(l), l)[..., None] if normalize else acc
    return out, m + torch.log(l)


def recompute_backward(q, k, v, out, lse, dout, mask, score_scale: float, grad_scale: float,
                       use_delta: bool = True, guard: bool = True):
    """The recomputation backward, whole, in float64, or with one mistake.

    score_scale: the scale used to recompute S; grad_scale: the one applied to dS K
    and dS^T Q (both are the softmax scale when right). use_delta=False drops
    D = rowsum(dO * O). guard=False lets rows with lse = -inf give NaN.
    Returns (dq, dk, dv), float64.
    """
    q, k, v, out, dout = (t.double() for t in (q, k, v, out, dout))
    lse = lse.double()
    if guard:
        lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    p = torch.exp(scores(q, k, score_scale, mask) - lse[..., None])
    dv = torch.matmul(p.transpose(-2, -1), dout)
    dp = torch.matmul(dout, v.transpose(-2, -1))
    delta = (dout * out).sum(dim=-1, keepdim=True) if use_delta else 0.0
    ds = p * (dp - delta)
    return (torch.matmul(ds, k) * grad_scale, torch.matmul(ds.transpose(-2, -1), q) * grad_scale, dv)
