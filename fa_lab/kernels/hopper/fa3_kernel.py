"""A FlashAttention-3 forward for Hopper (sm_90) written in Gluon.

Gluon (``triton.experimental.gluon``, shipped with Triton 3.6) is Triton's
lower-level language: the kernel author chooses the layouts, allocates shared
memory, issues TMA copies and WGMMAs and synchronizes with mbarriers. That is
what FlashAttention-3 needs and what plain Triton decides on its own. The
kernel below is organised the way the FA3 paper describes it:

* **Warp specialization.** One CTA computes ``BLOCK_M = 64 * CONSUMERS`` query
  rows (128, or 192 where three consumers run) of one (batch, head) with a *producer* warp that only
  issues TMA copies of Q, K and V into shared memory, and ``CONSUMERS``
  *consumer* warpgroups (4 warps each) that own 64 query rows each and only
  compute. The producer gets 24 registers per thread, two consumers 240 each
  (``setmaxnreg``).
* **A circular buffer of K/V tiles** (``STAGES`` slots). Each slot has a
  ``ready`` mbarrier (the TMA completes it, counting bytes) and an ``empty``
  mbarrier that every consumer arrives on once they no longer read the slot, so
  the producer runs up to ``STAGES`` tiles ahead. K and V have separate
  barriers: a consumer frees K as soon as its scores are computed.
* **Intra-warpgroup pipelining.** In iteration j a consumer issues
  ``S_j = Q K_j^T`` *and* ``O += P_{j-1} V_{j-1}`` as asynchronous WGMMAs, then
  waits for S_j only and runs the softmax of tile j while the tensor cores are
  still busy with the P V product of tile j-1.
* **Inter-warpgroup overlap.** The consumers run the same loop on different
  rows, each waiting on its own barriers, so one's softmax can run during the
  other's WGMMAs. ``PINGPONG`` enforces FA3's explicit alternation of the consumers'
  WGMMAs with its named barriers (:class:`.fa3_state.Turns`).
* **FP8** (``FP8``): e4m3 WGMMAs on per-tile quantized Q, K and V^T; V's per-tile
  descale is folded into P's exponent, and P's keys are renumbered in the order
  a thread holds them (V^T is stored in that order) so that P becomes an FP8
  operand without moving data between threads.
* **Persistent kernel** (``PERSISTENT``): one CTA per SM, each computing the work
  tiles that :mod:`.tile_schedule` lists for it (longest first, heads
  in groups). The ring's slots and phases run on across tiles, so the next tile's
  K/V (and, once the consumers release it, Q) load while this tile ends.
* **Epilogue through shared memory.** A consumer's Q tile is dead after its last
  ``Q K^T``, so, one tile per CTA, O is written into that buffer and stored with
  one TMA copy, which also drops the rows past ``seqlen_q``; in FP8, and in a
  persistent CTA where they fit, O has buffers of its own (``SEPARATE_O``).
* **Packed batches** (``VARLEN``): one launch over a list of (sequence,
  query tile) pairs (built on the host, or on the device for ``DeviceTiles``); each
  work tile reads its sequence's offsets from ``cu_seqlens``. Past a sequence's end
  lie the next sequence's rows, not zeros: their keys are masked like a ragged end,
  and a sequence's partial last tile stores O row by row.
* **Score modifiers** (``SOFTCAP``, ``ALIBI``): applied to each score tile in
  registers, before the masks (:func:`.fa3_softmax.softmax_tile`).

Tiles are addressed with 4-D TMA descriptors over (batch, heads, seqlen,
head_dim), block (1, 1, rows, head_dim): keys past ``seqlen_k`` arrive as zeros
and are masked to -inf in the scores. The kernel needs a Hopper GPU: it cannot
run in Triton's CPU interpreter, but it compiles on any machine
(:func:`.sm90_offline.compile_fa3_for_sm90`), which the CPU tests use.

The kernel is split by role: this entry allocates shared memory and barriers and starts the
partitions (:mod:`.fa3_producer`, :mod:`.fa3_consumer`) on one :class:`.fa3_state.KernelState`;
:mod:`.fa3_softmax` holds the consumers' register math, :mod:`.fa3_config` the fixed shapes.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .fa3_config import PRODUCER_REGS, ROWS_PER_CONSUMER, separate_o_fits
from .fa3_consumer import consumer
from .fa3_producer import producer
from .fa3_state import KernelState, QSlot, Ring, Turns, WorkList


@gluon.jit
def attention_fwd_fa3_kernel(q_desc, k_desc, v_desc, o_desc, o_ptr, lse_ptr, q_descale_ptr, k_descale_ptr,
                             v_exponent_ptr, v_descale_max_ptr, heads, group, seqlen_q, seqlen_k, left, right,
                             schedule_ptr, cu_seqlens_q, cu_seqlens_k, qk_scale, softcap_scale, slopes_ptr,
                             CONSUMERS: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                             PINGPONG: gl.constexpr, FP8: gl.constexpr, PERSISTENT: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr = False,
                             SOFTCAP: gl.constexpr = False, ALIBI: gl.constexpr = False,
                             SPLIT_LOOPS: gl.constexpr = False, RESCALE_EARLY: gl.constexpr = False,
                             CONVERT_P_LATE: gl.constexpr = False, EXP2_ON_FMA: gl.constexpr = 0):
    """O and lse of work tiles of 64 * CONSUMERS query rows of one (batch, head). Launch with num_warps=4.

    q/o_desc: TMA descriptors over (B, H, Nq, d), block (1, 1, 64, d); k_desc over
    (B, H // group, Nk, d), block (1, 1, BLOCK_N, d) (query head h reads K/V head h // group); v_desc the
    same, or in FP8 (group 1) over V^T (B, H, d, Nk), block (1, 1, d, BLOCK_N). lse_ptr: (B, H, Nq)
    float32; qk_scale = scale * log2(e).
    Work tile t (of cdiv(Nq, 64 * CONSUMERS) * B * H) is WorkList.tile(t). Grid: one CTA per tile, or
    PERSISTENT: at most one per SM, CTA c computing the tiles that schedule_ptr (int32, from
    tile_schedule.schedule_tensor) lists for it; unused otherwise. FP8 only: q/k_descale_ptr
    (B, H, tiles) float32 per-tile descales (128-row tiles), v_descale_max_ptr (B, H) the largest
    V descale of each head, v_exponent_ptr (B, H, tiles) log2(v_descale / v_descale_max).
    CONSUMER_REGS: registers per thread of a worker consumer warpgroup (setmaxnreg). WINDOW: a local
    window (left, right) (``BlockInfo.window_bounds``, causal folded in; CAUSAL off): each work tile
    visits only the K/V tiles of its band and masks the band's edge tiles.

    VARLEN: a packed batch. q/k/v/o_desc see the packed (total, heads, d) tensors as (1, heads, total, d);
    o_ptr: the packed O (total_q, H, d) (a sequence's partial last tile is stored through it); lse_ptr
    (H, total_q); seqlen_q: total_q; cu_seqlens_q/k: int32 (batch + 1,); schedule_ptr: the (sequence,
    first row) int32 pairs of ``varlen_schedule`` for BLOCK_M rows, one work tile per pair and head
    (grid: pairs * H; not PERSISTENT, not FP8). Otherwise o_ptr, cu_seqlens_q/k are not read.
    SOFTCAP: scores softcap * tanh(scale * q.k / softcap); qk_scale is then softcap * log2(e) and
    softcap_scale = scale / softcap. ALIBI: scores get -slope * |i + seqlen_k - seqlen_q - j|, slopes_ptr
    (B, H) float32 (a packed batch: one row per sequence). SPLIT_LOOPS: the consumers walk a work tile's K/V
    tiles in up to three loops, one per kind of mask (:func:`.fa3_consumer._consumer_tile`). RESCALE_EARLY: O is
    rescaled at the end of each K/V step instead of before the next P V product (:func:`.fa3_consumer._kv_steps`).
    CONVERT_P_LATE: P_{j-1} becomes the P V operand after S_j is issued (FP8's e4m3 packing) instead of before.
    EXP2_ON_FMA: of every four probabilities, how many are a polynomial on the FMA units rather than a MUFU.EX2
    (:func:`.fa3_softmax.exp2_mixed`).
    """
    BLOCK_M: gl.constexpr = ROWS_PER_CONSUMER * CONSUMERS
    if VARLEN:  # one work tile per (sequence, query tile) pair and head
        m_tiles = gl.num_programs(0) // heads
    else:
        m_tiles = gl.cdiv(seqlen_q, BLOCK_M)

    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    # O's own buffers: in FP8 (16-bit O does not fit in the e4m3 Q buffers), and in a persistent CTA where they
    # fit beside the rest, so that the next tile's Q loads while this tile's O is written and stored. Otherwise a
    # consumer's Q tile, dead after its last Q K^T, takes O.
    SEPARATE_O: gl.constexpr = FP8 or (PERSISTENT and separate_o_fits(
        CONSUMERS * q_desc.block_type.nbytes, STAGES * (k_desc.block_type.nbytes + v_desc.block_type.nbytes),
        CONSUMERS * o_desc.block_type.nbytes))
    if SEPARATE_O:
        o_bufs = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
    else:
        o_bufs = q_bufs
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=CONSUMERS)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    # (Triton passes an int argument equal to 1 as a constexpr: the work list takes tensors all the same.)
    work = WorkList(gl.to_tensor(m_tiles), gl.to_tensor(heads), gl.to_tensor(group), gl.to_tensor(seqlen_q),
                    gl.to_tensor(seqlen_k), gl.to_tensor(left), gl.to_tensor(right), schedule_ptr, cu_seqlens_q,
                    cu_seqlens_k)
    state = KernelState(q_desc, k_desc, v_desc, o_desc, o_bufs, o_ptr, lse_ptr, qk_scale, softcap_scale, slopes_ptr,
                        q_descale_ptr, k_descale_ptr, v_exponent_ptr, v_descale_max_ptr,
                        QSlot(q_bufs, q_ready, q_empty), Ring(k_bufs, k_ready, k_empty), Ring(v_bufs, v_ready, v_empty),
                        Turns(CONSUMERS), work, SPLIT_LOOPS, RESCALE_EARLY, CONVERT_P_LATE, EXP2_ON_FMA)
    # warp_specialize takes a literal list of partitions, so the two consumer counts are spelled out; the
    # constexprs stay in each argument tuple (a tuple first stored in a variable makes them runtime values).
    if CONSUMERS == 2:
        gl.warp_specialize([
            (consumer, (state, 0, CAUSAL, PINGPONG, FP8, PERSISTENT, WINDOW, VARLEN, SOFTCAP, ALIBI, SEPARATE_O)),
            (consumer, (state, 1, CAUSAL, PINGPONG, FP8, PERSISTENT, WINDOW, VARLEN, SOFTCAP, ALIBI, SEPARATE_O)),
            (producer, (state, CAUSAL, FP8, PERSISTENT, WINDOW, VARLEN)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (consumer, (state, 0, CAUSAL, PINGPONG, FP8, PERSISTENT, WINDOW, VARLEN, SOFTCAP, ALIBI, SEPARATE_O)),
            (consumer, (state, 1, CAUSAL, PINGPONG, FP8, PERSISTENT, WINDOW, VARLEN, SOFTCAP, ALIBI, SEPARATE_O)),
            (consumer, (state, 2, CAUSAL, PINGPONG, FP8, PERSISTENT, WINDOW, VARLEN, SOFTCAP, ALIBI, SEPARATE_O)),
            (producer, (state, CAUSAL, FP8, PERSISTENT, WINDOW, VARLEN)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
