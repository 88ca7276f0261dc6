"""The FlashAttention backward as Triton kernels.

Nothing of size (Nq, Nk) was saved by the forward: each kernel recomputes its
tiles of P = exp(S - lse) from Q, K and the saved log-sum-exp, then

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dK = scale dS^T Q,   dQ = scale dS K

with D = rowsum(dO * O) computed once by a small preprocessing kernel. Under a soft cap dS
is multiplied by tanh's derivative 1 - tanh^2; with grouped-query attention each dK/dV program
sums over the query heads of its group, so dK and dV are written once per K/V head.

By default dK/dV and dQ come from two kernels rather than one kernel with atomics:
the first gives each program a K/V tile and streams the Q/dO tiles past it, the
second gives each program a Q/dO tile and streams the K/V tiles past it. Each
output tile is then owned by exactly one program, so there are no atomic adds
and the result is deterministic; the price is that S and dP are recomputed in
both kernels (7 tile products instead of 5). With ``ATOMIC_DQ`` the first kernel
also computes each tile pair's dS K and adds it into a float32 dQ (FA3's scheme:
5 products, dQ summed in an order that varies from run to run).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import common
from .block_range import key_range, query_range, window_key_range, window_query_range
from .score_mod import in_window, modified_scores, softcap_tanh, visible_keys

LOG2E = tl.constexpr(common.LOG2E)


@triton.jit
def attention_bwd_preprocess_kernel(o_ptr, do_ptr, lse_ptr, delta_ptr, lse2_ptr, rows, head_dim, log2e,
                                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """delta = rowsum(O * dO) and lse2 = lse * log2(e) (+inf where lse = -inf), per row.

    o_ptr, do_ptr: (rows, head_dim) contiguous; lse_ptr, delta_ptr, lse2_ptr: (rows,) float32;
    HEAD_DIM: head_dim rounded up to a power of two.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    in_bounds = offs < rows
    tile_mask = in_bounds[:, None] & (cols[None, :] < head_dim)
    o = tl.load(o_ptr + offs[:, None] * head_dim + cols[None, :], mask=tile_mask, other=0.0)
    do = tl.load(do_ptr + offs[:, None] * head_dim + cols[None, :], mask=tile_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(lse_ptr + offs, mask=in_bounds, other=0.0)
    # A row that sees no key has lse = -inf; exp2(s - (+inf)) = 0 then recomputes its P as 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * log2e)
    tl.store(delta_ptr + offs, delta, mask=in_bounds)
    tl.store(lse2_ptr + offs, lse2, mask=in_bounds)


@triton.jit
def _dkdv_step(dk, dv, k, v, desc_q, desc_do, desc_dq, lse2_ptr, delta_ptr, batch, head, q_row0, row_base,
               row_stride, start_m, offs_n, seqlen_q, causal_offset, qk_scale, scale, mods,
               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """Add one Q/dO tile's contribution to the dK, dV accumulators of a K/V tile (transposed P), and with
    ATOMIC_DQ its scale * dS K to the float32 dQ through desc_dq (a TMA reduce-add on sm_90).

    mods: (left, right, softcap_scale, softcap_log2, slope_log2), as in the forward. Row r of the tile's
    sequence is row q_row0 + r of the descriptors and lse2/delta entry row_base + r * row_stride."""
    q = desc_q.load([batch, head, q_row0 + start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    do = desc_do.load([batch, head, q_row0 + start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    left, right, softcap_scale, softcap_log2, slope_log2 = mods
    # Rows past seqlen_q load lse2 = +inf, so their P^T column is exactly 0.
    lse2 = tl.load(lse2_ptr + row_base + offs_m * row_stride, mask=offs_m < seqlen_q, other=float("inf"))
    delta = tl.load(delta_ptr + row_base + offs_m * row_stride, mask=offs_m < seqlen_q, other=0.0)
    kq = tl.dot(k, tl.trans(q))
    if SOFTCAP or ALIBI:
        p_t = tl.math.exp2(modified_scores(kq, offs_m[None, :], offs_n[:, None], qk_scale, softcap_scale,
                                           softcap_log2, slope_log2, causal_offset, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
                           - lse2[None, :])
    else:
        p_t = tl.math.exp2(kq * qk_scale - lse2[None, :])
    if MASKED:
        if WINDOW:
            p_t = tl.where(in_window(offs_m[None, :], offs_n[:, None], causal_offset, left, right), p_t, 0.0)
        else:
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + causal_offset, p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv)
    dp_t = tl.dot(v, tl.trans(do))
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:  # back through softcap * tanh(scale * q.k / softcap): times 1 - tanh^2
        tanh = softcap_tanh(kq, softcap_scale)
        ds_t = ds_t * (1.0 - tanh * tanh)
    dk = tl.dot(ds_t.to(q.dtype), q, dk)
    if ATOMIC_DQ:
        _add_dq(desc_dq, ds_t, k, scale, batch, head, q_row0 + start_m, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM)
    return dk, dv


@triton.jit
def _add_dq(desc_dq, ds_t, k, scale, batch, head, row, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """ATOMIC_DQ: add scale * dS K of one tile pair (ds_t: dS^T (BLOCK_N, BLOCK_M)) into the float32 dQ rows
    [row, +BLOCK_M) of (batch, head) through desc_dq (a TMA reduce-add on sm_90)."""
    dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k) * scale
    desc_dq.atomic_add([batch, head, row, 0], dq.reshape(1, 1, BLOCK_M, HEAD_DIM))


@triton.jit
def _dkdv_head(dk, dv, k, v, desc_q, desc_do, desc_dq, lse2_ptr, delta_ptr, slopes_ptr, batch, head, heads,
               q_row0, slope_index, begin, full_begin, full_end, rows_end, offs_n, seqlen_q, causal_offset,
               qk_scale, scale, left, right, softcap_scale, softcap_log2,
               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
               ALIBI: tl.constexpr, VARLEN: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """The dK, dV contributions of query head ``head``'s Q tiles: masked [begin, full_begin), whole
    [full_begin, full_end), masked [full_end, rows_end) (the band's lower edge, WINDOW only).
    lse2/delta are (B, H, Nq), or (total_q, H) in a packed batch (VARLEN)."""
    if VARLEN:
        row_base = q_row0 * heads + head
        row_stride = heads
    else:
        row_base = (batch * heads + head) * seqlen_q
        row_stride = 1
    slope_log2 = 0.0
    if ALIBI:
        slope_log2 = tl.load(slopes_ptr + slope_index) * LOG2E
    mods = (left, right, softcap_scale, softcap_log2, slope_log2)
    for start_m in tl.range(begin, full_begin, BLOCK_M):
        dk, dv = _dkdv_step(dk, dv, k, v, desc_q, desc_do, desc_dq, lse2_ptr, delta_ptr, batch, head, q_row0,
                            row_base, row_stride, start_m, offs_n, seqlen_q, causal_offset, qk_scale, scale, mods,
                            BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, MASKED=True, WINDOW=WINDOW, SOFTCAP=SOFTCAP,
                            ALIBI=ALIBI, ATOMIC_DQ=ATOMIC_DQ)
    for start_m in tl.range(full_begin, full_end, BLOCK_M):
        dk, dv = _dkdv_step(dk, dv, k, v, desc_q, desc_do, desc_dq, lse2_ptr, delta_ptr, batch, head, q_row0,
                            row_base, row_stride, start_m, offs_n, seqlen_q, causal_offset, qk_scale, scale, mods,
                            BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, MASKED=False, WINDOW=WINDOW, SOFTCAP=SOFTCAP,
                            ALIBI=ALIBI, ATOMIC_DQ=ATOMIC_DQ)
    if WINDOW:
        for start_m in tl.range(full_end, rows_end, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, desc_q, desc_do, desc_dq, lse2_ptr, delta_ptr, batch, head,
                                q_row0, row_base, row_stride, start_m, offs_n, seqlen_q, causal_offset, qk_scale,
                                scale, mods,
                                BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, MASKED=True, WINDOW=WINDOW, SOFTCAP=SOFTCAP,
                                ALIBI=ALIBI, ATOMIC_DQ=ATOMIC_DQ)
    return dk, dv


@triton.jit
def _store_rows(ptr, tile, row0, offs, rows, head, heads, head_dim, HEAD_DIM: tl.constexpr):
    """Store a (BLOCK, HEAD_DIM) tile into rows row0 + offs of a packed (total, heads, head_dim) tensor,
    only the sequence's own rows (offs < rows)."""
    cols = tl.arange(0, HEAD_DIM)
    ptrs = ptr + ((row0 + offs)[:, None] * heads + head) * head_dim + cols[None, :]
    tl.store(ptrs, tile.to(ptr.dtype.element_ty), mask=(offs < rows)[:, None] & (cols[None, :] < head_dim))


@triton.jit
def _sequence(tiles_ptr, cu_q_ptr, cu_k_ptr, tile):
    """(first block row, q_row0, k_row0, seqlen_q, seqlen_k, sequence) of tile ``tile`` of a packed batch."""
    sequence = tl.load(tiles_ptr + 2 * tile)
    start = tl.load(tiles_ptr + 2 * tile + 1)
    q_row0 = tl.load(cu_q_ptr + sequence)
    k_row0 = tl.load(cu_k_ptr + sequence)
    return (start, q_row0, k_row0, tl.load(cu_q_ptr + sequence + 1) - q_row0,
            tl.load(cu_k_ptr + sequence + 1) - k_row0, sequence)


@triton.jit
def attention_bwd_dkdv_kernel(desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, desc_dq, lse2_ptr, delta_ptr,
                              heads, seqlen_q, seqlen_k, qk_scale, scale,
                              group, left, right, softcap_scale, softcap_log2, slopes_ptr,
                              cu_q_ptr, cu_k_ptr, tiles_ptr, dk_ptr, dv_ptr, head_dim,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                              ALIBI: tl.constexpr, GQA: tl.constexpr, VARLEN: tl.constexpr,
                              ATOMIC_DQ: tl.constexpr = False):
    """dK and dV of one K/V tile of BLOCK_N keys, summed over the ``group`` query heads that read it
    (GQA: group > 1), and with ATOMIC_DQ (dense only) each tile pair's share of dQ added into the float32
    (B, H, Nq, HEAD_DIM) tensor of desc_dq (block (1, 1, BLOCK_M, HEAD_DIM)), which must start at zero.
    Grid: (cdiv(seqlen_k, BLOCK_N), B * H // group); with VARLEN, (K tiles of the schedule tiles_ptr,
    H // group), and dK, dV stored by rows into dk_ptr, dv_ptr ((total_k, H // group, head_dim)), as the
    forward's VARLEN describes."""
    if VARLEN:
        kv_head = tl.program_id(1)
        batch = 0
        start_n, q_row0, k_row0, seqlen_q, seqlen_k, sequence = _sequence(tiles_ptr, cu_q_ptr, cu_k_ptr,
                                                                          tl.program_id(0))
        slope_row = sequence * heads
    else:
        pid_bh = tl.program_id(1)
        if GQA:
            heads_kv = heads // group
            batch = pid_bh // heads_kv
            kv_head = pid_bh % heads_kv
        else:
            batch = pid_bh // heads
            kv_head = pid_bh % heads
        start_n = tl.program_id(0) * BLOCK_N
        q_row0 = 0
        k_row0 = 0
        slope_row = batch * heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    causal_offset = seqlen_k - seqlen_q
    k = desc_k.load([batch, kv_head, k_row0 + start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = desc_v.load([batch, kv_head, k_row0 + start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # Q tiles that see none of this K tile are skipped; those crossing a mask edge need the mask.
    if WINDOW:
        begin, full_begin, full_end, rows_end = window_query_range(start_n, seqlen_q, seqlen_k, left, right,
                                                                   BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    else:
        begin, full_begin, rows_end = query_range(start_n, seqlen_q, seqlen_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                                  CAUSAL=CAUSAL)
        full_end = rows_end
    if GQA:  # the query heads of the group, one after another
        for member in tl.range(0, group):
            head = kv_head * group + member
            dk, dv = _dkdv_head(dk, dv, k, v, desc_q, desc_do, desc_dq, lse2_ptr, delta_ptr, slopes_ptr, batch,
                                head, heads, q_row0, slope_row + head, begin, full_begin, full_end, rows_end, offs_n,
                                seqlen_q, causal_offset, qk_scale, scale, left, right, softcap_scale,
                                softcap_log2, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, WINDOW=WINDOW, SOFTCAP=SOFTCAP,
                                ALIBI=ALIBI, VARLEN=VARLEN, ATOMIC_DQ=ATOMIC_DQ)
    else:
        dk, dv = _dkdv_head(dk, dv, k, v, desc_q, desc_do, desc_dq, lse2_ptr, delta_ptr, slopes_ptr, batch,
                            kv_head, heads, q_row0, slope_row + kv_head, begin, full_begin, full_end, rows_end, offs_n,
                            seqlen_q, causal_offset, qk_scale, scale, left, right, softcap_scale, softcap_log2,
                            BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
                            VARLEN=VARLEN, ATOMIC_DQ=ATOMIC_DQ)
    if VARLEN:  # the next sequence's rows follow this one's: store by rows, masked
        heads_kv = heads // group
        _store_rows(dk_ptr, dk * scale, k_row0, offs_n, seqlen_k, kv_head, heads_kv, head_dim, HEAD_DIM=HEAD_DIM)
        _store_rows(dv_ptr, dv, k_row0, offs_n, seqlen_k, kv_head, heads_kv, head_dim, HEAD_DIM=HEAD_DIM)
    else:
        # Keys past seqlen_k were loaded as zeros and their rows are dropped by the descriptor store.
        desc_dk.store([batch, kv_head, start_n, 0], (dk * scale).to(desc_dk.dtype).reshape(1, 1, BLOCK_N, HEAD_DIM))
        desc_dv.store([batch, kv_head, start_n, 0], dv.to(desc_dv.dtype).reshape(1, 1, BLOCK_N, HEAD_DIM))


@triton.jit
def _dq_step(dq, q, do, lse2, delta, desc_k, desc_v, batch, kv_head, k_row0, start_n, offs_m, seqlen_k,
             causal_offset, qk_scale, mods, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
             ALIBI: tl.constexpr):
    """Add one K/V tile's contribution to the dQ accumulator of a Q tile (keys from row k_row0 on)."""
    k = desc_k.load([batch, kv_head, k_row0 + start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = desc_v.load([batch, kv_head, k_row0 + start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    left, right, softcap_scale, softcap_log2, slope_log2 = mods
    qk = tl.dot(q, tl.trans(k))
    if SOFTCAP or ALIBI:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        p = tl.math.exp2(modified_scores(qk, offs_m[:, None], offs_n[None, :], qk_scale, softcap_scale,
                                         softcap_log2, slope_log2, causal_offset, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
                         - lse2[:, None])
    else:
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = visible_keys(offs_m[:, None], offs_n[None, :], seqlen_k, causal_offset, left, right, CAUSAL, WINDOW)
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        tanh = softcap_tanh(qk, softcap_scale)
        ds = ds * (1.0 - tanh * tanh)
    return tl.dot(ds.to(k.dtype), k, dq)


@triton.jit
def attention_bwd_dq_kernel(desc_q, desc_k, desc_v, desc_do, desc_dq, lse2_ptr, delta_ptr,
                            heads, seqlen_q, seqlen_k, qk_scale, scale,
                            group, left, right, softcap_scale, softcap_log2, slopes_ptr,
                            cu_q_ptr, cu_k_ptr, tiles_ptr, dq_ptr, head_dim,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                            CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                            ALIBI: tl.constexpr, GQA: tl.constexpr, VARLEN: tl.constexpr):
    """dQ of one Q tile of BLOCK_M rows. Grid: (cdiv(seqlen_q, BLOCK_M), B * H); with VARLEN, (the
    forward's schedule of Q tiles, H), dQ stored by rows into dq_ptr ((total_q, H, head_dim))."""
    if VARLEN:
        head = tl.program_id(1)
        batch = 0
        start_m, q_row0, k_row0, seqlen_q, seqlen_k, sequence = _sequence(tiles_ptr, cu_q_ptr, cu_k_ptr,
                                                                          tl.program_id(0))
        slope_index = sequence * heads + head
        row_base = q_row0 * heads + head
        row_stride = heads
    else:
        pid_bh = tl.program_id(1)
        batch = pid_bh // heads
        head = pid_bh % heads
        start_m = tl.program_id(0) * BLOCK_M
        q_row0 = 0
        k_row0 = 0
        slope_index = pid_bh
        row_base = pid_bh * seqlen_q
        row_stride = 1
    kv_head = head // group if GQA else head
    offs_m = start_m + tl.arange(0, BLOCK_M)
    causal_offset = seqlen_k - seqlen_q
    slope_log2 = 0.0
    if ALIBI:
        slope_log2 = tl.load(slopes_ptr + slope_index) * LOG2E
    mods = (left, right, softcap_scale, softcap_log2, slope_log2)
    q = desc_q.load([batch, head, q_row0 + start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    do = desc_do.load([batch, head, q_row0 + start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    lse2 = tl.load(lse2_ptr + row_base + offs_m * row_stride, mask=offs_m < seqlen_q, other=float("inf"))
    delta = tl.load(delta_ptr + row_base + offs_m * row_stride, mask=offs_m < seqlen_q, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # The same key ranges as the forward: unmasked tiles, then the diagonal / the band's edges / ragged end.
    if WINDOW:
        begin, full_begin, full_end, end = window_key_range(start_m, seqlen_q, seqlen_k, left, right,
                                                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        for start_n in tl.range(begin, full_begin, BLOCK_N):
            dq = _dq_step(dq, q, do, lse2, delta, desc_k, desc_v, batch, kv_head, k_row0, start_n, offs_m,
                          seqlen_k, causal_offset, qk_scale, mods, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, MASKED=True,
                          CAUSAL=CAUSAL, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    else:
        full_end, end = key_range(start_m, seqlen_q, seqlen_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
        full_begin = 0
    for start_n in tl.range(full_begin, full_end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, desc_k, desc_v, batch, kv_head, k_row0, start_n, offs_m, seqlen_k,
                      causal_offset, qk_scale, mods, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, MASKED=False, CAUSAL=CAUSAL,
                      WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    for start_n in tl.range(full_end, end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, desc_k, desc_v, batch, kv_head, k_row0, start_n, offs_m, seqlen_k,
                      causal_offset, qk_scale, mods, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, MASKED=True, CAUSAL=CAUSAL,
                      WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
    if VARLEN:
        _store_rows(dq_ptr, dq * scale, q_row0, offs_m, seqlen_q, head, heads, head_dim, HEAD_DIM=HEAD_DIM)
    else:
        desc_dq.store([batch, head, start_m, 0], (dq * scale).to(desc_dq.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))
