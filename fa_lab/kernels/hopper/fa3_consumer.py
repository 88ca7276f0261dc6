"""The Gluon FA3 kernel's consumer partitions: one warpgroup per 64 query rows, compute only.

In step j a consumer issues ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` as asynchronous WGMMAs,
then waits for S_j only and runs the softmax of tile j while the tensor cores still work on the
P V product of tile j-1 (intra-warpgroup pipelining). O is rescaled by each step's correction factor
either just before the P V product that follows it or, with ``state.rescale_early``, at the end of the
step that computed the factor (flash-attn-4's place): the same multiplications in the same order. FP8's
P_{j-1} becomes the e4m3 operand before S_j is issued or, with ``state.convert_p_late``, after. Its
epilogue writes O through shared memory with one TMA copy, which also drops the rows past seqlen_q; in a
packed batch a sequence's last, partial rows go out with a masked store instead (past them lies the next
sequence).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .block_range import visible_key_end, visible_key_start, window_key_end
from .fa3_config import LN2, LOG2E, P_SCALE, Q_QUANT_ROWS, ROWS_PER_CONSUMER
from .fa3_softmax import (
    MASK_BY_TILE,
    MASK_LOWER,
    MASK_NONE,
    MASK_UPPER,
    ScoreMods,
    carried_p,
    fp8_tile_scales,
    p_operand,
    softmax_tile,
    thread_row_sums,
    v_operand,
)


@gluon.jit
def consumer(state, CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, FP8: gl.constexpr,
             PERSISTENT: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr, SOFTCAP: gl.constexpr,
             ALIBI: gl.constexpr, SEPARATE_O: gl.constexpr):
    """Consumer warpgroup CONSUMER: its 64 rows of every work tile of this CTA (one tile, or its share of the
    schedule when persistent). state: the :class:`.fa3_state.KernelState`; SEPARATE_O: O has buffers of its
    own (else it goes out through the consumer's Q buffer)."""
    BLOCK_N: gl.constexpr = state.k.bufs.type.shape[3]
    CONSUMERS: gl.constexpr = state.q.bufs.type.shape[0]
    BLOCK_M: gl.constexpr = ROWS_PER_CONSUMER * CONSUMERS
    if PINGPONG:
        state.turns.start(CONSUMER)
    if PERSISTENT:
        kv_count = 0  # K/V tiles consumed by this CTA so far (the rings' count)
        first, last, tiles_ptr = state.work.cta_tiles()
        for k in range(first, last):
            tile = state.work.tile(gl.load(tiles_ptr + k), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL,
                                   WINDOW=WINDOW, VARLEN=VARLEN)
            _consumer_tile(state, tile, kv_count, k - first, CONSUMER=CONSUMER, CAUSAL=CAUSAL, PINGPONG=PINGPONG,
                           FP8=FP8, PERSISTENT=PERSISTENT, WINDOW=WINDOW, VARLEN=VARLEN, SOFTCAP=SOFTCAP,
                           ALIBI=ALIBI, SEPARATE_O=SEPARATE_O)
            kv_count += tile.n_iter
    else:
        tile = state.work.tile(gl.program_id(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL,
                               WINDOW=WINDOW, VARLEN=VARLEN)
        _consumer_tile(state, tile, 0, 0, CONSUMER=CONSUMER, CAUSAL=CAUSAL, PINGPONG=PINGPONG, FP8=FP8,
                       PERSISTENT=PERSISTENT, WINDOW=WINDOW, VARLEN=VARLEN, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
                       SEPARATE_O=SEPARATE_O)
    tma.store_wait(0)  # this consumer's last O store


@gluon.jit
def _consumer_tile(state, tile, kv_count, local, CONSUMER: gl.constexpr, CAUSAL: gl.constexpr,
                   PINGPONG: gl.constexpr, FP8: gl.constexpr, PERSISTENT: gl.constexpr, WINDOW: gl.constexpr,
                   VARLEN: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SEPARATE_O: gl.constexpr):
    """Rows [start_m + 64 * CONSUMER, +64) of one WorkTile through its K/V tiles, then the epilogue.

    kv_count: K/V tiles this CTA consumed before this work tile (step j takes ring tile kv_count + j);
    local: work tiles before it (the Q slot's count).
    """
    seqlen_q = tile.seqlen_q
    seqlen_k = tile.seqlen_k
    BLOCK_N: gl.constexpr = state.k.bufs.type.shape[3]
    HEAD_DIM: gl.constexpr = state.k.bufs.type.shape[4]
    dtype: gl.constexpr = state.k.bufs.dtype
    out_dtype: gl.constexpr = state.o_bufs.dtype
    # WGMMA accumulator layouts: 4 warps stacked along the 64 rows, N = the full tile width,
    # K = 32 bytes of the operand type per instruction (16 bf16 values, 32 e4m3 values).
    k_instr: gl.constexpr = 256 // dtype.primitive_bitwidth
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, k_instr])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, k_instr])
    # P feeds the second WGMMA from registers. For 16-bit types the accumulator layout of S
    # already is this operand layout, so the conversion moves no data (FA2/FA3's trick);
    # e4m3 packs 4 values per register, which needs a shuffle between threads.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=32 // dtype.primitive_bitwidth)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    SPLIT: gl.constexpr = state.split_loops and not ALIBI  # (also P packed across them: carried_p)

    q_smem = state.q.bufs.index(CONSUMER).reshape([ROWS_PER_CONSUMER, HEAD_DIM])
    row0 = tile.start_m + CONSUMER * ROWS_PER_CONSUMER
    offs_m = row0 + gl.arange(0, ROWS_PER_CONSUMER, layout=row_layout)
    if WINDOW:
        key_start = visible_key_start(offs_m, seqlen_q, seqlen_k, state.work.left)
        key_end = window_key_end(offs_m, seqlen_q, seqlen_k, state.work.right)
    else:
        key_start = offs_m  # (not read)
        key_end = visible_key_end(offs_m, seqlen_q, seqlen_k, CAUSAL=CAUSAL)
    m_i = gl.full([ROWS_PER_CONSUMER], float("-inf"), gl.float32, row_layout)
    s = gl.zeros([ROWS_PER_CONSUMER, BLOCK_N], gl.float32, s_layout)
    l_i = thread_row_sums(s)  # (64, 4) zeros: each thread's partial sums (softmax_tile)
    o = gl.zeros([ROWS_PER_CONSUMER, HEAD_DIM], gl.float32, o_layout)
    qk_scale = state.qk_scale
    tile_scale = qk_scale
    slope = 0.0
    if ALIBI:  # in the units of s (ScoreMods)
        slope = gl.load(state.slopes_ptr + tile.pid_bh) * LOG2E / qk_scale
    mods = ScoreMods(state.softcap_scale, gl.to_tensor(slope), (offs_m + (seqlen_k - seqlen_q)).to(gl.float32))
    log2_p_scale = 0.0
    if FP8:
        kv_tiles = gl.cdiv(seqlen_k, BLOCK_N)
        # Q is quantized in Q_QUANT_ROWS-row blocks; a consumer's 64 rows lie in one of them.
        q_tile = tile.pid_bh * gl.cdiv(seqlen_q, Q_QUANT_ROWS) + row0 // Q_QUANT_ROWS
        qk_scale = qk_scale * gl.load(state.q_descale_ptr + q_tile)
        v_descale_max = gl.load(state.v_descale_max_ptr + tile.pid_bh)

    # Prologue: scores and probabilities of tile 0.
    k_first = state.k.at(kv_count)  # K_0's place in the K ring
    state.q.wait_ready(local)
    k_first.wait_ready()
    if PINGPONG:
        state.turns.wait(CONSUMER)
    s = warpgroup_mma(q_smem, k_first.buf().reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s, use_acc=False,
                      is_async=True)
    if PINGPONG:
        state.turns.pass_on(CONSUMER)
    if FP8:
        tile_scale, log2_p_scale = fp8_tile_scales(qk_scale, state.k_descale_ptr, state.v_exponent_ptr,
                                                   tile.pid_bh * kv_tiles)
    s = warpgroup_mma_wait(0, deps=(s,))
    k_first.release()
    p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, tile_scale, log2_p_scale, key_start, key_end, tile.first,
                                      tile, mods, BLOCK_N=BLOCK_N, FP8=FP8, WINDOW=WINDOW, SOFTCAP=SOFTCAP,
                                      ALIBI=ALIBI, s_layout=s_layout, EXP2_ON_FMA=state.exp2_on_fma)
    p = carried_p(p, dtype, p_layout, FP8=FP8, PACKED=SPLIT)
    if state.rescale_early:
        o = _rescaled(o, alpha, o_layout)

    # Steps 1 .. n_iter - 1. With state.split_loops in up to three loops, as flash-attn-4 walks them: the band's
    # lower edge (a window), the full tiles, and the masked end (causal diagonal, ragged end, the band's upper edge),
    # each with its mask fixed at compile time, so that an edge tests one bound (BlockInfo.key_tile_edges states
    # when that holds: the work tile has a full tile). Otherwise, and with ALiBi (whose three loops spill registers
    # at d = 128), one loop deciding each tile's mask at run time.
    if (not SPLIT) or (WINDOW and (tile.first_masked <= tile.full_begin)):
        s, p, o, alpha, m_i, l_i = _kv_steps(state, tile, kv_count, 1, tile.n_iter, s, p, o, alpha, m_i, l_i,
                                             tile_scale, log2_p_scale, qk_scale, key_start, key_end, mods, q_smem,
                                             CONSUMER, PINGPONG, FP8, WINDOW, SOFTCAP, ALIBI, MASK_BY_TILE,
                                             SPLIT, s_layout, o_layout, p_layout)
    else:
        full_from = gl.minimum(gl.maximum(tile.full_begin - tile.first, 1), tile.n_iter)
        masked_from = gl.minimum(gl.maximum(tile.first_masked - tile.first, full_from), tile.n_iter)
        if WINDOW:  # (without one, full_begin is the first tile)
            s, p, o, alpha, m_i, l_i = _kv_steps(state, tile, kv_count, 1, full_from, s, p, o, alpha, m_i, l_i,
                                                 tile_scale, log2_p_scale, qk_scale, key_start, key_end, mods,
                                                 q_smem, CONSUMER, PINGPONG, FP8, WINDOW, SOFTCAP, ALIBI, MASK_LOWER,
                                                 SPLIT, s_layout, o_layout, p_layout)
        s, p, o, alpha, m_i, l_i = _kv_steps(state, tile, kv_count, full_from, masked_from, s, p, o, alpha, m_i,
                                             l_i, tile_scale, log2_p_scale, qk_scale, key_start, key_end, mods,
                                             q_smem, CONSUMER, PINGPONG, FP8, WINDOW, SOFTCAP, ALIBI, MASK_NONE,
                                             SPLIT, s_layout, o_layout, p_layout)
        s, p, o, alpha, m_i, l_i = _kv_steps(state, tile, kv_count, masked_from, tile.n_iter, s, p, o, alpha, m_i,
                                             l_i, tile_scale, log2_p_scale, qk_scale, key_start, key_end, mods,
                                             q_smem, CONSUMER, PINGPONG, FP8, WINDOW, SOFTCAP, ALIBI, MASK_UPPER,
                                             SPLIT, s_layout, o_layout, p_layout)

    if PERSISTENT and SEPARATE_O:  # every Q K^T of this tile is done: the producer may load the next tile's Q
        state.q.release()
    v_last = state.v.at(kv_count + tile.n_iter - 1)
    v_last.wait_ready()
    if not state.rescale_early:
        o = _rescaled(o, alpha, o_layout)
    o = warpgroup_mma(p_operand(p, dtype, p_layout, FP8=FP8), v_operand(v_last.buf(), FP8=FP8), o,
                      is_async=True)
    o = warpgroup_mma_wait(0, deps=(o,))
    v_last.release()

    # Epilogue (FA2's deferred normalization): O / l once; lse = ln 2 * (m + log2 l).
    l_i = gl.convert_layout(gl.sum(l_i, axis=1), row_layout)  # the four threads' partial sums of each row
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
    gl.store(state.lse_ptr + tile.lse_offset + offs_m, lse, mask=offs_m < seqlen_q)
    if FP8:  # P was scaled by P_SCALE * v_descale_j / v_descale_max: undo the constant part
        l_safe = l_safe * (P_SCALE / v_descale_max)
    o = o / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    o_smem = state.o_bufs.index(CONSUMER)
    if PERSISTENT and SEPARATE_O:  # the previous tile's O store from this buffer must have left it
        tma.store_wait(0)
    if VARLEN:
        if row0 + ROWS_PER_CONSUMER > seqlen_q:  # the TMA box would write into the next sequence
            _store_rows(state, o.to(out_dtype), tile, offs_m, o_layout)
        else:
            _store_tile(state, o.to(out_dtype), o_smem, tile, row0)
    else:
        _store_tile(state, o.to(out_dtype), o_smem, tile, row0)
    if PERSISTENT and not SEPARATE_O:  # O went out through the Q buffer: free it for the next tile's Q once stored
        tma.store_wait(0)
        state.q.release()


@gluon.jit
def _kv_steps(state, tile, kv_count, j_begin, j_end, s, p, o, alpha, m_i, l_i, tile_scale, log2_p_scale, qk_scale,
              key_start, key_end, mods, q_smem, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr, FP8: gl.constexpr,
              WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, MASK: gl.constexpr,
              PACKED: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """K/V steps j_begin .. j_end - 1 of a work tile, each score tile masked as MASK says. Step j issues Q K_j^T and
    P_{j-1} V_{j-1}, and runs the softmax of S_j while the tensor cores compute P_{j-1} V_{j-1}; P arrives and
    leaves as :func:`.fa3_softmax.carried_p` carries it (PACKED or not)."""
    BLOCK_N: gl.constexpr = state.k.bufs.type.shape[3]
    HEAD_DIM: gl.constexpr = state.k.bufs.type.shape[4]
    dtype: gl.constexpr = state.k.bufs.dtype
    kv_tiles = gl.cdiv(tile.seqlen_k, BLOCK_N)
    for j in range(j_begin, j_end):
        k_tile = state.k.at(kv_count + j)  # K_j, and V_{j-1}: this CTA's K/V tiles count across work tiles
        v_tile = state.v.at(kv_count + j - 1)
        if not state.convert_p_late:
            p_op = p_operand(p, dtype, p_layout, FP8=FP8)  # P_{j-1}
        k_tile.wait_ready()
        v_tile.wait_ready()
        if PINGPONG:
            state.turns.wait(CONSUMER)
        # Issue both GEMMs of this step: scores of tile j, and P V of tile j-1. O is rescaled
        # to tile j-1's running max in between (unless it was at the end of the last step), while the
        # tensor cores work on S_j.
        s = warpgroup_mma(q_smem, k_tile.buf().reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s, use_acc=False,
                          is_async=True)
        if state.convert_p_late:  # P_{j-1} packed into the operand (FP8: e4m3) while the tensor cores compute S_j
            p_op = p_operand(p, dtype, p_layout, FP8=FP8)
        if not state.rescale_early:
            o = _rescaled(o, alpha, o_layout)
        o = warpgroup_mma(p_op, v_operand(v_tile.buf(), FP8=FP8), o, is_async=True)
        if PINGPONG:
            state.turns.pass_on(CONSUMER)
        if FP8:
            tile_scale, log2_p_scale = fp8_tile_scales(qk_scale, state.k_descale_ptr, state.v_exponent_ptr,
                                                       tile.pid_bh * kv_tiles + j)
        # Wait for the scores only (one group, P V, may stay in flight) and free K_j.
        s = warpgroup_mma_wait(1, deps=(s,))
        k_tile.release()
        p, alpha, m_i, l_i = softmax_tile(s, m_i, l_i, tile_scale, log2_p_scale, key_start, key_end,
                                          tile.first + j, tile, mods, BLOCK_N=BLOCK_N, FP8=FP8, WINDOW=WINDOW,
                                          SOFTCAP=SOFTCAP, ALIBI=ALIBI, s_layout=s_layout, MASK=MASK,
                                          EXP2_ON_FMA=state.exp2_on_fma)
        if FP8:  # (the wait takes 16/32-bit dependencies only; ptxas still guards P's registers)
            o = warpgroup_mma_wait(0, deps=(o,))
        else:  # P's registers must stay untouched until the WGMMA reading them is done
            o, p_op = warpgroup_mma_wait(0, deps=(o, p_op))
        if state.rescale_early:  # O to tile j's running max, now that P_{j-1} V_{j-1} is in it
            o = _rescaled(o, alpha, o_layout)
        v_tile.release()
        p = carried_p(p, dtype, p_layout, FP8=FP8, PACKED=PACKED)
    return s, p, o, alpha, m_i, l_i


@gluon.jit
def _rescaled(o, alpha, o_layout: gl.constexpr):
    """O (64, d) in o_layout with each row multiplied by its correction factor alpha (64,) (the score tile's row
    layout)."""
    return o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]


@gluon.jit
def _store_tile(state, o, o_smem, tile, row0):
    """Store O (64, d) of rows [row0, +64) through shared memory with one TMA copy (rows past the tensor's
    end are dropped)."""
    o_smem.reshape([o.shape[0], o.shape[1]]).store(o)
    fence_async_shared()
    tma.async_copy_shared_to_global(state.o_desc, [tile.batch, tile.head, tile.q_offset + row0, 0], o_smem)


@gluon.jit
def _store_rows(state, o, tile, offs_m, o_layout: gl.constexpr):
    """Store a packed sequence's O rows offs_m (64,) below its seqlen_q, column by column from the registers
    (o: (64, d) in o_layout): the last, partial tile of a sequence, whose TMA box would overwrite the
    next sequence's first rows. o_desc gives the packed O's shape (1, H, total_q, d) and strides."""
    HEAD_DIM: gl.constexpr = o.shape[1]
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    row_stride = state.o_desc.strides[2]
    offs_m = gl.convert_layout(offs_m, gl.SliceLayout(1, o_layout))  # (from the score tile's row layout)
    rows = (tile.q_offset + offs_m).to(gl.int64)
    ptrs = state.o_ptr + tile.head * state.o_desc.strides[1] + rows[:, None] * row_stride + cols[None, :]
    mask = (offs_m < tile.seqlen_q)[:, None] & (cols < state.o_desc.shape[3])[None, :]
    gl.store(ptrs, o, mask=mask)
