"""MoBA's two passes on the varlen attention kernels (chapter 07), forward and backward.

Given each query's selection (:func:`fa_lab.sparse.moba_gate`: its own block first, then up to
``top_k - 1`` past blocks), MoBA's output is softmax attention over the union of those blocks, computed
in two varlen passes merged by their LSE, as flash-attn-based MoBA does:

1. *own block*: every query over its own block, causally. When the blocks tile the sequence, each block is
   a head of its own: q viewed as (B, H * N / block, block, d) goes through the dense causal kernel with no
   copy (:func:`block_heads`); otherwise varlen attention with one sequence per block
   (:func:`own_block_sequences`) on token-major copies;
2. *past blocks*, key-block-major: the (query, selected block) entries are grouped by (batch, head,
   block), so that the queries that chose one block of one head form one packed sequence against that
   block's keys, all of them in a single launch with one head per sequence (:func:`past_block_sequences`:
   a count per block and tile of queries, their running sums, then a kernel that writes each query's row of q to
   its packed places).
   Every key of a past block lies before the query, so this pass needs no mask.

The partial results are merged by their LSE in one kernel, :func:`moba_merge_kernel`, a jit copy of
:func:`fa_lab.online_softmax.merge_splits` that reads pass 1's rows in place and pass 2's through the
packing's inverse (``entries``), so that no partial result is copied or scattered first, a block of
rows a program (decoding's merge, one row a program, suits a few rows of many splits, not millions of rows of
a few). The backward runs each pass's backward with the *merged* output and LSE (P = exp(S - lse) is then the
final softmax, so each pass yields its exact share of the gradients, as ring attention's steps do) and adds
the shares; a query's dQ from its past blocks is added back through the same inverse
(:func:`add_past_rows_kernel`). The backward's packed operands (q, O and dO) are gathered by
:func:`gather_rows`.

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
import triton
import triton.language as tl

from ...block_info import cdiv
from .. import common
from ..common import SideWork, head_dim_bucket, kernel_operand, on_device
from .attention import (
    NO_OPTIONS,
    DeviceTiles,
    triton_backward,
    triton_forward,
    triton_varlen_backward,
    triton_varlen_forward,
)

LOG2E = tl.constexpr(common.LOG2E)
# Rows a program of moba_merge_kernel, gather_rows_kernel and add_past_rows_kernel. On the H200 at 64K this merge
# takes 0.57 ms where decoding's kernel (one program per row, the partial results scattered into per-slot buffers
# first) took 5.8 ms, and the gathers 0.38 ms in the forward and 1.1 in the backward where PyTorch's took 2.3 and
# 6.9 (docs/experiments/sparse_kernels.md).
ROWS_PER_PROGRAM = 16
# moba_count_kernel and moba_place_kernel: at most this many query rows a program, and (rows, blocks) counts (the
# tiles a step of moba_offsets_kernel, likewise).
PLACE_ROWS, PLACE_ELEMENTS = 64, 4096
# moba_gate_kernel: query rows a program, and the most key blocks it scores in registers (a (rows, blocks)
# float32 tile); fa_lab.sparse.moba_gate keeps longer block lists in PyTorch.
GATE_ROWS, GATE_BLOCKS = 64, 256


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


def key_block_bounds(rows: int, seqlen: int, block: int, device) -> torch.Tensor:
    """int32 (rows * blocks + 1,): the offsets of every key block of ``rows`` head rows of ``seqlen`` keys,
    packed one after another (pass 2's cu_seqlens_k), built where they are used: a copy from the host would
    wait for the GPU."""
    blocks = cdiv(seqlen, block)
    index = torch.arange(rows * blocks + 1, dtype=torch.int64, device=device)
    starts = (index // blocks) * seqlen + (index % blocks) * block  # the last one: (rows, 0) = the total
    return starts.to(torch.int32)


@triton.jit
def _tile_hits(selected_ptr, query, row_ok, TOP_K: tl.constexpr, BLOCKS: tl.constexpr):
    """(ROWS, BLOCKS) int32: for each of a tile's query rows (query: their rows of (B * H * N)), which key blocks
    it chose in a past slot (selected_ptr as :func:`moba_count_kernel`)."""
    cols = tl.arange(0, BLOCKS)
    hits = tl.zeros([query.shape[0], BLOCKS], dtype=tl.int32)
    for slot in tl.static_range(1, TOP_K):
        chosen = tl.load(selected_ptr + query * TOP_K + slot, mask=row_ok, other=-1)
        hits += (chosen[:, None] == cols[None, :]).to(tl.int32)
    return hits


@triton.jit
def moba_count_kernel(selected_ptr, counts_ptr, seqlen, blocks, TOP_K: tl.constexpr, ROWS: tl.constexpr,
                      BLOCKS: tl.constexpr):
    """counts_ptr[bh, t, b] (int32 (B * H, tiles, blocks)): how many (query, past slot) entries of query rows
    [t * ROWS, +ROWS) of head row bh chose key block b (BLOCKS >= blocks). selected_ptr: int64 (B * H, seqlen,
    TOP_K), the own block in slot 0, -1 for an unused slot. Program (t, bh)."""
    pid_t, bh = tl.program_id(0), tl.program_id(1)
    rows = pid_t * ROWS + tl.arange(0, ROWS)
    hits = _tile_hits(selected_ptr, bh.to(tl.int64) * seqlen + rows, rows < seqlen, TOP_K, BLOCKS)
    cols = tl.arange(0, BLOCKS)
    tl.store(counts_ptr + (bh.to(tl.int64) * tl.num_programs(0) + pid_t) * blocks + cols, tl.sum(hits, axis=0),
             mask=cols < blocks)


@triton.jit
def moba_offsets_kernel(counts_ptr, first_ptr, totals_ptr, tiles, blocks, CHUNK: tl.constexpr, BLOCKS: tl.constexpr):
    """The running sums of :func:`moba_count_kernel`'s counts over a head row's tiles (program bh, CHUNK tiles a
    step): first_ptr[bh, t, b] (int32, counts_ptr's shape) = block b's entries in tiles before t, and
    totals_ptr[bh, b] (int32 (B * H, blocks)) = all of them. (PyTorch's running sum along the middle dimension
    took 0.39 ms at 64K on the H200.)"""
    bh = tl.program_id(0)
    cols = tl.arange(0, BLOCKS)
    col_ok = cols < blocks
    head = bh.to(tl.int64) * tiles * blocks
    carry = tl.zeros([BLOCKS], dtype=tl.int32)
    for start in range(0, tiles, CHUNK):
        tile = start + tl.arange(0, CHUNK)
        ok = (tile < tiles)[:, None] & col_ok[None, :]
        at = head + tile[:, None] * blocks + cols[None, :]
        counts = tl.load(counts_ptr + at, mask=ok, other=0)
        tl.store(first_ptr + at, carry[None, :] + tl.cumsum(counts, axis=0) - counts, mask=ok)
        carry += tl.sum(counts, axis=0)
    tl.store(totals_ptr + bh * blocks + cols, carry, mask=col_ok)


@triton.jit
def moba_place_kernel(selected_ptr, cu_q_ptr, first_ptr, q_ptr, packed_q_ptr, query_rows_ptr, inverse_ptr, seqlen,
                      blocks, rows_total, width, TOP_K: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
                      WIDTH: tl.constexpr):
    """Pass 2's packing of query rows [t * ROWS, +ROWS) of head row bh (program (t, bh)): entry (row, slot s) with
    key block b goes to packed row cu_q_ptr[bh * blocks + b] (where the sequence of block b starts) plus
    first_ptr[bh, t, b] (its entries in earlier tiles, :func:`moba_offsets_kernel`) plus its entries in the
    tile's earlier rows, so that each block's queries stay in row order (the order of a stable sort by block).
    There it writes the query's row of q (q_ptr: (rows_total, width), packed_q_ptr the
    same width), its index (query_rows_ptr, int64), and the packed row into inverse_ptr[s - 1, row] (int32
    (TOP_K - 1, rows_total), -1 for an unused slot). selected_ptr and BLOCKS as :func:`moba_count_kernel`."""
    pid_t, bh = tl.program_id(0), tl.program_id(1)
    rows = pid_t * ROWS + tl.arange(0, ROWS)
    row_ok = rows < seqlen
    query = bh.to(tl.int64) * seqlen + rows  # rows of (B * H * N)
    hits = _tile_hits(selected_ptr, query, row_ok, TOP_K, BLOCKS)
    before = tl.cumsum(hits, axis=0) - hits  # each block's entries in the tile's earlier rows
    blocks_at = tl.arange(0, BLOCKS)
    first = (tl.load(cu_q_ptr + bh * blocks + blocks_at, mask=blocks_at < blocks, other=0)
             + tl.load(first_ptr + (bh.to(tl.int64) * tl.num_programs(0) + pid_t) * blocks + blocks_at,
                       mask=blocks_at < blocks, other=0))
    cols = tl.arange(0, WIDTH)
    col_ok = cols < width
    tile = tl.load(q_ptr + query[:, None] * width + cols[None, :], mask=row_ok[:, None] & col_ok[None, :])
    for slot in tl.static_range(1, TOP_K):
        chosen = tl.load(selected_ptr + query * TOP_K + slot, mask=row_ok, other=-1)
        packed = tl.sum(tl.where(chosen[:, None] == blocks_at[None, :], first[None, :] + before, 0), axis=1)
        used = row_ok & (chosen >= 0)
        tl.store(inverse_ptr + (slot - 1) * rows_total + query, tl.where(used, packed, -1), mask=row_ok)
        tl.store(query_rows_ptr + packed, query, mask=used)
        tl.store(packed_q_ptr + packed.to(tl.int64)[:, None] * width + cols[None, :], tile,
                 mask=used[:, None] & col_ok[None, :])


def place_tile(blocks: int) -> tuple[int, int]:
    """(ROWS, BLOCKS) of :func:`moba_count_kernel` and :func:`moba_place_kernel` for ``blocks`` key blocks: a
    (ROWS, BLOCKS) tile of at most PLACE_ELEMENTS counts, at least 16 rows."""
    padded = max(16, triton.next_power_of_2(blocks))
    return max(16, min(PLACE_ROWS, PLACE_ELEMENTS // padded)), padded


def past_block_sequences(selected: torch.Tensor, block: int, q: torch.Tensor) -> dict:
    """Pass 2's packing of the past-block entries, key-block-major, by :func:`moba_count_kernel`,
    :func:`moba_offsets_kernel` and :func:`moba_place_kernel`: the queries that chose one block of one head form
    one packed sequence against that block's keys, in row order.

    q: (B, H, N, d8) contiguous, the queries. Returns a dict: ``cu_q``, ``cu_k``: int32 (B * H * blocks + 1,),
    the packed queries and the key rows of each (batch, head, block) sequence (the keys as the (B * H * N) rows
    of k); ``q``: (E, 1, d8), the packed queries, E = B * H * N * past rows of which the first cu_q[-1] are used;
    ``query_rows``: int64 (E,), each packed row's row of q (the same cut); ``entries``: int32 (past, B * H * N),
    for slot s of query row r the packed row that holds it, -1 where the query chose nothing; ``past``: the slots
    per query. Nothing waits for the GPU: the forward schedules pass 2 from the offsets on the device
    (``DeviceTiles``), and cu_q is copied to the host without a wait for the backward (:func:`packing_bounds`).
    The sort this replaces (:func:`fa_lab.kernels.common.grouped_entries`) gives the same packing; a test holds
    them equal.
    """
    selected = selected.contiguous()
    batch, heads, seqlen, top_k = selected.shape
    blocks, past = cdiv(seqlen, block), top_k - 1
    device, head_rows, rows = selected.device, batch * heads, batch * heads * seqlen
    tile_rows, padded_blocks = place_tile(blocks)
    tiles = cdiv(seqlen, tile_rows)
    counts = torch.empty((head_rows, tiles, blocks), dtype=torch.int32, device=device)
    moba_count_kernel[(tiles, head_rows)](selected, counts, seqlen, blocks, TOP_K=top_k, ROWS=tile_rows,
                                          BLOCKS=padded_blocks)
    first = torch.empty_like(counts)
    totals = torch.empty((head_rows, blocks), dtype=torch.int32, device=device)
    moba_offsets_kernel[(head_rows,)](counts, first, totals, tiles, blocks, CHUNK=tile_rows, BLOCKS=padded_blocks)
    cu_q = torch.zeros(head_rows * blocks + 1, dtype=torch.int32, device=device)
    torch.cumsum(totals.flatten(), 0, out=cu_q[1:])
    width = q.shape[-1]
    packed_q = q.new_empty((rows * past, 1, width))
    query_rows = torch.empty(rows * past, dtype=torch.int64, device=device)
    entries = torch.empty((past, rows), dtype=torch.int32, device=device)
    moba_place_kernel[(tiles, head_rows)](selected, cu_q, first, q, packed_q, query_rows, entries, seqlen, blocks,
                                          rows, width, TOP_K=top_k, ROWS=tile_rows, BLOCKS=padded_blocks,
                                          WIDTH=head_dim_bucket(width))
    cu_q_host = torch.empty(cu_q.shape, dtype=torch.int32, pin_memory=cu_q.is_cuda)
    cu_q_host.copy_(cu_q, non_blocking=True)
    copied = torch.cuda.Event() if cu_q.is_cuda else None
    if copied is not None:
        copied.record()
    return {"past": past, "cu_q": cu_q, "cu_k": key_block_bounds(head_rows, seqlen, block, device), "q": packed_q,
            "query_rows": query_rows, "entries": entries, "cu_q_host": cu_q_host,
            "cu_k_host": key_block_bounds(head_rows, seqlen, block, "cpu"), "copied": copied}


def packing_bounds(packing: dict) -> tuple[list[int], list[int]]:
    """(cu_q, cu_k) of :func:`past_block_sequences` as lists, waiting for cu_q's copy to the host (and for
    nothing queued after it)."""
    if "bounds" not in packing:
        if packing["copied"] is not None:
            packing["copied"].synchronize()
        packing["bounds"] = (packing["cu_q_host"].tolist(), packing["cu_k_host"].tolist())
    return packing["bounds"]


@triton.jit
def _fold_split(top, total, acc, lse, part):
    """One more partial result (lse (ROWS,), part (ROWS, HEAD_DIM) float32) into the running maximum, sum and
    weighted sum: the online softmax's rescale. A partial result with lse = -inf weighs 0."""
    new_top = tl.maximum(top, lse)
    shift = tl.where(new_top == float("-inf"), 0.0, new_top)
    rescale, weight = tl.math.exp2((top - shift) * LOG2E), tl.math.exp2((lse - shift) * LOG2E)
    return new_top, total * rescale + weight, acc * rescale[:, None] + weight[:, None] * part


@triton.jit
def moba_merge_kernel(own_out_ptr, own_lse_ptr, past_out_ptr, past_lse_ptr, entry_ptr, out_ptr, lse_ptr, rows,
                      past, head_dim, stride_part, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """MoBA's merge, the jit copy of :func:`fa_lab.online_softmax.merge_splits`: program p merges rows
    p * ROWS ... of the ``rows`` rows of (B, H, N). Row r's partial results are pass 1's (own_out_ptr row r,
    own_lse_ptr[r]) and, for each of its ``past`` slots, pass 2's packed row entry_ptr[slot, r] (past_out_ptr,
    past_lse_ptr), none where that is -1. stride_part: the partial results' row stride (their head_dim padded
    to 8); out_ptr: (rows, head_dim) in its dtype, lse_ptr: (rows,) float32."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    cols = tl.arange(0, HEAD_DIM)
    col_ok = cols < head_dim
    top = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    own_lse = tl.load(own_lse_ptr + row, mask=row_ok, other=float("-inf"))
    own = tl.load(own_out_ptr + row.to(tl.int64)[:, None] * stride_part + cols[None, :],
                  mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    top, total, acc = _fold_split(top, total, acc, own_lse, own.to(tl.float32))
    for slot in tl.range(0, past):
        entry = tl.load(entry_ptr + slot * rows + row, mask=row_ok, other=-1)
        found = entry >= 0
        lse = tl.load(past_lse_ptr + entry, mask=found, other=float("-inf"))
        part = tl.load(past_out_ptr + entry.to(tl.int64)[:, None] * stride_part + cols[None, :],
                       mask=found[:, None] & col_ok[None, :], other=0.0)
        top, total, acc = _fold_split(top, total, acc, lse, part.to(tl.float32))
    empty = total == 0.0
    acc = acc / tl.where(empty, 1.0, total)[:, None]
    tl.store(lse_ptr + row, tl.where(empty, float("-inf"), top + tl.log(tl.where(empty, 1.0, total))), mask=row_ok)
    tl.store(out_ptr + row.to(tl.int64)[:, None] * head_dim + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def gather_rows_kernel(src_ptr, index_ptr, dst_ptr, count, width, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """dst row i = src row index_ptr[i] for program p's ROWS rows of the ``count``; src, dst: contiguous rows of
    ``width`` elements, one dtype."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < count
    cols = tl.arange(0, WIDTH)
    ok = row_ok[:, None] & (cols < width)[None, :]
    source = tl.load(index_ptr + row, mask=row_ok, other=0)
    tile = tl.load(src_ptr + source.to(tl.int64)[:, None] * width + cols[None, :], mask=ok)
    tl.store(dst_ptr + row.to(tl.int64)[:, None] * width + cols[None, :], tile, mask=ok)


@triton.jit
def add_past_rows_kernel(dq_ptr, part_ptr, entry_ptr, rows, past, width, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """dQ's share from the past blocks, in place: row r of dq_ptr (``rows`` rows of ``width``) gains, for each of
    its ``past`` slots, pass 2's packed row entry_ptr[slot, r] of part_ptr (none where that is -1), summed in
    float32 and rounded once."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    cols = tl.arange(0, WIDTH)
    col_ok = cols < width
    at = dq_ptr + row.to(tl.int64)[:, None] * width + cols[None, :]
    acc = tl.load(at, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    for slot in tl.range(0, past):
        entry = tl.load(entry_ptr + slot * rows + row, mask=row_ok, other=-1)
        acc += tl.load(part_ptr + entry.to(tl.int64)[:, None] * width + cols[None, :],
                       mask=(entry >= 0)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    tl.store(at, acc.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def moba_gate_kernel(q_ptr, means_ptr, out_ptr, seqlen, heads, group, blocks, block, head_dim, stride_part,
                     stride_qb, stride_qh, stride_qn, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """MoBA's gate for BLOCK_M query rows of one (batch, head), :func:`fa_lab.sparse.moba_gate`'s selection.
    The scores against every block's mean key come from three tensor-core products in q's dtype, one per
    piece of the float32 means (means_ptr: (3, B, H_kv, blocks, head_dim) in q's dtype, pieces stride_part
    apart, summing to the means: :func:`mean_key_pieces`; query head h reads KV head h // group), summed in
    float32: the float32 scores, as q's products with each piece are exact. Then, in registers: the own block
    first; then the best strictly earlier block, TOP_K - 1 times, each masked out once taken (-1 once none is
    left). out_ptr: int64 (B, H, N, TOP_K). q is read once, in its own dtype."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    batch, head = pid_bh // heads, pid_bh % heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seqlen
    dims = tl.arange(0, HEAD_DIM)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
                + rows.to(tl.int64)[:, None] * stride_qn + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    cols = tl.arange(0, BLOCKS)
    means = (means_ptr + (pid_bh // group).to(tl.int64) * blocks * head_dim  # (batch, head // group)
             + cols[:, None] * head_dim + dims[None, :])
    means_ok = (cols < blocks)[:, None] & dim_ok[None, :]
    scores = tl.zeros([BLOCK_M, BLOCKS], dtype=tl.float32)
    for piece in tl.static_range(3):
        scores = tl.dot(q, tl.trans(tl.load(means + piece * stride_part, mask=means_ok, other=0.0)), scores)
    own = rows // block
    scores = tl.where(cols[None, :] < own[:, None], scores, float("-inf"))  # strictly earlier blocks only
    at = out_ptr + (pid_bh.to(tl.int64) * seqlen + rows) * TOP_K
    tl.store(at, own.to(tl.int64), mask=row_ok)
    for slot in tl.static_range(1, TOP_K):
        best = tl.max(scores, axis=1)
        index = tl.argmax(scores, axis=1)
        tl.store(at + slot, tl.where(best == float("-inf"), -1, index).to(tl.int64), mask=row_ok)
        scores = tl.where(cols[None, :] == index[:, None], float("-inf"), scores)


def mean_key_pieces(means: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 means (B, H_kv, blocks, d) as three pieces in ``dtype`` (3, B, H_kv, blocks, d) that sum to
    them: each piece is the rest of the one before, rounded (about 8 more mantissa bits each in bfloat16)."""
    pieces, rest = [], means
    for _ in range(3):
        pieces.append(rest.to(dtype))
        rest = rest - pieces[-1].float()
    return torch.stack(pieces)


def triton_moba_gate(q: torch.Tensor, means: torch.Tensor, block: int, top_k: int) -> torch.Tensor:
    """:func:`moba_gate_kernel` over q (B, H, N, d) (last dim contiguous) and the blocks' float32 mean keys
    (B, H_kv, blocks, d): int64 (B, H, N, top_k). At most :data:`GATE_BLOCKS` blocks (the caller checks); the
    gate in PyTorch took 2.7 ms at 64K, most of it a float32 copy of q and its max passes
    (docs/experiments/sparse_kernels.md)."""
    batch, heads, seqlen, head_dim = q.shape
    blocks = means.shape[2]
    pieces = mean_key_pieces(means, q.dtype)
    out = torch.empty((batch, heads, seqlen, top_k), dtype=torch.int64, device=q.device)
    block_m = GATE_ROWS if seqlen >= GATE_ROWS else 16
    with on_device(q):
        moba_gate_kernel[(triton.cdiv(seqlen, block_m), batch * heads)](
            q, pieces, out, seqlen, heads, heads // means.shape[1], blocks, block, head_dim, pieces.stride(0),
            q.stride(0), q.stride(1), q.stride(2), TOP_K=top_k, BLOCK_M=block_m,
            BLOCKS=max(16, triton.next_power_of_2(blocks)), HEAD_DIM=head_dim_bucket(head_dim))
    return out


def gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] for t (R, ..., w) contiguous and index int64 (E,) on t's device: (E, ..., w), gathered by
    :func:`gather_rows_kernel` (PyTorch's gather of these 256-byte rows ran at about a quarter of the H200's
    bandwidth, docs/experiments/sparse_kernels.md)."""
    out = t.new_empty((len(index), *t.shape[1:]))
    width = t[0].numel()
    gather_rows_kernel[(triton.cdiv(len(index), ROWS_PER_PROGRAM),)](t, index, out, len(index), width,
                                                                    ROWS=ROWS_PER_PROGRAM,
                                                                    WIDTH=head_dim_bucket(width))
    return out


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) -> (B * H * N, 1, d): every head's rows as one-head sequences."""
    return t.reshape(-1, 1, t.shape[-1])


class MobaFunction(torch.autograd.Function):
    """Autograd wrapper of MoBA's two passes (module docstring); returns (out (B, H, N, d) in q.dtype,
    lse (B, H, N) float32, detached)."""

    @staticmethod
    def forward(ctx, q, k, v, select, block, scale, kernels=PassKernels()):
        """select: () -> selected, called once pass 1 is queued (it needs none of pass 1's results)."""
        batch, heads, seqlen, head_dim = q.shape
        q, k, v = (kernel_operand(t.contiguous()) for t in (q, k, v))  # (B, H, N, d8), contiguous
        as_heads = seqlen % block == 0  # pass 1 on the dense kernel, each block a head
        cu_own, own_bounds = (None, None) if as_heads else own_block_sequences(batch, seqlen, block, q.device)
        rows, stride_part = batch * heads * seqlen, q.shape[-1]
        with on_device(q):
            # The gate and pass 2's packing run beside pass 1 (SideWork, a second stream): neither needs the other.
            side = SideWork(q.device)
            # Pass 1's results as rows of (B, H, N): the dense kernel's are already; the varlen kernel's are
            # token-major and are copied to that order.
            if as_heads:
                own_out, own_lse = kernels.forward(*(block_heads(t, block) for t in (q, k, v)), True, scale)
            else:
                own_out, own_lse = kernels.varlen_forward(*(token_major(t) for t in (q, k, v)), cu_own, cu_own,
                                                          (own_bounds, own_bounds), True, scale, NO_OPTIONS)
                own_out = head_major(own_out, batch).contiguous()
                own_lse = own_lse.view(heads, batch, seqlen).transpose(0, 1).contiguous()
            with side:
                selected = select()
                past = selected.shape[-1] - 1  # slots after the own block
                packing = past_block_sequences(selected, block, q) if past else None
            if packing is not None:
                entries = packing["entries"]
                side.join(packing["q"], entries, packing["query_rows"], packing["cu_q"], packing["cu_k"])
                # The offsets stay on the device (DeviceTiles): nothing here waits for the GPU.
                tiles = DeviceTiles(packing["cu_q"], packing["cu_k"], len(packing["q"]))
                past_out, past_lse = kernels.varlen_forward(packing["q"], rows_of(k), rows_of(v), packing["cu_q"],
                                                            packing["cu_k"], tiles, False, scale, NO_OPTIONS)
                del packing["q"]  # (the backward gathers its own)
            else:  # the merge reads pass 1's results alone (placeholders, not read)
                past_out, past_lse = own_out, own_lse
                entries = torch.empty(1, dtype=torch.int32, device=q.device)
            out = torch.empty((batch, heads, seqlen, head_dim), dtype=q.dtype, device=q.device)
            lse = torch.empty((batch, heads, seqlen), dtype=torch.float32, device=q.device)
            moba_merge_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
                own_out, own_lse, past_out, past_lse, entries, out, lse, rows, past, head_dim, stride_part,
                ROWS=ROWS_PER_PROGRAM, HEAD_DIM=head_dim_bucket(head_dim))
        ctx.save_for_backward(q, k, v, out, lse, cu_own)
        ctx.args = (block, scale, own_bounds, packing, entries, kernels, head_dim)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, cu_own = ctx.saved_tensors  # q, k, v: (B, H, N, d8); out: (B, H, N, d)
        block, scale, own_bounds, packing, entries, kernels, head_dim = ctx.args
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
                bounds = packing_bounds(packing)  # the backward's schedules are built on the host
                rows = packing["query_rows"][:bounds[0][-1]]
                dq_g, dk_p, dv_p = kernels.varlen_backward(
                    gather_rows(rows_of(q), rows), rows_of(k), rows_of(v), gather_rows(rows_of(out), rows),
                    lse.reshape(1, -1)[:, rows].contiguous(), gather_rows(rows_of(grad_out), rows),
                    packing["cu_q"], packing["cu_k"], bounds, False, scale, NO_OPTIONS)
                dq = dq.contiguous()
                past, query_rows = entries.shape
                add_past_rows_kernel[(triton.cdiv(query_rows, ROWS_PER_PROGRAM),)](
                    dq, dq_g.contiguous(), entries, query_rows, past, dq.shape[-1],
                    ROWS=ROWS_PER_PROGRAM, WIDTH=head_dim_bucket(dq.shape[-1]))
                dk = dk + dk_p[:, 0].view(k.shape)
                dv = dv + dv_p[:, 0].view(v.shape)
        return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim], None, None, None, None
