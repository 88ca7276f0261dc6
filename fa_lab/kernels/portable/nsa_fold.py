"""The compressed branch's folded layout (:class:`fa_lab.sparse._Folding`), in and out, as one gather each.

Query i of a (b, h) sequence sits at row r = i + 1 of the folded tensor (B * block, H, steps, d), at
[b * block + r % block, h, r // block]; the rows that hold no query (r = 0, r > N) are zeros. Both directions copy
whole rows of d elements: each program writes ROWS consecutive rows of the destination (16 bytes a load and a
store at d = 128 in 16-bit dtypes) from wherever the layout puts them in the source. PyTorch's strided copies of
the same rows (three rectangles a direction) walk a six-dimensional index per element without wide loads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import head_dim_bucket, on_device

FOLD_ROWS = 32  # destination rows a program


@triton.jit
def nsa_fold_kernel(src_ptr, dst_ptr, seqlen, heads, steps, head_dim, chunks, BLOCK: tl.constexpr,
                    ROWS: tl.constexpr, DIM: tl.constexpr, UNFOLD: tl.constexpr):
    """Fold: src (B, H, N, head_dim) -> dst (B * BLOCK, H, steps, head_dim), zeros where no query sits; unfold:
    the reverse, the rows that hold no query dropped. Both contiguous; one program per ROWS rows of one (b, h),
    ``chunks`` programs per (b, h)."""
    pid = tl.program_id(0)
    sequence = pid // chunks  # b * heads + h
    b, h = sequence // heads, sequence % heads
    row = (pid % chunks).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # the destination's row within (b, h)
    if UNFOLD:
        in_range = row < seqlen
        folded = row + 1
        src_row = ((b * BLOCK + folded % BLOCK) * heads + h) * steps + folded // BLOCK
        dst_row = sequence.to(tl.int64) * seqlen + row
        has_source = in_range
    else:
        in_range = row < BLOCK * steps
        residue, step = row // steps, row % steps
        query = step * BLOCK + residue - 1
        src_row = sequence.to(tl.int64) * seqlen + query
        dst_row = ((b * BLOCK + residue) * heads + h) * steps + step
        has_source = in_range & (query >= 0) & (query < seqlen)
    dim = tl.arange(0, DIM)
    columns = (dim < head_dim)[None, :]
    rows = tl.load(src_ptr + src_row[:, None] * head_dim + dim[None, :], mask=has_source[:, None] & columns,
                   other=0.0)
    tl.store(dst_ptr + dst_row[:, None] * head_dim + dim[None, :], rows, mask=in_range[:, None] & columns)


def fold_rows(t: torch.Tensor, block: int, steps: int) -> torch.Tensor:
    """t (B, H, N, d) -> its folded layout (B * block, H, steps, d), zeros in the rows that hold no query."""
    t = t.contiguous()
    batch, heads, seqlen, head_dim = t.shape
    folded = t.new_empty(batch * block, heads, steps, head_dim)
    _launch(t, folded, batch * heads, seqlen, block, steps, unfold=False)
    return folded


def unfold_rows(folded: torch.Tensor, block: int, seqlen: int) -> torch.Tensor:
    """folded (B * block, H, steps, d) -> (B, H, seqlen, d), the queries' rows only."""
    folded = folded.contiguous()
    rows, heads, steps, head_dim = folded.shape
    t = folded.new_empty(rows // block, heads, seqlen, head_dim)
    _launch(folded, t, rows // block * heads, seqlen, block, steps, unfold=True)
    return t


def _launch(src, dst, sequences: int, seqlen: int, block: int, steps: int, unfold: bool) -> None:
    """nsa_fold_kernel over ``sequences`` (b, h) pairs, ROWS destination rows a program."""
    heads, head_dim = src.shape[1], src.shape[-1]
    chunks = triton.cdiv(seqlen if unfold else block * steps, FOLD_ROWS)
    if sequences * chunks == 0:
        return
    with on_device(src):
        nsa_fold_kernel[(sequences * chunks,)](src, dst, seqlen, heads, steps, head_dim, chunks, BLOCK=block,
                                               ROWS=FOLD_ROWS, DIM=head_dim_bucket(head_dim), UNFOLD=unfold)
