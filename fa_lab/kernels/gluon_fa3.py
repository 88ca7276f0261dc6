"""A FlashAttention-3 forward for Hopper (sm_90) written in Gluon.

Gluon (``triton.experimental.gluon``, shipped with Triton 3.6) is Triton's
lower-level language: the kernel author chooses the layouts, allocates shared
memory, issues TMA copies and WGMMAs and synchronizes with mbarriers. That is
what FlashAttention-3 needs and what plain Triton decides on its own. The
kernel below is organised the way the FA3 paper describes it:

* **Warp specialization.** One CTA computes ``BLOCK_M = 64 * CONSUMERS`` query
  rows (128 by default) of one (batch, head) with a *producer* warp that only
  issues TMA copies of Q, K and V into shared memory, and ``CONSUMERS``
  *consumer* warpgroups (4 warps each) that own 64 query rows each and only
  compute. The producer gets 24 registers per thread, two consumers 240 each
  (``setmaxnreg``).
* **A circular buffer of K/V tiles** (``STAGES`` slots). Each slot has a
  ``ready`` mbarrier (the TMA completes it, counting bytes) and an ``empty``
  mbarrier that both consumers arrive on once they no longer read the slot, so
  the producer runs up to ``STAGES`` tiles ahead. K and V have separate
  barriers: a consumer frees K as soon as its scores are computed.
* **Intra-warpgroup pipelining.** In iteration j a consumer issues
  ``S_j = Q K_j^T`` *and* ``O += P_{j-1} V_{j-1}`` as asynchronous WGMMAs, then
  waits for S_j only and runs the softmax of tile j while the tensor cores are
  still busy with the P V product of tile j-1.
* **Inter-warpgroup overlap.** The consumers run the same loop on different
  rows, each waiting on its own barriers, so one's softmax can run during the
  other's WGMMAs. (FA3's explicit ping-pong orders this with named barriers;
  ``PINGPONG`` enforces the same alternation with one mbarrier per consumer.)
* **FP8** (``FP8``): e4m3 WGMMAs on per-tile quantized Q, K and V^T; V's per-tile
  descale is folded into P's exponent, and P's keys are renumbered in the order
  a thread holds them (V^T is stored in that order) so that P becomes an FP8
  operand without moving data between threads.
* **Persistent kernel** (``PERSISTENT``): one CTA per SM, each computing the work
  tiles that :mod:`fa_lab.kernels.tile_schedule` lists for it (longest first, heads
  in groups). The ring's slots and phases run on across tiles, so the next tile's
  K/V (and, once the consumers release it, Q) load while this tile ends.
* **Epilogue through shared memory.** A consumer's Q tile is dead after its last
  ``Q K^T``, so O is written into that buffer and stored with one TMA copy,
  which also drops the rows past ``seqlen_q``.

Tiles are addressed with 4-D TMA descriptors over (batch, heads, seqlen,
head_dim), block (1, 1, rows, head_dim): keys past ``seqlen_k`` arrive as zeros
and are masked to -inf in the scores. The kernel needs a Hopper GPU: it cannot
run in Triton's CPU interpreter, but it compiles on any machine
(:func:`fa_lab.kernels.sm90_offline.compile_fa3_for_sm90`), which the CPU tests use.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

ROWS_PER_CONSUMER = gl.constexpr(64)  # one warpgroup's WGMMA covers 64 rows (4 warps x 16)
Q_QUANT_ROWS = gl.constexpr(128)  # FP8: rows of Q per quantization block (descale)
KV_BLOCK = gl.constexpr(128)  # keys per K/V tile (the launcher's choice; the kernel reads it off k_desc)
PRODUCER_REGS = gl.constexpr(24)  # the minimum setmaxnreg allows: the producer holds only scalars
CONSUMER_REGS = {2: 240, 3: 160}  # per consumer thread: 2 x 240 + 24 (x 128 threads) fills the 64K registers


def descriptor_blocks(head_dim: int, fp8: bool) -> dict[str, list[int]]:
    """TMA block shapes of the q, k, v and o descriptors for a padded head_dim (v's is V^T's in FP8)."""
    rows, keys = ROWS_PER_CONSUMER.value, KV_BLOCK.value
    v_block = [1, 1, head_dim, keys] if fp8 else [1, 1, keys, head_dim]
    return {"q": [1, 1, rows, head_dim], "k": [1, 1, keys, head_dim], "v": v_block, "o": [1, 1, rows, head_dim]}


def launch_maxnreg(consumers: int) -> int:
    """Registers per thread at launch: the 64K of an SM over every warpgroup (the producer's single warp
    counts as one), in steps of 8. ``setmaxnreg`` then moves them from the producer to the consumers."""
    return 65536 // (128 * (consumers + 1)) // 8 * 8

# FP8: P in [0, 1] is stored times 256 (exp2(x + 8)), below e4m3's maximum 448, so small
# probabilities keep their bits (the same P_SCALE as fa_lab.fp8 and the Triton kernel).
P_SCALE = gl.constexpr(256.0)
LOG2_P_SCALE = gl.constexpr(8.0)


@gluon.jit
def _tile_plan(start_m, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(n_iter, first_masked): K/V tiles this CTA visits, and the first one that needs a mask.

    Bottom-right causal alignment: query row i sees keys j <= i + (seqlen_k - seqlen_q).
    A CTA whose rows see no key at all still visits one (fully masked) tile, so every
    row leaves with l = 0 and gets O = 0, lse = -inf.
    """
    if CAUSAL:
        offset = seqlen_k - seqlen_q
        end = gl.minimum(seqlen_k, gl.maximum(start_m + BLOCK_M + offset, 0))
        end_full = gl.minimum(gl.maximum(start_m + offset + 1, 0), end)
    else:
        end = seqlen_k
        end_full = seqlen_k
    n_tiles = gl.cdiv(end, BLOCK_N)
    return gl.maximum(n_tiles, 1), gl.minimum(end_full // BLOCK_N, n_tiles)


@gluon.jit
def _tile_coords(tile, work, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(batch, head, pid_bh, start_m, n_iter, first_masked) of work tile ``tile``; work: (m_tiles, heads,
    seqlen_q, seqlen_k).

    The m_tiles query tiles of one (batch, head) are consecutive (its K and V stay in L2 while they
    run); with causal masking the longest rows come first, so that the short ones fill the tail.
    (tile_schedule.encode_tile is the inverse on the host.)
    """
    m_tiles, heads, seqlen_q, seqlen_k = work
    pid_m = tile % m_tiles
    if CAUSAL:
        pid_m = m_tiles - 1 - pid_m
    pid_bh = tile // m_tiles
    start_m = pid_m * BLOCK_M
    n_iter, first_masked = _tile_plan(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    return pid_bh // heads, pid_bh % heads, pid_bh, start_m, n_iter, first_masked


@gluon.jit
def _scheduled_tiles(schedule_ptr):
    """(first, last, tiles_ptr): this CTA computes tiles tiles_ptr[first:last] (see tile_schedule.schedule_tensor)."""
    cta = gl.program_id(0)
    return gl.load(schedule_ptr + cta), gl.load(schedule_ptr + cta + 1), schedule_ptr + gl.num_programs(0) + 1


@gluon.jit
def _producer(args, STAGES: gl.constexpr, FP8: gl.constexpr, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr):
    """TMA copies only. For each work tile of this CTA: K_j and V_j (V_j^T in FP8) into the ring's
    slots, and the consumers' Q rows (see _producer_tile).

    args: the runtime values (descriptors, buffers, barriers, work, schedule_ptr). The constexprs come
    separately: a tuple built in a variable turns them into runtime values.
    """
    q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, work, schedule_ptr = args
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    CONSUMERS: gl.constexpr = q_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = ROWS_PER_CONSUMER * CONSUMERS
    if PERSISTENT:
        kv_count = 0  # K/V tiles loaded by this CTA so far: the ring's position and phases run across work tiles
        first, last, tiles_ptr = _scheduled_tiles(schedule_ptr)
        for k in range(first, last):
            coords = _tile_coords(gl.load(tiles_ptr + k), work, BLOCK_M, BLOCK_N, CAUSAL)
            # k - first: work tiles of this CTA before this one, the phase of q_ready / q_empty
            _producer_tile(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, coords, kv_count, k - first, STAGES,
                           FP8, PERSISTENT)
            kv_count += coords[4]
    else:  # one tile per CTA: the phases are constants
        coords = _tile_coords(gl.program_id(0), work, BLOCK_M, BLOCK_N, CAUSAL)
        _producer_tile(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, coords, 0, 0, STAGES, FP8, PERSISTENT)


@gluon.jit
def _producer_tile(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, coords, kv_count, local,
                   STAGES: gl.constexpr, FP8: gl.constexpr, PERSISTENT: gl.constexpr):
    """The producer's copies for one work tile; kv_count / local: K/V tiles and work tiles this CTA loaded
    before it. Q goes first, except in a persistent CTA, where the Q buffers may still be busy with the
    previous tile: there Q follows K_0 and V_0, which need no free Q buffer."""
    batch, head, pid_bh, start_m, n_iter, first_masked = coords
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    k_ready, v_ready, k_empty, v_empty = bars[2], bars[3], bars[4], bars[5]
    if not PERSISTENT:
        _load_q(q_desc, q_bufs, bars, batch, head, start_m, local)
    for j in range(n_iter):
        slot = (kv_count + j) % STAGES
        phase = ((kv_count + j) // STAGES) & 1
        # A fresh mbarrier counts as having completed the phase before phase 0,
        # so the first STAGES waits on "empty" pass at once.
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [batch, head, j * BLOCK_N, 0], k_ready.index(slot),
                                        k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        if FP8:
            tma.async_copy_global_to_shared(v_desc, [batch, head, 0, j * BLOCK_N], v_ready.index(slot),
                                            v_bufs.index(slot))
        else:
            tma.async_copy_global_to_shared(v_desc, [batch, head, j * BLOCK_N, 0], v_ready.index(slot),
                                            v_bufs.index(slot))
        if PERSISTENT:
            if j == 0:
                _load_q(q_desc, q_bufs, bars, batch, head, start_m, local)


@gluon.jit
def _load_q(q_desc, q_bufs, bars, batch, head, start_m, local):
    """Every consumer's Q rows of a work tile, once the consumers have released the Q buffers."""
    q_ready, q_empty = bars[0], bars[1]
    CONSUMERS: gl.constexpr = q_bufs.type.shape[0]
    mbarrier.wait(q_empty, (local & 1) ^ 1)
    mbarrier.expect(q_ready, CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [batch, head, start_m + c * ROWS_PER_CONSUMER, 0], q_ready,
                                        q_bufs.index(c))


@gluon.jit
def _softmax_tile(s, m_i, l_i, tile_scale, log2_p_scale, key_end, j, first_masked, BLOCK_N: gl.constexpr,
                  FP8: gl.constexpr, s_layout: gl.constexpr):
    """Online-softmax update with raw scores s = Q K_j^T: (64, BLOCK_N) fp32.

    Returns (p, alpha, m_new, l_new), m in log2 units (tile_scale = scale * log2 e, times
    the Q and K descales in FP8). Only tiles from ``first_masked`` on pay for a mask
    (causal diagonal, ragged end): key_end (64,) int32 is each row's end of visible keys
    (_visible_key_end), so the mask is one compare per score. In FP8, p comes out multiplied by
    2**log2_p_scale (folded into the exponent, so it costs nothing per score) while l sums the true p.
    """
    if j >= first_masked:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = cols[None, :] < (key_end - j * BLOCK_N)[:, None]
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * tile_scale)
    # A row that has seen no visible key keeps m = -inf: subtract 0 there so exp2 gives 0, not NaN.
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_sub)
    if FP8:
        p = gl.exp2(s * tile_scale - (m_sub - log2_p_scale)[:, None])
        l_new = l_i * alpha + gl.sum(p, axis=1) * gl.exp2(-log2_p_scale)
    else:
        p = gl.exp2(s * tile_scale - m_sub[:, None])  # one FFMA + one MUFU.EX2 per score
        l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def _visible_key_end(offs_m, seqlen_q, seqlen_k, CAUSAL: gl.constexpr):
    """Per query row, one past its last visible key: seqlen_k, or with causal masking (bottom-right
    aligned, row i sees keys j <= i + seqlen_k - seqlen_q) the smaller of that and i + 1 + seqlen_k - seqlen_q."""
    if CAUSAL:
        return gl.minimum(offs_m + (seqlen_k - seqlen_q + 1), seqlen_k)
    else:
        return gl.full(offs_m.shape, seqlen_k, gl.int32, offs_m.type.layout)


@gluon.jit
def _consumer(state, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              PINGPONG: gl.constexpr, FP8: gl.constexpr, PERSISTENT: gl.constexpr):
    """One warpgroup: its 64 rows of every work tile of this CTA (one tile, or several when persistent).

    state: what every consumer shares, built once by the kernel entry.
    """
    (o_desc, lse_ptr, scales, q_bufs, k_bufs, v_bufs, o_bufs, bars, work, qk_scale, schedule_ptr) = state
    BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
    BLOCK_M: gl.constexpr = ROWS_PER_CONSUMER * CONSUMERS
    if PERSISTENT:
        kv_count = 0  # K/V tiles consumed by this CTA so far (the ring's position and phases)
        first, last, tiles_ptr = _scheduled_tiles(schedule_ptr)
        for k in range(first, last):
            coords = _tile_coords(gl.load(tiles_ptr + k), work, BLOCK_M, BLOCK_N, CAUSAL)
            _consumer_tile(state, coords, kv_count, k - first, CONSUMER, CONSUMERS, STAGES, CAUSAL, PINGPONG, FP8,
                           PERSISTENT)
            kv_count += coords[4]
    else:
        coords = _tile_coords(gl.program_id(0), work, BLOCK_M, BLOCK_N, CAUSAL)
        _consumer_tile(state, coords, 0, 0, CONSUMER, CONSUMERS, STAGES, CAUSAL, PINGPONG, FP8, PERSISTENT)
    tma.store_wait(0)  # this consumer's last O store


@gluon.jit
def _consumer_tile(state, coords, kv_count, local, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr,
                   STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, FP8: gl.constexpr,
                   PERSISTENT: gl.constexpr):
    """Rows [start_m + 64 * CONSUMER, +64) of one work tile through every K/V tile, then the epilogue.

    coords: _tile_coords of the tile; kv_count: K/V tiles this CTA consumed before it (step j uses
    ring slot (kv_count + j) % STAGES); local: work tiles before it.
    """
    (o_desc, lse_ptr, scales, q_bufs, k_bufs, v_bufs, o_bufs, bars, work, qk_scale, schedule_ptr) = state
    m_tiles, heads, seqlen_q, seqlen_k = work
    batch, head, pid_bh, start_m, n_iter, first_masked = coords
    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn = bars
    q_descale_ptr, k_descale_ptr, v_exponent_ptr, v_descale_max_ptr = scales
    BLOCK_N: gl.constexpr = k_bufs.type.shape[3]
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[4]
    dtype: gl.constexpr = k_bufs.dtype
    out_dtype: gl.constexpr = o_bufs.dtype
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

    q_smem = q_bufs.index(CONSUMER).reshape([ROWS_PER_CONSUMER, HEAD_DIM])
    row0 = start_m + CONSUMER * ROWS_PER_CONSUMER
    offs_m = row0 + gl.arange(0, ROWS_PER_CONSUMER, layout=row_layout)
    key_end = _visible_key_end(offs_m, seqlen_q, seqlen_k, CAUSAL)
    m_i = gl.full([ROWS_PER_CONSUMER], float("-inf"), gl.float32, row_layout)
    l_i = gl.full([ROWS_PER_CONSUMER], 0.0, gl.float32, row_layout)
    s = gl.zeros([ROWS_PER_CONSUMER, BLOCK_N], gl.float32, s_layout)
    o = gl.zeros([ROWS_PER_CONSUMER, HEAD_DIM], gl.float32, o_layout)
    tile_scale = qk_scale
    log2_p_scale = 0.0
    if FP8:
        kv_tiles = gl.cdiv(seqlen_k, BLOCK_N)
        # Q is quantized in Q_QUANT_ROWS-row blocks; a consumer's 64 rows lie in one of them.
        q_tile = pid_bh * gl.cdiv(seqlen_q, Q_QUANT_ROWS) + row0 // Q_QUANT_ROWS
        qk_scale = qk_scale * gl.load(q_descale_ptr + q_tile)
        v_descale_max = gl.load(v_descale_max_ptr + pid_bh)

    # Prologue: scores and probabilities of tile 0.
    first = kv_count % STAGES
    mbarrier.wait(q_ready, local & 1)
    mbarrier.wait(k_ready.index(first), (kv_count // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turn.index(CONSUMER), kv_count & 1)
    s = warpgroup_mma(q_smem, k_bufs.index(first).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s,
                      use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index((CONSUMER + 1) % CONSUMERS))
    if FP8:
        tile_scale, log2_p_scale = _fp8_tile_scales(qk_scale, k_descale_ptr, v_exponent_ptr, pid_bh * kv_tiles)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(first))
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, tile_scale, log2_p_scale, key_end, 0, first_masked, BLOCK_N,
                                       FP8, s_layout)
    p = _carried_p(p, dtype, p_layout, FP8)

    for j in range(1, n_iter):
        g = kv_count + j  # this CTA's K/V tile count: the ring slot and phase
        slot = g % STAGES
        prev = (g - 1) % STAGES
        p_op = _p_operand(p, dtype, p_layout, FP8)  # P_{j-1} (a no-op for 16-bit types: see _carried_p)
        mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(CONSUMER), g & 1)
        # Issue both GEMMs of this step: scores of tile j, and P V of tile j-1. O is rescaled
        # to tile j-1's running max in between, while the tensor cores work on S_j.
        s = warpgroup_mma(q_smem, k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s,
                          use_acc=False, is_async=True)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        o = warpgroup_mma(p_op, _v_operand(v_bufs.index(prev), FP8), o, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index((CONSUMER + 1) % CONSUMERS))
        if FP8:
            tile_scale, log2_p_scale = _fp8_tile_scales(qk_scale, k_descale_ptr, v_exponent_ptr,
                                                        pid_bh * kv_tiles + j)
        # Wait for the scores only (one group, P V, may stay in flight) and free K_j.
        s = warpgroup_mma_wait(1, deps=(s,))
        mbarrier.arrive(k_empty.index(slot))
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, tile_scale, log2_p_scale, key_end, j, first_masked,
                                           BLOCK_N, FP8, s_layout)
        # The softmax above ran while the tensor cores computed P_{j-1} V_{j-1}.
        if FP8:  # (the wait takes 16/32-bit dependencies only; ptxas still guards P's registers)
            o = warpgroup_mma_wait(0, deps=(o,))
        else:  # P's registers must stay untouched until the WGMMA reading them is done
            o, p_op = warpgroup_mma_wait(0, deps=(o, p_op))
        mbarrier.arrive(v_empty.index(prev))
        p = _carried_p(p, dtype, p_layout, FP8)

    if PERSISTENT and FP8:  # every Q K^T of this tile is done: the producer may load the next tile's Q
        mbarrier.arrive(q_empty)
    last = (kv_count + n_iter - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((kv_count + n_iter - 1) // STAGES) & 1)
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    o = warpgroup_mma(_p_operand(p, dtype, p_layout, FP8), _v_operand(v_bufs.index(last), FP8), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o,))
    mbarrier.arrive(v_empty.index(last))

    # Epilogue (FA2's deferred normalization): O / l once; lse = ln 2 * (m + log2 l).
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    gl.store(lse_ptr + pid_bh * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
    if FP8:  # P was scaled by P_SCALE * v_descale_j / v_descale_max: undo the constant part
        l_safe = l_safe * (P_SCALE / v_descale_max)
    o = o / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    o_smem = o_bufs.index(CONSUMER)
    if PERSISTENT and FP8:  # the previous tile's O store from this buffer must have left it
        tma.store_wait(0)
    o_smem.reshape([ROWS_PER_CONSUMER, HEAD_DIM]).store(o.to(out_dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [batch, head, row0, 0], o_smem)
    if PERSISTENT and not FP8:  # O went out through the Q buffer: free it for the next tile's Q once stored
        tma.store_wait(0)
        mbarrier.arrive(q_empty)


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, FP8: gl.constexpr):
    """P (64, BLOCK_N) fp32 in the accumulator layout -> the A operand of the P V WGMMA.

    FP8: the columns are reordered within each 32-key block (key 16h + 8a + 2c + b goes to
    position 16h + 4c + 2a + b), which is the order in which a thread already holds them, so the
    operand needs no data exchange between threads; V^T's keys are stored in the same order.
    """
    if FP8:
        rows: gl.constexpr = p.shape[0]
        keys: gl.constexpr = p.shape[1]
        p = p.reshape([rows, keys // 32, 2, 2, 4, 2])  # (row, block, h, a, c, b)
        p = p.permute((0, 1, 2, 4, 3, 5)).reshape([rows, keys])  # (row, block, h, c, a, b)
        return _to_e4m3x4(gl.convert_layout(p, p_layout))
    else:
        return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _carried_p(p, dtype: gl.constexpr, p_layout: gl.constexpr, FP8: gl.constexpr):
    """What the loop carries of P_j into step j+1, where it feeds the P V WGMMA.

    16-bit types: the operand itself (half the registers of float32 P). FP8 carries P in float32 and
    converts it in step j+1: an e4m3 tensor carried across the loop's back edge is kept one byte
    per register and repacked (about 5 instructions per operand register).
    """
    if FP8:
        return p
    else:
        return _p_operand(p, dtype, p_layout, FP8)


@gluon.jit
def _to_e4m3x4(x):
    """fp32 -> e4m3, four neighbours in a thread's registers into one 32-bit register.

    Two ``cvt.rn.satfinite.e4m3x2.f32`` per register: the compiler's own conversion makes
    16-bit halves and then moves the bytes one by one (about 5 instructions per register more).
    In the operand layout of P, a register's four values are four consecutive keys of one row.
    """
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi}; }",
        "=r,r,r,r,r", [x], dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def _v_operand(v_tile, FP8: gl.constexpr):
    """The B operand (BLOCK_N, d) of P V. FP8 WGMMA reads B K-major, so V arrives as V^T tiles (d, BLOCK_N)."""
    if FP8:
        return v_tile.reshape([v_tile.type.shape[2], v_tile.type.shape[3]]).permute((1, 0))
    else:
        return v_tile.reshape([v_tile.type.shape[2], v_tile.type.shape[3]])


@gluon.jit
def _fp8_tile_scales(qk_scale, k_descale_ptr, v_exponent_ptr, tile):
    """(tile_scale, log2_p_scale) of K/V tile ``tile`` (index into the flat per-tile arrays).

    S is descaled through the softmax scale; P is stored as P * P_SCALE * v_descale_j / v_descale_max,
    which keeps it below e4m3's 448 and folds V's per-tile descale into P (one constant is left for
    the epilogue), so P V accumulates in one register tile across all tiles. The exponent
    log2(v_descale_j / v_descale_max) comes precomputed (a float32 log2 costs ~30 instructions).
    """
    return qk_scale * gl.load(k_descale_ptr + tile), LOG2_P_SCALE + gl.load(v_exponent_ptr + tile)


@gluon.jit
def attention_fwd_fa3_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, q_descale_ptr, k_descale_ptr, v_exponent_ptr,
                             v_descale_max_ptr, heads, seqlen_q, seqlen_k, schedule_ptr, qk_scale,
                             CONSUMERS: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                             PINGPONG: gl.constexpr, FP8: gl.constexpr, PERSISTENT: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr):
    """O and lse of work tiles of 64 * CONSUMERS query rows of one (batch, head). Launch with num_warps=4.

    q/o_desc: TMA descriptors over (B, H, Nq, d), block (1, 1, 64, d); k_desc over
    (B, H, Nk, d), block (1, 1, BLOCK_N, d); v_desc the same, or in FP8 over V^T
    (B, H, d, Nk), block (1, 1, d, BLOCK_N). lse_ptr: (B, H, Nq) float32; qk_scale = scale * log2(e).
    Work tile t (of cdiv(Nq, 64 * CONSUMERS) * B * H) is _tile_coords(t). Grid: one CTA per tile, or
    PERSISTENT: at most one per SM, CTA c computing the tiles that schedule_ptr (int32, from
    tile_schedule.schedule_tensor) lists for it; unused otherwise. FP8 only: q/k_descale_ptr
    (B, H, tiles) float32 per-tile descales (128-row tiles), v_descale_max_ptr (B, H) the largest
    V descale of each head, v_exponent_ptr (B, H, tiles) log2(v_descale / v_descale_max).
    CONSUMER_REGS: registers per thread of a worker consumer warpgroup (setmaxnreg).
    """
    BLOCK_M: gl.constexpr = ROWS_PER_CONSUMER * CONSUMERS
    m_tiles = gl.cdiv(seqlen_q, BLOCK_M)

    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    if FP8:  # O (16-bit) does not fit in the e4m3 Q buffers
        o_bufs = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
    else:  # a consumer's Q tile is dead after its last Q K^T: O reuses its shared memory
        o_bufs = q_bufs
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(c), count=1)
    if PINGPONG:  # consumer 0 issues first: give it its first turn
        mbarrier.arrive(turn.index(0))
    bars = (q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn)
    scales = (q_descale_ptr, k_descale_ptr, v_exponent_ptr, v_descale_max_ptr)

    work = (m_tiles, heads, seqlen_q, seqlen_k)
    state = (o_desc, lse_ptr, scales, q_bufs, k_bufs, v_bufs, o_bufs, bars, work, qk_scale, schedule_ptr)
    producer_args = (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, work, schedule_ptr)
    # (warp_specialize takes a literal list of partitions, so the two consumer counts are spelled out.)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (state, 0, CONSUMERS, STAGES, CAUSAL, PINGPONG, FP8, PERSISTENT)),
            (_consumer, (state, 1, CONSUMERS, STAGES, CAUSAL, PINGPONG, FP8, PERSISTENT)),
            (_producer, (producer_args, STAGES, FP8, CAUSAL, PERSISTENT)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (state, 0, CONSUMERS, STAGES, CAUSAL, PINGPONG, FP8, PERSISTENT)),
            (_consumer, (state, 1, CONSUMERS, STAGES, CAUSAL, PINGPONG, FP8, PERSISTENT)),
            (_consumer, (state, 2, CONSUMERS, STAGES, CAUSAL, PINGPONG, FP8, PERSISTENT)),
            (_producer, (producer_args, STAGES, FP8, CAUSAL, PERSISTENT)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
