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
    The loop runs over query tiles, each walking the key tiles it sees (FlashAttention-2's order in one
    program; :func:`flash_backward_key_major` is FlashAttention-3's).
    """
    tiles, k3, v3, delta, lse_safe = _backward_operands(q, k, v, out, lse, grad_out, causal, scale, window,
                                                        softcap, alibi_slopes)
    batch, heads, seqlen_q, head_dim = q.shape
    dq = torch.zeros((batch, heads, seqlen_q, head_dim), device=q.device)
    dk, dv = torch.zeros(k3.shape, device=q.device), torch.zeros(v3.shape, device=q.device)
    for i0 in range(0, seqlen_q, block_q):
        i1 = min(i0 + block_q, seqlen_q)
        rows = tuple(tiles.pack(t, i0, i1) for t in (q, grad_out, lse_safe, delta))
        dq_tile = torch.zeros(rows[0].shape, device=q.device)
        for j0, j1 in tiles.key_tiles(i0, i1, block_k):
            dq_part, dk_part, dv_part = _pair_gradients(tiles, *rows, k3[:, j0:j1], v3[:, j0:j1], i0, i1, j0, j1)
            dq_tile += dq_part
            dk[:, j0:j1] += dk_part
            dv[:, j0:j1] += dv_part  # the group's rows sum into one dV
        dq[:, :, i0:i1] = dq_tile.view(batch, heads, i1 - i0, head_dim)
    return _scaled_gradients(tiles, q, k, v, dq, dk, dv)


def flash_backward_key_major(q, k, v, out, lse, grad_out, causal=False, scale=None, block_q=DEFAULT_BLOCK_Q,
                             block_k=DEFAULT_BLOCK_K, key_tile_order=None, window=(-1, -1), softcap=0.0,
                             alibi_slopes=None):
    """The same backward in FlashAttention-3's order: one program per key tile keeps its dK and dV (in
    registers, on a GPU) while it walks every query tile that sees it, and adds its share of each dQ tile
    into one float32 buffer shared by all programs (atomic adds, on a GPU).

    key_tile_order: the order in which the key tiles' programs add into dQ (indices of the key tiles;
    default: in order), which on a GPU is the order in which CTAs happen to get there. Float32 addition is
    not associative, so dQ's last bits depend on it; a kernel that must be deterministic fixes the order.
    Returns (dq, dk, dv) as :func:`flash_backward`.
    """
    tiles, k3, v3, delta, lse_safe = _backward_operands(q, k, v, out, lse, grad_out, causal, scale, window,
                                                        softcap, alibi_slopes)
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    dq_accum = torch.zeros((batch, heads, seqlen_q, head_dim), device=q.device)  # FA3's float32 dQaccum
    dk, dv = torch.zeros(k3.shape, device=q.device), torch.zeros(v3.shape, device=q.device)
    starts = list(range(0, seqlen_k, block_k))
    query_tiles = [(i0, min(i0 + block_q, seqlen_q)) for i0 in range(0, seqlen_q, block_q)]
    packed = [tuple(tiles.pack(t, i0, i1) for t in (q, grad_out, lse_safe, delta)) for i0, i1 in query_tiles]
    for index in (range(len(starts)) if key_tile_order is None else key_tile_order):
        j0 = starts[index]
        j1 = min(j0 + block_k, seqlen_k)
        for (i0, i1), rows in zip(query_tiles, packed):
            first, end = tiles.info.key_range(i0, i1)
            if end <= j0 or j1 <= first:  # no row of this query tile sees these keys
                continue
            dq_part, dk_part, dv_part = _pair_gradients(tiles, *rows, k3[:, j0:j1], v3[:, j0:j1], i0, i1, j0, j1)
            dk[:, j0:j1] += dk_part
            dv[:, j0:j1] += dv_part
            dq_accum[:, :, i0:i1] += dq_part.view(batch, heads, i1 - i0, head_dim)  # the contended write
    return _scaled_gradients(tiles, q, k, v, dq_accum, dk, dv)


def _backward_operands(q, k, v, out, lse, grad_out, causal, scale, window, softcap, alibi_slopes):
    """(tiles, k3, v3, delta, lse_safe): what both loop orders read. k3, v3: float32 (B * Hkv, Nk, d);
    delta = D = rowsum(dO * O) (B, H, Nq, 1); lse_safe (B, H, Nq, 1) with +inf where a row sees no key."""
    tiles = _Tiles(q, k, causal, scale, window, softcap, alibi_slopes)
    rows_kv = q.shape[0] * tiles.heads_kv
    k3, v3 = (t.reshape(rows_kv, k.shape[2], k.shape[3]).float() for t in (k, v))
    delta = (grad_out.float() * out.float()).sum(dim=-1, keepdim=True)
    # exp(S - (+inf)) = 0 gives P = 0 on rows that see no key (their lse is -inf).
    lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)[..., None]
    return tiles, k3, v3, delta, lse_safe


def _pair_gradients(tiles, q_tile, do_tile, lse_tile, delta_tile, k_tile, v_tile, i0, i1, j0, j1):
    """The backward's five GEMMs for query rows [i0, i1) (packed by ``tiles.pack``) against keys [j0, j1):
    S = Q K^T again, P = exp(S - LSE), dV = P^T dO, dP = dO V^T, dS = P (dP - D), dQ = dS K, dK = dS^T Q.
    Returns the partial (dq, dk, dv), before the softmax scale."""
    scores = tiles.scores(q_tile * tiles.scale, k_tile, i0, i1, j0, j1)
    p = torch.exp(scores - lse_tile)  # P recomputed from the saved LSE, already normalized
    dv = torch.bmm(p.transpose(1, 2), do_tile)
    dp = torch.bmm(do_tile, v_tile.transpose(1, 2))
    ds = p * (dp - delta_tile)  # dS = P * (dP - D): the softmax Jacobian applied row by row
    if tiles.softcap:  # back through softcap * tanh(s / softcap); ALiBi adds a constant
        ds *= soft_cap_derivative(_alibi_free(scores, tiles, i0, i1, j0, j1), tiles.softcap)
    return torch.bmm(ds, k_tile), torch.bmm(ds.transpose(1, 2), q_tile), dv


def _scaled_gradients(tiles, q, k, v, dq, dk, dv):
    """dq (B, H, Nq, d), dk, dv (B * Hkv, Nk, d) in float32 -> the inputs' shapes and dtypes, dq and dk
    times the softmax scale."""
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
