"""Attention over selected key blocks as Triton kernels: NSA's selected branch and block-sparse attention.

A selection ``indices (B, H_kv, R, S)`` lists, for each *selection row* ``r`` (the queries
``[r * block_q, (r + 1) * block_q)``, cut to seqlen_q) of each KV head, up to ``S`` key blocks of
``block_k`` keys (-1: an unused slot, anywhere in the list). ``block_q = 1`` is NSA's per-query
selection (:func:`fa_lab.sparse.nsa_select`'s output as it is), ``block_q > 1`` block-sparse
attention's per-tile list (:func:`fa_lab.sparse.block_sparse_attention`'s ``key_tiles``).

One program takes one selection row of one KV head and packs the rows of every query head of its
GQA group into the tile (``group * queries`` rows, head-major: packed row ``p`` is query head
``kv_head * group + p // queries`` at position ``r * block_q + p % queries``), so that each selected
K/V block is read once per group, not once per query head, and a per-query selection still fills
a tile. Rows that do not fit one tile of BLOCK_M go to further programs. Grid:
``(R, B * H_kv, cdiv(group * block_q, BLOCK_M))``.

The forward gathers the selected blocks through the index tensor, in chunks of BLOCK_N keys, and
runs the online softmax over them (:func:`.forward.online_softmax_tile`, exp2 with the folded
1/ln 2, float32 state). With ``causal`` key ``j`` is visible to query ``i`` iff
``j <= i + seqlen_k - seqlen_q`` (the course's bottom-right alignment). A row that sees no key gets
zeros and lse = -inf.

The backward is two kernels, as notebook 03's dense backward is. dQ runs over the forward's grid: each
program recomputes P from the saved LSE for the blocks its row selected and writes dQ of its own rows.
dK and dV run per key block: the selection is inverted on the device (:func:`selection_csr`, a stable
sort of the (row, slot) entries by block), and each program gathers the packed tiles of every row that
selected its block, keeps its dK, dV in registers and stores them once. No program adds into another's
rows, so there are no atomics and the backward is deterministic; delta = rowsum(dO * O) comes from
:func:`.backward.attention_bwd_preprocess_kernel`.

Tensors are contiguous (B, H, N, d) (the launcher makes them so); the kernels read rows through
pointers with the head_dim masked, so head_dim needs no padding.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ...inputs import check_block_size, check_qkv, resolve_scale
from ...sparse import check_key_tiles
from .. import interpreting
from ..common import LOG2E, cdiv, check_triton_inputs, grouped_entries, head_dim_bucket, on_device
from .backward import attention_bwd_preprocess_kernel
from .block_range import row_key_end
from .configs import TileConfig
from .forward import online_softmax_tile, write_output_rows
from .score_mod import visible_keys


@triton.jit
def packed_rows(sel_row, pid_bkv, chunk, group, seqlen_q, block_q, BLOCK_M: tl.constexpr):
    """The tile's rows: (rows, query, valid, last_query).

    rows: (BLOCK_M,) indices into the (B * H * seqlen_q) rows of q, o, lse; query: their positions;
    valid: False for the padding past the group's ``group * queries`` rows; last_query: the selection
    row's last position (what bounds its causal key range).
    """
    return rows_of_packed(sel_row, chunk * BLOCK_M + tl.arange(0, BLOCK_M), pid_bkv, group, seqlen_q, block_q)


@triton.jit
def rows_of_packed(sel_row, packed, pid_bkv, group, seqlen_q, block_q):
    """Elementwise :func:`packed_rows`: packed row ``packed`` of selection row ``sel_row`` (scalars, or
    vectors of one shape: a tile may stack the rows of several selection rows) -> (rows, query, valid,
    last_query)."""
    first = sel_row * block_q
    queries = tl.minimum(block_q, seqlen_q - first)  # the last selection row may be ragged
    valid = packed < group * queries
    query = first + packed % queries
    # (batch * heads + head) = pid_bkv * group + member, since head = kv_head * group + member.
    rows = (pid_bkv * group + packed // queries) * seqlen_q + query
    return rows, query, valid, first + queries - 1


@triton.jit
def row_tile(rows, valid, head_dim, HEAD_DIM: tl.constexpr):
    """(offsets, mask) of a (len(rows), HEAD_DIM) tile of a contiguous (rows, head_dim) tensor."""
    cols = tl.arange(0, HEAD_DIM)
    return rows.to(tl.int64)[:, None] * head_dim + cols[None, :], valid[:, None] & (cols[None, :] < head_dim)


@triton.jit
def selected_keys(index_ptr, slot, seqlen_k, block_k, key_limit):
    """(start, stop): the keys of the block in ``slot`` of the selection row at index_ptr, cut to
    seqlen_k and to ``key_limit`` (the causal end); an unused slot (-1) gives an empty range."""
    block = tl.load(index_ptr + slot)
    start = block * block_k
    stop = tl.minimum(tl.minimum(start + block_k, seqlen_k), key_limit)
    return start, tl.where(block >= 0, stop, start)


@triton.jit
def load_key_chunk(k_ptr, v_ptr, kv_row0, start_n, stop, head_dim, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(keys, offsets, mask, k, v): keys start_n + arange(BLOCK_N), the offsets and mask of their rows of one KV
    head (from row kv_row0 of the contiguous (B * Hkv * seqlen_k, head_dim) tensors; keys from ``stop`` on
    masked), and their (BLOCK_N, HEAD_DIM) K and V rows, zeros where masked."""
    keys = start_n + tl.arange(0, BLOCK_N)
    offsets, mask = row_tile(kv_row0 + keys, keys < stop, head_dim, HEAD_DIM=HEAD_DIM)
    k = tl.load(k_ptr + offsets, mask=mask, other=0.0)
    return keys, offsets, mask, k, tl.load(v_ptr + offsets, mask=mask, other=0.0)


@triton.jit
def attend_chunk(q, acc, l_i, m_i, k_ptr, v_ptr, kv_row0, start_n, stop, query, causal_offset, head_dim, qk_scale,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr):
    """(acc, l_i, m_i) after the online-softmax update of the packed rows over keys [start_n, start_n +
    BLOCK_N) cut to ``stop``. Always the masked update: a chunk may end inside its block, and any block may
    hold the causal diagonal of some rows (``stop`` plays seqlen_k: keys from it on are hidden)."""
    _, _, _, k, v = load_key_chunk(k_ptr, v_ptr, kv_row0, start_n, stop, head_dim, BLOCK_N=BLOCK_N,
                                   HEAD_DIM=HEAD_DIM)
    p, alpha, l_i, m_new = online_softmax_tile(tl.dot(q, tl.trans(k)), l_i, m_i, qk_scale, query, start_n, stop,
                                               causal_offset, BLOCK_N=BLOCK_N, MASKED=True, CAUSAL=CAUSAL)
    return tl.dot(p.to(v.dtype), v, acc * alpha[:, None]), l_i, m_new


@triton.jit
def block_select_fwd_kernel(q_ptr, k_ptr, v_ptr, index_ptr, o_ptr, lse_ptr,
                            group, seqlen_q, seqlen_k, head_dim, block_q, block_k, slots, qk_scale,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                            CAUSAL: tl.constexpr, ONE_CHUNK: tl.constexpr):
    """O and the LSE of one tile of packed rows over the blocks its selection row lists.

    q_ptr, o_ptr: (B, H, seqlen_q, head_dim); k_ptr, v_ptr: (B, H // group, seqlen_k, head_dim);
    index_ptr: int32 (B, H // group, R, slots); lse_ptr: (B, H, seqlen_q) float32; all contiguous.
    qk_scale = scale * log2(e). ONE_CHUNK: block_k <= BLOCK_N, so a block is one chunk and the loop over
    slots is the only loop, which the compiler pipelines (the next block's index and K/V loads issued
    while this one computes); an unused or causally hidden slot is then a fully masked chunk.
    """
    sel_row, pid_bkv, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, query, valid, last_query = packed_rows(sel_row, pid_bkv, chunk, group, seqlen_q, block_q, BLOCK_M=BLOCK_M)
    causal_offset = seqlen_k - seqlen_q
    key_limit = row_key_end(last_query, seqlen_q, seqlen_k, CAUSAL=CAUSAL)  # no row of the tile sees a key past it
    offsets, mask = row_tile(rows, valid, head_dim, HEAD_DIM=HEAD_DIM)
    q = tl.load(q_ptr + offsets, mask=mask, other=0.0)
    selection = index_ptr + (pid_bkv * tl.num_programs(0) + sel_row) * slots
    kv_row0 = pid_bkv * seqlen_k

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for slot in tl.range(0, slots):
        start, stop = selected_keys(selection, slot, seqlen_k, block_k, key_limit)
        if ONE_CHUNK:
            acc, l_i, m_i = attend_chunk(q, acc, l_i, m_i, k_ptr, v_ptr, kv_row0, start, stop, query, causal_offset,
                                         head_dim, qk_scale, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL)
        else:
            for start_n in tl.range(start, stop, BLOCK_N):
                acc, l_i, m_i = attend_chunk(q, acc, l_i, m_i, k_ptr, v_ptr, kv_row0, start_n, stop, query,
                                             causal_offset, head_dim, qk_scale, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                                             CAUSAL=CAUSAL)

    # The epilogue of a packed batch, over the group's rows of o as (group * seqlen_q, 1, head_dim) and
    # of lse as (1, group * seqlen_q) (offsets within one group fit in int32): padding rows are sent
    # past the end, where its row mask drops them.
    group_row0 = pid_bkv * group * seqlen_q
    group_rows = group * seqlen_q
    write_output_rows(acc, l_i, m_i, o_ptr + group_row0.to(tl.int64) * head_dim, head_dim, lse_ptr + group_row0,
                      0, 0, 1, 0, tl.where(valid, rows - group_row0, group_rows), group_rows, HEAD_DIM=HEAD_DIM)


@triton.jit
def packed_tile(q_ptr, do_ptr, lse2_ptr, delta_ptr, sel_row, pid_bkv, chunk, group, seqlen_q, head_dim, block_q,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """What the backward reads of one tile of packed rows: (rows' query positions, their q and dO tiles,
    lse2 (+inf on padding rows, so their P is exactly 0, as is that of rows that see no key), delta, the
    tile's offsets and mask, its selection row's last query)."""
    rows, query, valid, last_query = packed_rows(sel_row, pid_bkv, chunk, group, seqlen_q, block_q, BLOCK_M=BLOCK_M)
    q, do, lse2, delta, offsets, mask = load_backward_rows(q_ptr, do_ptr, lse2_ptr, delta_ptr, rows, valid, head_dim,
                                                           HEAD_DIM=HEAD_DIM)
    return query, q, do, lse2, delta, offsets, mask, last_query


@triton.jit
def load_backward_rows(q_ptr, do_ptr, lse2_ptr, delta_ptr, rows, valid, head_dim, HEAD_DIM: tl.constexpr):
    """(q, dO, lse2, delta, offsets, mask) of the given rows (:func:`packed_tile` says what each holds)."""
    offsets, mask = row_tile(rows, valid, head_dim, HEAD_DIM=HEAD_DIM)
    q = tl.load(q_ptr + offsets, mask=mask, other=0.0)
    do = tl.load(do_ptr + offsets, mask=mask, other=0.0)
    lse2 = tl.load(lse2_ptr + rows, mask=valid, other=float("inf"))
    delta = tl.load(delta_ptr + rows, mask=valid, other=0.0)
    return q, do, lse2, delta, offsets, mask


@triton.jit
def probabilities(q, k, v, do, lse2, delta, keys, stop, query, causal_offset, qk_scale, CAUSAL: tl.constexpr):
    """(P, dS) of a tile of packed rows against a chunk of keys, from the saved LSE: P = exp2(S qk_scale
    - lse2) where visible (keys before ``stop``, and causally), dS = P (dO V^T - delta), dS unscaled."""
    visible = visible_keys(query[:, None], keys[None, :], stop, causal_offset, 0, 0, CAUSAL)
    p = tl.where(visible, tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None]), 0.0)
    return p, p * (tl.dot(do, tl.trans(v)) - delta[:, None])


@triton.jit
def chunk_dq(dq, q, do, lse2, delta, k_ptr, v_ptr, kv_row0, start_n, stop, query, causal_offset, head_dim, qk_scale,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr):
    """dq plus the packed rows' dS K over keys [start_n, start_n + BLOCK_N) cut to ``stop`` (unscaled)."""
    keys, _, _, k, v = load_key_chunk(k_ptr, v_ptr, kv_row0, start_n, stop, head_dim, BLOCK_N=BLOCK_N,
                                      HEAD_DIM=HEAD_DIM)
    _, ds = probabilities(q, k, v, do, lse2, delta, keys, stop, query, causal_offset, qk_scale, CAUSAL=CAUSAL)
    return tl.dot(ds.to(k.dtype), k, dq)


@triton.jit
def block_select_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse2_ptr, delta_ptr, index_ptr, dq_ptr,
                               group, seqlen_q, seqlen_k, head_dim, block_q, block_k, slots, qk_scale, scale,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                               CAUSAL: tl.constexpr, ONE_CHUNK: tl.constexpr):
    """dQ of one tile of packed rows over the blocks its selection row lists (the forward's grid).

    Layouts as the forward; do_ptr, dq_ptr like q; lse2_ptr (lse * log2 e, +inf where lse = -inf) and
    delta_ptr: (B, H, seqlen_q) float32. ONE_CHUNK as in the forward.
    """
    sel_row, pid_bkv, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    query, q, do, lse2, delta, offsets, mask, last_query = packed_tile(
        q_ptr, do_ptr, lse2_ptr, delta_ptr, sel_row, pid_bkv, chunk, group, seqlen_q, head_dim, block_q,
        BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM)
    causal_offset = seqlen_k - seqlen_q
    key_limit = row_key_end(last_query, seqlen_q, seqlen_k, CAUSAL=CAUSAL)
    selection = index_ptr + (pid_bkv * tl.num_programs(0) + sel_row) * slots
    kv_row0 = pid_bkv * seqlen_k
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for slot in tl.range(0, slots):
        start, stop = selected_keys(selection, slot, seqlen_k, block_k, key_limit)
        if ONE_CHUNK:
            dq = chunk_dq(dq, q, do, lse2, delta, k_ptr, v_ptr, kv_row0, start, stop, query, causal_offset, head_dim,
                          qk_scale, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL)
        else:
            for start_n in tl.range(start, stop, BLOCK_N):
                dq = chunk_dq(dq, q, do, lse2, delta, k_ptr, v_ptr, kv_row0, start_n, stop, query, causal_offset,
                              head_dim, qk_scale, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL)
    tl.store(dq_ptr + offsets, (dq * scale).to(dq_ptr.dtype.element_ty), mask=mask)


@triton.jit
def probabilities_t(q, k, v, do, lse2, delta, keys, stop, query, causal_offset, qk_scale, CAUSAL: tl.constexpr):
    """(P^T, dS^T) of :func:`probabilities`, computed transposed ((keys, rows) tiles: K Q^T and V dO^T), so that
    dK and dV take them as they come. Transposing a tl.dot result instead (tl.trans(dS)) miscompiles on
    Hopper with Triton 3.4 to 3.7.0: wrong, run-to-run different dK (flash-linear-attention met it in its
    ``chunk_bwd_dqkwg``)."""
    visible = visible_keys(query[None, :], keys[:, None], stop, causal_offset, 0, 0, CAUSAL)
    p_t = tl.where(visible, tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :]), 0.0)
    return p_t, p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])


@triton.jit
def tile_dkdv(dk, dv, k, v, keys, stop, q_ptr, do_ptr, lse2_ptr, delta_ptr, rows, query, valid, head_dim,
              causal_offset, qk_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr):
    """(dk, dv) plus the contributions of a tile of rows (:func:`rows_of_packed`) to a chunk of keys:
    dV += P^T dO, dK += dS^T Q (unscaled)."""
    q, do, lse2, delta, _, _ = load_backward_rows(q_ptr, do_ptr, lse2_ptr, delta_ptr, rows, valid, head_dim,
                                                  HEAD_DIM=HEAD_DIM)
    p_t, ds_t = probabilities_t(q, k, v, do, lse2, delta, keys, stop, query, causal_offset, qk_scale, CAUSAL=CAUSAL)
    return tl.dot(ds_t.to(q.dtype), q, dk), tl.dot(p_t.to(do.dtype), do, dv)


@triton.jit
def block_select_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse2_ptr, delta_ptr, offsets_ptr, selectors_ptr,
                                 dk_ptr, dv_ptr, group, seqlen_q, seqlen_k, head_dim, block_q, block_k, qk_scale,
                                 scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, STACK: tl.constexpr,
                                 HEADS_INNER: tl.constexpr):
    """dK, dV of one chunk of BLOCK_N keys of one key block of one KV head, gathered from every selection row
    that selected the block. Grid ``(B * H_kv, blocks * cdiv(block_k, BLOCK_N))`` with HEADS_INNER, else the
    two axes swapped. The GPU starts programs in the order of their first axis fastest: with HEADS_INNER in
    block order across every KV head row (under a causal selection the first blocks have the longest lists,
    as every later query may pick them, so the longest start first everywhere), else one head row's blocks
    after another's.

    The selection inverted: the rows that selected block b of KV head row bkv are
    ``selectors[offsets[bkv * blocks + b] : offsets[bkv * blocks + b + 1]]`` (int32, CSR, from
    :func:`selection_csr`). Each is read as the forward reads it, its packed tile of the group's query
    rows, and the program keeps its dK, dV in registers and stores them once: no atomics, so the
    backward is deterministic. STACK >= 1: a selection row's ``group * block_q`` packed rows fit a tile
    STACK times, so each step stacks the rows of STACK selecting rows into one tile (fla's NSA backward
    stacks selecting queries the same way), and the loop over them is the only loop, which the compiler
    pipelines; STACK = 0: a selection row takes several tiles, one step each.
    """
    per_block = tl.cdiv(block_k, BLOCK_N)
    if HEADS_INNER:
        pid_bkv, pid = tl.program_id(0), tl.program_id(1)
    else:
        pid, pid_bkv = tl.program_id(0), tl.program_id(1)
    block = pid // per_block
    start_n = block * block_k + (pid % per_block) * BLOCK_N
    stop = tl.minimum(block * block_k + block_k, seqlen_k)
    keys, kv_offsets, kv_mask, k, v = load_key_chunk(k_ptr, v_ptr, pid_bkv * seqlen_k, start_n, stop, head_dim,
                                                     BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM)
    list_at = pid_bkv * tl.cdiv(seqlen_k, block_k) + block
    first, last = tl.load(offsets_ptr + list_at), tl.load(offsets_ptr + list_at + 1)
    causal_offset = seqlen_k - seqlen_q
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if STACK > 0:
        tile_row = tl.arange(0, BLOCK_M)
        per_row = group * block_q  # packed rows per selection row (a ragged last one has fewer: masked)
        for step in tl.range(first, last, STACK):
            entry = step + tile_row // per_row
            live = (tile_row // per_row < STACK) & (entry < last)
            sel_row = tl.load(selectors_ptr + entry, mask=live, other=0)
            rows, query, valid, _ = rows_of_packed(sel_row, tile_row % per_row, pid_bkv, group, seqlen_q, block_q)
            dk, dv = tile_dkdv(dk, dv, k, v, keys, stop, q_ptr, do_ptr, lse2_ptr, delta_ptr, rows, query,
                               valid & live, head_dim, causal_offset, qk_scale, HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL)
    else:
        for entry in tl.range(first, last):
            sel_row = tl.load(selectors_ptr + entry)
            packed = group * tl.minimum(block_q, seqlen_q - sel_row * block_q)
            for chunk in tl.range(0, tl.cdiv(packed, BLOCK_M)):
                rows, query, valid, _ = packed_rows(sel_row, pid_bkv, chunk, group, seqlen_q, block_q, BLOCK_M=BLOCK_M)
                dk, dv = tile_dkdv(dk, dv, k, v, keys, stop, q_ptr, do_ptr, lse2_ptr, delta_ptr, rows, query, valid,
                                   head_dim, causal_offset, qk_scale, HEAD_DIM=HEAD_DIM, CAUSAL=CAUSAL)
    tl.store(dk_ptr + kv_offsets, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv_offsets, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


# ---- launchers -------------------------------------------------------------------------------------

# The dK/dV gather's tile: the packed rows of several selecting rows stacked up to GATHER_ROWS rows (capped
# below), at GATHER_WARPS warps where the tile has at most that many rows and head_dim <= 128. On the H200
# (benchmarks/h200_nsa_dkdv_variants.json, NSA's case) the backward took 40.9 ms at 64K with 32 rows and 4
# warps, 56.4 with 64 rows and 8 (the 32-row tile at 8 warps 63.3): the 64-row tile needs 255 registers a
# thread at 8 warps, one CTA an SM; 64 rows at 4 warps spill (docs/experiments/sparse_kernels.md).
GATHER_ROWS, GATHER_WARPS = 32, 4
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second (and third) axis


def tile_config(rows: int, block_k: int, head_dim: int, backward: bool) -> TileConfig:
    """The tile of a launch: block_m covers a selection row's ``rows = group * block_q`` packed rows
    (a power of two, at least 16 for tl.dot) up to a cap, block_n one selected block or a chunk of it.

    On a GPU the caps and warps keep every tile free of register spills and within an H200's shared
    memory (checked by compiling for sm_90 offline, with a launch's divisibility hints): 128 rows in the
    forward at head_dim <= 64, else 64; the backward, whose q, dO and dQ tiles stay resident, 64 rows
    and 64 keys, 32 and 32 at head_dim 256; 8 warps for the larger tiles. The interpreter takes 64 and 64.
    """
    padded = head_dim_bucket(head_dim)
    if interpreting():
        cap_m, cap_n = 64, 64
    elif backward:
        cap_m, cap_n = (32, 32) if padded > 128 else (64, 64)
    else:
        cap_m, cap_n = (128 if padded <= 64 else 64), 64
    block_m = min(max(16, triton.next_power_of_2(rows)), cap_m)
    block_n = min(max(16, triton.next_power_of_2(block_k)), cap_n)
    large = (backward and padded >= 128) or block_m * padded >= 128 * 64
    return TileConfig(block_m, block_n, num_warps=8 if large else 4)


def gather_config(rows: int, block_k: int, head_dim: int) -> TileConfig:
    """The dK/dV gather's tile and launch for selection rows of ``rows`` packed rows: several of them stacked
    into GATHER_ROWS rows (one taller row takes its own tiles), at GATHER_WARPS warps where that fits."""
    config = tile_config(max(rows, GATHER_ROWS), block_k, head_dim, backward=True)
    if config.block_m <= GATHER_ROWS and head_dim_bucket(head_dim) <= 128:
        config = replace(config, num_warps=GATHER_WARPS)
    return config


def launch_meta(config: TileConfig, head_dim: int, causal: bool) -> dict:
    """The tile, head-dim and causal constexprs and the warps and stages of a launch at ``config``."""
    return dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim_bucket(head_dim), CAUSAL=causal,
                num_warps=config.num_warps, num_stages=config.num_stages)


def block_select_forward(q, k, v, indices, block_q: int, block_k: int, causal: bool, scale: float, *,
                         config: TileConfig | None = None):
    """Forward on contiguous q (B, H, Nq, d), k, v (B, Hkv, Nk, d) and int32 indices (B, Hkv, R, S), at
    ``config`` (:func:`tile_config`'s when None).

    Returns (out (B, H, Nq, d) in q.dtype, lse (B, H, Nq) float32).
    """
    batch, heads, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k, group = k.shape[1], k.shape[2], heads // k.shape[1]
    config = config or tile_config(group * block_q, block_k, head_dim, backward=False)
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    grid = (indices.shape[2], batch * heads_kv, cdiv(group * block_q, config.block_m))
    block_select_fwd_kernel[grid](
        q, k, v, indices, out, lse, group, seqlen_q, seqlen_k, head_dim, block_q, block_k, indices.shape[3],
        scale * LOG2E, ONE_CHUNK=block_k <= config.block_n, **launch_meta(config, head_dim, causal))
    return out, lse


def selection_csr(indices: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection inverted: for every KV head row and key block, which selection rows list the block.

    indices: int32 (B, Hkv, R, S), -1 for an unused slot; blocks: key blocks per sequence. Returns
    (offsets int32 (B * Hkv * blocks + 1,), selectors int32 (the listed entries,)): the rows that select
    block b of KV head row bkv (bkv = batch * Hkv + kv_head) are
    ``selectors[offsets[bkv * blocks + b] : offsets[bkv * blocks + b + 1]]``, in increasing order
    (:func:`grouped_entries` by (bkv, block), the unused slots past the end).
    """
    batch, heads_kv, rows, slots = indices.shape
    lists = batch * heads_kv * blocks
    flat = indices.reshape(batch * heads_kv, rows * slots).long()
    owner = torch.arange(batch * heads_kv, device=indices.device)[:, None] * blocks
    key = torch.where(flat >= 0, flat + owner, lists).flatten()
    selector = torch.arange(rows, device=indices.device).repeat_interleave(slots).repeat(batch * heads_kv)
    order, offsets = grouped_entries(key, lists)
    return offsets, selector[order].to(torch.int32).contiguous()


# The dQ kernel's warps for short tiles (NSA's 16 rows: one query of a 16-head group). At 16 rows and d = 128 the
# offline sm_90 build needs 64 registers a thread at 8 warps (tile_config's), 111 at 4 and 215 at 2, none
# spilling; on the H200 (benchmarks/h200_nsa_dq_warps.json, NSA's case at 16K-64K) the whole backward took
# 0.91-0.93 of its 8-warp time at 2 warps and 0.92-0.94 at 4: fewer warps split a short tile's rows less.
SHORT_DQ_TILE_ROWS, SHORT_DQ_TILE_WARPS = 16, 2


def block_select_backward(q, k, v, out, lse, grad_out, indices, block_q: int, block_k: int, causal: bool,
                          scale: float, dq_warps: int | None = None, gather: TileConfig | None = None,
                          heads_inner: bool = True):
    """Backward on the forward's operands and outputs; grad_out like out. Returns (dq, dk, dv) in
    q.dtype, shaped like q, k, v (dk, dv summed over the group's query heads and the selecting rows).

    Two kernels: dQ over the forward's grid, and dK, dV per key block over the selection inverted
    (:func:`selection_csr`), as notebook 03's dense backward splits them, so no program adds into
    another's rows. dq_warps: the dQ kernel's warps; by default :func:`tile_config`'s, but
    ``SHORT_DQ_TILE_WARPS`` for tiles of at most ``SHORT_DQ_TILE_ROWS`` rows. gather: the dK/dV kernel's tile
    and launch (block_m a multiple of ``group * block_q`` or below it); by default :func:`gather_config`'s.
    heads_inner: the gather programs' order (:func:`block_select_bwd_dkdv_kernel`'s HEADS_INNER).
    """
    batch, heads, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k, group = k.shape[1], k.shape[2], heads // k.shape[1]
    grad_out = grad_out.contiguous()
    rows, pre_block = batch * heads * seqlen_q, 64
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    attention_bwd_preprocess_kernel[(cdiv(rows, pre_block),)](
        out, grad_out, lse, delta, lse2, rows, head_dim, LOG2E, HEAD_DIM=head_dim_bucket(head_dim), BLOCK=pre_block)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    config = tile_config(group * block_q, block_k, head_dim, backward=True)
    if dq_warps is None and config.block_m <= SHORT_DQ_TILE_ROWS:
        dq_warps = SHORT_DQ_TILE_WARPS
    if dq_warps is not None:
        config = replace(config, num_warps=dq_warps)
    grid = (indices.shape[2], batch * heads_kv, cdiv(group * block_q, config.block_m))
    block_select_bwd_dq_kernel[grid](
        q, k, v, grad_out, lse2, delta, indices, dq, group, seqlen_q, seqlen_k, head_dim, block_q, block_k,
        indices.shape[3], scale * LOG2E, scale, ONE_CHUNK=block_k <= config.block_n,
        **launch_meta(config, head_dim, causal))
    blocks = cdiv(seqlen_k, block_k)
    offsets, selectors = selection_csr(indices, blocks)
    gather = gather or gather_config(group * block_q, block_k, head_dim)
    stack = gather.block_m // (group * block_q)  # 0: a selection row takes several tiles
    gather_grid = (batch * heads_kv, blocks * cdiv(block_k, gather.block_n))
    # A grid's second axis holds at most 65535 programs (DSA's blocks of one key pass that at 64K tokens): the
    # key blocks go first then, in the other order.
    heads_inner = heads_inner and gather_grid[1] <= MAX_GRID_Y
    block_select_bwd_dkdv_kernel[gather_grid if heads_inner else gather_grid[::-1]](
        q, k, v, grad_out, lse2, delta, offsets, selectors, dk, dv, group, seqlen_q, seqlen_k, head_dim, block_q,
        block_k, scale * LOG2E, scale, STACK=stack, HEADS_INNER=heads_inner, **launch_meta(gather, head_dim, causal))
    return dq, dk, dv


class BlockSelectFunction(torch.autograd.Function):
    """Autograd wrapper: saves the contiguous q, k, v, the indices, O and the LSE for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, indices, block_q, block_k, causal, scale):
        q, k, v = (t.contiguous() for t in (q, k, v))
        with on_device(q):
            out, lse = block_select_forward(q, k, v, indices, block_q, block_k, causal, scale)
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.args = (block_q, block_k, causal, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, indices, out, lse = ctx.saved_tensors
        with on_device(q):
            dq, dk, dv = block_select_backward(q, k, v, out, lse, grad_out.to(q.dtype), indices, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def triton_block_select_attention(q, k, v, block_indices, block_k: int, causal: bool = False,
                                  scale: float | None = None, *, block_q: int = 1, name: str = "block_indices"):
    """Differentiable attention of each query over the key blocks its selection row lists.

    q: (B, H, Nq, d), k, v: (B, Hkv, Nk, d), float16 or bfloat16 (H a multiple of Hkv: the group
    shares the selection). block_indices: int32/int64 (B, Hkv, cdiv(Nq, block_q), S), key blocks of
    ``block_k`` keys, -1 for an unused slot; block_q = 1 (the default) is a per-query selection such as
    :func:`fa_lab.sparse.nsa_select`'s, block_q > 1 a per-tile list such as block-sparse attention's.
    A selection is checked before anything runs (:func:`fa_lab.sparse.check_key_tiles`: indices in
    range, no block twice in one row, none that a causal call's rows all lie before; ``name``: the selection's
    argument name in its messages).
    Returns (out (B, H, Nq, d) in q.dtype, lse (B, H, Nq) float32, detached); rows that see no key
    get zeros and lse = -inf.
    """
    check_qkv(q, k, v)
    check_triton_inputs(q)
    block_q, block_k = check_block_size("block_q", block_q), check_block_size("block_k", block_k)
    scale = resolve_scale(scale, q.shape[-1])
    indices = check_key_tiles(block_indices, q, k, block_q, block_k, causal, name=name)
    return selected_blocks_attention(q, k, v, indices, block_k, causal, scale, block_q)


def selected_blocks_attention(q, k, v, indices, block_k: int, causal: bool, scale: float, block_q: int = 1):
    """:func:`triton_block_select_attention` without its checks, for a selection the library made itself (NSA's, from
    the importance kernel, which holds it to range, distinct blocks and the causal past by construction): checking
    costs a sort and three reads back to the host, with the GPU idle while the host waits (1.1-2.0 ms of NSA's
    forward at 16K-64K tokens on an H100, docs/experiments/sparse_kernels.md). indices: int32 or int64 on q's device;
    scale resolved."""
    indices = indices.to(device=q.device, dtype=torch.int32).contiguous()
    return BlockSelectFunction.apply(q, k, v, indices, block_q, block_k, bool(causal), scale)
