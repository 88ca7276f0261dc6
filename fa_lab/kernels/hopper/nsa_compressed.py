"""NSA's compressed branch on the dense kernels, its queries read and written in place (chapter 07).

Compressed key j (the mean of keys j c .. j c + c - 1, c = block_cmp) is visible to query i iff the whole block is
in i's past, (j + 1) c - 1 <= i (:func:`fa_lab.sparse.nsa_compressed_attention`). Write i = s c + r (step s,
residue r): a query of residue r < c - 1 sees the keys j <= s - 1, one of residue c - 1 the keys j <= s. So the
queries of one residue, step by step, are a sequence over the compressed keys under the course's bottom-right causal
mask, with one key fewer than queries (query s sees j <= s - 1) below residue c - 1 and as many at c - 1.

Such a sequence is a strided view of q: rows c apart from row r. Neighbouring residues start one row apart, so a range
of residues is one 4-D view, (B * H, residues, steps, d) with the residues where the heads stand, which a tensor
descriptor reads in place (:func:`residue_rows`). Every residue range of one mask and length is one launch of
``impl="triton_hopper"``'s forward or backward (:func:`residue_groups`: at most three), writing O, and in the
backward dQ, through the same views. The compressed keys and values are expanded to one head per query head,
(B * H, 1, N // c, d): each launch's residues then share their K/V head as a grouped-query call's heads do.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ...reference import expand_kv
from ..common import kernel_operand, on_device
from ..portable.attention import backward_preprocess
from .attention import hopper_backward, hopper_forward


class ResidueGroup(NamedTuple):
    """Residues ``first`` .. ``first + residues - 1``: ``queries`` steps each, over the first ``keys`` compressed
    keys under the bottom-right causal mask (query s sees keys j <= s + keys - queries)."""
    first: int
    residues: int
    queries: int
    keys: int


def residue_groups(seqlen: int, block: int) -> list[ResidueGroup]:
    """The launches that cover N = seqlen queries with compressed blocks of ``block`` tokens. With N = S block + t,
    residues below t hold S + 1 queries and the others S; the last residue sees one key more than the rest."""
    steps, tail = divmod(seqlen, block)
    groups = [ResidueGroup(0, tail, steps + 1, steps), ResidueGroup(tail, block - 1 - tail, steps, steps - 1),
              ResidueGroup(block - 1, 1, steps, steps)]
    return [group for group in groups if group.residues > 0 and group.queries > 0]


def residue_rows(t: torch.Tensor, group: ResidueGroup, block: int) -> torch.Tensor:
    """The rows of ``group``'s queries in t: (B, H, N, *rest), contiguous, as the view
    (B * H, residues, queries, *rest); [b * H + h, r, s] is query s * block + group.first + r of (b, h)."""
    if not t.is_contiguous():
        raise ValueError("residue_rows views a contiguous tensor")
    batch, heads, seqlen = t.shape[:3]
    row = t.stride(2)
    return t.as_strided((batch * heads, group.residues, group.queries, *t.shape[3:]),
                        (seqlen * row, row, block * row, *t.stride()[3:]), t.storage_offset() + group.first * row)


class CompressedAttention(torch.autograd.Function):
    """(out (B, H, N, d), lse (B, H, N) float32) of q (B, H, N, d) over the compressed keys and values
    (B, H_kv, N // block, d), differentiable in all three; rows that see no compressed key give 0 and -inf."""

    @staticmethod
    def forward(ctx, q, k_cmp, v_cmp, block: int, scale: float):
        batch, heads, seqlen, head_dim = q.shape
        qp = kernel_operand(q.contiguous())
        kp, vp = (kernel_operand(expand_kv(t.to(q.dtype), heads).reshape(batch * heads, 1, *t.shape[2:]))
                  for t in (k_cmp, v_cmp))
        out = torch.empty(qp.shape, dtype=qp.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        with on_device(q):
            for group in residue_groups(seqlen, block):
                out_rows, lse_rows = residue_rows(out, group, block), residue_rows(lse, group, block)
                if group.keys == 0:  # (a sequence shorter than two blocks: residues that see no key yet)
                    out_rows.zero_()
                    lse_rows.fill_(float("-inf"))
                    continue
                _, group_lse = hopper_forward(residue_rows(qp, group, block), kp[:, :, :group.keys],
                                              vp[:, :, :group.keys], True, scale, out=out_rows)
                lse_rows.copy_(group_lse)
        ctx.save_for_backward(qp, kp, vp, out, lse)
        ctx.args = (block, scale, head_dim, k_cmp.shape[1], k_cmp.dtype)
        ctx.mark_non_differentiable(lse)
        return out[..., :head_dim], lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        qp, kp, vp, out, lse = ctx.saved_tensors
        block, scale, head_dim, heads_kv, kv_dtype = ctx.args
        batch, heads, seqlen, _ = qp.shape
        grad_out = kernel_operand(grad_out.to(qp.dtype).contiguous())
        dq = torch.empty(qp.shape, dtype=qp.dtype, device=qp.device)
        dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (kp, vp))
        with on_device(qp):
            row_vectors = backward_preprocess(out, grad_out, lse)  # (delta, lse2) of every row, (B, H, N)
            for group in residue_groups(seqlen, block):
                dq_rows = residue_rows(dq, group, block)
                if group.keys == 0:
                    dq_rows.zero_()
                    continue
                keys = group.keys
                _, dk_rows, dv_rows = hopper_backward(
                    residue_rows(qp, group, block), kp[:, :, :keys], vp[:, :, :keys], None, None,
                    residue_rows(grad_out, group, block), True, scale,
                    row_vectors=tuple(residue_rows(t, group, block).contiguous() for t in row_vectors), dq=dq_rows)
                dk[:, :, :keys] += dk_rows
                dv[:, :, :keys] += dv_rows
        group_size = heads // heads_kv  # the expanded heads back to their K/V head
        dk, dv = (t.view(batch, heads_kv, group_size, *t.shape[2:]).sum(2)[..., :head_dim].to(kv_dtype)
                  for t in (dk, dv))
        return dq[..., :head_dim], dk, dv, None, None
