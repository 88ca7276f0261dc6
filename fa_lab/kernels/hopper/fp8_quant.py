"""The FP8 quantization of the Gluon FA3 kernel's operands in two Triton passes.

:func:`fa_lab.kernels.hopper.fp8_attention.quantize_for_kernel` prepares what ``impl="triton_hopper_fp8"``
feeds the Gluon kernel: Q and K rotated by M = diag(signs) H / sqrt(d) and quantized to
e4m3 with one scale per 128-row tile, and V quantized per 128-key tile and stored
transposed, its keys renumbered (:func:`fa_lab.kernels.common.gluon_fp8_key_order`).
Written as PyTorch operations that is a dozen passes over memory, several times the attention
kernel's own time at long sequences. Here it is two passes:

1. :func:`_quantize_tile_kernel` on Q and K, one program per (tile, batch * head): load
   the tile, rotate it with one ``tl.dot`` against Sylvester's +-1 matrix H (exact bf16/fp16
   products, float32 sums: no rounding between the butterflies of a fast transform), take
   its absolute maximum, store the descale and the e4m3 tile. For V the same kernel only
   stores each tile's absolute maximum (``AMAX_ONLY``).
2. :func:`_quantize_tile_kernel` on V again with the descales given (floored at
   ``V_SCALE_FLOOR`` of the head's largest, computed in between on the tiny (B, H, tiles)
   array), gathering the keys in the kernel's order and storing the tile transposed.

The result matches the PyTorch path up to the rotation's rounding (float32 here, the
input's dtype there) and so to one e4m3 step at most, in a few values. The kernel is plain
Triton, so the CPU tests run it in the interpreter. Like the other kernel modules it imports
triton: import it after :func:`fa_lab.kernels.load_triton` (``quantize_for_kernel`` does, on a GPU only).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...fp8 import hadamard_transform
from .. import common, interpreting, load_triton
from ..common import cdiv

E4M3_MAX = tl.constexpr(common.E4M3_MAX)  # e4m3's largest finite value (a constexpr: read in the kernel)


@triton.jit
def _quantize_tile_kernel(x_ptr, out_ptr, descale_ptr, hadamard_ptr, signs_ptr, seqlen, out_keys, stride_xbh,
                          stride_xn, stride_obh, stride_orow, rsqrt_d,
                          BLOCK: tl.constexpr = 128, HEAD_DIM: tl.constexpr = 128,
                          ROTATE: tl.constexpr = False, AMAX_ONLY: tl.constexpr = False,
                          V_TRANSPOSED: tl.constexpr = False, FLOAT32_DOT: tl.constexpr = False):
    """One (BLOCK, HEAD_DIM) tile of x (B * H, N, d) -> e4m3, its descale stored per (bh, tile).

    AMAX_ONLY: store the tile's absolute maximum at descale_ptr instead, and nothing else.

    V_TRANSPOSED: the tile's rows are the keys at positions [tile * BLOCK, +BLOCK) of the kernel's
    key order (common.gluon_fp8_key_order: position 16h + 4c + 2a + b of each 32 holds key
    16h + 8a + 2c + b), the descale is read, not computed, and the tile is stored as
    out[bh, column, position] for positions < out_keys.
    """
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    n_tiles = tl.num_programs(0)
    position = tile * BLOCK + tl.arange(0, BLOCK)
    if V_TRANSPOSED:
        r = position % 32
        row = position - r + 16 * (r // 16) + 8 * (r % 4 // 2) + 2 * (r % 16 // 4) + r % 2
    else:
        row = position
    col = tl.arange(0, HEAD_DIM)
    inside = row[:, None] < seqlen
    x = tl.load(x_ptr + bh * stride_xbh + row[:, None] * stride_xn + col[None, :], mask=inside, other=0.0)
    if ROTATE:  # x diag(signs) H / sqrt(d): the +-1 products are exact in x's dtype
        if FLOAT32_DOT:  # (the CPU interpreter: numpy has no bf16 matmul)
            x = x.to(tl.float32)
        signs = tl.load(signs_ptr + col).to(x.dtype)
        hadamard = tl.load(hadamard_ptr + col[:, None] * HEAD_DIM + col[None, :]).to(x.dtype)
        x = tl.dot(x * signs[None, :], hadamard) * rsqrt_d
    else:
        x = x.to(tl.float32)
    if V_TRANSPOSED:
        descale = tl.load(descale_ptr + bh * n_tiles + tile)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        if AMAX_ONLY:
            tl.store(descale_ptr + bh * n_tiles + tile, amax)
            return
        descale = tl.where(amax > 0, amax / E4M3_MAX, 1.0)
        tl.store(descale_ptr + bh * n_tiles + tile, descale)
    x8 = tl.clamp(x / descale, -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
    if V_TRANSPOSED:  # transposed in registers first, so that consecutive threads store consecutive keys
        tl.store(out_ptr + bh * stride_obh + col[:, None] * stride_orow + position[None, :], tl.trans(x8),
                 mask=position[None, :] < out_keys)
    else:
        tl.store(out_ptr + bh * stride_obh + row[:, None] * stride_orow + col[None, :], x8, mask=inside)


@functools.lru_cache(maxsize=None)
def _sylvester_hadamard(head_dim: int, device: torch.device) -> torch.Tensor:
    """Sylvester's +-1 matrix (head_dim, head_dim): the fast transform of the identity, times sqrt(d).
    Cached per device: a copy to the GPU on every call would cost more than the quantization."""
    return (hadamard_transform(torch.eye(head_dim)) * head_dim ** 0.5).round().to(device)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x: (B, H, N, d) as (B * H, N, d) with unit stride along d (what the kernel indexes)."""
    x = x.reshape(-1, *x.shape[2:])
    return x if x.stride(-1) == 1 else x.contiguous()


def quantize_fp8_operands(q, k, v, signs, block: int, v_scale_floor: float):
    """(q8, k8, vt8, (q_descale, k_descale, v_exponent, v_descale_max)) as quantize_for_kernel(gluon=True).

    q: (B, H, Nq, d), k, v: (B, H, Nk, d), bf16 or fp16, d a power of 2; signs: (d,) of +-1, or None
    for no rotation. q8, k8: (B, H, N, d) e4m3; vt8: (B, H, d, Nk rounded up to 32) e4m3 in the Gluon
    kernel's key order; descales (B, H, tiles) float32, v_descale_max (B, H).
    """
    load_triton()
    batch, heads, _, head_dim = q.shape
    device = q.device
    options = dict(BLOCK=block, HEAD_DIM=head_dim, num_warps=8)
    rotate = signs is not None
    if rotate:
        hadamard = _sylvester_hadamard(head_dim, device)
        signs = signs.to(device=device, dtype=torch.float32)
    else:
        hadamard = signs = q  # not read without the rotation

    def quantize_rows(x):
        x = _as_rows(x)
        tiles = cdiv(x.shape[1], block)
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
        descale = torch.empty(x.shape[0], tiles, dtype=torch.float32, device=device)
        _quantize_tile_kernel[(tiles, x.shape[0])](
            x, out, descale, hadamard, signs, x.shape[1], 0, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            head_dim ** -0.5, ROTATE=rotate, FLOAT32_DOT=interpreting(), **options)
        return out.view(batch, heads, *x.shape[1:]), descale.view(batch, heads, tiles)

    q8, q_descale = quantize_rows(q)
    k8, k_descale = quantize_rows(k)

    v_rows = _as_rows(v)
    seqlen_k = v_rows.shape[1]
    grid = (cdiv(seqlen_k, block), v_rows.shape[0])
    amax = torch.empty(grid[::-1], dtype=torch.float32, device=device)
    _quantize_tile_kernel[grid](v_rows, amax, amax, hadamard, signs, seqlen_k, 0, v_rows.stride(0), v_rows.stride(1),
                                0, 0, 1.0, AMAX_ONLY=True, **options)
    amax = torch.maximum(amax, v_scale_floor * amax.amax(dim=-1, keepdim=True))
    v_descale = torch.where(amax > 0, amax / common.E4M3_MAX, torch.ones_like(amax))
    v_descale_max = v_descale.amax(dim=-1)
    keys = cdiv(seqlen_k, 32) * 32
    vt8 = torch.empty(v_rows.shape[0], head_dim, keys, dtype=torch.float8_e4m3fn, device=device)
    _quantize_tile_kernel[grid](v_rows, vt8, v_descale, hadamard, signs, seqlen_k, keys, v_rows.stride(0),
                                v_rows.stride(1), vt8.stride(0), vt8.stride(1), 1.0, V_TRANSPOSED=True, **options)
    v_exponent = torch.log2(v_descale / v_descale_max[:, None])
    descales = (q_descale, k_descale, v_exponent.view(batch, heads, -1), v_descale_max.view(batch, heads))
    return q8, k8, vt8.view(batch, heads, head_dim, keys), descales
