"""The gate's cumulative sums of the linear-attention kernels, each one memory pass.

- :func:`chunk_cumsum_log2_kernel`: the forward's gate, cumulated inside each chunk and put in log2
  units (times RCP_LN2 = log2(e)) in the one pass that reads it, zero log-decays past the sequence's end;
- :func:`reverse_cumsum_kernel`: the backward's ``dg_t = sum_{s >= t} dL/dG_s`` over the whole sequence.

As PyTorch ops each is three passes over GLA's (B, H, N, d_k) float32 gate (a copy, the cumsum and a
multiply; ``flip``, ``cumsum``, ``flip``), which cost more than some of the kernels around them
(docs/experiments/linear_and_ring.md has the breakdown).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import common
from .linear_chunk import chunk_tile, load_rows


@triton.jit
def chunk_cumsum_log2_kernel(g_ptr, out_ptr, seqlen, width, rcp_ln2, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """out (B*H, chunks * CHUNK, width) float32 = rcp_ln2 * the cumulative sum of g (B*H, N, width) within
    each chunk of CHUNK rows (rows past N add zero). Grid (chunks, B*H, cdiv(width, BLOCK))."""
    c, bh, pid = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    rows = c * CHUNK + tl.arange(0, CHUNK)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    g = load_rows(g_ptr, bh, rows, seqlen, cols, width).to(tl.float32)
    offsets, _ = chunk_tile(bh, rows, tl.num_programs(0) * CHUNK, cols, width)
    tl.store(out_ptr + offsets, tl.cumsum(g, axis=0) * rcp_ln2, mask=(cols < width)[None, :])


@triton.jit
def reverse_cumsum_kernel(x_ptr, out_ptr, seqlen, width, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out[:, t] = sum over s >= t of x[:, s], for x and out (B*H, N, width) float32. Grid
    (B*H, cdiv(width, BLOCK)): a program walks its columns' N rows from the end, ROWS at a time, carrying
    the sum of the rows after them."""
    bh, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    carry = tl.zeros([BLOCK], dtype=tl.float32)
    steps = tl.cdiv(seqlen, ROWS)
    for back in range(steps):
        rows = (steps - 1 - back) * ROWS + tl.arange(0, ROWS)
        offsets, mask = chunk_tile(bh, rows, seqlen, cols, width)
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        tl.store(out_ptr + offsets, tl.cumsum(x, axis=0, reverse=True) + carry[None, :], mask=mask)
        carry += tl.sum(x, axis=0)


def column_block(width: int) -> int:
    """A power-of-two tile width for ``width`` gate columns (1 for a scalar gate), at most 32."""
    return min(32, triton.next_power_of_2(width))


def log2_cumulated_gate(g, chunk_size: int):
    """g (B, H, N[, d_k]) natural-log decays -> float32 (B*H, chunks * C[, d_k]), cumulated within each chunk
    and multiplied by RCP_LN2 = log2(e), once (the kernels' every decay is then one exp2)."""
    from ..common import cdiv, on_device

    batch, heads, seqlen = g.shape[:3]
    width = g.shape[3] if g.dim() == 4 else 1
    chunks = cdiv(seqlen, chunk_size)
    out = torch.empty(batch * heads, chunks * chunk_size, *g.shape[3:], dtype=torch.float32, device=g.device)
    block = column_block(width)
    with on_device(g):
        chunk_cumsum_log2_kernel[(chunks, batch * heads, cdiv(width, block))](
            g.contiguous(), out, seqlen, width, common.LOG2E, CHUNK=chunk_size, BLOCK=block)
    return out


def reverse_cumsum(x):
    """x (B, H, N[, d]) float32 -> its reverse cumulative sum along N (a new tensor of x's shape)."""
    from ..common import cdiv, on_device

    batch, heads, seqlen = x.shape[:3]
    width = x.shape[3] if x.dim() == 4 else 1
    x = x.contiguous()
    out = torch.empty_like(x)
    block = column_block(width)
    with on_device(x):
        reverse_cumsum_kernel[(batch * heads, cdiv(width, block))](x, out, seqlen, width,
                                                                   ROWS=max(16, 4096 // block), BLOCK=block)
    return out
