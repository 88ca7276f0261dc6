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


def causal_rule(seqlen_q: int, seqlen_k: int, formula: bool = False) -> str:
    """The causal rule in words for these lengths; formula=True spells out j <= i + Nk - Nq even when Nq = Nk."""
    offset = seqlen_k - seqlen_q
    if not (offset or formula):
        return "query i sees keys j <= i"
    shift = f" {'+' if offset > 0 else '-'} {abs(offset)}" if offset else ""
    return f"query i sees keys j <= i + Nk - Nq, here j <= i{shift}"


def offset_mask(rows: torch.Tensor, cols: torch.Tensor, offset: int) -> torch.Tensor:
    """(len(rows), len(cols)) bool: query rows[a] sees key cols[b] when cols[b] <= rows[a] + offset."""
    return causal_visible(rows[:, None], cols[None, :], offset)


def causal_mask_with_offset(seqlen_q: int, seqlen_k: int, offset: int) -> torch.Tensor:
    """(Nq, Nk) bool: query i sees key j when j <= i + offset.

    offset = Nk - Nq is the course's bottom-right mask; 0 is top-left; +1 / -1 are
    the off-by-one masks.
    """
    return offset_mask(torch.arange(seqlen_q), torch.arange(seqlen_k), offset)


def tile_local_mask(seqlen_q: int, seqlen_k: int, block_q: int, block_k: int, offset: int) -> torch.Tensor:
    """(Nq, Nk) bool: the causal rule applied to positions inside each (block_q, block_k) tile, as a
    tile mask built from torch.arange(i1 - i0) and torch.arange(j1 - j0) instead of the sequence's."""
    rows, cols = torch.arange(seqlen_q) % block_q, torch.arange(seqlen_k) % block_k
    return causal_visible(rows[:, None], cols[None, :], offset)


def visited_keys(seqlen_q: int, seqlen_k: int, block_q: int, block_k: int, end) -> torch.Tensor:
    """(Nq, Nk) bool: the keys of the key blocks that each query's block visits, when the key loop of
    the query block [i0, i1) runs ``for j0 in range(0, end(i0, i1), block_k)`` over [j0, j0 + block_k).

    end(i0, i1) -> int: the loop's end (the judges build the right one and the wrong ones from
    :class:`fa_lab.block_info.BlockInfo`).
    """
    visited = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool)
    block_start = torch.arange(seqlen_k) // block_k * block_k
    for i0 in range(0, seqlen_q, block_q):
        i1 = min(i0 + block_q, seqlen_q)
        visited[i0:i1] = block_start < end(i0, i1)
    return visited


def product(q, k) -> torch.Tensor:
    """q k^T in float64, (B, H, Nq, Nk): computed once per case and passed as ``qk`` to the functions
    below (the judges try many mistakes on the same q and k)."""
    return torch.matmul(q.double(), k.double().transpose(-2, -1))


def scores(q, k, scale: float, mask, qk=None) -> torch.Tensor:
    """S = scale * q k^T in float64, -inf where ``mask`` (Nq, Nk) is False. (B, H, Nq, Nk).
    qk: :func:`product` of q and k, when already computed."""
    s = (product(q, k) if qk is None else qk) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def attention(q, k, v, scale: float, mask, qk=None):
    """Exact attention under any mask: (out (B, H, Nq, d), lse (B, H, Nq)), float64."""
    p, lse = softmax_with_lse(scores(q, k, scale, mask, qk))
    return torch.matmul(p, v.double()), lse


def stream_softmax(score_blocks, value_blocks=None, *, rescale_l=True, rescale_acc=True, flip=False,
                   guard=True, running_max=True, subtract_max=True, update_max=True, m_start=float("-inf"),
                   terms_old_max=False, visits=None, dtype=torch.float32):
    """Fold score blocks (..., Bc_j) into (m, l, acc) as FlashAttention does, or with one mistake.

    value_blocks: (..., Bc_j, d) per block, or None (acc is then None).
    rescale_l / rescale_acc=False: the old sum / accumulator is not multiplied by alpha.
    flip: alpha = exp(m_new - m_old) instead of exp(m_old - m_new).
    guard=False: a row whose max is still -inf gives exp(-inf - (-inf)) = NaN.
    running_max=False: m is the max of the latest block only.
    subtract_max=False: exp(s) summed directly (and nothing is rescaled).
    update_max=False: m is never assigned m_new, so it stays m_start and every block restarts the sums.
    m_start: the running max before the first block (-inf when right; 0 is a mistake).
    terms_old_max: the block's terms are exp(s - m_old) (m_old guarded) instead of exp(s - m_new).
    visits: per block, a bool tensor broadcastable to the rows, False where a row's loop skips the
        block (its state is left as it was), or None (every row sees every block).
    dtype: the precision of the stream; float32 by default, as the lab asks, so that exp
    overflows (and gives inf and NaN) exactly where the learner's would.
    Returns m, l: (...,) and acc: (..., d) or None, in dtype.
    """
    first = score_blocks[0]
    m = torch.full(first.shape[:-1], m_start, dtype=dtype)
    l = torch.zeros(first.shape[:-1], dtype=dtype)
    acc = None if value_blocks is None else torch.zeros((*first.shape[:-1], value_blocks[0].shape[-1]),
                                                        dtype=dtype)
    for j, block in enumerate(score_blocks):
        block = block.to(dtype)
        m_new = torch.maximum(m, block.amax(dim=-1)) if running_max else block.amax(dim=-1)
        m_used = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new) if guard else m_new
        if subtract_max:
            alpha = torch.exp(m_used - m) if flip else torch.exp(m - m_used)
            reference = torch.where(torch.isinf(m), torch.zeros_like(m), m) if terms_old_max else m_used
            p = torch.exp(block - reference[..., None])
        else:
            alpha, p = torch.ones_like(m), torch.exp(block)
        l_new = (alpha * l if rescale_l else l) + p.sum(dim=-1)
        acc_new = None
        if value_blocks is not None:
            pv = torch.matmul(p, value_blocks[j].to(dtype))
            acc_new = (alpha[..., None] * acc if rescale_acc else acc) + pv
        m_next = m_new if update_max else m
        if visits is None:
            m, l, acc = m_next, l_new, acc_new
        else:
            seen = visits[j]
            m, l = torch.where(seen, m_next, m), torch.where(seen, l_new, l)
            acc = None if acc is None else torch.where(seen[..., None], acc_new, acc)
    return m, l, acc


def tiled_forward(q, k, v, scale: float, mask, block_k: int, normalize: bool = True, visited=None, qk=None,
                  **mistakes):
    """The forward over key blocks of ``block_k``: (out (B, H, Nq, d), lse (B, H, Nq)).

    visited: (Nq, Nk) bool, the keys whose blocks each query's loop visits (None: every block);
    a row skips a key block when it visits none of its keys. mistakes: the keyword arguments of
    :func:`stream_softmax` (float32 unless its dtype says otherwise); normalize=False leaves out
    unnormalized (acc, not acc / l). qk: :func:`product` of q and k, when already computed.
    """
    s = scores(q, k, scale, mask, qk)
    seqlen_k = k.shape[-2]
    starts = range(0, seqlen_k, block_k)
    visits = None if visited is None else [visited[:, j] for j in starts]
    m, l, acc = stream_softmax([s[..., j:j + block_k] for j in starts],
                               [v[..., j:j + block_k, :] for j in starts], visits=visits, **mistakes)
    out = acc / torch.where(l == 0, torch.ones_like(l), l)[..., None] if normalize else acc
    return out, m + torch.log(l)


def _last_visit(visited: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    """For each row (dim=1) or key (dim=0) of ``visited``, the index of the last block along the
    other dim that the loop visits for it (-1 when none): block = block_k (dim=1) or block_q (dim=0)."""
    size = visited.shape[dim]
    index = (torch.arange(size) // block).unsqueeze(1 - dim)
    return torch.where(visited, index, torch.full_like(index, -1)).amax(dim=dim)


def recompute_backward(q, k, v, out, lse, dout, mask, score_scale: float, grad_scale: float, *,
                       delta: str = "out", flip_ds: bool = False, guard: bool = True, visited=None,
                       blocks=None, overwrite: str | None = None, qk=None, dp=None):
    """The recomputation backward, whole, in float64, or with one mistake.

    score_scale: the scale used to recompute S; grad_scale: the one applied to dS K
    and dS^T Q (both are the softmax scale when right).
    delta: "out" for D = rowsum(dO * O) (right), "dout" for rowsum(dO), "none" for no D,
        "tile" for D summed over each key tile only, rowsum(P dP) tile by tile (needs blocks).
    flip_ds: dS = P * (D - dP) instead of P * (dP - D).
    guard=False lets rows with lse = -inf give exp(-inf - (-inf)) = NaN in the tiles they visit.
    visited: (Nq, Nk) bool, the keys whose tiles the loop visits (None: all of them): tiles it
        skips add nothing (this matters for NaN and for ``overwrite``).
    blocks: (block_q, block_k) of the tiling, for delta="tile" and ``overwrite``.
    overwrite: "dq", "dk" or "dv" written with = instead of += in the tile loop (query blocks
        outside, key blocks inside): dq keeps its last key tile's term, dk and dv their last query
        block's.
    qk, dp: :func:`product` of q and k, and of dout and v, when already computed.
    Returns (dq, dk, dv), float64.
    """
    q, k, v, out, dout = (t.double() for t in (q, k, v, out, dout))
    lse = lse.double()
    if guard:
        lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    p = torch.exp(scores(q, k, score_scale, mask, qk) - lse[..., None])
    if visited is not None:
        p = torch.where(visited, p, torch.zeros_like(p))
    else:
        visited = torch.ones(p.shape[-2:], dtype=torch.bool)
    dp = product(dout, v) if dp is None else dp
    if delta == "tile":
        block_k = blocks[1]
        pdp = torch.nn.functional.pad(p * dp, (0, -p.shape[-1] % block_k))
        per_tile = pdp.unflatten(-1, (-1, block_k)).sum(dim=-1)
        d = per_tile.repeat_interleave(block_k, dim=-1)[..., :p.shape[-1]]
    else:
        d = {"out": (dout * out).sum(dim=-1, keepdim=True), "dout": dout.sum(dim=-1, keepdim=True),
             "none": torch.zeros_like(dp[..., :1])}[delta]
    ds = p * (d - dp) if flip_ds else p * (dp - d)
    keep_q = keep_kv = None
    if overwrite == "dq":
        last = _last_visit(visited, blocks[1], dim=1)
        keep_q = (torch.arange(p.shape[-1]) // blocks[1])[None, :] == last[:, None]
    elif overwrite in ("dk", "dv"):
        last = _last_visit(visited, blocks[0], dim=0)
        keep_kv = (torch.arange(p.shape[-2]) // blocks[0])[:, None] == last[None, :]

    def kept(t, keep):
        return t if keep is None else torch.where(keep, t, torch.zeros_like(t))

    dq = torch.matmul(kept(ds, keep_q), k) * grad_scale
    dk = torch.matmul(kept(ds, keep_kv if overwrite == "dk" else None).transpose(-2, -1), q) * grad_scale
    dv = torch.matmul(kept(p, keep_kv if overwrite == "dv" else None).transpose(-2, -1), dout)
    return dq, dk, dv
