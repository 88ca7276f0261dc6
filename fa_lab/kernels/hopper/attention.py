"""impl="triton_hopper": the FA3 forward (Gluon on sm_90, the portable pipelined kernel elsewhere, the portable
``triton_forward`` for calls with score options there).

The Gluon kernel takes grouped-query K/V, packed batches (``cu_seqlens``), a local window, the soft cap
and ALiBi itself. Gradients, from this forward's O and LSE: the Gluon FA3 backward
(:mod:`.fa3_backward`) on sm_90 for calls without a soft cap or ALiBi at head_dim 64 or 128 (grouped K/V,
causal calls, dense windows and packed batches included; under "auto" causal calls from
``GLUON_BACKWARD_MIN_KEYS`` keys), and the portable recomputation kernels (``impl="triton"``) for the rest (the
soft cap, ALiBi, windowed packed batches, shorter causal calls, other head sizes, other GPUs).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch

from ...block_info import BlockInfo
from ...impls import has_score_options
from ...reference import expand_kv
from .. import interpreting, load_triton
from ..common import LOG2E, cdiv, check_triton_inputs, device_capability, gluon_descriptor, head_dim_bucket, sm_count
from ..launch import cached_launch
from ..portable.attention import (
    NO_OPTIONS,
    ScoreOptions,
    TritonAttentionFunction,
    backward_preprocess,
    heads_view,
    host_bounds,
    pipelined_forward,
    query_tiles,
    triton_backward,
    triton_forward,
    triton_varlen_backward,
    triton_varlen_forward,
    varlen_schedule,
)
from ..portable.configs import TileConfig, forward_config
from .tile_schedule import heads_per_group, schedule_tensor


@dataclass(frozen=True)
class HopperOptions:
    """Which kernel and which FA3 ideas the forward uses (each can be switched to measure it).

    ``kernel="gluon"``: the warp-specialized FA3 kernel of :mod:`fa_lab.kernels.hopper.fa3_kernel`
    (producer warp + ``consumers`` consumer warpgroups, ``stages`` K/V slots, ``pingpong`` to
    alternate the consumers' WGMMAs explicitly, ``persistent`` for one CTA per SM walking a tile
    schedule). It runs on sm_90 for head_dim 33 to 128 (padded to 64 or 128); other shapes and the
    CPU interpreter use ``kernel="triton"``.

    ``kernel="triton"``: the plain-Triton kernel of :mod:`fa_lab.kernels.portable.pipelined_forward`,
    with ``pipeline`` (QK^T of tile j+1 issued before the softmax of tile j) and
    ``warp_specialize`` (Triton's own pass).

    The defaults (2 stages, free-running consumers) are the bf16 variant the H200 measurements chose
    (docs/experiments/hopper_forward.md); ``persistent=None`` picks by :data:`PERSISTENT_MAX_KEYS`, and
    ``consumers=None`` by :data:`THREE_CONSUMERS_MIN_KEYS`: three consumers (192-row tiles, persistent) leave
    each 160 registers, which holds a d = 64 work tile's loop (without spills without a mask; 8 spilled loads and
    stores in the causal build's masked loops), not a d = 128 one's (see
    :mod:`fa_lab.kernels.hopper.sm90_offline`); ``split_loops=None`` by :data:`SPLIT_LOOPS_MIN_KEYS`, and the
    backward's ``backward_dq=None`` by :data:`DQ_MODE_BY_HEAD_DIM`.
    """

    kernel: str = "gluon"
    pipeline: bool = False
    warp_specialize: bool = False
    stages: int = 2
    pingpong: bool = False
    split_loops: bool | None = None  # Gluon: K/V steps in 3 loops, one per kind of mask (flash-attn-4); None: auto
    rescale_early: bool = False  # Gluon: O rescaled at the end of each K/V step (flash-attn-4's place), same bits
    convert_p_late: bool = False  # Gluon FP8: P packed to e4m3 after the step's Q K^T is issued, not before; same bits
    consumers: int | None = None  # Gluon: 2 or 3 consumer warpgroups (128- or 192-row tiles); None: auto
    persistent: bool | None = None  # Gluon: one CTA per SM, each looping over its tiles (tile_schedule); None: auto
    spare_sms: int = 0  # persistent: SMs left without a CTA, for kernels of other streams running beside it
    backward: str = "auto"  # "gluon" (where it runs), "triton", or "auto" (gluon_backward_is_faster)
    backward_dq: str | None = None  # the Gluon backward's dQ scheme (DQ_MODES); None: dq_mode_by_default
    softcap_max_first: bool = False  # Gluon soft cap: row max over the raw scores, capped once a row (not with ALiBi)
    softcap_q_scaled: bool = False  # Gluon soft cap, dense 16-bit: Q times scale / softcap before the kernel
    exp2_on_fma: int = 0  # Gluon forward: of every 4 probabilities, how many by a polynomial on the FMA units (0-4)


# MoBA's forward passes on the Gluon kernel (fa_lab/kernels/portable/moba.py): pass 1, its own blocks (causal,
# each block a head), and pass 2, its past blocks (packed, no mask), both one tile per CTA. Pass 1 persistent
# measured 19.36-19.43 ms at 64K against 19.35-19.69, and with SMs left to the gate beside it (spare_sms 8-48)
# 19.25-19.99 (benchmarks/h200_moba_forward_gaps.json): within the spread of the rounds.
MOBA_PASS_OPTIONS = (HopperOptions(persistent=False), HopperOptions(persistent=False))

# Where the bf16/fp16 Gluon forward runs persistent by default (HopperOptions.persistent None). The A/B of
# benchmarks/h200_persistent_bf16.json (the FA3-paper shapes, medians of three rounds) had it at least 2% ahead of
# one tile per CTA up to PERSISTENT_MAX_KEYS keys per (head_dim bucket, causal): causal, its LPT schedule evens out
# the tiles' unequal lengths (+4 to +24% up to 8K keys, level at 16K); without a mask it pays only where tiles are
# short (1K-2K keys). Below 4K keys that gain once hid behind the call's host time (0.2-0.3 ms to issue it, as long
# as the kernel: benchmarks/h200_persistent_host_bound.log); with the plan cached per kind of call the host takes
# 0.14-0.24 ms and do_bench, as the protocol times, had the persistent kernel 1.05-1.30x ahead at 1K-2K causal and
# level to 1.07x at 2K without a mask on an H100 (benchmarks/h100_persistent_host_bound.log), as an A/B on the H200
# the same day had it 1.12-1.23x causal and 1.02-1.13x without a mask (docs/experiments/hopper_forward.md, "Persistent
# as the bf16 default from 1K keys"). PERSISTENT_MIN_KEYS is the shortest length the A/B measured. A CPU test holds
# both to the A/B. A windowed call runs persistent from PERSISTENT_MIN_KEYS keys at any length:
# each work tile walks only its band's few K/V tiles, so its start and end weigh as in a short dense call, which
# the persistent kernel overlaps with the next tile's loads (450 against 434 TFLOP/s at (1024, 0) and 16K in
# benchmarks/h200_window_variants.json, 456 against 424 in the run before). Packed batches stay one tile per CTA.
PERSISTENT_MAX_KEYS = {(64, False): 2048, (64, True): 8192, (128, False): 1024, (128, True): 8192}
PERSISTENT_MIN_KEYS = 1024


def persistent_by_default(head_dim: int, causal: bool, seqlen_k: int, banded: bool, fp8: bool = False,
                          consumers: int = 2) -> bool:
    """HopperOptions.persistent None's choice for a call with these keys: in bf16/fp16 by PERSISTENT_MAX_KEYS and
    _MIN_KEYS (a banded call from _MIN_KEYS at any length), and always with three consumers; in FP8 always (its
    default, FP8_OPTIONS)."""
    return fp8 or consumers == 3 or (
        PERSISTENT_MIN_KEYS <= seqlen_k
        and (banded or seqlen_k <= PERSISTENT_MAX_KEYS.get((head_dim_bucket(head_dim), causal), 0)))


# Where the bf16/fp16 Gluon forward takes three consumer warpgroups by default (HopperOptions.consumers None): from
# how many keys, per (head_dim bucket, causal), without a window, in a dense call. At d = 64 a tile's two products
# take half as long as at d = 128 while its softmax takes as long, so two consumers leave the tensor cores waiting;
# a third (192-row tiles, FA3's shape there; each K/V tile is also read by a third fewer CTAs) fills the gaps. The
# persistent kernel with three consumers measured 1.05-1.09x two consumers without a mask from 4K keys, causal
# 1.04-1.06x at 16K, 1.00-1.02x at 8K and 0.94x at 4K (benchmarks/h200_three_consumers.json and a rerun,
# docs/experiments/hopper_forward.md). At d = 128 a consumer's loop does not fit its 160 registers, nor at d = 64 with
# ALiBi (112-140 spilled loads and stores in the K/V loops, none with two consumers: a CPU test builds both), so
# ALiBi calls keep two. A CPU test holds the table to the recorded run.
THREE_CONSUMERS_MIN_KEYS = {(64, False): 4096, (64, True): 16384}


def consumers_by_default(head_dim: int, causal: bool, seqlen_k: int, banded: bool, fp8: bool = False,
                         alibi: bool = False) -> int:
    """HopperOptions.consumers None's choice for a dense call (THREE_CONSUMERS_MIN_KEYS; FP8, windows and ALiBi:
    two)."""
    min_keys = THREE_CONSUMERS_MIN_KEYS.get((head_dim_bucket(head_dim), causal))
    return 3 if not (fp8 or banded or alibi) and min_keys is not None and seqlen_k >= min_keys else 2


# Where impl="triton_hopper" takes the Gluon FA3 backward by default (HopperOptions.backward "auto"): from how
# many keys, per (head_dim, causal), the H200 measured it faster than the portable backward
# (benchmarks/h200_backward.json; a CPU test holds this table to that file). At d = 128 it is 1.12-1.20x from 1K
# without a mask and 1.11-1.30x causal from 2K (1.00x at 1K causal); at d = 64, in 128-row steps, 1.07-1.17x from 1K
# without a mask and 1.02-1.20x causal from 2K (0.93x at 1K).
GLUON_BACKWARD_MIN_KEYS = {(128, False): 0, (128, True): 2048, (64, False): 0, (64, True): 2048}


# Where the bf16/fp16 Gluon forward walks its K/V steps in three loops, one per kind of mask (HopperOptions.split_loops
# None): from how many keys, per (head_dim bucket, causal). The loop without a mask then carries no mask's branch and
# the edges' loops one bound each. benchmarks/h200_split_loops.json (the FA3-paper shapes, medians of three rounds,
# the same bits as one loop at every shape) had it 1.02-1.04x one loop at d = 128 without a mask, 1.00-1.02x causal,
# 1.045x in the window (1024, 0) at 16K; at d = 64 1.02-1.05x without a mask from 2K, causal 0.98-1.00x below 16K
# and 1.05x at 16K. A CPU test holds the table to that run. FP8 keeps one loop: split, its kernel ran 0.94-0.97x
# at d = 64 and 128 from 4K (benchmarks/h200_split_loops_fp8.json). ALiBi keeps one in the kernel (three spill).
SPLIT_LOOPS_MIN_KEYS = {(64, False): 2048, (64, True): 16384, (128, False): 0, (128, True): 0}


def split_loops_by_default(head_dim: int, causal: bool, seqlen_k: int, fp8: bool = False) -> bool:
    """HopperOptions.split_loops None's choice (SPLIT_LOOPS_MIN_KEYS; ``causal`` as the kernel sees it: False in a
    window)."""
    return not fp8 and seqlen_k >= SPLIT_LOOPS_MIN_KEYS[(head_dim_bucket(head_dim), causal)]


# The Gluon backward's dQ scheme by default (HopperOptions.backward_dq None), per head_dim bucket. In
# benchmarks/h200_backward_dq.json (two rounds each, FA3-paper shapes 2K-16K) "named" (dS handed between the
# consumers through named barriers, one empty barrier for Q and dO) ran 1.010x "turns" at d = 128 (geometric mean of
# the shapes' medians; 0.99-1.03x) and 0.993x at d = 64 (0.96-1.01x); the edit it came from had measured 1.00-1.04x
# at d = 128 (benchmarks/h200_backward_variants_ab.json). "partial" was slower everywhere (0.80-0.93x "turns"),
# "split" ran 0.97-1.01x. A CPU test
# holds the table to the run.
DQ_MODE_BY_HEAD_DIM = {64: "turns", 128: "named"}


def dq_mode_by_default(head_dim: int) -> str:
    """The dQ scheme :func:`gluon_backward` and :func:`gluon_varlen_backward` take when given none."""
    return DQ_MODE_BY_HEAD_DIM[head_dim_bucket(head_dim)]


def gluon_backward_is_faster(head_dim: int, causal: bool, seqlen_k: int) -> bool:
    """The "auto" choice of :func:`hopper_backward` (GLUON_BACKWARD_MIN_KEYS)."""
    min_keys = GLUON_BACKWARD_MIN_KEYS.get((head_dim, causal))
    return min_keys is not None and seqlen_k >= min_keys


# The FP8 forward's default: persistent, free-running consumers. FP8's K/V steps are short enough for a
# work tile's start and end to show, which the persistent kernel overlaps with the next tile's loads
# (docs/experiments/hopper_forward.md has the measurements).
FP8_OPTIONS = HopperOptions(persistent=True)


def uses_gluon(q: torch.Tensor, options: HopperOptions) -> bool:
    """True when the Gluon FA3 kernel runs this input: asked for, on sm_90, head_dim bucket 64 or 128."""
    return (options.kernel == "gluon" and q.is_cuda and not interpreting() and device_capability(q.device) == (9, 0)
            and head_dim_bucket(q.shape[-1]) in (64, 128))


def gluon_forward(q, k, v, causal, scale, options: HopperOptions = HopperOptions(), fp8_scales=None,
                  out_dtype=None, window=(-1, -1), softcap: float = 0.0, alibi_slopes=None, out=None):
    """The Gluon FA3 forward on prepared operands (as :func:`hopper_forward`): (out, lse). out: where to write
    O (a view shaped like q that a descriptor can describe, :func:`fa_lab.kernels.common.tma_readable`), or None.

    window: flash-attn's (left, right), bottom-right aligned (:class:`fa_lab.block_info.BlockInfo`); the
    kernel visits only the K/V tiles of each work tile's band. softcap (0: off) and alibi_slopes ((B, H)
    float32 or None): as :func:`fa_lab.attention`, applied to each score tile in registers.

    fp8_scales: None for bf16/fp16 operands; for e4m3 operands (v given as V^T, (B, H, d, Nk))
    the tuple (q_descale, k_descale, v_exponent, v_descale_max) of
    :func:`fa_lab.kernels.hopper.fp8_attention.quantize_for_kernel` with ``gluon=True``, and
    ``out_dtype`` the output's dtype.
    """
    fp8 = fp8_scales is not None
    plan = _forward_plan(tuple(q.shape), tuple(k.shape), q.device, causal, tuple(window), fp8,
                         alibi_slopes is not None, bool(softcap), options)
    if out is None:
        out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    schedule = lse if plan.schedule is None else plan.schedule  # (lse: a placeholder pointer, not read)
    heads, seqlen_q, seqlen_k = q.shape[1], q.shape[2], k.shape[2]
    if plan.q_scaled:  # rounded once, to q's dtype
        q = torch.mul(q, scale / softcap)
    descriptors = [gluon_descriptor(t, block) for t, block in zip((q, k, v, out), plan.blocks)]
    _launch_fa3(descriptors, out, lse, plan.grid, (heads, heads // k.shape[1], seqlen_q, seqlen_k, schedule, lse, lse),
                plan.window_bounds, scale, softcap, alibi_slopes, fp8_scales, plan.constants)
    return out, lse


@dataclass(frozen=True)
class ForwardPlan:
    """What a dense Gluon forward launch decides from its shape and options alone (:func:`_forward_plan` keeps one
    per kind of call, so that a call only allocates its outputs, builds its descriptors and launches): the grid,
    the persistent kernel's tile schedule (None: one work tile per CTA), the q, k, v, o descriptors' blocks, the
    window's (left, right) bounds and the kernel's compile-time arguments (:func:`fa3_launch_constants`).
    q_scaled: the launcher multiplies Q by scale / softcap first (the soft cap's SOFTCAP_Q_SCALED bit)."""

    grid: tuple[int]
    schedule: torch.Tensor | None
    blocks: tuple[list[int], ...]
    window_bounds: tuple[int, int]
    constants: Mapping[str, object]
    q_scaled: bool


@functools.lru_cache(maxsize=256)
def _forward_plan(q_shape: tuple, k_shape: tuple, device: torch.device, causal: bool, window: tuple, fp8: bool,
                  alibi: bool, softcap: bool, options: HopperOptions) -> ForwardPlan:
    """The :class:`ForwardPlan` of :func:`gluon_forward` for operands of these shapes on ``device``: ``options``'
    unset choices resolved by the defaults' tables (consumers, persistent, split loops)."""
    from .fa3_config import KV_BLOCK, ROWS_PER_CONSUMER, descriptor_blocks
    from .fa3_softmax import SOFTCAP_Q_SCALED

    batch, heads, seqlen_q, head_dim = q_shape
    seqlen_k = k_shape[2]
    info = BlockInfo(seqlen_q, seqlen_k, causal, window)
    if options.consumers is None:
        options = replace(options, consumers=consumers_by_default(head_dim, causal, seqlen_k, info.banded, fp8, alibi))
    block_m = ROWS_PER_CONSUMER.value * options.consumers
    total_tiles = cdiv(seqlen_q, block_m) * batch * heads
    persistent = options.persistent
    if persistent is None:
        persistent = persistent_by_default(head_dim, causal, seqlen_k, info.banded, fp8, options.consumers)
    if options.split_loops is None:
        options = replace(options, split_loops=split_loops_by_default(head_dim, info.causal_only, seqlen_k, fp8))
    grid, schedule = (total_tiles,), None
    if persistent:
        grid = (min(total_tiles, max(sm_count(device) - options.spare_sms, 1)),)
        schedule = schedule_tensor(batch * heads, seqlen_q, seqlen_k, block_m, KV_BLOCK.value, info.causal_only,
                                   grid[0], device)
    blocks = descriptor_blocks(head_dim_bucket(head_dim), fp8)
    constants = fa3_launch_constants(options, info.causal_only, info.banded, persistent, softcap, alibi, fp8,
                                     varlen=False)
    return ForwardPlan(grid, schedule, tuple(blocks[name] for name in "qkvo"), _window_bounds(info), constants,
                       q_scaled=bool(constants["SOFTCAP"] & SOFTCAP_Q_SCALED.value))


def _window_bounds(info: BlockInfo) -> tuple[int, int]:
    """The kernel's (left, right) arguments: the band's bounds, (0, 0) without a band (not read)."""
    return info.window_bounds() if info.banded else (0, 0)


@functools.lru_cache(maxsize=256)
def fa3_launch_constants(options: HopperOptions, causal: bool, banded: bool, persistent: bool, softcap: bool,
                         alibi: bool, fp8: bool, varlen: bool) -> Mapping[str, object]:
    """The compile-time arguments and launch options of :func:`.fa3_kernel.attention_fwd_fa3_kernel` for resolved
    ``options`` (consumers and split_loops set) and a call of this kind (``causal``: the kernel's CAUSAL, causal
    without a band), read-only."""
    from .fa3_config import CONSUMER_REGS, launch_maxnreg
    from .fa3_softmax import SOFTCAP_MAX_FIRST, SOFTCAP_ON, SOFTCAP_Q_SCALED

    if not 0 <= options.exp2_on_fma <= 4:
        raise ValueError(f"HopperOptions.exp2_on_fma counts exponentials of four (0-4), got {options.exp2_on_fma}")
    softcap_bits = 0
    if softcap:
        softcap_bits = (SOFTCAP_ON.value | (SOFTCAP_MAX_FIRST.value if options.softcap_max_first and not alibi else 0)
                        | (SOFTCAP_Q_SCALED.value if options.softcap_q_scaled and not (varlen or fp8) else 0))
    return MappingProxyType(dict(
        CONSUMERS=options.consumers, STAGES=options.stages, CAUSAL=causal, PINGPONG=options.pingpong, FP8=fp8,
        PERSISTENT=persistent, CONSUMER_REGS=CONSUMER_REGS[options.consumers], WINDOW=banded, VARLEN=varlen,
        SOFTCAP=softcap_bits, ALIBI=alibi, SPLIT_LOOPS=options.split_loops, RESCALE_EARLY=options.rescale_early,
        CONVERT_P_LATE=options.convert_p_late, EXP2_ON_FMA=options.exp2_on_fma, num_warps=4,
        maxnreg=launch_maxnreg(options.consumers)))


def gluon_varlen_forward(q, k, v, cu_q, cu_k, bounds, causal, scale, options: ScoreOptions,
                         hopper: HopperOptions = HopperOptions()):
    """The Gluon FA3 forward of a packed batch on prepared operands q: (total_q, H, d8), k, v:
    (total_k, Hkv, d8), cu_q, cu_k int32 offsets, bounds their values as :func:`host_bounds` takes them (or
    ``DeviceTiles``, no mask):
    (out (total_q, H, d8), lse (H, total_q) float32). One work tile per (sequence, query tile) of
    ``varlen_schedule`` (longest first; or ``DeviceTiles.schedule``, built on the device in sequence order) and
    head; nothing is padded to the longest sequence."""
    from .fa3_config import ROWS_PER_CONSUMER, descriptor_blocks

    total_q, heads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    if hopper.consumers is None:  # packed batches keep two consumers (the three-consumer default was timed dense)
        hopper = replace(hopper, consumers=2)
    block_m = ROWS_PER_CONSUMER.value * hopper.consumers
    blocks = descriptor_blocks(head_dim_bucket(q.shape[-1]), False)
    descriptors = [gluon_descriptor(heads_view(t), blocks[name]) for name, t in zip("qkvo", (q, k, v, out))]
    tiles, cu_q, cu_k = query_tiles(bounds, cu_q, cu_k, block_m, causal, options.window, q.device)
    if not len(tiles):
        return out, lse
    work = (heads, heads // k.shape[1], total_q, k.shape[0], tiles, cu_q, cu_k)
    info = BlockInfo(total_q, k.shape[0], causal, tuple(options.window))
    if hopper.split_loops is None:  # where the table splits at any length (the sequences' lengths stay on the GPU)
        hopper = replace(hopper, split_loops=split_loops_by_default(q.shape[-1], info.causal_only, 0))
    constants = fa3_launch_constants(hopper, info.causal_only, info.banded, False, bool(options.softcap),
                                     options.alibi_slopes is not None, False, varlen=True)
    _launch_fa3(descriptors, out, lse, (len(tiles) * heads,), work, _window_bounds(info), scale, options.softcap,
                options.alibi_slopes, None, constants)
    return out, lse


def _launch_fa3(descriptors, out, lse, grid, work, window_bounds, scale, softcap, alibi_slopes, fp8_scales,
                constants: Mapping[str, object]):
    """Launch :func:`.fa3_kernel.attention_fwd_fa3_kernel`. work: (heads, group, seqlen_q, seqlen_k, schedule,
    cu_seqlens_q, cu_seqlens_k), the kernel's arguments of those names; window_bounds: its (left, right);
    constants: :func:`fa3_launch_constants`."""
    from .fa3_kernel import attention_fwd_fa3_kernel

    heads, group, seqlen_q, seqlen_k, schedule, cu_q, cu_k = work
    qk_scale = (softcap if softcap else scale) * LOG2E
    slopes = lse if alibi_slopes is None else alibi_slopes.float().contiguous()
    cached_launch(attention_fwd_fa3_kernel)[grid](
        *descriptors, out, lse, *(fp8_scales or (lse,) * 4), heads, group, seqlen_q, seqlen_k, *window_bounds,
        schedule, cu_q, cu_k, qk_scale, scale / softcap if softcap else 0.0, slopes, **constants)


def hopper_forward(q, k, v, causal, scale, config: TileConfig | None = None, options=HopperOptions(),
                   score_options: ScoreOptions = NO_OPTIONS, out=None):
    """bf16/fp16 forward on prepared operands (as :func:`fa_lab.kernels.portable.attention.triton_forward`,
    k and v with heads_kv heads, out where to write O or None): (out, lse). The Gluon kernel reads grouped K/V in
    place and takes every score option; elsewhere a call with options goes to the portable kernel
    (:func:`triton_forward`), and the portable pipelined kernel gets grouped K/V expanded to one head per query
    head."""
    if uses_gluon(q, options):
        return gluon_forward(q, k, v, causal, scale, options, window=score_options.window,
                             softcap=score_options.softcap, alibi_slopes=score_options.alibi_slopes, out=out)
    if has_score_options(q.shape[2], k.shape[2], causal, score_options.window, score_options.softcap,
                         score_options.alibi_slopes):
        return triton_forward(q, k, v, causal, scale, options=score_options, out=out)
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    config = config or forward_config(q.shape[-1], causal, interpreting())
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    dummy = lse  # the descale pointers are not read outside FP8
    pipelined_forward(q, k, v, out, lse, (dummy, dummy, dummy), causal, scale, config, pipeline=options.pipeline,
                      warp_specialize=options.warp_specialize)
    return out, lse


def hopper_varlen_forward(q, k, v, cu_q, cu_k, bounds, causal, scale, options: ScoreOptions,
                          hopper: HopperOptions = HopperOptions()):
    """A packed batch's forward (as :func:`triton_varlen_forward`): the Gluon kernel where it runs, else the
    portable one-launch kernel."""
    if uses_gluon(q, hopper):
        return gluon_varlen_forward(q, k, v, cu_q, cu_k, bounds, causal, scale, options, hopper)
    return triton_varlen_forward(q, k, v, cu_q, cu_k, bounds, causal, scale, options)


def uses_gluon_backward(q, k, causal, options: ScoreOptions, window: bool = False) -> bool:
    """True when the Gluon FA3 backward takes this call: sm_90, head_dim (padded to 8) exactly 64 or 128, and no
    soft cap or ALiBi, nor a window unless ``window`` (the dense launcher takes one, packed batches do not)."""
    band = (-1, -1) if window else options.window
    return (uses_gluon(q, HopperOptions()) and q.shape[-1] in (64, 128)
            and not has_score_options(q.shape[2], k.shape[2], causal, band, options.softcap, options.alibi_slopes))


DQ_MODES = ("turns", "partial", "split", "named")  # fa3_backward.DQ_SCHEMES's names; "split" at d = 128 only


def gluon_backward(q, k, v, out, lse, grad_out, causal: bool, scale: float, dq_mode: str | None = None,
                   rows: int | None = None, rows_by_producer: bool = True, head_group: int | None = None,
                   rows_ahead: bool = False, kv_split: int = 1, row_vectors=None, dq=None, window=(-1, -1)):
    """The Gluon FA3 backward on prepared operands q, out, grad_out: (B, H, Nq, d), k, v: (B, Hkv, Nk, d),
    d = 64 or 128, lse (B, H, Nq) float32: (dq, dk, dv) in q's dtype, dk and dv summed over each group.
    row_vectors, dq: as :func:`fa_lab.kernels.portable.attention.triton_backward` takes them. window: flash-attn's
    (left, right) as :func:`fa_lab.attention` takes it; each key tile's CTA walks only the query tiles of its band.
    dq_mode: "turns" (each step's whole dQ tile computed by one consumer, in turns), "partial" (each consumer
    adds a partial dQ tile over its own keys), "split" or "named" (:mod:`.fa3_backward`; None:
    :func:`dq_mode_by_default`); rows: query rows per step
    (None: :data:`.fa3_backward.BWD_ROWS` by head_dim); rows_by_producer: each step's lse2 and D rows brought
    into shared memory by the producer warp (1.02-1.11x on the H200, benchmarks/h200_backward_row_vectors.json),
    or (False) loaded by each consumer; rows_ahead: the producer loads them one step ahead (0.99x, geometric
    mean, in benchmarks/h200_backward_rows_ahead.json: off by default);
    head_group: (batch, K/V head) pairs whose CTAs run key tile by key tile together
    (:func:`.fa3_backward.key_tile_of_cta`; None: :func:`.tile_schedule.heads_per_group` with a causal mask, 1
    without). kv_split: CTAs per (key tile, K/V head) of a grouped-query call, a divisor of the group (1: one CTA
    walks every query head of its group). With kv_split > 1 each CTA walks group / kv_split of them: the kernel
    runs on K and V repeated kv_split times along the heads (each copy a K/V head of its own, group / kv_split query
    heads to a copy) and stores float32 partial dK, dV per copy, summed here. kv_split times as many CTAs, each
    kv_split times shorter, for a copy of K and V and the partials' bytes (FA3 adds dK and dV of a grouped call
    across CTAs in float32 too)."""
    from .fa3_backward import BWD_BLOCK_N

    batch, heads, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    group = heads // heads_kv
    if isinstance(kv_split, bool) or not isinstance(kv_split, int) or kv_split < 1 or group % kv_split:
        raise ValueError(f"kv_split must be a divisor of the group of {group} query heads per K/V head, "
                         f"got {kv_split!r}")
    k_run, v_run = (t.repeat_interleave(kv_split, dim=1) for t in (k, v)) if kv_split > 1 else (k, v)
    key_tiles, kv_pairs = cdiv(seqlen_k, BWD_BLOCK_N), batch * k_run.shape[1]  # (batch, K/V head of the run) pairs
    info = BlockInfo(seqlen_q, seqlen_k, causal, tuple(window))
    if head_group is None:
        head_group = heads_per_group(kv_pairs, key_tiles, sm_count(q.device)) if info.causal_only else 1
    if row_vectors is None:
        grad_out = grad_out.contiguous()
        row_vectors = backward_preprocess(out, grad_out, lse)
    delta, lse2 = row_vectors
    dq_sum, dk, dv = _backward_outputs(q, k_run, v_run, torch.float32 if kv_split > 1 else None)
    _launch_backward((key_tiles * kv_pairs,), (q, k_run, v_run, grad_out, dq_sum), dk, dv, lse2, delta, heads,
                     seqlen_q, seqlen_k, head_group, None, info, scale, dq_mode, rows, rows_by_producer, rows_ahead)
    if kv_split > 1:  # the copies' partial sums, added in float32 and rounded once
        dk, dv = (t.view(batch, heads_kv, kv_split, seqlen_k, head_dim).sum(2).to(k.dtype) for t in (dk, dv))
    return _scaled_dq(dq_sum, scale, q.dtype, dq), dk, dv


def gluon_varlen_backward(q, k, v, out, lse, grad_out, cu_q, cu_k, bounds, causal: bool, scale: float,
                          dq_mode: str | None = None, rows: int | None = None, rows_by_producer: bool = True,
                          rows_ahead: bool = False):
    """The Gluon FA3 backward of a packed batch on prepared operands q, out, grad_out: (total_q, H, d), k, v:
    (total_k, Hkv, d), d = 64 or 128, lse (H, total_q) float32, cu_q, cu_k int32 offsets and bounds their
    values (as :func:`host_bounds` takes them): (dq, dk, dv) in q's dtype. One CTA per (sequence, key tile)
    of ``varlen_schedule`` (most work first) and K/V head; nothing is padded to the longest sequence. dq_mode,
    rows, rows_by_producer, rows_ahead: as :func:`gluon_backward`'s."""
    from .fa3_backward import BWD_BLOCK_N

    total_q, heads, _ = q.shape
    dq, dk, dv = _backward_outputs(q, k, v)  # (dk, dv: every key is stored by the CTA of its tile)
    tiles = varlen_schedule(*host_bounds(bounds), BWD_BLOCK_N, True, causal, (-1, -1), q.device)
    if total_q * heads == 0 or not len(tiles):
        return dq.to(q.dtype), dk.zero_(), dv.zero_()
    grad_out = grad_out.contiguous()
    # The preprocess writes (total_q, H), the order of out's rows; the kernel reads each head's rows together.
    delta, lse2 = (t.t().contiguous() for t in backward_preprocess(out, grad_out, lse.t().contiguous()))
    _launch_backward((len(tiles), k.shape[1]), [heads_view(t) for t in (q, k, v, grad_out, dq)], dk, dv, lse2, delta,
                     heads, total_q, k.shape[0], 1, (tiles, cu_q, cu_k), BlockInfo(total_q, k.shape[0], causal),
                     scale, dq_mode, rows, rows_by_producer, rows_ahead)
    return _scaled_dq(dq, scale, q.dtype), dk, dv


def _scaled_dq(dq_sum: torch.Tensor, scale: float, dtype: torch.dtype, dq=None) -> torch.Tensor:
    """dQ in ``dtype`` from the float32 sum of dS K the Gluon backward adds (dQ / scale: the kernel leaves the
    softmax scale to this cast), in one pass, into ``dq`` (a view shaped like dq_sum) or a new tensor."""
    if dq is None:
        dq = torch.empty(dq_sum.shape, dtype=dtype, device=dq_sum.device)
    return torch.mul(dq_sum, scale, out=dq)


def _backward_outputs(q, k, v, kv_dtype: torch.dtype | None = None):
    """(dq, dk, dv) of the Gluon backward: dq the float32 target of the reduce-adds, zeroed; dk, dv contiguous in
    k's and v's shape and dtype (or kv_dtype), for the kernel's stores."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return dq, *(torch.empty(t.shape, dtype=kv_dtype or t.dtype, device=t.device) for t in (k, v))


def _launch_backward(grid, operands, dk, dv, lse2, delta, heads, seqlen_q, seqlen_k, head_group, packing,
                     info: BlockInfo, scale, dq_mode, rows, rows_by_producer, rows_ahead):
    """Launch :func:`.fa3_backward.attention_bwd_fa3_kernel`. operands: q, k, v, grad_out and the float32 dQ as
    its descriptors see them, (B, H, N, d) (packed: (1, H, total, d) views); head_group: the kernel's argument
    (dense launches); packing: None, or (schedule,
    cu_seqlens_q, cu_seqlens_k) of a packed batch, whose seqlen_q and seqlen_k are then the totals; info: the
    call's mask (its causal flag and band); dq_mode, rows, rows_by_producer, rows_ahead: as the two launchers take
    them."""
    from .fa3_backward import BWD_CONSUMERS, DQ_SCHEMES, DQ_SPLIT, attention_bwd_fa3_kernel, backward_blocks
    from .fa3_config import launch_maxnreg

    q, k, v, grad_out, dq = operands
    head_dim = q.shape[-1]
    dq_mode = dq_mode_by_default(head_dim) if dq_mode is None else dq_mode
    if dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode must be one of {DQ_MODES}; got {dq_mode!r}")
    scheme = DQ_SCHEMES[dq_mode]
    if scheme == DQ_SPLIT.value and head_dim != 128:
        raise ValueError(f"dq_mode='split' halves dQ's 128 columns: head_dim 128 only, got {head_dim}")
    row_block, keys, dq_block = backward_blocks(head_dim, scheme, rows)
    cached_launch(attention_bwd_fa3_kernel)[grid](
        gluon_descriptor(q, row_block), gluon_descriptor(k, keys), gluon_descriptor(v, keys),
        gluon_descriptor(grad_out, row_block), gluon_descriptor(dq, dq_block),
        dk, dv, lse2, delta, heads, heads // k.shape[1], seqlen_q, seqlen_k, head_group, *_window_bounds(info),
        *(packing or (lse2,) * 3), scale * LOG2E, scale, CAUSAL=info.causal_only, STAGES=2,
        VARLEN=packing is not None, DQ_SCHEME=scheme, ROWS_BY_PRODUCER=rows_by_producer,
        ROWS_AHEAD=rows_by_producer and rows_ahead, WINDOW=info.banded, num_warps=4,
        maxnreg=launch_maxnreg(BWD_CONSUMERS.value))


# Whether "auto" may give packed batches the Gluon backward (then at the keys of varlen_keys_per_sequence). On the
# H200 (benchmarks/h200_varlen_backward.json: chapter 05's varlen lengths, d = 128, 32 query heads over 32 or 8
# K/V heads) every dQ scheme but "partial" ran at 1.42-1.49x the portable backward, causal or not; the gpu test
# test_gpu_gluon_varlen_backward checks it.
GLUON_VARLEN_BACKWARD_AUTO = True


def varlen_keys_per_sequence(bounds_k: list[int]) -> int:
    """The keys of the sequence an average key of a packed batch belongs to (sum of squared lengths over their
    sum): the length :func:`gluon_backward_is_faster` is asked about for a packed batch."""
    lengths = [end - start for start, end in zip(bounds_k, bounds_k[1:])]
    return sum(n * n for n in lengths) // max(sum(lengths), 1)


def hopper_varlen_backward(q, k, v, out, lse, grad_out, cu_q, cu_k, bounds, causal: bool, scale: float,
                           options: ScoreOptions, hopper: HopperOptions = HopperOptions()):
    """impl="triton_hopper"'s backward of a packed batch (arguments as :func:`triton_varlen_backward`): the Gluon
    FA3 backward where :func:`uses_gluon_backward` and ``hopper.backward`` asks for it ("auto": where
    ``GLUON_VARLEN_BACKWARD_AUTO`` allows it, at the keys of :func:`varlen_keys_per_sequence`), else the portable
    kernels."""
    bounds = host_bounds(bounds)
    wanted = hopper.backward == "gluon" or (
        hopper.backward == "auto" and GLUON_VARLEN_BACKWARD_AUTO
        and gluon_backward_is_faster(q.shape[-1], causal, varlen_keys_per_sequence(bounds[1])))
    if wanted and uses_gluon_backward(q, k, causal, options):
        return gluon_varlen_backward(q, k, v, out, lse, grad_out, cu_q, cu_k, bounds, causal, scale,
                                     hopper.backward_dq)
    return triton_varlen_backward(q, k, v, out, lse, grad_out, cu_q, cu_k, bounds, causal, scale, options)


def hopper_backward(q, k, v, out, lse, grad_out, causal: bool, scale: float, config: TileConfig | None = None,
                    options: ScoreOptions = NO_OPTIONS, hopper: HopperOptions = HopperOptions(), row_vectors=None,
                    dq=None):
    """impl="triton_hopper"'s backward (arguments as :func:`triton_backward`): the Gluon FA3 backward where
    :func:`uses_gluon_backward` and ``hopper.backward`` asks for it ("auto": :func:`gluon_backward_is_faster`),
    else the portable kernels."""
    wanted = hopper.backward == "gluon" or (hopper.backward == "auto"
                                            and gluon_backward_is_faster(q.shape[-1], causal, k.shape[2]))
    if wanted and config is None and uses_gluon_backward(q, k, causal, options, window=True):
        return gluon_backward(q, k, v, out, lse, grad_out, causal, scale, hopper.backward_dq,
                              row_vectors=row_vectors, dq=dq, window=options.window)
    return triton_backward(q, k, v, out, lse, grad_out, causal, scale, config, options, row_vectors=row_vectors,
                           dq=dq)


def triton_hopper_attention(q, k, v, causal, scale, config: TileConfig | None = None, options=HopperOptions(),
                            window=(-1, -1), softcap: float = 0.0, alibi_slopes=None):
    """impl="triton_hopper": (out, lse); gradients through :func:`hopper_backward` (both backwards, like the
    Gluon forward, read grouped K/V once per group and sum dK, dV over it, and skip the tiles outside a window
    of a dense call; the portable one also carries the soft cap's and ALiBi's terms)."""
    load_triton()
    check_triton_inputs(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    score_options = ScoreOptions(tuple(window), float(softcap), alibi_slopes)
    forward_fn = functools.partial(hopper_forward, config=config, options=options, score_options=score_options)
    backward_fn = functools.partial(hopper_backward, hopper=options)
    return TritonAttentionFunction.apply(q, k, v, causal, scale, forward_fn, None, score_options, backward_fn)
