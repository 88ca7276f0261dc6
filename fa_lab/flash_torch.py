"""FlashAttention in plain PyTorch: a tiled forward with online softmax and a recomputation backward.

The algorithm is the one every FlashAttention kernel runs, written with torch
ops on tiles so that it runs on a laptop CPU (and on CUDA):

* forward: for each block of ``block_q`` queries, stream over blocks of
  ``block_k`` keys, keep the running (m, l) state and an unnormalized output
  accumulator, and save only O and the log-sum-exp ``lse = m + log l``;
* backward: with D = rowsum(dO * O), recompute each tile of probabilities
  P = exp(S - lse) from the saved LSE, then dV += P^T dO, dP = dO V^T,
  dS = P * (dP - D), dQ += dS K * scale, dK += dS^T Q * scale.

Grouped-query attention, local windows, the soft cap and ALiBi (chapter 05) act per tile:
see :class:`_Tiles`. No (Nq, Nk) matrix is ever built: peak extra memory is O(block_q * block_k)
per head, against O(Nq * Nk) for :func:`fa_lab.reference.naive_attention`.
Tiles are computed in float32 whatever the input dtype (as GPU kernels
accumulate in float32), and results are cast back to the input dtype.
"""
from __future__ import annotations

import torch

from .block_info import BlockInfo
from .online_softmax import SoftmaxState, online_softmax_update
from .score_mods import alibi_bias, modify_scores, soft_cap_derivative

# Chosen on a 2-core CPU (B=1, H=8, N=8K, d=64, fp32): tiles of 512 x 256 keep S in cache,
# larger tiles spill out of it and get slower (this size's times against SDPA's:
# benchmarks/cpu_2core.json).
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 256


class _Tiles:
    """What every tile of one call needs: the visible keys, the score modifiers, the head grouping.

    Grouped-query attention packs the ``group = H // Hkv`` query heads that share a key/value head
    into the rows of one tile (flash-attn's ``pack_gqa``): a tile holds ``group * tq`` rows and
    meets each K/V tile once. Row ``r`` of a packed tile is query ``i0 + r % tq`` of head ``r // tq``.
    """

    def __init__(self, q, k, causal, scale, window, softcap, alibi_slopes):
        batch, heads, seqlen_q, head_dim = q.shape
        self.heads_kv, self.group = k.shape[1], heads // k.shape[1]
        self.info = BlockInfo(seqlen_q, k.shape[2], causal, tuple(window))
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap
        # ALiBi slopes per packed row block: (B * Hkv, group, 1, 1).
        self.slopes = None if alibi_slopes is None else \
            alibi_slopes.expand(batch, heads).reshape(batch * self.heads_kv, self.group, 1, 1).float()
        self.device = q.device

    def pack(self, t, i0, i1):
        """(B, H, N, x) -> the float32 rows [i0, i1) of each head group: (B * Hkv, group * (i1 - i0), x),
        always a copy (the caller may scale it in place)."""
        batch, _, _, width = t.shape
        rows = t[:, :, i0:i1].to(torch.float32, copy=True)
        return rows.reshape(batch * self.heads_kv, self.group * (i1 - i0), width)

    def scores(self, q_tile, k_tile, i0, i1, j0, j1):
        """The modified, masked (B * Hkv, group * tq, tk) scores of a tile (q_tile already scaled)."""
        scores = torch.bmm(q_tile, k_tile.transpose(1, 2))
        rows_scores = scores.view(scores.shape[0], self.group, i1 - i0, j1 - j0)
        if self.softcap or self.slopes is not None:
            rows = torch.arange(i0, i1, device=self.device)[:, None]
            cols = torch.arange(j0, j1, device=self.device)[None, :]
            modify_scores(rows_scores, self.softcap, self.slopes, rows, cols, self.info.offset, inplace=True)
        if self.info.tile_kind(i0, i1, j0, j1) != "full":  # only tiles crossing a mask edge pay for it
            rows_scores.masked_fill_(~self.info.mask(i0, i1, j0, j1, self.device), float("-inf"))
        return scores

    def key_tiles(self, i0, i1, block_k, keys=(0, None)):
        """(j0, j1) of the key tiles that rows [i0, i1) visit: tiles on the block_k grid, cut to the
        key range ``keys`` = (first, stop) (a split of the keys; stop None: all of them)."""
        start, end = self.info.key_range(i0, i1)
        first, stop = keys[0], self.info.seqlen_k if keys[1] is None else keys[1]
        for j0 in range(start // block_k * block_k, end, block_k):
            lo, hi = max(j0, first), min(j0 + block_k, stop, self.info.seqlen_k)
            if lo < hi:
                yield lo, hi


def flash_forward(q, k, v, causal=False, scale=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
                  window=(-1, -1), softcap=0.0, alibi_slopes=None, keys=(0, None)):
    """Tiled forward. q: (B, H, Nq, d), k, v: (B, Hkv, Nk, d) with H a multiple of Hkv.

    window, softcap, alibi_slopes ((B, H) float32 or None): as :func:`fa_lab.attention`.
    keys: (first, stop), the keys this call attends to (one split of split-KV decoding: its result
    merges with the other splits' by the LSE); the masks stay those of the whole sequence.
    Returns (out: (B, H, Nq, d) in q.dtype, lse: (B, H, Nq) float32, natural log).
    """
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    tiles = _Tiles(q, k, causal, scale, window, softcap, alibi_slopes)
    rows_kv = batch * tiles.heads_kv
    k3, v3 = (t.reshape(rows_kv, seqlen_k, head_dim).float() for t in (k, v))
    out = torch.empty((batch, heads, seqlen_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    for i0 in range(0, seqlen_q, block_q):
        i1 = min(i0 + block_q, seqlen_q)
        q_tile = tiles.pack(q, i0, i1).mul_(tiles.scale)  # scale Q once per tile instead of every S tile
        state = SoftmaxState.empty(q_tile.shape[:2], q.device)
        acc = torch.zeros(q_tile.shape, device=q.device)
        for j0, j1 in tiles.key_tiles(i0, i1, block_k, keys):
            scores = tiles.scores(q_tile, k3[:, j0:j1], i0, i1, j0, j1)
            state, p, alpha = online_softmax_update(state, scores, inplace=True)
            acc.mul_(alpha[..., None]).baddbmm_(p, v3[:, j0:j1])  # acc = alpha * acc + P V
        l = state.l[..., None]
        acc = acc / torch.where(l == 0, torch.ones_like(l), l)
        out[:, :, i0:i1] = acc.view(batch, heads, i1 - i0, head_dim).to(q.dtype)
        lse[:, :, i0:i1] = state.lse.view(batch, heads, i1 - i0)
    return out, lse


def flash_backward(q, k, v, out, lse, grad_out, causal=False, scale=None,
                   block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K, window=(-1, -1), softcap=0.0,
                   alibi_slopes=None):
    """Recomputation backward. Shapes and options as :func:`flash_forward`; grad_out like out.

    Returns (dq, dk, dv) in the dtypes of q, k, v; dk and dv sum over each group of query heads.
    """
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    tiles = _Tiles(q, k, causal, scale, window, softcap, alibi_slopes)
    rows_kv = batch * tiles.heads_kv
    k3, v3 = (t.reshape(rows_kv, seqlen_k, head_dim).float() for t in (k, v))
    delta = (grad_out.float() * out.float()).sum(dim=-1, keepdim=True)  # D = rowsum(dO * O): (B, H, Nq, 1)
    # exp(S - (+inf)) = 0 gives P = 0 on rows that see no key (their lse is -inf).
    lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)[..., None]
    dq = torch.zeros((batch, heads, seqlen_q, head_dim), device=q.device)
    dk = torch.zeros((rows_kv, seqlen_k, head_dim), device=q.device)
    dv = torch.zeros((rows_kv, seqlen_k, head_dim), device=q.device)
    for i0 in range(0, seqlen_q, block_q):
        i1 = min(i0 + block_q, seqlen_q)
        q_tile, do_tile = tiles.pack(q, i0, i1), tiles.pack(grad_out, i0, i1)
        lse_tile, delta_tile = tiles.pack(lse_safe, i0, i1), tiles.pack(delta, i0, i1)
        dq_tile = torch.zeros(q_tile.shape, device=q.device)
        for j0, j1 in tiles.key_tiles(i0, i1, block_k):
            k_tile, v_tile = k3[:, j0:j1], v3[:, j0:j1]
            scores = tiles.scores(q_tile * tiles.scale, k_tile, i0, i1, j0, j1)
            p = torch.exp(scores - lse_tile)  # P recomputed from the saved LSE, already normalized
            dv[:, j0:j1] += torch.bmm(p.transpose(1, 2), do_tile)  # the group's rows sum into one dV
            dp = torch.bmm(do_tile, v_tile.transpose(1, 2))
            ds = p * (dp - delta_tile)  # dS = P * (dP - D): the softmax Jacobian applied row by row
            if tiles.softcap:  # back through softcap * tanh(s / softcap); ALiBi adds a constant
                ds *= soft_cap_derivative(_alibi_free(scores, tiles, i0, i1, j0, j1), tiles.softcap)
            dq_tile += torch.bmm(ds, k_tile)
            dk[:, j0:j1] += torch.bmm(ds.transpose(1, 2), q_tile)
        dq[:, :, i0:i1] = dq_tile.view(batch, heads, i1 - i0, head_dim)
    dk, dv = dk.view(k.shape), dv.view(v.shape)
    return (dq * tiles.scale).to(q.dtype), (dk * tiles.scale).to(k.dtype), dv.to(v.dtype)


def _alibi_free(scores, tiles: _Tiles, i0, i1, j0, j1):
    """The capped scores of a tile without their ALiBi bias (what tanh' is computed from)."""
    if tiles.slopes is None:
        return scores
    rows = torch.arange(i0, i1, device=tiles.device)[:, None]
    cols = torch.arange(j0, j1, device=tiles.device)[None, :]
    bias = alibi_bias(tiles.slopes, rows, cols, tiles.info.offset)
    return (scores.view(bias.shape[0], tiles.group, i1 - i0, j1 - j0) - bias).view(scores.shape)


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, O and the LSE (never P) for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
                window=(-1, -1), softcap=0.0, alibi_slopes=None):
        out, lse = flash_forward(q, k, v, causal, scale, block_q, block_k, window, softcap, alibi_slopes)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, block_q, block_k, window, softcap, alibi_slopes)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, out, lse, grad_out, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


def flash_attention(q, k, v, causal=False, scale=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
                    window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Differentiable tiled attention. Returns (out, lse); gradients flow through out."""
    return FlashAttentionFunction.apply(q, k, v, causal, scale, block_q, block_k, window, softcap, alibi_slopes)
