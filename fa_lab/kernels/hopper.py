"""Launchers of the Hopper forward (impl "triton_hopper" and "triton_hopper_fp8").

``triton_hopper``: the pipelined forward of :mod:`fa_lab.kernels.triton_hopper`
with the backward of the portable kernels (``impl="triton"``): a backward tuned
for Hopper did not pay for itself yet, so gradients come from the same
recomputation kernels, fed with this forward's O and LSE.

``triton_hopper_fp8``: forward only (inference). Q, K, V are quantized to e4m3
with one scale per kernel tile, after an optional random Hadamard rotation of Q
and K (incoherent processing, :mod:`fa_lab.fp8`); the output is in q's dtype.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import interpreting, load_triton
from .configs import TileConfig, forward_config, head_dim_bucket
from .flash_triton import (
    LOG2E,
    TritonAttentionFunction,
    check_triton_inputs,
    descriptor,
    kernel_operand,
    on_device,
    triton_cdiv,
)
from .tile_schedule import schedule_tensor


@dataclass(frozen=True)
class HopperOptions:
    """Which kernel and which FA3 ideas the forward uses (each can be switched to measure it).

    ``kernel="gluon"``: the warp-specialized FA3 kernel of :mod:`fa_lab.kernels.gluon_fa3`
    (producer warp + ``consumers`` consumer warpgroups, ``stages`` K/V slots, ``pingpong`` to
    alternate the consumers' WGMMAs explicitly). It runs on sm_90 for head_dim <= 128
    (padded to 64 or 128); other shapes and the CPU interpreter use ``kernel="triton"``.

    ``kernel="triton"``: the plain-Triton kernel of :mod:`fa_lab.kernels.triton_hopper`,
    with ``pipeline`` (QK^T of tile j+1 issued before the softmax of tile j) and
    ``warp_specialize`` (Triton's own pass).

    Measured on an H200 at d=128, 8K (benchmarks/h200_hopper_variants.json), forward TFLOP/s
    not causal / causal: gluon 613 / 578, with 3 stages 602 / 614, with ping-pong 607 / 562,
    persistent 610 / 609; plain Triton 514 / 471 (pipelined, 2 stages: 499 / 458). Between runs
    the Gluon variants swap places by 5-10% (the run before: 614 / 567, 603 / 565, 612 / 581,
    607 / 627), so 2 stages, one tile per CTA, stay the bf16 default. FP8 (FP8_OPTIONS): persistent
    835 / 812, one tile per CTA 836 / 761. Three consumers (192-row tiles) leave each 160 registers,
    and ptxas spills (see :mod:`fa_lab.kernels.sm90_offline`).
    """

    kernel: str = "gluon"
    pipeline: bool = False
    warp_specialize: bool = False
    stages: int = 2
    pingpong: bool = False
    consumers: int = 2
    persistent: bool = False  # Gluon: one CTA per SM, each looping over its tiles (tile_schedule)


# The FP8 forward's default. Ping-pong paid before P was packed with two cvt per register (684
# against 651 TFLOP/s at 8K); since then the free-running consumers are as fast or faster
# (825 / 771 against 820 / 744 at 8K), as in bf16. The persistent kernel pays in FP8, whose
# K/V steps are short enough for a work tile's start and end to show (4K: 813 against 781 not
# causal, 706 against 668 causal, benchmarks/probes/session4_sched_probe.jsonl; 8K causal: 812
# against 761, h200_hopper_variants.json). In bf16 it does not pay reliably (HopperOptions).
FP8_OPTIONS = HopperOptions(persistent=True)


def uses_gluon(q: torch.Tensor, options: HopperOptions) -> bool:
    """True when the Gluon FA3 kernel runs this input: asked for, on sm_90, head_dim bucket 64 or 128."""
    return (options.kernel == "gluon" and q.is_cuda and not interpreting()
            and torch.cuda.get_device_capability(q.device) == (9, 0)
            and head_dim_bucket(q.shape[-1]) in (64, 128))


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The swizzled shared-memory layout of a TMA tile (cached: building it costs ~5 us per launch)."""
    from triton.experimental.gluon import language as gl

    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


def gluon_descriptor(t: torch.Tensor, block: list[int]):
    """A Gluon TMA descriptor over t: (B, H, N, d8), or V^T (B, H, d, N8), with tiles of shape ``block``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _shared_layout(tuple(block), t.dtype))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU: the persistent kernel's grid."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def gluon_forward(q, k, v, causal, scale, options: HopperOptions = HopperOptions(), fp8_scales=None,
                  out_dtype=None):
    """The Gluon FA3 forward on prepared operands (as :func:`hopper_forward`): (out, lse).

    fp8_scales: None for bf16/fp16 operands; for e4m3 operands (v given as V^T, (B, H, d, Nk))
    the tuple (q_descale, k_descale, v_exponent, v_descale_max) of :func:`quantize_for_kernel`
    with ``gluon=True``, and ``out_dtype`` the output's dtype.
    """
    from .gluon_fa3 import (
        CONSUMER_REGS,
        ROWS_PER_CONSUMER,
        attention_fwd_fa3_kernel,
        descriptor_blocks,
        launch_maxnreg,
    )

    batch, heads, seqlen_q, _ = q.shape
    fp8 = fp8_scales is not None
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    blocks = descriptor_blocks(head_dim_bucket(q.shape[-1]), fp8)
    descriptors = [gluon_descriptor(t, blocks[name]) for name, t in zip("qkvo", (q, k, v, out))]
    block_m = ROWS_PER_CONSUMER.value * options.consumers
    total_tiles = triton_cdiv(seqlen_q, block_m) * batch * heads
    grid, schedule = (total_tiles,), lse  # (lse: a placeholder pointer, not read)
    if options.persistent:
        grid = (min(total_tiles, _sm_count(q.device)),)
        schedule = schedule_tensor(batch * heads, seqlen_q, k.shape[2], block_m, blocks["k"][2], causal, grid[0],
                                   q.device)
    attention_fwd_fa3_kernel[grid](
        *descriptors, lse,
        *(fp8_scales or (lse,) * 4), heads, seqlen_q, k.shape[2], schedule, scale * LOG2E,
        CONSUMERS=options.consumers, STAGES=options.stages, CAUSAL=causal, PINGPONG=options.pingpong, FP8=fp8,
        PERSISTENT=options.persistent,
        CONSUMER_REGS=CONSUMER_REGS[options.consumers], num_warps=4, maxnreg=launch_maxnreg(options.consumers))
    return out, lse


def hopper_launch(q, k, v, out, lse, descales, causal, scale, config, options, fp8=False):
    """Launch the kernel on prepared operands; v is V (B, H, Nk, d) or, in FP8, V^T (B, H, d, Nk)."""
    from .triton_hopper import attention_fwd_hopper_kernel

    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    head_dim_pad = head_dim_bucket(head_dim)
    if fp8:
        from triton.tools.tensor_descriptor import TensorDescriptor
        desc_v = TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, head_dim_pad, config.block_n])
    else:
        desc_v = descriptor(v, config.block_n)
    grid = (triton_cdiv(seqlen_q, config.block_m), batch * heads)
    attention_fwd_hopper_kernel[grid](
        descriptor(q, config.block_m), descriptor(k, config.block_n), desc_v, descriptor(out, config.block_m),
        lse, *descales, heads, seqlen_q, seqlen_k, scale * LOG2E,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim_pad, CAUSAL=causal,
        PIPELINE=options.pipeline, WARP_SPECIALIZE=options.warp_specialize, FP8=fp8,
        num_warps=config.num_warps, num_stages=config.num_stages)


def hopper_forward(q, k, v, causal, scale, config: TileConfig | None = None, options=HopperOptions()):
    """bf16/fp16 forward on prepared operands (as :func:`flash_triton.triton_forward`): (out, lse)."""
    if uses_gluon(q, options):
        return gluon_forward(q, k, v, causal, scale, options)
    config = config or forward_config(q.shape[-1], causal, interpreting())
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    dummy = lse  # the descale pointers are not read outside FP8
    hopper_launch(q, k, v, out, lse, (dummy, dummy, dummy), causal, scale, config, options)
    return out, lse


def triton_hopper_attention(q, k, v, causal, scale, config: TileConfig | None = None, options=HopperOptions()):
    """impl="triton_hopper": (out, lse); gradients through the portable recomputation backward."""
    load_triton()
    check_triton_inputs(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    forward_fn = functools.partial(hopper_forward, config=config, options=options)
    return TritonAttentionFunction.apply(q, k, v, causal, scale, forward_fn, None)


# No V tile's scale is below 2^-24 of its head's largest: the Gluon kernel folds the ratio of the
# two into P's exponent (see gluon_fa3._fp8_tile_scales), which must stay in float32's range.
V_SCALE_FLOOR = 2.0 ** -24
GLUON_TILES = TileConfig(128, 128)  # the Gluon kernel's Q and K/V tiles (the quantization blocks follow them)


def gluon_fp8_key_order(seqlen_k: int, device=None) -> torch.Tensor:
    """Where the Gluon FP8 kernel expects each key of V^T: index (N32,) into the keys, N32 = seqlen_k up to 32.

    Inside each 32-key block, position 16h + 4c + 2a + b holds key 16h + 8a + 2c + b: the order
    in which a thread of the WGMMA accumulator holds P, so P becomes an FP8 operand without
    moving data between threads (see gluon_fa3._p_operand, which reorders P the same way).
    """
    position = torch.arange(-(-seqlen_k // 32) * 32, device=device)
    r = position % 32
    h, c, a, b = r // 16, r % 16 // 4, r % 4 // 2, r % 2
    return position - r + 16 * h + 8 * a + 2 * c + b


@functools.lru_cache(maxsize=None)
def rotation_signs(head_dim: int, device: torch.device) -> torch.Tensor:
    """The FP8 path's fixed random signs (seed 0), (head_dim,) float32 on ``device`` (cached: no copy per call)."""
    from ..fp8 import random_signs

    return random_signs(head_dim, torch.Generator().manual_seed(0)).to(device)


def quantize_for_kernel(q, k, v, config: TileConfig, rotate: bool = True, gluon: bool = False, fused: bool = True):
    """FP8 operands of the kernel: (q8, k8, vt8, (q_descale, k_descale, v_descale, v_descale_max)).

    q: (B, H, Nq, d), k, v: (B, H, Nk, d). With ``rotate``, Q and K are first
    multiplied by the same random orthogonal M = diag(signs) H / sqrt(d)
    (QK^T is unchanged; outliers are spread over all d columns). Each tensor then
    gets one e4m3 scale per kernel tile (BLOCK_M rows of Q, BLOCK_N rows of K/V);
    V is returned transposed, (B, H, d, Nk), because Hopper's FP8 WGMMA reads it K-major.
    The descales are (B, H, tiles) float32; v_descale_max, (B, H), is the largest V descale per head.
    ``gluon`` (for the Gluon kernel only): V^T's keys in the order of :func:`gluon_fp8_key_order`,
    and V's descales given as the exponents log2(v_descale / v_descale_max) that the kernel adds to P's.
    On a GPU this runs as two Triton passes (:mod:`fa_lab.kernels.fp8_quant`, which rotates in float32
    rather than in q's dtype) where they apply; ``fused=False`` keeps the PyTorch operations below.
    """
    from ..fp8 import incoherent_rotation, quantize_e4m3

    signs = rotation_signs(q.shape[-1], q.device) if rotate else None
    # The two Triton passes cover the Gluon kernel's operands: head_dim 64 or 128, 128-row tiles.
    if (fused and gluon and q.is_cuda and not interpreting() and q.shape[-1] in (64, 128)
            and config.block_m == config.block_n == 128):
        load_triton()
        from .fp8_quant import quantize_fp8_operands

        return quantize_fp8_operands(q, k, v, signs, config.block_n, V_SCALE_FLOOR)
    if rotate:
        q, k = incoherent_rotation(q, k, signs)
    q8, k8 = quantize_e4m3(q, config.block_m), quantize_e4m3(k, config.block_n)
    v8 = quantize_e4m3(v, config.block_n, floor_ratio=V_SCALE_FLOOR)
    vt8 = v8.data.transpose(-2, -1)
    if gluon:  # keys padded to 32 (masked by seqlen_k in the kernel) and reordered
        order = gluon_fp8_key_order(vt8.shape[-1], vt8.device)
        vt8 = torch.nn.functional.pad(vt8.view(torch.uint8), (0, len(order) - vt8.shape[-1]))
        vt8 = vt8[..., order].view(torch.float8_e4m3fn)
    vt8 = kernel_operand(vt8)  # keys padded to 16: masked by seqlen_k in the kernel
    v_descale_max = v8.scales.amax(dim=-1).contiguous()
    v_descales = torch.log2(v8.scales / v_descale_max[..., None]) if gluon else v8.scales
    descales = (q8.scales, k8.scales, v_descales, v_descale_max)
    return kernel_operand(q8.data), kernel_operand(k8.data), vt8, descales


def fp8_forward(q8, k8, vt8, descales, seqlen_k, causal, scale, config: TileConfig, out_dtype, head_dim,
                options: HopperOptions = FP8_OPTIONS):
    """The FP8 kernel on quantized operands: (out: (B, H, Nq, d) in out_dtype, lse).

    The Gluon kernel when :func:`uses_gluon` (its operands quantized with GLUON_TILES and ``gluon=True``),
    else the Triton one.
    """
    if uses_gluon(q8, options):
        out, lse = gluon_forward(q8, k8, vt8, causal, scale, options, fp8_scales=descales, out_dtype=out_dtype)
        return out[..., :head_dim], lse
    batch, heads, seqlen_q, _ = q8.shape
    out = torch.empty((batch, heads, seqlen_q, q8.shape[-1]), dtype=out_dtype, device=q8.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q8.device)
    hopper_launch(q8, k8, vt8, out, lse, descales[:3], causal, scale, config, options, fp8=True)
    return out[..., :head_dim], lse


class _ForwardOnly(torch.autograd.Function):
    """Passes the FP8 forward's output through and refuses a backward with the reason."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("impl='triton_hopper_fp8' is forward-only (FP8 attention is for inference); "
                           "use impl='triton_hopper' or 'triton' to train")


def triton_hopper_fp8_attention(q, k, v, causal, scale, config: TileConfig | None = None, rotate: bool = True,
                                options: HopperOptions = FP8_OPTIONS):
    """impl="triton_hopper_fp8": quantize (and rotate) then the FP8 kernel; forward only. (out, lse).

    ``config`` (tiles, and so quantization blocks) applies to the Triton kernel; the Gluon kernel
    has its own tiles (GLUON_TILES).
    """
    load_triton()
    check_triton_inputs(q)
    head_dim = q.shape[-1]
    if rotate and head_dim & (head_dim - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, got {head_dim}")
    scale = head_dim ** -0.5 if scale is None else scale
    gluon = uses_gluon(q, options)
    config = GLUON_TILES if gluon else config or forward_config(head_dim, causal, interpreting())
    with torch.no_grad():
        q8, k8, vt8, descales = quantize_for_kernel(q, k, v, config, rotate, gluon=gluon)
        with on_device(q):
            out, lse = fp8_forward(q8, k8, vt8, descales, k.shape[2], causal, scale, config, q.dtype, head_dim,
                                   options)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out = _ForwardOnly.apply(out, q, k, v)
    return out, lse
