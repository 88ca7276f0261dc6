"""FlashAttention-2's work partitioning as arithmetic: non-matmul FLOPs, grids, waves, causal load balance.

Everything here counts; no tensor is built. Shapes are :class:`fa_lab.iomodel.AttentionShape`
(q: (B, H, Nq, d), k, v: (B, H, Nk, d)); tiles are ``block_q`` query rows (B_r) by
``block_k`` keys (B_c). A program (a CTA on a GPU) owns one Q tile of one (batch, head)
and loops over the K/V tiles it needs.

* Non-matmul FLOPs: FA1's inner step (Algorithm 1 of the FA1 paper, as written)
  normalizes the output by the running sum l after every K/V tile; FA2 keeps an
  unnormalized accumulator, rescales it by alpha = exp(m_old - m_new) and divides
  by l once at the end. :func:`nonmatmul_flops` counts both.
* Grids and waves: FA1 launches one CTA per (batch, head); FA2 one per (Q tile, head,
  batch). :func:`waves` says how many rounds of CTAs that takes on a GPU's SMs.
* Causal load balance: under the bottom-right mask (query i sees keys
  j <= i + Nk - Nq, as :class:`fa_lab.block_info.BlockInfo` says) Q tiles need different
  numbers of K/V tiles. :func:`list_schedule` plays a launch order on S SMs.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from .block_info import BlockInfo
from .iomodel import GPU_SPECS, AttentionShape

H100_SMS = GPU_SPECS["H100"].sm_count  # 132, as on the H200 (the same GH100 die)

# ---------------------------------------------------------------- non-matmul FLOPs

# FLOPs per score of a computed tile, in both versions: row max, subtract the max, row sum
# (3) and one exponential. The softmax scale is folded into the exponent (exp2 with
# scale * log2(e)), so it costs nothing separately.
SCORE_OPS_PER_SCORE = 3
EXPS_PER_SCORE = 1
# Per query row and K/V tile. FA2: m_new = max(m, rowmax) 1, alpha = exp(m - m_new) 2,
# l = alpha * l + rowsum 2. FA1: m_new 1, exp(m - m_new) 2, exp(m~ - m_new) 2,
# l_new = a * l + b * l~ 3, the old output's factor l * exp(m - m_new) 1.
ROW_STEP_FLOPS = {"fa1": 9, "fa2": 5}
# Per accumulator element (row x head_dim) and K/V tile. FA2: acc *= alpha (the + P V is
# the tensor cores' accumulate). FA1: factor * O, exp(m~ - m_new) * (P V), their sum.
RESCALE_STEP_FLOPS = {"fa1": 3, "fa2": 1}
# Per row, once per Q tile at the end: FA2 writes lse = m + log(l); FA1 stores m and l as they are.
ROW_END_FLOPS = {"fa1": 0, "fa2": 2}


def nonmatmul_flops(shape: AttentionShape, block_q: int = 128, block_k: int = 128,
                    deferred_rescale: bool = True) -> dict[str, int]:
    """Non-matmul FLOPs of the forward, summed over batch and heads, by kind.

    Counted per computed tile of block_q x block_k scores (a kernel computes whole
    tiles, masked ones too), so a ragged edge counts as a full tile. Causal skips
    the tiles that :func:`tile_kind` calls "skipped" (the mask's own compare-and-select
    on diagonal tiles is left out, as it is the same in both). ``deferred_rescale`` picks
    FA2 (True) or FA1 (False). Keys: "scores: max, subtract, sum", "scores: exp",
    "row statistics m, l", "output: rescale", "output: divide by l"; FLOPs.
    """
    version = "fa2" if deferred_rescale else "fa1"
    work = kv_tiles_per_cta(shape.seqlen_q, shape.seqlen_k, block_q, block_k, shape.causal)
    steps, q_tiles = sum(work), len(work)  # (Q tile, K/V tile) pairs computed; Q tiles, per head
    scores, outputs = steps * block_q * block_k, block_q * shape.head_dim
    divides = q_tiles * outputs if deferred_rescale else steps * outputs  # once per Q tile vs every step
    per_head = {
        "scores: max, subtract, sum": SCORE_OPS_PER_SCORE * scores,
        "scores: exp": EXPS_PER_SCORE * scores,
        "row statistics m, l": (ROW_STEP_FLOPS[version] * steps + ROW_END_FLOPS[version] * q_tiles) * block_q,
        "output: rescale": RESCALE_STEP_FLOPS[version] * steps * outputs,
        "output: divide by l": divides,
    }
    return {kind: flops * shape.heads_total for kind, flops in per_head.items()}


def computed_matmul_flops(shape: AttentionShape, block_q: int = 128, block_k: int = 128) -> int:
    """Tensor-core FLOPs the kernel executes: 4·block_q·block_k·d per computed tile, all heads.

    This exceeds :func:`fa_lab.iomodel.attention_flops` (the FA3 convention, causal
    halved) by the masked halves of diagonal tiles and the padding of ragged tiles.
    """
    work = kv_tiles_per_cta(shape.seqlen_q, shape.seqlen_k, block_q, block_k, shape.causal)
    return 4 * block_q * block_k * shape.head_dim * sum(work) * shape.heads_total


# ---------------------------------------------------------------- grids and waves

def grid(shape: AttentionShape, block_q: int = 128, split_seqlen: bool = True) -> tuple[int, ...]:
    """The launch grid: FA2's (ceil(Nq / block_q), heads, batch), or FA1's (batch, heads).

    FA1 gives each (batch, head) one CTA that loops over all of its Q tiles;
    FA2 (``split_seqlen``) gives every Q tile its own CTA.
    """
    if split_seqlen:
        return (math.ceil(shape.seqlen_q / block_q), shape.heads, shape.batch)
    return (shape.batch, shape.heads)


@dataclass(frozen=True)
class Waves:
    """How ``ctas`` equal CTAs run on ``slots`` = SMs x CTAs per SM.

    sms_busy: SMs that get at least one CTA; count: rounds of CTAs (ceil(ctas / slots));
    last_wave_fill: fraction of the slots that the last round uses (1.0 when full);
    efficiency: ctas / (count x slots), the busy fraction of the SM time the launch
    holds when every CTA takes the same time.
    """

    ctas: int
    slots: int
    sms_busy: int
    count: int
    last_wave_fill: float
    efficiency: float


def waves(ctas: int, sm_count: int = H100_SMS, ctas_per_sm: int = 1) -> Waves:
    """Waves of ``ctas`` equal CTAs on ``sm_count`` SMs holding ``ctas_per_sm`` each (the occupancy)."""
    if ctas < 1 or sm_count < 1 or ctas_per_sm < 1:
        raise ValueError(f"ctas, sm_count and ctas_per_sm must be >= 1, got {ctas}, {sm_count}, "
                         f"{ctas_per_sm}")
    slots = sm_count * ctas_per_sm
    count = math.ceil(ctas / slots)
    last = ctas - (count - 1) * slots
    return Waves(ctas, slots, min(ctas, sm_count), count, last / slots, ctas / (count * slots))


# ---------------------------------------------------------------- causal tiles

def tile_kind(q_tile: int, kv_tile: int, seqlen_q: int, seqlen_k: int, block_q: int, block_k: int) -> str:
    """"full", "masked" or "skipped": tile (q_tile, kv_tile) under the bottom-right causal mask.

    Only the part inside the (Nq, Nk) matrix counts: "full" when every query of it
    sees every key of it, "skipped" when none sees any, "masked" otherwise
    (:meth:`fa_lab.block_info.BlockInfo.tile_kind`).
    """
    q0, k0 = q_tile * block_q, kv_tile * block_k
    return BlockInfo(seqlen_q, seqlen_k, causal=True).tile_kind(q0, q0 + block_q, k0, k0 + block_k)


def tile_map(seqlen_q: int, seqlen_k: int, block_q: int, block_k: int,
             causal: bool = True) -> list[list[str]]:
    """Kinds of all tiles: [q_tile][kv_tile] -> "full" / "masked" / "skipped" (all "full" without causal)."""
    rows, cols = math.ceil(seqlen_q / block_q), math.ceil(seqlen_k / block_k)
    if not causal:
        return [["full"] * cols for _ in range(rows)]
    return [[tile_kind(i, j, seqlen_q, seqlen_k, block_q, block_k) for j in range(cols)] for i in range(rows)]


def tile_counts(seqlen_q: int, seqlen_k: int, block_q: int, block_k: int,
                causal: bool = True) -> dict[str, int]:
    """How many tiles of one head are "full", "masked" and "skipped"."""
    kinds = [kind for row in tile_map(seqlen_q, seqlen_k, block_q, block_k, causal) for kind in row]
    return {kind: kinds.count(kind) for kind in ("full", "masked", "skipped")}


def kv_tiles_per_cta(seqlen_q: int, seqlen_k: int, block_q: int, block_k: int,
                     causal: bool = True) -> list[int]:
    """K/V tiles that each Q tile's program computes (full + masked), one entry per Q tile of a head."""
    return [sum(kind != "skipped" for kind in row)
            for row in tile_map(seqlen_q, seqlen_k, block_q, block_k, causal)]


def load_imbalance(work: list[float]) -> float:
    """max / mean of per-CTA work: 1.0 when balanced, about 2 for a square causal head."""
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


# ---------------------------------------------------------------- launch orders and scheduling

LAUNCH_ORDERS = ("natural", "reversed", "heaviest first")


def launch_order(work: list[float], programs: int, order: str = "natural") -> list[float]:
    """Per-CTA work of a whole grid in the order the GPU dispatches it.

    ``work``: per Q tile of one head (:func:`kv_tiles_per_cta`); ``programs``: batch x heads.
    The grid is (Q tiles, batch x heads) with the Q tile index fastest, as in
    :mod:`fa_lab.kernels.portable.forward`. "natural": each head's Q tiles from the top
    (lightest first under causal); "reversed": each head's Q tiles from the bottom,
    what the Triton kernel's REVERSE_GRID does; "heaviest first": every CTA of the grid
    sorted by work, largest first (longest-processing-time-first, LPT).
    """
    if order == "natural":
        return list(work) * programs
    if order == "reversed":
        return list(reversed(work)) * programs
    if order == "heaviest first":
        return sorted(list(work) * programs, reverse=True)
    raise ValueError(f"order must be one of {LAUNCH_ORDERS}, got {order!r}")


@dataclass(frozen=True)
class Schedule:
    """A list schedule: CTA c (in launch order) runs on slot[c] from start[c] to end[c].

    Times are in the unit of the durations (here: K/V tiles). makespan: when the last
    CTA ends; lower_bound: max(total work / slots, longest CTA), what no order can beat;
    utilisation: total work / (makespan x slots).
    """

    start: list[float]
    end: list[float]
    slot: list[int]
    slots: int

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)

    @property
    def busy(self) -> float:
        return sum(e - s for s, e in zip(self.start, self.end, strict=True))

    @property
    def lower_bound(self) -> float:
        return max(self.busy / self.slots, max((e - s for s, e in zip(self.start, self.end, strict=True)),
                                               default=0.0))

    @property
    def utilisation(self) -> float:
        return self.busy / (self.makespan * self.slots) if self.makespan else 1.0


def list_schedule(durations: list[float], slots: int = H100_SMS) -> Schedule:
    """Greedy list scheduling: each CTA, in launch order, starts on the slot that frees first.

    This is how a GPU's block scheduler hands out a grid larger than the machine: a
    CTA is dispatched as soon as an SM has room. Ties go to the lowest slot index.
    durations: per CTA, any time unit; slots: SMs x CTAs per SM.
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    free = [(0.0, index) for index in range(slots)]  # (time the slot frees, slot index), a min-heap
    start, end, slot = [], [], []
    for duration in durations:
        time, index = heapq.heappop(free)
        start.append(time)
        end.append(time + duration)
        slot.append(index)
        heapq.heappush(free, (time + duration, index))
    return Schedule(start, end, slot, slots)


def busy_over_time(schedule: Schedule) -> tuple[list[float], list[int]]:
    """The number of busy slots as a step function: (times, busy), busy[i] holding from times[i] on."""
    events: dict[float, int] = {}
    for s, e in zip(schedule.start, schedule.end, strict=True):
        if e > s:
            events[s] = events.get(s, 0) + 1
            events[e] = events.get(e, 0) - 1
    times, busy, running = [], [], 0
    for time in sorted(events):
        running += events[time]
        times.append(time)
        busy.append(running)
    return times, busy


def simulate_grid(shape: AttentionShape, block_q: int = 128, block_k: int = 128, order: str = "natural",
                  sm_count: int = H100_SMS, ctas_per_sm: int = 1, cta_overhead: float = 0.0) -> Schedule:
    """List-schedule FA2's grid for ``shape`` in ``order`` on ``sm_count`` SMs.

    A CTA takes as long as its K/V tiles plus ``cta_overhead`` (its fixed cost: loading
    Q, filling the pipeline, writing O), all in units of one K/V tile's time.
    """
    work = kv_tiles_per_cta(shape.seqlen_q, shape.seqlen_k, block_q, block_k, shape.causal)
    durations = [tiles + cta_overhead for tiles in launch_order(work, shape.heads_total, order)]
    return list_schedule(durations, sm_count * ctas_per_sm)


# ---------------------------------------------------------------- warp partitioning

def split_k_reduction_bytes(block_q: int = 128, head_dim: int = 128, warps: int = 4,
                            acc_bytes: int = 4) -> dict[str, int]:
    """Shared-memory bytes per K/V tile that FA1's split-K warp partitioning spends on reductions.

    Each of ``warps`` warps holds block_k / warps keys of the tile, so each computes a
    partial score block (block_q, block_k / warps) and a partial output
    (block_q, head_dim) in fp32 (``acc_bytes``). Per tile: every warp writes its row
    maxima, row sums and partial output to shared memory, and every warp reads the
    statistics of all warps plus its share of the rows of every partial output. Split-Q
    (FA2: each warp owns block_q / warps rows and sees all keys) needs none of it.
    """
    statistics = 2 * block_q * acc_bytes  # row max and row sum of one warp
    partial_output = block_q * head_dim * acc_bytes
    return {
        "row statistics written": warps * statistics,
        "row statistics read": warps * warps * statistics,
        "partial outputs written": warps * partial_output,
        "partial outputs read": warps * partial_output,
    }
