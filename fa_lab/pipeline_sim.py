"""A discrete-event model of FlashAttention-3's forward pipeline on one Hopper SM.

An SM runs one CTA at a time. A CTA has ``consumers`` warpgroups, each with its own
Q tile of ``block_m`` rows, that share the ``n_kv = ceil(N / block_n)`` K/V tiles of
one (batch, head). Per K/V tile j and consumer warpgroup, the tasks and their costs:

    load K_j, load V_j        TMA copy engine         tile bytes / the SM's share of HBM bandwidth
    gemm0: S = Q K_j^T        tensor cores            2·block_m·block_n·d / (SM peak · tensor_efficiency)
    softmax_j (max, exp,      the warpgroup's warps   (exps / SM MUFU rate + 3.5 ALU ops per score /
      sum, scale, convert)      (MUFU and ALU)          SM FP32 rate) / softmax_efficiency
    rescale_j: O *= e^(m-m')  the warpgroup's warps   block_m·d ALU ops / same rate
    gemm1: O += P_j V_j       tensor cores            as gemm0
    wait, barrier             the warpgroup's warps   sync_s each (wgmma wait, mbarrier, named barrier)

The TMA engine and the tensor cores serve the whole SM, one task at a time (a
warpgroup's WGMMA uses all four tensor cores). MUFU/ALU work is modelled per
warpgroup: a warpgroup's softmax is a dependent chain (row max, exp, row sum) that
leaves the SM's MUFU pipes mostly idle, so two warpgroups' softmaxes overlap.
``Result.utilisation["mufu"]``, the load on the shared MUFU pipes, must stay below 1
for that assumption to hold.

A schedule is a program each warpgroup issues in order; :class:`_Program` compiles
it into a task graph and :func:`run_tasks` runs it: a task starts once its inputs
are done and its unit is free, and a unit serves ready tasks first come, first
served. CTA time x waves over 132 SMs gives the time and TFLOP/s of a whole forward.

Where such a model stops being right: see :mod:`fa_lab.pipeline_fit`.
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, replace

from .iomodel import GPU_SPECS, AttentionShape, attention_flops

H100_MUFU_OPS = 3.9e12  # exponentials/s of an H100 SXM5, as the FA3 paper quotes it


@dataclass(frozen=True)
class SMRates:
    """One SM's share of a GPU's peak rates, per second."""

    tensor_flops: float  # dense fp16/bf16 tensor-core FLOP/s
    mufu_ops: float  # exponentials/s
    alu_ops: float  # FP32 instructions/s summed over lanes (an FMA counts once)
    load_bytes: float  # bytes/s from memory: the SM's share of HBM bandwidth
    num_sms: int

    @classmethod
    def from_gpu(cls, gpu: str = "H100", mufu_ops: float = H100_MUFU_OPS, dtype: str = "fp16") -> SMRates:
        """Rates of one SM of ``fa_lab.iomodel.GPU_SPECS[gpu]``; ``mufu_ops`` is for the whole GPU."""
        spec = GPU_SPECS[gpu]
        n = spec.sm_count
        return cls(spec.peak_tflops(dtype) * 1e12 / n, mufu_ops / n, spec.fp32_tflops * 1e12 / 2 / n,
                   spec.hbm_tb_s * 1e12 / n, n)


H100 = SMRates.from_gpu("H100")


@dataclass(frozen=True)
class CostParams:
    """The model's free parameters, fitted by :func:`fa_lab.pipeline_fit.calibrate`.

    tensor_efficiency: fraction of the SM's tensor-core peak a GEMM runs at.
    softmax_efficiency: fraction of its MUFU + ALU instruction bound a warpgroup's softmax runs at.
    sync_s: seconds one wait or barrier costs on a warpgroup's critical path.
    """

    tensor_efficiency: float
    softmax_efficiency: float
    sync_s: float


# fa_lab.pipeline_fit.calibrate() on the FA3 paper's ablation, rounded (residuals under 0.5%).
H100_FIT = CostParams(tensor_efficiency=0.690, softmax_efficiency=0.413, sync_s=31e-9)


@dataclass(frozen=True)
class Schedule:
    """How one CTA overlaps its work.

    consumers: warpgroups doing GEMMs and softmax, each with its own Q tile of block_m rows.
    producer: warp specialization: a producer warp keeps a circular buffer of ``stages`` K and
        ``stages`` V slots full. Without it, the consumers refill the slots themselves after a
        barrier of all consumers at the end of every iteration.
    pingpong: named barriers hand the tensor cores to one consumer's GEMMs at a time, in turn.
        Without them nothing staggers the consumers: they run the same code on the same K/V
        stages in step (each issues iteration j's GEMMs once all have finished iteration j-1),
        and their WGMMAs interleave on the tensor cores ``gemm_slices`` k-steps at a time.
    intra_depth: the GEMM-softmax pipeline inside a warpgroup. 0: synchronous (each load and
        GEMM is waited for at once; one consumer, no producer). 1: none (softmax_j waits
        behind gemm1_{j-1}). 2: FA3's two stages (gemm0_j is issued before gemm1_{j-1}, so
        softmax_j overlaps gemm1_{j-1}). 3: three stages (gemm0_{j+1} is issued in iteration j).
    gemm_slowdown: factor on every GEMM's time, the price of register pressure (a smaller or
        spilling WGMMA tile). The model allocates no registers, so this is given, not derived.
    """

    name: str
    consumers: int = 2
    producer: bool = True
    pingpong: bool = True
    intra_depth: int = 2
    stages: int = 2
    block_m: int = 128
    block_n: int = 128
    gemm_slices: int = 8
    gemm_slowdown: float = 1.0

    def __post_init__(self):
        for field in ("consumers", "stages", "block_m", "block_n", "gemm_slices"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Schedule.{field} must be a positive int, got {value!r}")
        if not self.gemm_slowdown >= 1.0:
            raise ValueError(f"Schedule.gemm_slowdown must be >= 1.0, got {self.gemm_slowdown!r}")
        if self.intra_depth not in (0, 1, 2, 3):
            raise ValueError(f"Schedule.intra_depth must be 0, 1, 2 or 3, got {self.intra_depth!r}")
        if self.intra_depth == 0 and (self.consumers != 1 or self.producer or self.pingpong):
            raise ValueError("the synchronous schedule (intra_depth=0) needs consumers=1, producer=False "
                             f"and pingpong=False; got {self}")
        if self.intra_depth == 3 and not self.producer and self.stages < 2:
            raise ValueError("a 3-stage pipeline without a producer needs stages >= 2 (gemm0_{j+1} needs "
                             f"K_{{j+1}} while K_j holds the only slot); got stages={self.stages}")


FA3 = Schedule("FA3: warp spec. + ping-pong + 2-stage pipelining")
SYNCHRONOUS = Schedule("synchronous (FA2-style)", consumers=1, producer=False, pingpong=False, intra_depth=0)
NO_PIPELINING = replace(FA3, name="warp spec. + ping-pong, no GEMM-softmax pipelining", intra_depth=1)
NO_WARP_SPECIALIZATION = replace(FA3, name="GEMM-softmax pipelining, no warp spec.", producer=False,
                                 pingpong=False)
FA3_NO_PINGPONG = replace(FA3, name="FA3 without ping-pong", pingpong=False)
# A third stage keeps one more S tile in registers: the paper's kernel had to shrink its tile
# and the compiler did not overlap the second WGMMA. The paper gives no figure for that cost;
# 5% slower GEMMs here are an illustration.
FA3_THREE_STAGE = replace(FA3, name="FA3 with a 3-stage pipeline (GEMMs 5% slower)", intra_depth=3,
                          gemm_slowdown=1.05)
SCHEDULES = (SYNCHRONOUS, NO_PIPELINING, NO_WARP_SPECIALIZATION, FA3, FA3_NO_PINGPONG, FA3_THREE_STAGE)

# The FA3 paper's ablation: FP16, non-causal, batch 4, seqlen 8448, 16 heads, head_dim 128.
ABLATION_SHAPE = AttentionShape(batch=4, heads=16, seqlen_q=8448, head_dim=128, dtype="fp16")


@dataclass(frozen=True)
class TileCosts:
    """Seconds each task takes on its unit, for one block_m x block_n tile of one warpgroup."""

    gemm: float  # gemm0 and gemm1 alike: 2·block_m·block_n·d FLOPs each
    softmax: float
    rescale: float
    finalize: float  # O /= l and the conversion to fp16 at the end
    load_q: float
    load_kv: float  # one K or one V tile
    store_o: float
    sync: float

    @classmethod
    def of(cls, schedule: Schedule, params: CostParams, head_dim: int, rates: SMRates = H100,
           element_bytes: int = 2) -> TileCosts:
        m, n, d = schedule.block_m, schedule.block_n, head_dim
        # Per score: one exp on the MUFU; max, scale-and-subtract (an FFMA), sum and half a
        # packed fp32 -> fp16 convert on the ALU.
        softmax = (m * n / rates.mufu_ops + 3.5 * m * n / rates.alu_ops) / params.softmax_efficiency
        o_tile = m * d / rates.alu_ops / params.softmax_efficiency
        gemm_flops = 2 * m * n * d * schedule.gemm_slowdown
        return cls(gemm=gemm_flops / (rates.tensor_flops * params.tensor_efficiency), softmax=softmax,
                   rescale=o_tile, finalize=1.5 * o_tile, load_q=m * d * element_bytes / rates.load_bytes,
                   load_kv=n * d * element_bytes / rates.load_bytes,
                   store_o=m * d * element_bytes / rates.load_bytes, sync=params.sync_s)


# ---------------------------------------------------------------- the event engine


def run_tasks(units, durations, deps) -> tuple[list[float], list[float]]:
    """Run a task graph: task i needs ``units[i]`` for ``durations[i]`` after every task in ``deps[i]``.

    A unit runs one task at a time and serves ready tasks by (time they became ready,
    index). Returns (starts, ends). Raises ValueError when some task can never run.
    """
    n = len(units)
    missing = [len(d) for d in deps]
    dependents = [[] for _ in range(n)]
    for i, task_deps in enumerate(deps):
        for d in task_deps:
            dependents[d].append(i)
    queues = {unit: [] for unit in units}
    busy = dict.fromkeys(queues, False)
    for i in range(n):
        if not missing[i]:
            queues[units[i]].append((0.0, i))  # appended in index order: already a heap
    starts, ends = [math.nan] * n, [math.nan] * n
    running, now = [], 0.0
    while True:
        for unit, queue in queues.items():
            if queue and not busy[unit]:
                _, i = heapq.heappop(queue)
                starts[i], ends[i] = now, now + durations[i]
                busy[unit] = True
                heapq.heappush(running, (ends[i], i))
        if not running:
            break
        now = running[0][0]
        while running and running[0][0] == now:  # finish everything that ends now, then dispatch
            _, i = heapq.heappop(running)
            busy[units[i]] = False
            for j in dependents[i]:
                missing[j] -= 1
                if not missing[j]:
                    heapq.heappush(queues[units[j]], (now, j))
    if any(missing):
        raise ValueError(f"{sum(1 for m in missing if m)} tasks can never run: the task graph has a cycle")
    return starts, ends


class _Program:
    """A schedule's per-warpgroup programs compiled into the task graph of one CTA: per task a unit,
    a label (unit, task, tile, wg), a price (TileCosts field, fraction) and deps. No costs: compiled once.
    """

    def __init__(self, schedule: Schedule, n_kv: int):
        self.s, self.n = schedule, n_kv
        self.units, self.prices, self.deps, self.labels = [], [], [], []
        consumers = schedule.consumers
        self.lane = [None] * consumers  # each warpgroup's last task on its own warps (program order)
        self.tensor = [None] * consumers  # each warpgroup's last WGMMA (they complete in issue order)
        self.gemm0 = [[None] * n_kv for _ in range(consumers)]
        self.gemm1 = [[None] * n_kv for _ in range(consumers)]
        self.load_q, self.load_k, self.load_v = [None] * consumers, [None] * n_kv, [None] * n_kv
        self.turn = None  # with ping-pong: the GEMMs whose turn on the tensor cores comes before
        self.in_step = consumers > 1 and not schedule.pingpong
        self.slices = schedule.gemm_slices if self.in_step else 1
        self.round_end = ()  # without ping-pong: every consumer's last task of the previous iteration
        self.build_synchronous() if schedule.intra_depth == 0 else self.build_pipelined()

    def add(self, unit, task, tile, wg, price, deps, fraction=1.0) -> int:
        self.units.append(unit)
        self.prices.append((price, fraction))
        self.deps.append(tuple(sorted({d for d in deps if d is not None})))
        self.labels.append((unit, task, tile, wg))
        return len(self.units) - 1

    def durations(self, costs: TileCosts) -> list[float]:
        return [getattr(costs, price) * fraction for price, fraction in self.prices]

    def on_lane(self, w, task, tile, price, deps=()):
        self.lane[w] = self.add(f"wg{w}", task, tile, w, price, (self.lane[w], *deps))
        return self.lane[w]

    def wait(self, w, tile, task_id):
        return self.on_lane(w, "wait", tile, "sync", (task_id,))

    def load(self, task, tile, deps):
        return self.add("tma", task, tile, -1, "load_kv" if task in ("load_k", "load_v") else task, deps)

    def issue(self, w, gemms):
        """Issue WGMMAs [(task, tile, input deps)] back to back (with ping-pong, in this warpgroup's turn)."""
        turn = (self.turn,) if self.s.pingpong else self.round_end if self.in_step else ()
        for task, tile, inputs in gemms:
            slice_id = None
            for _ in range(self.slices):
                first = (self.lane[w], self.tensor[w], *inputs, *turn) if slice_id is None else ()
                slice_id = self.add("tensor", task, tile, w, "gemm", (slice_id, *first), 1 / self.slices)
                turn = ()
            self.tensor[w] = slice_id
            (self.gemm0 if task == "gemm0" else self.gemm1)[w][tile] = slice_id
        if gemms and self.s.pingpong:
            self.turn = self.tensor[w]

    def gemm0_of(self, w, j):
        return ("gemm0", j, (self.load_q[w], self.ensure_load(self.load_k, self.gemm0, "load_k", j)))

    def gemm1_of(self, w, j):
        return ("gemm1", j, (self.ensure_load(self.load_v, self.gemm1, "load_v", j),))

    def ensure_load(self, loads, releasers, task, j):
        """Tile j's K (or V) load: the producer issues it once every consumer's GEMM freed its slot."""
        if loads[j] is None:
            assert self.s.producer, "without a producer, refill() issues every load"
            released = [g[j - self.s.stages] for g in releasers] if j >= self.s.stages else []
            assert None not in released, "a slot is released by a GEMM not compiled yet"
            loads[j] = self.load(task, j, released)
        return loads[j]

    def iteration(self, w, j):
        """Iteration j (0..n) of consumer w: issue its GEMMs, then softmax_j and rescale_j; j == n drains."""
        depth, n = self.s.intra_depth, self.n
        g0 = [self.gemm0_of(w, j)] if j < n else []
        g1 = [self.gemm1_of(w, j - 1)] if j > 0 else []
        if depth == 3:  # gemm0 runs one tile further ahead; gemm0_0 was issued before iteration 0
            g0 = [self.gemm0_of(w, j + 1)] if j + 1 < n else []
        self.issue(w, g1 + g0 if depth == 1 else g0 + g1)
        if j == n:
            self.wait(w, n - 1, self.gemm1[w][n - 1])
            self.on_lane(w, "finalize", n - 1, "finalize")
            self.load("store_o", -1, (self.lane[w],))
            return
        self.wait(w, j, self.gemm0[w][j])
        self.on_lane(w, "softmax", j, "softmax")
        if j > 0:
            if depth >= 2:  # gemm1_{j-1} may still be running: wait for it before touching O
                self.wait(w, j, self.gemm1[w][j - 1])
            self.on_lane(w, "rescale", j, "rescale", (self.gemm1[w][j - 1],))

    def refill(self, j):
        """Without a producer: after iteration j, a barrier of all consumers, then warpgroup 0 reloads."""
        arrived = tuple(self.lane)
        for w in range(self.s.consumers):
            self.on_lane(w, "barrier", j, "sync", arrived)
        stages = self.s.stages
        if j + stages < self.n:  # K_j's slot is free: every consumer has waited for gemm0_j
            self.load_k[j + stages] = self.load("load_k", j + stages, (self.lane[0],))
        if j >= 1 and j - 1 + stages < self.n:  # V_{j-1}'s slot is free: gemm1_{j-1} was waited for
            self.load_v[j - 1 + stages] = self.load("load_v", j - 1 + stages, (self.lane[0],))

    def build_pipelined(self):
        s = self.s
        for w in range(s.consumers):
            self.load_q[w] = self.load("load_q", -1, ())
        if not s.producer:  # warpgroup 0 fills the first slots before its first GEMM
            for j in range(min(s.stages, self.n)):
                self.load_k[j] = self.load("load_k", j, ())
            for j in range(min(s.stages, self.n)):
                self.load_v[j] = self.load("load_v", j, ())
        if s.intra_depth == 3:
            for w in range(s.consumers):
                self.issue(w, [self.gemm0_of(w, 0)])
        for j in range(self.n + 1):
            for w in range(s.consumers):
                self.iteration(w, j)
            if not s.producer and j < self.n:
                self.refill(j)
            self.round_end = tuple(self.lane)

    def build_synchronous(self):
        """One warpgroup, no producer: every load and GEMM is issued and waited for at once."""
        self.load_q[0] = self.load("load_q", -1, ())
        self.wait(0, -1, self.load_q[0])
        for j in range(self.n):
            self.load_k[j] = self.load("load_k", j, (self.lane[0],))
            self.wait(0, j, self.load_k[j])
            self.issue(0, [("gemm0", j, ())])
            self.wait(0, j, self.gemm0[0][j])
            self.on_lane(0, "softmax", j, "softmax")
            if j > 0:
                self.on_lane(0, "rescale", j, "rescale")
            self.load_v[j] = self.load("load_v", j, (self.lane[0],))
            self.wait(0, j, self.load_v[j])
            self.issue(0, [("gemm1", j, ())])
            self.wait(0, j, self.gemm1[0][j])
        self.on_lane(0, "finalize", self.n - 1, "finalize")
        self.wait(0, -1, self.load("store_o", -1, (self.lane[0],)))


@functools.lru_cache(maxsize=32)
def _compile(schedule: Schedule, n_kv: int) -> _Program:
    return _Program(schedule, n_kv)


# ---------------------------------------------------------------- simulate


@dataclass(frozen=True)
class Event:
    """One task as it ran; ``deps`` are the indices (in ``Result.events``) of the tasks it waited for."""

    unit: str  # "tma", "tensor", or "wg0", "wg1", ...: a consumer warpgroup's own warps
    task: str  # load_q, load_k, load_v, gemm0, gemm1, softmax, rescale, wait, barrier, finalize, store_o
    tile: int  # K/V tile index; -1 for load_q and store_o
    wg: int  # consumer warpgroup; -1 for loads and stores
    start: float
    end: float
    deps: tuple[int, ...]


@dataclass(frozen=True)
class Result:
    """One schedule on one problem: the timeline of one CTA, and what it predicts for the whole GPU.

    events: every task of one CTA, in the order it was compiled.
    utilisation: busy fraction of the CTA's time per unit ("tma", "tensor", "wg0", ...), and
        "mufu": the load the exponentials put on the SM's shared MUFU pipes at their peak rate.
    cta_time_s: one CTA on one SM. ctas: CTAs in the problem; waves: rounds of them over the SMs.
    time_s = waves x cta_time_s; tflops: the problem's FLOPs (FA3 convention) / time_s / 1e12.
    """

    schedule: Schedule
    params: CostParams
    shape: AttentionShape
    costs: TileCosts
    events: tuple[Event, ...]
    utilisation: dict
    cta_time_s: float
    ctas: int
    waves: int
    time_s: float
    tflops: float


def _run_cta(schedule: Schedule, params: CostParams, shape: AttentionShape, rates: SMRates, compile=None):
    """Compile and run one CTA of ``shape``: (costs, program, starts, ends, ctas, waves).
    compile(schedule, n_kv): the program builder (default: the schedule's own, :class:`_Program`)."""
    if shape.causal or shape.seqlen_k != shape.seqlen_q:
        raise ValueError(f"the pipeline model covers non-causal self-attention only; got {shape}")
    costs = TileCosts.of(schedule, params, shape.head_dim, rates, shape.element_bytes)
    program = (compile or _compile)(schedule, math.ceil(shape.seqlen_k / schedule.block_n))
    starts, ends = run_tasks(program.units, program.durations(costs), program.deps)
    q_tiles = math.ceil(shape.seqlen_q / schedule.block_m)
    ctas = shape.heads_total * math.ceil(q_tiles / schedule.consumers)
    return costs, program, starts, ends, ctas, math.ceil(ctas / rates.num_sms)


def predict_tflops(schedule: Schedule, params: CostParams = H100_FIT, shape: AttentionShape = ABLATION_SHAPE,
                   rates: SMRates = H100) -> float:
    """The TFLOP/s :func:`simulate` predicts, without building its timeline (fast, for fitting)."""
    *_, ends, _, waves = _run_cta(schedule, params, shape, rates)
    return attention_flops(shape) / (waves * max(ends)) / 1e12


def simulate(schedule: Schedule, params: CostParams = H100_FIT, shape: AttentionShape = ABLATION_SHAPE,
             rates: SMRates = H100) -> Result:
    """Run one CTA of ``schedule`` on ``shape`` (non-causal) and scale it to the whole problem."""
    costs, program, starts, ends, ctas, waves = _run_cta(schedule, params, shape, rates)
    labelled = zip(program.labels, starts, ends, program.deps, strict=True)
    events = tuple(Event(*label, start, end, deps) for label, start, end, deps in labelled)
    cta_time = max(ends)
    utilisation = dict.fromkeys(sorted(set(program.units)), 0.0)
    for event in events:
        utilisation[event.unit] += (event.end - event.start) / cta_time
    exps = schedule.consumers * schedule.block_m * schedule.block_n * program.n
    utilisation["mufu"] = exps / rates.mufu_ops / cta_time
    time_s = waves * cta_time
    return Result(schedule, params, shape, costs, events, utilisation, cta_time, ctas, waves, time_s,
                  attention_flops(shape) / time_s / 1e12)
