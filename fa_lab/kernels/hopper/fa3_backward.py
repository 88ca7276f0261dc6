"""A FlashAttention-3 backward for Hopper (sm_90) written in Gluon.

One CTA owns a tile of 128 keys of one (batch, K/V head) and walks down the query tiles (64 rows at d = 128,
128 at d = 64: :data:`BWD_ROWS`) that see it, in FA3's loop order (notebook 04, section 8). Its partitions:

* **Producer** (one warp): TMA copies of K and V once, then of each step's Q_i and dO_i into a ring of
  ``STAGES`` slots; with ``ROWS_BY_PRODUCER`` (the launchers' default) it also stores each step's rows of
  -lse2 / (scale * log2 e) and -D in shared memory beside them, so that no consumer waits on global memory for
  them (1.02-1.11x dense and 1.06-1.17x packed on the H200: docs/experiments/backward.md) nor computes them.
* **Two consumer warpgroups**, 64 keys each. Per step a consumer computes, for its keys,
  S^T = K Q_i^T and dP^T = V dO_i^T (asynchronous WGMMAs), P^T = exp2(S^T * scale * log2 e - lse2),
  dV += P^T dO_i and dS^T = P^T * (dP^T - D), dK += dS^T Q_i (both from registers: the accumulator
  layout of P^T is the operand layout), and writes dS^T into a double-buffered shared tile. dK and dV
  stay in registers until the CTA ends. The two products start from -lse2 / (scale * log2 e) (-inf where the
  mask hides a pair) and from -D instead of zero, so that the row vectors lse2 and D, which every thread holds
  a copy of, are not live beside the accumulators (that freed the registers the 128-row steps need).
* **dQ by one consumer per step, in turns.** dQ_i = dS_i K sums over all 128 keys, so it needs both
  consumers' dS. The consumer whose turn it is (step i's dS slot, i mod 2) computes the whole tile (rows x d)
  once the other's rows are in; the other goes straight on to the next step. The two warpgroups drift
  apart, so one's exponentials and shared-memory stores run while the other's products keep the tensor
  cores busy. (Splitting dQ's columns between the consumers makes each wait for the other at every step:
  0.78-0.85x the speed of one consumer carrying dQ at d = 128; taking turns rather than leaving dQ to
  consumer 0 alone gained 4-6% at d = 64 and stayed within the spread at d = 128;
  docs/experiments/backward.md.)
* **dQ writer** (one warp): adds each step's dQ_i into a float32 dQ in global memory with a TMA
  reduce-add, from a double buffer, so that no consumer waits for global memory.
* **Or partial dQ tiles** (``DQ_PARTIAL``): each consumer multiplies its own 64 keys' dS_i by its own K rows
  every step, a partial dQ_i over half the keys, and the writer adds both partials (two reduce-adds a step,
  one buffer per consumer). No consumer waits for the other's dS; the atomic traffic doubles.
* **Or dS handed over through named barriers** (``DQ_NAMED``): dQ in turns, but the other consumer's dS rows
  reach the turn's consumer through hardware named barriers (``bar.sync`` / ``bar.arrive``, FA3's way) instead of
  mbarriers, and one empty barrier frees a step's Q and dO slots: 4 warpgroup barriers on a turn step instead of 8
  (Triton puts one before every single-thread mbarrier arrive).
* **Or dQ's columns split, in FA3's order** (``DQ_SPLIT``, d = 128): both consumers store their dS rows first,
  meet, and each computes dQ_i's half of the columns over all 128 keys, issued before dK so that the store of
  its dQ half overlaps the dK product; the writer adds the two halves (one reduce-add's traffic a step). The
  consumers run in lockstep, each carrying the same work every step.

Grouped-query attention: the steps run over the query tiles of every query head of the K/V head's
group, so dK and dV are summed over the group in registers. Causal masking skips the query tiles that
see none of the CTA's keys and masks the diagonal ones. Rows past seqlen_q arrive as zeros with
lse2 = +inf, so their probabilities are 0; keys past seqlen_k arrive as zeros, so their dS K adds 0 to
dQ, and their dK, dV rows are not stored. The preprocess (D = rowsum(dO * O), lse2) is the portable
backward's; the launchers (:func:`fa_lab.kernels.hopper.attention.gluon_backward`, ``gluon_varlen_backward``)
scale dQ by the softmax scale as they cast it, in one pass at the end: the kernel adds sum_i dS_i K unscaled, so
that the consumer whose turn it is goes from its dQ product to the shared-memory store with no multiply on the
way (64 FMUL a thread, every other step, at d = 128; flash-attn-4 scales in its postprocess too).

Launch order (dense): the CTAs run in groups of ``head_group`` (batch, K/V head) pairs, key tile by key tile
across a group's heads (:func:`key_tile_of_cta`; causal launches take the group size from
:func:`.tile_schedule.heads_per_group`, others run head by head), so that the tiles with the most query steps
start first while the group's Q and dO rows stay in L2.

No deterministic mode: the writers of different CTAs add into dQ in whatever order the CTAs reach a tile, so dQ's
last bits can differ between two calls (dK and dV, each computed whole by one CTA, do not). flash-attn's
``deterministic=True`` orders those adds with a semaphore per dQ tile (notebook 04, section 8).

Packed batches (``VARLEN``): one CTA per (sequence, key tile) pair of ``varlen_schedule`` and K/V head, the
descriptors seeing the packed (total, heads, d) tensors as (1, heads, total, d). A tile at a sequence's end
reads the next sequence's rows. Its rows past seqlen_q get lse2 = +inf as above. Its keys past seqlen_k are
masked out of P (causal, the diagonal mask already hides them from every row before seqlen_q), so their dS
is 0 and they add nothing to dQ. dQ's reduce-add of such a tile adds exact zeros to the next sequence's
rows, which leaves them as they are.
"""
from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .block_range import visible_key_start, window_key_end, window_query_plan
from .fa3_state import Ring, named_barrier, ring_phase, wait_until_empty

KEYS_PER_CONSUMER = gl.constexpr(64)
BWD_CONSUMERS = gl.constexpr(2)
BWD_BLOCK_N = BWD_CONSUMERS.value * KEYS_PER_CONSUMER.value  # keys per CTA
BWD_CONSUMER_REGS = gl.constexpr(240)
BWD_WORKER_REGS = gl.constexpr(24)  # the producer and the dQ writer hold only scalars
# Query rows per step, by head_dim: 64 at d = 128 (dK and dV take 128 of a consumer's 240 registers), 128 at d = 64,
# where a step of 64 rows is too short to hide its waits (docs/experiments/backward.md, "128-row steps at d = 64").
BWD_ROWS = {64: 128, 128: 64}


def bwd_rows(head_dim: int, rows: int | None = None) -> int:
    """The query rows per step a launch at ``head_dim`` (64 or 128) uses: ``rows`` (64 or 128) if given, else
    :data:`BWD_ROWS`'s."""
    rows = BWD_ROWS[head_dim] if rows is None else rows
    if rows not in (64, 128):
        raise ValueError(f"the Gluon backward steps over 64 or 128 query rows, got {rows}")
    return rows


# The dQ schemes (the kernel's DQ_SCHEME; HopperOptions.backward_dq names them): whole tiles by the consumers in
# turn, a partial tile per consumer over its own keys, each consumer's half of the columns over all keys, or whole
# tiles in turn with dS handed over through named barriers.
DQ_TURNS, DQ_PARTIAL, DQ_SPLIT, DQ_NAMED = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2), gl.constexpr(3)
DQ_SCHEMES = {"turns": DQ_TURNS.value, "partial": DQ_PARTIAL.value, "split": DQ_SPLIT.value, "named": DQ_NAMED.value}
# DQ_NAMED's hardware named barriers: slot s's dS rows are in (DS_READY + s), and its dQ product has read it
# (DS_FREE + s). (Triton's warp specialization takes the low ids; sm_90 has 16.)
DS_READY = gl.constexpr(12)
DS_FREE = gl.constexpr(14)


def dq_tile_columns(head_dim: int, scheme: int) -> int:
    """The columns of one dQ tile a consumer hands the writer (the dQ descriptor's block width)."""
    return head_dim // 2 if scheme == DQ_SPLIT.value else head_dim


def backward_blocks(head_dim: int, scheme: int, rows: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """The TMA blocks of a launch: (Q and dO's, K and V's, the float32 dQ's), each (1, 1, rows, columns)."""
    block_m = bwd_rows(head_dim, rows)
    return ([1, 1, block_m, head_dim], [1, 1, BWD_BLOCK_N, head_dim],
            [1, 1, block_m, dq_tile_columns(head_dim, scheme)])


@builtin
def async_reduce_add_shared_to_global(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add (``cp.reduce.async.bulk.tensor ... .add``) of the shared tile src into tensor_desc's
    block at coord; completes like a TMA store (:func:`tma.store_wait`). Gluon 3.6 builds the operation
    but exports no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _step_rows(t, first_q, q_tiles, kv_head, group, BLOCK_M: gl.constexpr):
    """Step t's query head and first row: the group's heads one after another, each over its query tiles
    (of BLOCK_M rows) from first_q on."""
    head = kv_head * group + t // q_tiles
    start_m = (first_q + t % q_tiles) * BLOCK_M
    return head, start_m


@gluon.jit
def _step_row_vectors(lse2_ptr, delta_ptr, batch, heads, head, lse_rows, q_start, rows, valid):
    """lse2 and D of a step's rows (in rows' layout), from (B, H, Nq), or (H, total_q) packed (lse_rows rows per
    head, the sequence's from q_start); rows not ``valid`` (past seqlen_q) get lse2 = +inf (probability 0) and
    D = 0, and are not read."""
    base = (batch * heads + head) * lse_rows + q_start
    lse2 = gl.load(lse2_ptr + base + rows, mask=valid, other=float("inf"))
    return lse2, gl.load(delta_ptr + base + rows, mask=valid, other=0.0)


@gluon.jit
def _rows_of_step(t, steps, lse2_ptr, delta_ptr, batch, heads, kv_head, group, first_q, q_tiles, seqlen_q, q_start,
                  lse_rows, BLOCK_M: gl.constexpr, row_layout: gl.constexpr):
    """Step t's lse2 and D rows (:func:`_step_row_vectors`, BLOCK_M of them in row_layout), none read past the last
    of ``steps``."""
    head, start_m = _step_rows(t, first_q, q_tiles, kv_head, group, BLOCK_M)
    rows = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
    return _step_row_vectors(lse2_ptr, delta_ptr, batch, heads, head, lse_rows, q_start, rows,
                             (rows < seqlen_q) & (t < steps))


@gluon.jit
def _product_starts(lse2_ptr, delta_ptr, batch, heads, head, lse_rows, q_start, rows, seqlen_q, qk_scale):
    """What the S^T and dP^T products of a step's rows start from (in rows' layout): -lse2 / qk_scale and -D
    (:func:`_step_row_vectors`)."""
    lse2, delta = _step_row_vectors(lse2_ptr, delta_ptr, batch, heads, head, lse_rows, q_start, rows,
                                    rows < seqlen_q)
    return _starts_of(lse2, delta, qk_scale)


@gluon.jit
def _starts_of(lse2, delta, qk_scale):
    """The S^T and dP^T products' start rows from a step's lse2 and D rows: -lse2 / qk_scale and -D."""
    return -(lse2 / qk_scale), -delta


@gluon.jit
def _store_starts(row_bufs, slot, s_rows, dp_rows):
    """A step's start rows into its Q slot's row buffers (2 slot and 2 slot + 1), every lane's stores done before
    the ready barrier's arrival that announces them."""
    row_bufs.index(2 * slot).store(s_rows)
    row_bufs.index(2 * slot + 1).store(dp_rows)
    gl.thread_barrier()


@gluon.jit
def _widen(x):
    """The float32 values of a 16-bit tensor, read out of the 32-bit registers that hold them two by two.

    (``x.to(gl.float32)`` converts the same values, but on bf16 it made ptxas round P^T to bf16 one value at a
    time: 32 F2F.BF16.F32 and 16 PRMT a step where the operand alone takes 16 F2FP, since each value then had a
    second use. Read from the packed registers, the values have none.)"""
    if x.dtype == gl.bfloat16:  # a bf16 is the top half of the float32 with the same value
        asm: gl.constexpr = "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }"
    else:
        asm: gl.constexpr = "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }"
    return gl.inline_asm_elementwise(asm, "=r,=r,r", [x], dtype=gl.float32, is_pure=True, pack=2)


@gluon.jit
def _bwd_producer(q_desc, k_desc, v_desc, do_desc, k_ring, v_ring, q_ring, do_ring, row_bufs, lse2_ptr, delta_ptr,
                  batch, kv_head, start_n, heads, group, first_q, q_tiles, seqlen_q, q_start, k_start, lse_rows,
                  qk_scale, ROWS_BY_PRODUCER: gl.constexpr, ROWS_AHEAD: gl.constexpr):
    """TMA copies: K and V of the CTA's keys once, then Q_i and dO_i of every step (q_start, k_start: the
    sequence's first row in a packed batch, else 0). ROWS_BY_PRODUCER: also the start rows of step i's two products
    (:func:`_product_starts`), into row_bufs[2 slot] and [2 slot + 1] before Q_i's copy is announced on the slot's
    ready barrier. ROWS_AHEAD: the rows' global loads leave the path from a free slot to its copies: step i + 1's
    lse2 and D are loaded right after step i's copies are issued (their latency passes while the producer waits for
    the next free slot), and a step's copies are issued as soon as its slot is free, its rows stored after them and
    announced by a second arrival on the slot's ready barrier (which then counts two)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    k_ring.at(0).fill(k_desc, [batch, kv_head, k_start + start_n, 0])
    v_ring.at(0).fill(v_desc, [batch, kv_head, k_start + start_n, 0])
    steps = group * q_tiles
    if ROWS_AHEAD:
        lse2, delta = _rows_of_step(0, steps, lse2_ptr, delta_ptr, batch, heads, kv_head, group, first_q, q_tiles,
                                    seqlen_q, q_start, lse_rows, BLOCK_M, row_layout)
    for t in range(steps):
        head, start_m = _step_rows(t, first_q, q_tiles, kv_head, group, BLOCK_M)
        q_tile = q_ring.at(t)
        if ROWS_AHEAD:
            q_tile.fill(q_desc, [batch, head, q_start + start_m, 0])  # (waits for the free slot)
            do_ring.at(t).fill(do_desc, [batch, head, q_start + start_m, 0])
            s_rows, dp_rows = _starts_of(lse2, delta, qk_scale)
            _store_starts(row_bufs, q_tile.slot, s_rows, dp_rows)
            mbarrier.arrive(q_ring.ready.index(q_tile.slot))
            lse2, delta = _rows_of_step(t + 1, steps, lse2_ptr, delta_ptr, batch, heads, kv_head, group, first_q,
                                        q_tiles, seqlen_q, q_start, lse_rows, BLOCK_M, row_layout)
        else:
            if ROWS_BY_PRODUCER:
                wait_until_empty(q_ring.empty.index(q_tile.slot), ring_phase(t, q_ring.bufs.type.shape[0]))
                rows = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
                s_rows, dp_rows = _product_starts(lse2_ptr, delta_ptr, batch, heads, head, lse_rows, q_start, rows,
                                                  seqlen_q, qk_scale)
                _store_starts(row_bufs, q_tile.slot, s_rows, dp_rows)  # (announced with Q's copy below)
            q_tile.fill(q_desc, [batch, head, q_start + start_m, 0])
            do_ring.at(t).fill(do_desc, [batch, head, q_start + start_m, 0])


@gluon.jit
def _bwd_dq_writer(dq_desc, dq_bufs, dq_full, dq_empty, batch, kv_head, group, first_q, q_tiles, q_start,
                   DQ_SCHEME: gl.constexpr):
    """Each step's dQ_i from shared memory into the float32 dQ (TMA reduce-adds): the whole tile of step i's slot
    (turns); the two consumers' partial tiles (buffer c of consumer c); or the slot's two column halves (buffer
    2 * slot + c holds consumer c's columns)."""
    for t in range(group * q_tiles):
        head, start_m = _step_rows(t, first_q, q_tiles, kv_head, group, dq_desc.block_type.shape[2])
        if DQ_SCHEME == DQ_PARTIAL:
            for c in gl.static_range(BWD_CONSUMERS):
                mbarrier.wait(dq_full.index(c), ring_phase(t, 1))
                async_reduce_add_shared_to_global(dq_desc, [batch, head, q_start + start_m, 0], dq_bufs.index(c))
            tma.store_wait(0)  # both adds have read their buffers: the consumers may refill them
            for c in gl.static_range(BWD_CONSUMERS):
                mbarrier.arrive(dq_empty.index(c))
        elif DQ_SCHEME == DQ_SPLIT:
            slot = t % 2
            half: gl.constexpr = dq_desc.block_type.shape[3]
            for c in gl.static_range(BWD_CONSUMERS):
                mbarrier.wait(dq_full.index(2 * slot + c), ring_phase(t, 2))
                async_reduce_add_shared_to_global(dq_desc, [batch, head, q_start + start_m, c * half],
                                                  dq_bufs.index(2 * slot + c))
            tma.store_wait(0)
            for c in gl.static_range(BWD_CONSUMERS):
                mbarrier.arrive(dq_empty.index(2 * slot + c))
        else:
            slot = t % 2
            mbarrier.wait(dq_full.index(slot), ring_phase(t, 2))
            async_reduce_add_shared_to_global(dq_desc, [batch, head, q_start + start_m, 0], dq_bufs.index(slot))
            tma.store_wait(0)  # the add has read the buffer: its consumer may refill it
            mbarrier.arrive(dq_empty.index(slot))


@gluon.jit
def _turn_dq(step, ds_bufs, k_all, ds_ready, ds_free, dq_bufs, dq_full, dq_empty, DQ_SCHEME: gl.constexpr):
    """dQ_step = dS_step K over the 128 keys (k_all: the CTA's K tile, (128, d) in shared memory), by the consumer
    whose turn the step's dS slot (step % 2) is, once the other consumer's rows are in too (DQ_TURNS through
    ds_ready, DQ_NAMED through its named barrier); it frees the slot and hands the tile to the dQ writer."""
    BLOCK_M: gl.constexpr = ds_bufs.type.shape[2]
    HEAD_DIM: gl.constexpr = k_all.type.shape[1]
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    slot = step % 2
    ds_slot = ds_bufs.index(slot)
    if DQ_SCHEME == DQ_NAMED:
        named_barrier("bar.sync", DS_READY + slot)
    else:
        mbarrier.wait(ds_ready.index(slot), ring_phase(step, 2))
    dq = warpgroup_mma(ds_slot.permute((1, 0)), k_all,
                       gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, kv_layout), use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    if DQ_SCHEME == DQ_NAMED:
        named_barrier("bar.arrive", DS_FREE + slot)
    else:
        mbarrier.arrive(ds_free.index(slot))
    wait_until_empty(dq_empty.index(slot), ring_phase(step, 2))
    dq_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM]).store(dq)
    fence_async_shared()
    mbarrier.arrive(dq_full.index(slot))


@gluon.jit
def _bwd_consumer(k_ring, v_ring, q_ring, do_ring, ds_bufs, ds_ready, ds_free, dq_bufs, dq_full, dq_empty,
                  row_bufs, lse2_ptr, delta_ptr, dk_ptr, dv_ptr, batch, kv_head, start_n, heads, group, first_q,
                  q_tiles, seqlen_q, seqlen_k, q_start, k_start, lse_rows, qk_scale, scale, window_left, window_right,
                  CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr, DQ_SCHEME: gl.constexpr,
                  ROWS_BY_PRODUCER: gl.constexpr, WINDOW: gl.constexpr):
    """Consumer warpgroup CONSUMER: keys [start_n + 64 * CONSUMER, +64) through every step, then its dK, dV rows;
    it also computes the dQ tile of every step whose dS slot is its own (t % 2 == CONSUMER), or (DQ_PARTIAL) its
    partial dQ tile of every step, or (DQ_SPLIT) its half of every step's dQ columns. Rows and keys are
    counted within the sequence; q_start, k_start place a packed sequence (VARLEN) in the packed tensors, whose
    lse2 and delta hold lse_rows rows per head (seqlen_q, or total_q packed). WINDOW: rows i see the keys
    i + offset - window_left <= j <= i + offset + window_right (``BlockInfo.window_bounds``)."""
    HEAD_DIM: gl.constexpr = k_ring.bufs.type.shape[4]
    BLOCK_M: gl.constexpr = q_ring.bufs.type.shape[3]
    dtype: gl.constexpr = k_ring.bufs.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    query_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    key_layout: gl.constexpr = gl.SliceLayout(1, st_layout)

    key0 = start_n + CONSUMER * KEYS_PER_CONSUMER
    k_tile = k_ring.at(0)
    v_tile = v_ring.at(0)
    k_all = k_tile.buf().reshape([2 * KEYS_PER_CONSUMER, HEAD_DIM])
    k_own = k_all.slice(CONSUMER * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER)
    v_own = v_tile.buf().reshape([2 * KEYS_PER_CONSUMER, HEAD_DIM]).slice(CONSUMER * KEYS_PER_CONSUMER,
                                                                         KEYS_PER_CONSUMER)
    offset = seqlen_k - seqlen_q
    dk = gl.zeros([KEYS_PER_CONSUMER, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([KEYS_PER_CONSUMER, HEAD_DIM], gl.float32, kv_layout)
    k_tile.wait_ready()
    v_tile.wait_ready()
    if DQ_SCHEME == DQ_NAMED:
        named_barrier("bar.arrive", DS_FREE + CONSUMER)  # this consumer's slot is free for the other's first rows
    for t in range(group * q_tiles):
        head, start_m = _step_rows(t, first_q, q_tiles, kv_head, group, BLOCK_M)
        rows = start_m + gl.arange(0, BLOCK_M, layout=query_layout)
        q_tile = q_ring.at(t)
        do_tile = do_ring.at(t)
        q_smem = q_tile.buf().reshape([BLOCK_M, HEAD_DIM])
        do_smem = do_tile.buf().reshape([BLOCK_M, HEAD_DIM])
        if ROWS_BY_PRODUCER:  # (the producer stored them before Q's ready barrier)
            q_tile.wait_ready()
            s_rows = row_bufs.index(2 * q_tile.slot).load(query_layout)
            dp_rows = row_bufs.index(2 * q_tile.slot + 1).load(query_layout)
        else:
            s_rows, dp_rows = _product_starts(lse2_ptr, delta_ptr, batch, heads, head, lse_rows, q_start, rows,
                                              seqlen_q, qk_scale)
        # The accumulators start at -lse2 / qk_scale and -D: the products then leave S^T - lse2 / qk_scale and
        # dP^T - D, and neither row vector stays live beside them. (Broadcast, not added to zeros: no instruction.)
        zeros = gl.zeros([KEYS_PER_CONSUMER, BLOCK_M], gl.float32, st_layout)
        s_start = gl.broadcast(s_rows[None, :], zeros)[0]
        # A masked pair starts at -inf, so that its probability is 0.
        if CAUSAL:
            if start_m + offset < key0 + KEYS_PER_CONSUMER - 1:  # the diagonal: some keys come after a row
                keys = key0 + gl.arange(0, KEYS_PER_CONSUMER, layout=key_layout)
                s_start = gl.where(keys[:, None] <= rows[None, :] + offset, s_start, float("-inf"))
        elif WINDOW:  # a step across either edge of the band (or past the last key)
            if ((visible_key_start(start_m + BLOCK_M - 1, seqlen_q, seqlen_k, window_left) > key0)
                    | (key0 + KEYS_PER_CONSUMER > window_key_end(start_m, seqlen_q, seqlen_k, window_right))):
                keys = key0 + gl.arange(0, KEYS_PER_CONSUMER, layout=key_layout)
                seen = ((keys[:, None] >= visible_key_start(rows, seqlen_q, seqlen_k, window_left)[None, :])
                        & (keys[:, None] < window_key_end(rows, seqlen_q, seqlen_k, window_right)[None, :]))
                s_start = gl.where(seen, s_start, float("-inf"))
        elif VARLEN:  # (causal, the mask above hides them: a row before seqlen_q sees no key past seqlen_k)
            if key0 + KEYS_PER_CONSUMER > seqlen_k:  # the sequence's last keys: the next sequence's follow them
                keys = key0 + gl.arange(0, KEYS_PER_CONSUMER, layout=key_layout)
                s_start = gl.where(keys[:, None] < seqlen_k, s_start, float("-inf"))
        if not ROWS_BY_PRODUCER:  # (with the producer's rows, Q's wait came before reading them)
            q_tile.wait_ready()
        do_tile.wait_ready()
        st = warpgroup_mma(k_own, q_smem.permute((1, 0)), s_start, is_async=True)
        dpt = warpgroup_mma(v_own, do_smem.permute((1, 0)), gl.broadcast(dp_rows[None, :], zeros)[0], is_async=True)
        st = warpgroup_mma_wait(1, deps=(st,))
        pt = gl.exp2(st * qk_scale)
        # P^T is kept as the 16-bit operand only (the registers of the float32 tile are the budget's
        # limit); dS = P (dP - D) reads it back, rounded as the dV product reads it.
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv = warpgroup_mma(pt_op, do_smem, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt,))
        pt_back = gl.convert_layout(_widen(pt_op), st_layout)
        dst = (pt_back * dpt).to(dtype)
        ds_op = gl.convert_layout(dst, op_layout)
        slot = t % 2
        ds_slot = ds_bufs.index(slot)
        if DQ_SCHEME == DQ_SPLIT:
            # FA3's order: both consumers' dS rows stored and met first; this consumer's half of dQ_i's columns
            # (over all 128 keys) issued before dK, so that its store overlaps the dK product.
            half: gl.constexpr = HEAD_DIM // 2
            dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                instr_shape=[16, half, 16])
            wait_until_empty(ds_free.index(slot), ring_phase(t, 2))  # both dQ halves of step i - 2 have read it
            ds_slot.slice(CONSUMER * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER).store(dst)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(slot))
            mbarrier.wait(ds_ready.index(slot), ring_phase(t, 2))
            dq = warpgroup_mma(ds_slot.permute((1, 0)), k_all.slice(CONSUMER * half, half, dim=1),
                               gl.zeros([BLOCK_M, half], gl.float32, dq_layout), use_acc=False, is_async=True)
            dk = warpgroup_mma(ds_op, q_smem, dk, is_async=True)
            dv, dq, pt_op = warpgroup_mma_wait(1, deps=(dv, dq, pt_op))  # dV and dQ done, dK in flight
            do_tile.release()
            mbarrier.arrive(ds_free.index(slot))
            buffer = 2 * slot + CONSUMER
            wait_until_empty(dq_empty.index(buffer), ring_phase(t, 2))
            dq_bufs.index(buffer).reshape([BLOCK_M, half]).store(dq)
            fence_async_shared()
            mbarrier.arrive(dq_full.index(buffer))
            dk, ds_op = warpgroup_mma_wait(0, deps=(dk, ds_op))
            q_tile.release()
        elif DQ_SCHEME == DQ_PARTIAL:  # dS_i over this consumer's keys times their K rows: its own partial dQ_i
            dk = warpgroup_mma(ds_op, q_smem, dk, is_async=True)
            ds_own = ds_slot.slice(CONSUMER * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER)
            ds_own.store(dst)  # (read by this consumer's own dQ product below, within the step)
            fence_async_shared()
            dv, dk, pt_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, ds_op))
            q_tile.release()
            do_tile.release()
            dq = warpgroup_mma(ds_own.permute((1, 0)), k_own,
                               gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, kv_layout), use_acc=False, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq,))
            wait_until_empty(dq_empty.index(CONSUMER), ring_phase(t, 1))
            dq_bufs.index(CONSUMER).reshape([BLOCK_M, HEAD_DIM]).store(dq)
            fence_async_shared()
            mbarrier.arrive(dq_full.index(CONSUMER))
        else:
            dk = warpgroup_mma(ds_op, q_smem, dk, is_async=True)
            # This consumer's rows of dS_i^T into the step's slot (free once dQ_{i-2} has read it).
            if DQ_SCHEME == DQ_NAMED:  # the turn's consumer read its own slot itself; the other waits for it
                if slot != CONSUMER:
                    named_barrier("bar.sync", DS_FREE + slot)
            else:
                wait_until_empty(ds_free.index(slot), ring_phase(t, 2))
            ds_slot.slice(CONSUMER * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER).store(dst)
            fence_async_shared()
            if DQ_SCHEME == DQ_NAMED:
                if slot != CONSUMER:
                    named_barrier("bar.arrive", DS_READY + slot)
            else:
                mbarrier.arrive(ds_ready.index(slot))
            dv, dk, pt_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, ds_op))
            q_tile.release()
            if DQ_SCHEME != DQ_NAMED:  # (DQ_NAMED: Q's release frees dO's slot too)
                do_tile.release()
            if slot == CONSUMER:  # this step's dQ_i = dS_i K over the 128 keys, once the other rows are in too
                _turn_dq(t, ds_bufs, k_all, ds_ready, ds_free, dq_bufs, dq_full, dq_empty, DQ_SCHEME)

    # dK, dV rows of this consumer's keys below seqlen_k: (B, H_kv, N_k, d), or packed (total_k, H_kv, d).
    out_keys = key0 + gl.arange(0, KEYS_PER_CONSUMER, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    if VARLEN:
        offsets = ((k_start + out_keys.to(gl.int64)) * (heads // group) + kv_head)[:, None] * HEAD_DIM
    else:
        offsets = ((batch * (heads // group) + kv_head) * seqlen_k + out_keys.to(gl.int64))[:, None] * HEAD_DIM
    mask = (out_keys < seqlen_k)[:, None]
    gl.store(dk_ptr + offsets + cols[None, :], (dk * scale).to(dk_ptr.dtype.element_ty), mask=mask)
    gl.store(dv_ptr + offsets + cols[None, :], dv.to(dv_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def key_tile_of_cta(cta, key_tiles, head_group):
    """(key tile, batch * K/V head) of CTA ``cta`` of a dense launch (key_tiles x (B * H // group) CTAs). The
    (batch, head) pairs go in groups of head_group, a divisor of their count; within a group the CTAs run key tile
    by key tile across its heads, so that with a causal mask the tiles with the most query steps start first
    while the group's Q and dO rows stay in L2 (:func:`.tile_schedule.heads_per_group`). head_group 1 is head by
    head, each head's key tiles in order. (Two integer divisions: more in this prologue made the d = 64 causal
    loop spill.)"""
    span = head_group * key_tiles  # the CTAs of one group
    group_index = cta // span
    rest = cta - group_index * span
    key_tile = rest // head_group
    return key_tile, group_index * head_group + rest - key_tile * head_group


@gluon.jit
def attention_bwd_fa3_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_ptr, dv_ptr, lse2_ptr, delta_ptr,
                             heads, group, seqlen_q, seqlen_k, head_group, window_left, window_right, schedule_ptr,
                             cu_seqlens_q, cu_seqlens_k, qk_scale, scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                             VARLEN: gl.constexpr = False, DQ_SCHEME: gl.constexpr = DQ_TURNS,
                             ROWS_BY_PRODUCER: gl.constexpr = False, ROWS_AHEAD: gl.constexpr = False,
                             WINDOW: gl.constexpr = False):
    """dK, dV (stored) and dQ (added) of one tile of 128 keys of one (batch, K/V head). Launch with num_warps=4.

    q/do_desc: TMA descriptors over (B, H, Nq, d), block (1, 1, rows, d) (rows: :func:`bwd_rows`); k/v_desc over
    (B, H // group, Nk, d), block (1, 1, 128, d); dq_desc over the float32 dQ (B, H, Nq, d), zeroed, block
    (1, 1, rows, dq_tile_columns(d)), which receives dQ / scale;
    dk_ptr, dv_ptr: (B, H // group, Nk, d) contiguous, in K's dtype or float32; lse2_ptr (lse * log2 e, +inf for
    rows that see no key) and delta_ptr (rowsum(dO * O)): (B, H, Nq) float32; qk_scale = scale * log2(e); d = 64
    or 128.
    STAGES: slots of the Q and dO rings. Grid: (cdiv(Nk, 128) * B * H // group,), the CTAs in the order of
    :func:`key_tile_of_cta` with head_group (batch, K/V head) pairs per group (a divisor of B * H // group).
    schedule_ptr, cu_seqlens_q/k are read only with VARLEN. DQ_SCHEME: DQ_TURNS, DQ_PARTIAL, DQ_SPLIT (d = 128) or
    DQ_NAMED, the module docstring's dQ schemes. ROWS_BY_PRODUCER: each step's start rows (:func:`_product_starts`)
    reach the consumers through shared memory (the producer loads and computes them) instead of each consumer's own
    loads; ROWS_AHEAD (with it): the producer loads each step's rows one step ahead and issues a step's copies before
    it stores the step's rows (:func:`_bwd_producer`). WINDOW (dense calls only; CAUSAL off, a causal band folded
    into its bounds): the band of ``BlockInfo.window_bounds`` (window_left, window_right); each CTA walks only the
    query tiles that see its key tile (:func:`.block_range.window_query_plan`) and masks the steps across the band's
    edges.

    VARLEN: a packed batch. The descriptors see the packed (total, heads, d) tensors as (1, heads, total, d)
    (dQ's too); dk_ptr, dv_ptr: (total_k, H // group, d); lse2_ptr, delta_ptr: (H, total_q); seqlen_q: total_q;
    seqlen_k: not read; cu_seqlens_q/k: int32 (batch + 1,); schedule_ptr: the (sequence, first key) int32 pairs of
    ``varlen_schedule`` for 128-key tiles. Grid: (pairs, H // group); head_group is not read.
    """
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    heads_kv = heads // group
    lse_rows = seqlen_q
    if VARLEN:  # one CTA per (sequence, key tile) pair and K/V head
        sequence = gl.load(schedule_ptr + 2 * gl.program_id(0))
        start_n = gl.load(schedule_ptr + 2 * gl.program_id(0) + 1)
        q_start = gl.load(cu_seqlens_q + sequence)
        k_start = gl.load(cu_seqlens_k + sequence)
        seqlen_q = gl.load(cu_seqlens_q + sequence + 1) - q_start
        seqlen_k = gl.load(cu_seqlens_k + sequence + 1) - k_start
        batch = 0
        kv_head = gl.program_id(1)
    else:
        key_tile, batch_head = key_tile_of_cta(gl.program_id(0), gl.cdiv(seqlen_k, BLOCK_N), head_group)
        start_n = key_tile * BLOCK_N
        q_start: gl.constexpr = 0
        k_start: gl.constexpr = 0
        batch = batch_head // heads_kv
        kv_head = batch_head - batch * heads_kv
    first_q = 0
    if CAUSAL:  # query row i sees key j when j <= i + seqlen_k - seqlen_q
        first_q = gl.maximum(start_n - (seqlen_k - seqlen_q), 0) // BLOCK_M
    q_tiles = gl.maximum(gl.cdiv(seqlen_q, BLOCK_M) - first_q, 0)
    if WINDOW:
        gl.static_assert(not (CAUSAL or VARLEN), "a window folds causal in, and packed batches take none")
        first_q, q_tiles = window_query_plan(start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N)

    # K and V are loaded once, through one-slot Rings; nothing arrives on their empty barriers, whose
    # fresh state lets the producer's single fill through.
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], q_desc.dtype)
    ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    # dQ's buffers: two (turns: a slot each; partial: a consumer each), or a column half per slot and consumer.
    DQ_BUFFERS: gl.constexpr = 4 if DQ_SCHEME == DQ_SPLIT else 2
    dq_bufs = gl.allocate_shared_memory(gl.float32, [DQ_BUFFERS] + dq_desc.block_type.shape, dq_desc.layout)
    if ROWS_BY_PRODUCER:  # each step's start rows of its two products, a slot per Q slot
        row_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M],
                                             gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    else:
        row_bufs = dq_bufs  # (not read)
    k_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(k_ready.index(0), count=1)
    mbarrier.init(k_empty.index(0), count=BWD_CONSUMERS)
    mbarrier.init(v_ready.index(0), count=1)
    mbarrier.init(v_empty.index(0), count=BWD_CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=2 if ROWS_AHEAD else 1)  # (ROWS_AHEAD: the copy's and the rows')
        mbarrier.init(q_empty.index(i), count=BWD_CONSUMERS)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(do_empty.index(i), count=BWD_CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=BWD_CONSUMERS)  # both consumers' rows of dS are in
        # the dQ products that read the slot are done: the slot owner's, or (split) both consumers'
        mbarrier.init(ds_free.index(i), count=BWD_CONSUMERS if DQ_SCHEME == DQ_SPLIT else 1)
    for i in gl.static_range(DQ_BUFFERS):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    k_ring = Ring(k_bufs, k_ready, k_empty)
    v_ring = Ring(v_bufs, v_ready, v_empty)
    q_ring = Ring(q_bufs, q_ready, q_empty)
    if DQ_SCHEME == DQ_NAMED:  # a step's Q and dO slots freed together, by Q's release
        do_ring = Ring(do_bufs, do_ready, q_empty)
    else:
        do_ring = Ring(do_bufs, do_ready, do_empty)
    gl.warp_specialize([
        (_bwd_consumer, (k_ring, v_ring, q_ring, do_ring, ds_bufs, ds_ready, ds_free, dq_bufs, dq_full, dq_empty,
                         row_bufs, lse2_ptr, delta_ptr, dk_ptr, dv_ptr, batch, kv_head, start_n, heads, group, first_q,
                         q_tiles, seqlen_q, seqlen_k, q_start, k_start, lse_rows, qk_scale, scale, window_left,
                         window_right, 0, CAUSAL, VARLEN, DQ_SCHEME, ROWS_BY_PRODUCER, WINDOW)),
        (_bwd_consumer, (k_ring, v_ring, q_ring, do_ring, ds_bufs, ds_ready, ds_free, dq_bufs, dq_full, dq_empty,
                         row_bufs, lse2_ptr, delta_ptr, dk_ptr, dv_ptr, batch, kv_head, start_n, heads, group, first_q,
                         q_tiles, seqlen_q, seqlen_k, q_start, k_start, lse_rows, qk_scale, scale, window_left,
                         window_right, 1, CAUSAL, VARLEN, DQ_SCHEME, ROWS_BY_PRODUCER, WINDOW)),
        (_bwd_producer, (q_desc, k_desc, v_desc, do_desc, k_ring, v_ring, q_ring, do_ring, row_bufs, lse2_ptr,
                         delta_ptr, batch, kv_head, start_n, heads, group, first_q, q_tiles, seqlen_q, q_start,
                         k_start, lse_rows, qk_scale, ROWS_BY_PRODUCER, ROWS_AHEAD)),
        (_bwd_dq_writer, (dq_desc, dq_bufs, dq_full, dq_empty, batch, kv_head, group, first_q, q_tiles, q_start,
                          DQ_SCHEME)),
    ], [4, 1, 1], [BWD_CONSUMER_REGS, BWD_WORKER_REGS, BWD_WORKER_REGS])
