"""FlashAttention in plain PyTorch: a tiled forward with online softmax and a recomputation backward.

The algorithm is the one every FlashAttention kernel runs, written with torch
ops on tiles so that it runs on a laptop CPU (and on CUDA):

* forward: for each block of ``block_q`` queries, stream over blocks of
  ``block_k`` keys, keep the running (m, l) state and an unnormalized output
  accumulator, and save only O and the log-sum-exp ``lse = m + log l``;
* backward: with D = rowsum(dO * O), recompute each tile of probabilities
  P = exp(S - lse) from the saved LSE, then dV += P^T dO, dP = dO V^T,
  dS = P * (dP - D), dQ += dS K * scale, dK += dS^T Q * scale.

No (Nq, Nk) matrix is ever built: peak extra memory is O(block_q * block_k)
per head, against O(Nq * Nk) for :func:`fa_lab.reference.naive_attention`.
Tiles are computed in float32 whatever the input dtype (as GPU kernels
accumulate in float32), and results are cast back to the input dtype.
"""
from __future__ import annotations

import torch

from .block_info import BlockInfo
from .online_softmax import SoftmaxState, online_softmax_update

# Measured on a 2-core CPU (B=1, H=8, N=8K, d=64, fp32): tiles of 512 x 256 keep S in
# cache and ran at 1.3-1.45x of SDPA's time on an idle machine (benchmarks/cpu_2core.json);
# larger tiles spill out of cache and get slower.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 256


def _tile_mask(info: BlockInfo, i0, i1, j0, j1, device):
    """The (i1 - i0, j1 - j0) mask of a tile that crosses the causal diagonal, or None when every
    query of the tile sees every key of it (only the diagonal tiles pay for masking)."""
    if info.tile_kind(i0, i1, j0, j1) == "full":
        return None
    return info.mask(i0, i1, j0, j1, device)


def flash_forward(q, k, v, causal=False, scale=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
    """Tiled forward. q: (B, H, Nq, d), k, v: (B, H, Nk, d).

    Returns (out: (B, H, Nq, d) in q.dtype, lse: (B, H, Nq) float32, natural log).
    """
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    # (B, H) flattened into one batch dim so that the tile products are single bmm calls.
    q3, k3, v3 = (t.reshape(batch * heads, t.shape[2], head_dim) for t in (q, k, v))
    k3, v3 = k3.float(), v3.float()
    info = BlockInfo(seqlen_q, seqlen_k, causal)
    out = torch.empty((batch * heads, seqlen_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch * heads, seqlen_q), dtype=torch.float32, device=q.device)
    for i0 in range(0, seqlen_q, block_q):
        i1 = min(i0 + block_q, seqlen_q)
        q_tile = q3[:, i0:i1].float() * scale  # scale Q once per tile instead of every S tile
        state = SoftmaxState.empty((batch * heads, i1 - i0), q.device)
        acc = torch.zeros((batch * heads, i1 - i0, head_dim), device=q.device)
        for j0 in range(0, info.key_range(i0, i1)[1], block_k):
            j1 = min(j0 + block_k, seqlen_k)
            scores = torch.bmm(q_tile, k3[:, j0:j1].transpose(1, 2))
            mask = _tile_mask(info, i0, i1, j0, j1, q.device)
            if mask is not None:  # only tiles crossing the diagonal pay for masking
                scores.masked_fill_(~mask, float("-inf"))
            state, p, alpha = online_softmax_update(state, scores, inplace=True)
            acc.mul_(alpha[..., None]).baddbmm_(p, v3[:, j0:j1])  # acc = alpha * acc + P V
        l = state.l[..., None]
        out[:, i0:i1] = (acc / torch.where(l == 0, torch.ones_like(l), l)).to(q.dtype)
        lse[:, i0:i1] = state.lse
    return out.view(q.shape), lse.view(batch, heads, seqlen_q)


def flash_backward(q, k, v, out, lse, grad_out, causal=False, scale=None,
                   block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
    """Recomputation backward. Shapes as :func:`flash_forward`; grad_out like out.

    Returns (dq, dk, dv) in the dtypes of q, k, v.
    """
    seqlen_q, head_dim = q.shape[2], q.shape[3]
    seqlen_k = k.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    info = BlockInfo(seqlen_q, seqlen_k, causal)
    k32, v32 = k.float(), v.float()
    delta = (grad_out.float() * out.float()).sum(dim=-1)  # D = rowsum(dO * O): (B, H, Nq)
    # exp(S - (+inf)) = 0 gives P = 0 on rows that see no key (their lse is -inf).
    lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    dq = torch.zeros(q.shape, device=q.device)
    dk = torch.zeros(k.shape, device=q.device)
    dv = torch.zeros(v.shape, device=q.device)
    for i0 in range(0, seqlen_q, block_q):
        i1 = min(i0 + block_q, seqlen_q)
        q_tile = q[:, :, i0:i1].float()
        do_tile = grad_out[:, :, i0:i1].float()
        lse_tile, delta_tile = lse_safe[:, :, i0:i1, None], delta[:, :, i0:i1, None]
        for j0 in range(0, info.key_range(i0, i1)[1], block_k):
            j1 = min(j0 + block_k, seqlen_k)
            k_tile, v_tile = k32[:, :, j0:j1], v32[:, :, j0:j1]
            scores = torch.matmul(q_tile, k_tile.transpose(-2, -1)) * scale
            mask = _tile_mask(info, i0, i1, j0, j1, q.device)
            if mask is not None:
                scores.masked_fill_(~mask, float("-inf"))
            p = torch.exp(scores - lse_tile)  # P recomputed from the saved LSE, already normalized
            dv[:, :, j0:j1] += torch.matmul(p.transpose(-2, -1), do_tile)
            dp = torch.matmul(do_tile, v_tile.transpose(-2, -1))
            ds = p * (dp - delta_tile)  # dS = P * (dP - D): the softmax Jacobian applied row by row
            dq[:, :, i0:i1] += torch.matmul(ds, k_tile)
            dk[:, :, j0:j1] += torch.matmul(ds.transpose(-2, -1), q_tile)
    return (dq * scale).to(q.dtype), (dk * scale).to(k.dtype), dv.to(v.dtype)


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves q, k, v, O and the LSE (never P) for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_q, block_k):
        out, lse = flash_forward(q, k, v, causal, scale, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, block_q, block_k)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, out, lse, grad_out, *ctx.args)
        return dq, dk, dv, None, None, None, None


def flash_attention(q, k, v, causal=False, scale=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
    """Differentiable tiled attention. Returns (out, lse); gradients flow through out."""
    return FlashAttentionFunction.apply(q, k, v, causal, scale, block_q, block_k)
