"""What the Gluon FA3 kernel's partitions share, as named aggregates.

The kernel entry allocates the shared memory and the mbarriers once and hands every partition one
:class:`KernelState`: the descriptors, the K and V rings (:class:`Ring`, the Gluon tutorials'
channel), the Q slot, the ping-pong turns and the work list. The ring arithmetic (which slot a
tile uses, which phase its barriers complete) lives in :func:`ring_slot` and :func:`ring_phase` only.

(No ``from __future__ import annotations`` here: an aggregate checks its fields against the annotations.)
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.core import _aggregate as aggregate  # Triton 3.6's Gluon aggregate (its tutorials use it so)

from .block_range import tile_plan, window_tile_plan
from .fa3_config import ROWS_PER_CONSUMER


@gluon.jit
def ring_slot(count, STAGES: gl.constexpr):
    """The slot of the count-th tile through a ring of STAGES slots: tiles take the slots in turn."""
    return count % STAGES


@gluon.jit
def ring_phase(count, STAGES: gl.constexpr):
    """The phase in which the count-th tile's barriers complete: a slot's barriers complete once per lap."""
    return (count // STAGES) & 1


@gluon.jit
def wait_until_empty(empty_bar, phase):
    """Producer: wait until the consumers have released a slot whose barriers are in ``phase``."""
    # A fresh mbarrier counts as having completed the phase before phase 0, so the first lap's waits pass at once.
    mbarrier.wait(empty_bar, phase ^ 1)


@aggregate
class Ring:
    """STAGES tiles of shared memory, each with a ``ready`` mbarrier (its TMA copy completes it, counting
    bytes) and an ``empty`` one (every consumer arrives once it no longer reads the tile).

    bufs: (STAGES, 1, 1, rows, cols); ready, empty: (STAGES, 1). Tiles are numbered by ``count``, the
    tiles through the ring so far (this CTA's K/V tiles, across its work tiles); :meth:`at` gives
    tile count's place.
    """
    bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, bufs, ready, empty):
        self.bufs = bufs
        self.ready = ready
        self.empty = empty

    @gluon.jit
    def at(self, count):
        """The RingTile of tile ``count``."""
        return RingTile(self, ring_slot(count, self.bufs.type.shape[0]), count)


@aggregate
class RingTile:
    """The count-th tile through a Ring: its slot, and (from count) the phase its barriers complete in.
    slot and count are constexprs where the count is (a launch with one work tile per CTA)."""
    ring: Ring
    slot: gl.tensor | gl.constexpr
    count: gl.tensor | gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ring, slot, count):
        self.ring = ring
        # (a constexpr_function receives constexprs unwrapped: wrap them back)
        self.slot = slot if isinstance(slot, gl.tensor) else gl.constexpr(slot)
        self.count = count if isinstance(count, gl.tensor) else gl.constexpr(count)

    @gluon.jit
    def fill(self, desc, coords):
        """Producer: once the slot is free, copy desc's block at ``coords`` into it."""
        phase = ring_phase(self.count, self.ring.bufs.type.shape[0])
        wait_until_empty(self.ring.empty.index(self.slot), phase)
        mbarrier.expect(self.ring.ready.index(self.slot), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, coords, self.ring.ready.index(self.slot), self.ring.bufs.index(self.slot))

    @gluon.jit
    def wait_ready(self):
        """Consumer: wait until the tile has arrived."""
        mbarrier.wait(self.ring.ready.index(self.slot), ring_phase(self.count, self.ring.bufs.type.shape[0]))

    @gluon.jit
    def buf(self):
        """The tile's buffer (1, 1, rows, cols)."""
        return self.ring.bufs.index(self.slot)

    @gluon.jit
    def release(self):
        """Consumer: done with the tile (the producer refills its slot once every consumer is)."""
        mbarrier.arrive(self.ring.empty.index(self.slot))


@aggregate
class QSlot:
    """Every consumer's Q rows of the current work tile: a ring of one slot, taken once per work tile.

    bufs: (CONSUMERS, 1, 1, 64, d), consumer c's rows in bufs[c]; ready: one mbarrier (the TMA copies
    complete it); empty: one mbarrier (every consumer arrives once it no longer reads its rows).
    ``local`` numbers this CTA's work tiles.
    """
    bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, bufs, ready, empty):
        self.bufs = bufs
        self.ready = ready
        self.empty = empty

    @gluon.jit
    def fill(self, local, desc, batch, head, start_m):
        """Producer: once the consumers have released the Q buffers, copy the rows [start_m, +64 * CONSUMERS)."""
        CONSUMERS: gl.constexpr = self.bufs.type.shape[0]
        wait_until_empty(self.empty, ring_phase(local, 1))
        mbarrier.expect(self.ready, CONSUMERS * desc.block_type.nbytes)
        for c in gl.static_range(CONSUMERS):
            tma.async_copy_global_to_shared(desc, [batch, head, start_m + c * ROWS_PER_CONSUMER, 0], self.ready,
                                            self.bufs.index(c))

    @gluon.jit
    def wait_ready(self, local):
        """Consumer: wait until work tile local's Q has arrived."""
        mbarrier.wait(self.ready, ring_phase(local, 1))

    @gluon.jit
    def release(self):
        """Consumer: done with this work tile's Q rows (and, without separate O buffers, with the O stored from
        them)."""
        mbarrier.arrive(self.empty)


# The hardware named barriers of the ping-pong turns: consumer c waits on TURN_BARRIER + c. (Triton's warp
# specialization takes the low ids for its partitions' own barriers; sm_90 has 16.)
TURN_BARRIER = gl.constexpr(12)


@aggregate
class Turns:
    """PINGPONG: consumer c issues a K/V step's WGMMAs once consumer c - 1 has issued its own, through hardware
    named barriers as FA3 does (its warp-scheduler barriers), not mbarriers: consumer c's turn is barrier
    TURN_BARRIER + c completing with 256 threads, its own 128 (``bar.sync``) and the previous consumer's 128
    (``bar.arrive``, which does not wait). Nothing in shared memory, no polling, and no warpgroup barrier
    before an elected thread's arrive (an mbarrier arrive costs one). The last consumer gives consumer 0 its
    first turn as it starts (:meth:`start`)."""
    consumers: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, consumers):
        self.consumers = gl.constexpr(consumers)

    @gluon.jit
    def start(self, CONSUMER: gl.constexpr):
        """At a consumer's start: the last one passes the first turn to consumer 0."""
        if CONSUMER == self.consumers - 1:
            self.pass_on(CONSUMER)

    @gluon.jit
    def wait(self, CONSUMER: gl.constexpr):
        """Wait for CONSUMER's turn (once per K/V step)."""
        named_barrier("bar.sync", TURN_BARRIER + CONSUMER)

    @gluon.jit
    def pass_on(self, CONSUMER: gl.constexpr):
        """Give the next consumer its turn."""
        named_barrier("bar.arrive", TURN_BARRIER + (CONSUMER + 1) % self.consumers)


@gluon.jit
def named_barrier(INSTRUCTION: gl.constexpr, barrier):
    """``bar.sync`` or ``bar.arrive`` on named barrier ``barrier`` (an int, or an int32 computed at run time) for
    two consumer warpgroups (256 threads), executed once by every thread of the calling warpgroup: inline PTX on one
    value a thread (the barrier id), declared impure so that it keeps its place among the kernel's other side
    effects (the WGMMAs, the mbarrier waits)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ids = gl.full([128], 0, gl.int32, layout) + barrier
    gl.inline_asm_elementwise(INSTRUCTION + " $1, 256;\n mov.b32 $0, $1;", "=r,r", [ids], dtype=gl.int32,
                              is_pure=False, pack=1)


@aggregate
class WorkTile:
    """One work tile: BLOCK_M query rows from start_m of one sequence and head, which read K/V head kv_head
    (head // group), and its K/V loop: n_iter tiles from tile ``first``, masked before tile full_begin and
    from tile first_masked on (:func:`.block_range.tile_plan`; with a window
    :func:`.block_range.window_tile_plan`; without one, first = full_begin = 0).

    seq: the sequence (the batch index; in a packed batch, the index into cu_seqlens); batch: the
    descriptors' batch coordinate (seq, or 0 in a packed batch, whose descriptors see (1, heads, total, d));
    q_offset, k_offset: the sequence's first row in the descriptors' token dimension (0 unpacked);
    seqlen_q, seqlen_k: its lengths; pid_bh = seq * heads + head; lse_offset: where its row 0's LSE goes.
    """
    seq: gl.tensor
    batch: gl.tensor
    head: gl.tensor
    kv_head: gl.tensor
    pid_bh: gl.tensor
    start_m: gl.tensor
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    q_offset: gl.tensor
    k_offset: gl.tensor
    lse_offset: gl.tensor
    first: gl.tensor
    n_iter: gl.tensor
    full_begin: gl.tensor
    first_masked: gl.tensor

    @gluon.constexpr_function
    def __init__(self, seq, batch, head, kv_head, pid_bh, start_m, seqlen_q, seqlen_k, q_offset, k_offset,
                 lse_offset, first, n_iter, full_begin, first_masked):
        self.seq = seq
        self.batch = batch
        self.head = head
        self.kv_head = kv_head
        self.pid_bh = pid_bh
        self.start_m = start_m
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.q_offset = q_offset
        self.k_offset = k_offset
        self.lse_offset = lse_offset
        self.first = first
        self.n_iter = n_iter
        self.full_begin = full_begin
        self.first_masked = first_masked


@aggregate
class WorkList:
    """The work tiles of the launch: m_tiles query tiles per (batch, head), and in a persistent launch
    each CTA's share of them (schedule_ptr: int32, see tile_schedule.schedule_tensor; unused otherwise).
    group: query heads per K/V head (grouped-query attention; 1 for MHA); left, right: the window's
    bounds (``BlockInfo.window_bounds``; read only with WINDOW).

    A packed batch (VARLEN): schedule_ptr holds m_tiles (sequence, first row) pairs
    (``varlen_schedule``, longest first, or ``DeviceTiles.schedule``, built on the device in sequence order),
    each computed for every head; seqlen_q is the packed total of
    query rows (the LSE's row length), seqlen_k unused; cu_seqlens_q/k: int32 (batch + 1,) offsets
    (read only with VARLEN)."""
    m_tiles: gl.tensor
    heads: gl.tensor
    group: gl.tensor
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    left: gl.tensor
    right: gl.tensor
    schedule_ptr: gl.tensor
    cu_seqlens_q: gl.tensor
    cu_seqlens_k: gl.tensor

    @gluon.constexpr_function
    def __init__(self, m_tiles, heads, group, seqlen_q, seqlen_k, left, right, schedule_ptr, cu_seqlens_q,
                 cu_seqlens_k):
        self.m_tiles = m_tiles
        self.heads = heads
        self.group = group
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.left = left
        self.right = right
        self.schedule_ptr = schedule_ptr
        self.cu_seqlens_q = cu_seqlens_q
        self.cu_seqlens_k = cu_seqlens_k

    @gluon.jit
    def cta_tiles(self):
        """(first, last, tiles_ptr): this CTA computes the tiles tiles_ptr[first:last]."""
        cta = gl.program_id(0)
        return (gl.load(self.schedule_ptr + cta), gl.load(self.schedule_ptr + cta + 1),
                self.schedule_ptr + gl.num_programs(0) + 1)

    @gluon.jit
    def tile(self, tile_id, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
             WINDOW: gl.constexpr, VARLEN: gl.constexpr = False):
        """The WorkTile numbered ``tile_id``.

        The m_tiles query tiles of one (batch, head) are consecutive (its K and V stay in L2 while they
        run); with causal masking the longest rows come first, so that the short ones fill the tail.
        (tile_schedule.encode_tile is the inverse on the host.) In a packed batch tile_id is
        head * m_tiles + entry: a head's tiles of every sequence, longest first, then the next head's
        (a head's K and V of the whole batch stay in L2 while they run).
        """
        if VARLEN:
            entry = tile_id % self.m_tiles
            head = tile_id // self.m_tiles
            seq = gl.load(self.schedule_ptr + 2 * entry)
            start_m = gl.load(self.schedule_ptr + 2 * entry + 1)
            q_offset = gl.load(self.cu_seqlens_q + seq)
            k_offset = gl.load(self.cu_seqlens_k + seq)
            seqlen_q = gl.load(self.cu_seqlens_q + seq + 1) - q_offset
            seqlen_k = gl.load(self.cu_seqlens_k + seq + 1) - k_offset
            batch = gl.to_tensor(0)
            lse_offset = head * self.seqlen_q + q_offset
        else:
            pid_m = tile_id % self.m_tiles
            if CAUSAL:
                pid_m = self.m_tiles - 1 - pid_m
            pid_bh = tile_id // self.m_tiles
            start_m = pid_m * BLOCK_M
            seq = pid_bh // self.heads
            head = pid_bh % self.heads
            seqlen_q = self.seqlen_q
            seqlen_k = self.seqlen_k
            q_offset = gl.to_tensor(0)
            k_offset = gl.to_tensor(0)
            batch = seq
            lse_offset = pid_bh * seqlen_q
        if WINDOW:
            first, n_iter, full_begin, first_masked = window_tile_plan(start_m, seqlen_q, seqlen_k, self.left,
                                                                       self.right, BLOCK_M=BLOCK_M,
                                                                       BLOCK_N=BLOCK_N)
        else:
            n_iter, first_masked = tile_plan(start_m, seqlen_q, seqlen_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                             CAUSAL=CAUSAL)
            first = gl.to_tensor(0)
            full_begin = gl.to_tensor(0)
        return WorkTile(seq, batch, head, head // self.group, seq * self.heads + head, start_m, seqlen_q, seqlen_k,
                        q_offset, k_offset, lse_offset, first, n_iter, full_begin, first_masked)


@aggregate
class KernelState:
    """What every partition of one CTA shares (built once by the kernel entry).

    q/k/v/o_desc: the kernel's TMA descriptors; o_bufs: (CONSUMERS, 1, 1, 64, d) where each consumer stages
    its O tile; o_ptr: O itself (a packed batch stores a sequence's last, partial tile through it, row by
    row: a TMA store would run into the next sequence); lse_ptr: (B, H, Nq), or (H, total_q) packed, float32;
    qk_scale = scale * log2(e), or softcap * log2(e) with a soft cap; softcap_scale = scale / softcap
    (read only with SOFTCAP); slopes_ptr: ALiBi's (B, H) float32 slopes (read only with ALIBI);
    q_descale_ptr, k_descale_ptr, v_exponent_ptr, v_descale_max_ptr: the FP8 descales (see the kernel
    entry; unread in bf16); split_loops: the consumers walk their K/V tiles in three loops, one per kind of mask
    (:func:`.fa3_consumer._consumer_tile`); rescale_early: a consumer rescales O to step j's maximum at the end of
    step j, once P_{j-1} V_{j-1} is done, instead of just before it issues P_j V_j (:func:`.fa3_consumer._kv_steps`);
    convert_p_late: a consumer turns P_{j-1} into the P V product's operand after issuing S_j instead of before
    (FP8's packing to e4m3; a no-op for 16-bit P); exp2_on_fma: of every four probabilities, how many a consumer
    computes on the FMA units instead of the MUFU (:func:`.fa3_softmax.exp2_mixed`).
    """
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    o_desc: tma.tensor_descriptor
    o_bufs: gl.shared_memory_descriptor
    o_ptr: gl.tensor
    lse_ptr: gl.tensor
    qk_scale: gl.tensor
    softcap_scale: gl.tensor
    slopes_ptr: gl.tensor
    q_descale_ptr: gl.tensor
    k_descale_ptr: gl.tensor
    v_exponent_ptr: gl.tensor
    v_descale_max_ptr: gl.tensor
    q: QSlot
    k: Ring
    v: Ring
    turns: Turns
    work: WorkList
    split_loops: gl.constexpr
    rescale_early: gl.constexpr
    convert_p_late: gl.constexpr
    exp2_on_fma: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, v_desc, o_desc, o_bufs, o_ptr, lse_ptr, qk_scale, softcap_scale, slopes_ptr,
                 q_descale_ptr, k_descale_ptr, v_exponent_ptr, v_descale_max_ptr, q, k, v, turns, work,
                 split_loops=False, rescale_early=False, convert_p_late=False, exp2_on_fma=0):
        self.q_desc = q_desc
        self.k_desc = k_desc
        self.v_desc = v_desc
        self.o_desc = o_desc
        self.o_bufs = o_bufs
        self.o_ptr = o_ptr
        self.lse_ptr = lse_ptr
        self.qk_scale = qk_scale
        self.softcap_scale = softcap_scale
        self.slopes_ptr = slopes_ptr
        self.q_descale_ptr = q_descale_ptr
        self.k_descale_ptr = k_descale_ptr
        self.v_exponent_ptr = v_exponent_ptr
        self.v_descale_max_ptr = v_descale_max_ptr
        self.q = q
        self.k = k
        self.v = v
        self.turns = turns
        self.work = work
        self.split_loops = gl.constexpr(split_loops)
        self.rescale_early = gl.constexpr(rescale_early)
        self.convert_p_late = gl.constexpr(convert_p_late)
        self.exp2_on_fma = gl.constexpr(exp2_on_fma)
