"""impl="triton_hopper_fp8": the FP8 forward (inference only), Gluon on sm_90, the portable kernel elsewhere.

Q, K, V are quantized to e4m3 with one scale per kernel tile, after an optional random Hadamard
rotation of Q and K (incoherent processing, :mod:`fa_lab.fp8`); the output is in q's dtype.
"""
from __future__ import annotations

import functools

import torch

from .. import interpreting, load_triton
from ..common import cdiv, check_triton_inputs, gluon_fp8_key_order, kernel_operand, on_device
from ..portable.attention import pipelined_forward
from ..portable.configs import TileConfig, forward_config
from .attention import FP8_OPTIONS, HopperOptions, gluon_forward, uses_gluon

# No V tile's scale is below 2^-24 of its head's largest: the Gluon kernel folds the ratio of the
# two into P's exponent (see fa3_softmax.fp8_tile_scales), which must stay in float32's range.
V_SCALE_FLOOR = 2.0 ** -24
GLUON_TILES = TileConfig(128, 128)  # the Gluon kernel's Q and K/V tiles (the quantization blocks follow them)


@functools.lru_cache(maxsize=None)
def rotation_signs(head_dim: int, device: torch.device) -> torch.Tensor:
    """The FP8 path's fixed random signs (seed 0), (head_dim,) float32 on ``device`` (cached: no copy per call)."""
    from ...fp8 import random_signs

    return random_signs(head_dim, torch.Generator().manual_seed(0)).to(device)


def quantize_for_kernel(q, k, v, config: TileConfig, rotate: bool = True, gluon: bool = False, fused: bool = True):
    """FP8 operands of the kernel: (q8, k8, vt8, (q_descale, k_descale, v_descale, v_descale_max)).

    q: (B, H, Nq, d), k, v: (B, H, Nk, d). With ``rotate``, Q and K are first
    multiplied by the same random orthogonal M = diag(signs) H / sqrt(d)
    (QK^T is unchanged; outliers are spread over all d columns). Each tensor then
    gets one e4m3 scale per kernel tile (BLOCK_M rows of Q, BLOCK_N rows of K/V);
    V is returned transposed, (B, H, d, Nk), because Hopper's FP8 WGMMA reads it K-major.
    The descales are (B, H, tiles) float32; v_descale_max, (B, H), is the largest V descale per head.
    ``gluon`` (for the Gluon kernel only): V^T's keys in the order of
    :func:`fa_lab.kernels.common.gluon_fp8_key_order`,
    and V's descales given as the exponents log2(v_descale / v_descale_max) that the kernel adds to P's.
    For the Gluon kernel's operands (``gluon``, on sm_90) this runs as one pass and a finish (:mod:`.fp8_quant`:
    the Gluon pass, or the Triton one where that does not apply; both rotate in float32 rather than in q's
    dtype); elsewhere, and with ``fused=False``, the PyTorch operations below.
    """
    from ...fp8 import incoherent_rotation, quantize_e4m3

    signs = rotation_signs(q.shape[-1], q.device) if rotate else None
    # The fused pass covers the Gluon kernel's operands: head_dim 64 or 128, 128-row tiles.
    if (fused and gluon and q.is_cuda and not interpreting() and q.shape[-1] in (64, 128)
            and config.block_m == config.block_n == 128):
        load_triton()
        from .fp8_quant import quantize_fp8_operands

        return quantize_fp8_operands(q, k, v, signs, config.block_n, V_SCALE_FLOOR)
    if rotate:
        q, k = incoherent_rotation(q, k, signs)
    q8, k8 = quantize_e4m3(q, config.block_m), quantize_e4m3(k, config.block_n)
    v8 = quantize_e4m3(v, config.block_n, floor_ratio=V_SCALE_FLOOR)
    vt8 = v_transposed(v8.data, gluon)
    v_descale_max = v8.scales.amax(dim=-1).contiguous()
    v_descales = torch.log2(v8.scales / v_descale_max[..., None]) if gluon else v8.scales
    descales = (q8.scales, k8.scales, v_descales, v_descale_max)
    return kernel_operand(q8.data), kernel_operand(k8.data), vt8, descales


def v_transposed(v8: torch.Tensor, gluon: bool) -> torch.Tensor:
    """e4m3 V (B, H, Nk, d) -> V^T (B, H, d, keys) as the FP8 kernels read it (Hopper's FP8 WGMMA takes B
    K-major): keys padded to 16, or for the Gluon kernel to 32 and renumbered
    (:func:`fa_lab.kernels.common.gluon_fp8_key_order`); the padding is masked by seqlen_k in the kernels."""
    vt8 = v8.transpose(-2, -1)
    if gluon:
        order = gluon_fp8_key_order(vt8.shape[-1], vt8.device)
        vt8 = torch.nn.functional.pad(vt8.view(torch.uint8), (0, len(order) - vt8.shape[-1]))
        vt8 = vt8[..., order].view(torch.float8_e4m3fn)
    return kernel_operand(vt8)


def prequantized_operands(q8, k8, v8, q_descale, k_descale, v_descale, config: TileConfig, gluon: bool):
    """The FP8 kernel's operands from inputs already in e4m3 with flash-attn's descales: q8 (B, H, Nq, d),
    k8, v8 (B, H, Nk, d) (K/V expanded to one head per query head), each descale (B, H) float32, one per
    (batch, head), as a framework that quantizes in its own kernel (with RoPE, say) passes them. Returns
    (q8, k8, vt8, descales) as :func:`quantize_for_kernel`: every tile of a head gets its head's descale,
    and V's per-tile exponents are 0 (one descale per head is its own largest)."""
    batch, heads, seqlen_q, _ = q8.shape
    q_tiles, k_tiles = cdiv(seqlen_q, config.block_m), cdiv(k8.shape[2], config.block_n)
    per_tile = [d.float()[..., None].expand(batch, heads, tiles).contiguous()
                for d, tiles in ((q_descale, q_tiles), (k_descale, k_tiles), (v_descale, k_tiles))]
    if gluon:
        v_exponent = torch.zeros_like(per_tile[2])
        descales = (per_tile[0], per_tile[1], v_exponent, v_descale.float().contiguous())
    else:
        descales = (*per_tile, v_descale.float().contiguous())
    return kernel_operand(q8), kernel_operand(k8), v_transposed(v8, gluon), descales


def fp8_forward(q8, k8, vt8, descales, causal, scale, config: TileConfig, out_dtype, head_dim,
                options: HopperOptions = FP8_OPTIONS):
    """The FP8 kernel on quantized operands: (out: (B, H, Nq, d) in out_dtype, lse).

    The Gluon kernel when :func:`.attention.uses_gluon` (its operands quantized with GLUON_TILES and
    ``gluon=True``), else the portable pipelined kernel.
    """
    if uses_gluon(q8, options):
        out, lse = gluon_forward(q8, k8, vt8, causal, scale, options, fp8_scales=descales, out_dtype=out_dtype)
        return out[..., :head_dim], lse
    batch, heads, seqlen_q, _ = q8.shape
    out = torch.empty((batch, heads, seqlen_q, q8.shape[-1]), dtype=out_dtype, device=q8.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q8.device)
    pipelined_forward(q8, k8, vt8, out, lse, descales[:3], causal, scale, config, pipeline=options.pipeline,
                      warp_specialize=options.warp_specialize, fp8=True)
    return out[..., :head_dim], lse


def triton_hopper_fp8_prequantized(q8, k8, v8, descales, causal, scale, out_dtype=torch.bfloat16,
                                   options: HopperOptions = FP8_OPTIONS):
    """impl="triton_hopper_fp8" on inputs already in e4m3: q8 (B, H, Nq, d), k8, v8 (B, H, Nk, d) (K/V
    expanded to one head per query head), descales = (q_descale, k_descale, v_descale), each (B, H)
    float32, flash-attn's convention (x = x8 * descale). No rotation and no quantization pass: V is only
    laid out as V^T (a pass over its bytes). Returns (out (B, H, Nq, d) in out_dtype, lse)."""
    load_triton()
    head_dim = q8.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    gluon, config = _fp8_tiles(q8, causal, options)
    with torch.no_grad():
        operands = prequantized_operands(q8, k8, v8, *descales, config, gluon)
        with on_device(q8):
            return fp8_forward(*operands, causal, scale, config, out_dtype, head_dim, options)


def _fp8_tiles(q, causal: bool, options: HopperOptions, config: TileConfig | None = None):
    """(gluon, tiles): whether the Gluon kernel runs q, and the tiles (so the quantization blocks) of the
    kernel that does: GLUON_TILES, else ``config`` or the portable kernel's own."""
    gluon = uses_gluon(q, options)
    return gluon, GLUON_TILES if gluon else config or forward_config(q.shape[-1], causal, interpreting())


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

    ``config`` (tiles, and so quantization blocks) applies to the portable kernel; the Gluon kernel
    has its own tiles (GLUON_TILES).
    """
    load_triton()
    check_triton_inputs(q)
    head_dim = q.shape[-1]
    if rotate and head_dim & (head_dim - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, got {head_dim}")
    scale = head_dim ** -0.5 if scale is None else scale
    gluon, config = _fp8_tiles(q, causal, options, config)
    with torch.no_grad():
        q8, k8, vt8, descales = quantize_for_kernel(q, k, v, config, rotate, gluon=gluon)
        with on_device(q):
            out, lse = fp8_forward(q8, k8, vt8, descales, causal, scale, config, q.dtype, head_dim, options)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out = _ForwardOnly.apply(out, q, k, v)
    return out, lse
