"""MoBA's two passes on the varlen attention kernels (chapter 07), forward and backward.

Given each query's selection (:func:`fa_lab.sparse.moba_gate`: its own block first, then up to
``top_k - 1`` past blocks), MoBA's output is softmax attention over the union of those blocks, computed
in two varlen passes merged by their LSE, as flash-attn-based MoBA does:

1. *own block*: every query over its own block, causally. When the blocks tile the sequence, each block is
   a head of its own: q viewed as (B, H * N / block, block, d) goes through the dense causal kernel with no
   copy (:func:`block_heads`); otherwise varlen attention with one sequence per block
   (:func:`own_block_sequences`) on token-major copies;
2. *past blocks*, key-block-major: the (query, selected block) entries are sorted by (batch, head,
   block), so that the queries that chose one block of one head form one packed sequence against that
   block's keys, all of them in a single launch with one head per sequence (:func:`past_block_sequences`).
   Every key of a past block lies before the query, so this pass needs no mask.

The partial results are merged by their LSE in one kernel, a jit copy of
:func:`fa_lab.online_softmax.merge_splits` beside decoding's that takes a block of rows a program
(:func:`.decode.merge_split_results` with ``row_blocks``). The backward runs each pass's backward with the
*merged* output and LSE (P = exp(S - lse) is then the final softmax, so each pass yields its exact share of
the gradients, as ring attention's steps do) and adds the shares; a query's dQ from its past blocks is
gathered back with ``index_add``.

The kernels are chapter 05's, on prepared operands (:class:`PassKernels`): the portable ones by default;
:func:`fa_lab.kernels.triton_moba_attention` gives impl="triton_hopper"'s Gluon FA3 forward and backward
where they run (sm_90).

Layouts: q, k, v (B, H, N, d) with k, v already expanded to H heads (MoBA gates per query head);
selected int64 (B, H, N, top_k), -1 for an unused slot.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...block_info import cdiv
from ..common import kernel_operand, on_device
from .attention import NO_OPTIONS, triton_backward, triton_forward, triton_varlen_backward, triton_varlen_forward
from .decode import merge_split_results


@dataclass(frozen=True)
class PassKernels:
    """The attention kernels of MoBA's passes, each with the signature of its portable default (positional
    arguments only): dense ``forward``/``backward`` (:func:`triton_forward`, :func:`triton_backward`) for the
    own blocks as heads, ``varlen_forward``/``varlen_backward`` for packed sequences."""

    forward: Callable = triton_forward
    backward: Callable = triton_backward
    varlen_forward: Callable = triton_varlen_forward
    varlen_backward: Callable = triton_varlen_backward


def block_heads(t: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, N, d) contiguous, N a multiple of block -> the view (B, H * N / block, block, d): every block
    a head of its own."""
    batch, heads, seqlen, head_dim = t.shape
    return t.view(batch, heads * (seqlen // block), block, head_dim)


def token_major(t: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) -> (B * N, H, d), contiguous (the backward's row reads of O and dO assume it): the
    packed layout of varlen attention, one sequence per batch row."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[-1]).contiguous()


def head_major(t: torch.Tensor, batch: int) -> torch.Tensor:
    """(B * N, H, d) -> (B, H, N, d), the inverse of :func:`token_major`."""
    return t.reshape(batch, -1, *t.shape[1:]).transpose(1, 2)


def own_block_sequences(batch: int, seqlen: int, block: int, device) -> tuple[torch.Tensor, list[int]]:
    """(cu_seqlens int32, its values as a list) of pass 1: the blocks of every batch row as sequences of
    the (B * N) token-major rows."""
    bounds = [b * seqlen + start for b in range(batch) for start in range(0, seqlen, block)] + [batch * seqlen]
    return torch.tensor(bounds, dtype=torch.int32, device=device), bounds


def past_block_sequences(selected: torch.Tensor, block: int) -> dict:
    """Pass 2's packing of the past-block entries, key-block-major.

    The queries are the (B * H * N) head-major rows of q, the keys those of k. Returns a dict:
    ``entries``: int64 (E,), which (query, slot) pairs of ``selected[..., 1:]`` (flattened) are packed, in
    packed order; ``query_rows``: int64 (E,), their rows of q; ``cu_q``, ``cu_k``: int32 (B * H * blocks + 1,),
    the packed queries and the key rows of each (batch, head, block) sequence; ``bounds``: both as lists.
    """
    batch, heads, seqlen, top_k = selected.shape
    blocks, past = cdiv(seqlen, block), top_k - 1
    device = selected.device
    sequences = batch * heads * blocks
    head_rows = torch.arange(batch * heads, device=device).view(batch, heads, 1, 1)
    sequence = torch.where(selected[..., 1:] >= 0, head_rows * blocks + selected[..., 1:], sequences).flatten()
    counts = torch.bincount(sequence, minlength=sequences + 1)[:sequences]
    entries = torch.argsort(sequence, stable=True)[:int(counts.sum())]  # unused slots sort past the end
    cu_q = torch.zeros(sequences + 1, dtype=torch.int32, device=device)
    cu_q[1:] = torch.cumsum(counts, 0)
    starts = torch.arange(batch * heads, device=device)[:, None] * seqlen + \
        torch.arange(blocks, device=device)[None, :] * block
    cu_k = torch.cat([starts.flatten(), torch.tensor([batch * heads * seqlen], device=device)]).to(torch.int32)
    return {"entries": entries, "query_rows": entries // past, "cu_q": cu_q, "cu_k": cu_k,
            "bounds": (cu_q.tolist(), cu_k.tolist())}


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) -> (B * H * N, 1, d): every head's rows as one-head sequences."""
    return t.reshape(-1, 1, t.shape[-1])


class MobaFunction(torch.autograd.Function):
    """Autograd wrapper of MoBA's two passes (module docstring); returns (out (B, H, N, d) in q.dtype,
    lse (B, H, N) float32, detached)."""

    @staticmethod
    def forward(ctx, q, k, v, selected, block, scale, kernels=PassKernels()):
        batch, heads, seqlen, head_dim = q.shape
        q, k, v = (kernel_operand(t.contiguous()) for t in (q, k, v))  # (B, H, N, d8), contiguous
        as_heads = seqlen % block == 0  # pass 1 on the dense kernel, each block a head
        cu_own, own_bounds = (None, None) if as_heads else own_block_sequences(batch, seqlen, block, q.device)
        packing = past_block_sequences(selected, block) if selected.shape[-1] > 1 else None
        with on_device(q):
            # The merge's operands, one split per pass-1 result and past slot, (top_k, B, H, N[, d]); a slot
            # that selected nothing keeps out 0 and lse -inf, so it weighs 0.
            past = selected.shape[-1] - 1 if packing is not None else 0
            outs = q.new_empty(1 + past, batch, heads, seqlen, head_dim)
            lses = torch.full((1 + past, batch, heads, seqlen), float("-inf"), device=q.device)
            if as_heads:
                own_out, own_lse = kernels.forward(*(block_heads(t, block) for t in (q, k, v)), True, scale)
                outs[0] = own_out.view(q.shape)[..., :head_dim]
                lses[0] = own_lse.view(batch, heads, seqlen)
            else:
                own_out, own_lse = kernels.varlen_forward(*(token_major(t) for t in (q, k, v)), cu_own, cu_own,
                                                          (own_bounds, own_bounds), True, scale, NO_OPTIONS)
                outs[0] = head_major(own_out[..., :head_dim], batch)
                lses[0] = own_lse.view(heads, batch, seqlen).transpose(0, 1)
            outs[1:] = 0
            if packing is not None:
                out_g, lse_g = kernels.varlen_forward(
                    rows_of(q)[packing["query_rows"]], rows_of(k), rows_of(v), packing["cu_q"], packing["cu_k"],
                    packing["bounds"], False, scale, NO_OPTIONS)
                # Entry e is slot e % past of query row e // past: row e // past of split 1 + e % past.
                dest = (1 + packing["entries"] % past) * (batch * heads * seqlen) + packing["query_rows"]
                outs.view(-1, head_dim)[dest] = out_g[:, 0, :head_dim]
                lses.view(-1)[dest] = lse_g[0]
        # Every (batch, head) as a batch row of one head, so that the merged rows come out as (B, H, N, d).
        out, lse = merge_split_results(outs.view(1 + past, batch * heads, 1, seqlen, head_dim),
                                       lses.view(1 + past, batch * heads, 1, seqlen), q.dtype, row_blocks=True)
        out, lse = out.view(batch, heads, seqlen, head_dim), lse.view(batch, heads, seqlen)
        ctx.save_for_backward(q, k, v, out, lse, cu_own)
        ctx.args = (block, scale, own_bounds, packing, kernels, head_dim)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, cu_own = ctx.saved_tensors  # q, k, v: (B, H, N, d8); out: (B, H, N, d)
        block, scale, own_bounds, packing, kernels, head_dim = ctx.args
        batch, heads, seqlen, _ = q.shape
        out, grad_out = (kernel_operand(t.to(q.dtype).contiguous()) for t in (out, grad_out))
        with on_device(q):
            if cu_own is None:  # the own blocks as heads (forward)
                dq, dk, dv = (g.view(q.shape) for g in kernels.backward(
                    *(block_heads(t, block) for t in (q, k, v, out)), lse.view(batch, -1, block),
                    block_heads(grad_out, block), True, scale))
            else:
                lse_rows = lse.transpose(0, 1).reshape(heads, batch * seqlen).contiguous()
                dq, dk, dv = (head_major(g, batch) for g in kernels.varlen_backward(
                    *(token_major(t) for t in (q, k, v, out)), lse_rows, token_major(grad_out), cu_own, cu_own,
                    (own_bounds, own_bounds), True, scale, NO_OPTIONS))
            if packing is not None:
                rows = packing["query_rows"]
                dq_g, dk_p, dv_p = kernels.varlen_backward(
                    rows_of(q)[rows], rows_of(k), rows_of(v), rows_of(out)[rows],
                    lse.reshape(1, -1)[:, rows].contiguous(), rows_of(grad_out)[rows], packing["cu_q"],
                    packing["cu_k"], packing["bounds"], False, scale, NO_OPTIONS)
                dq = dq.reshape(-1, q.shape[-1]).index_add(0, rows, dq_g[:, 0]).view(q.shape)
                dk = dk + dk_p[:, 0].view(k.shape)
                dv = dv + dv_p[:, 0].view(v.shape)
        return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim], None, None, None, None
