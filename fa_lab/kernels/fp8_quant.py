"""The FP8 quantization of the Gluon FA3 kernel's operands in two Triton passes.

:func:`fa_lab.kernels.hopper.quantize_for_kernel` prepares what ``impl="triton_hopper_fp8"``
feeds the Gluon kernel: Q and K rotated by M = diag(signs) H / sqrt(d) and quantized to
e4m3 with one scale per 128-row tile, and V quantized per 128-key tile and stored
transposed, its keys renumbered (:func:`fa_lab.kernels.hopper.gluon_fp8_key_order`).
Written as PyTorch operations that is a dozen passes over memory: 4.7 ms on an H200 at
the FA3 protocol's 16K tokens x 16 heads, more than three times the attention kernel.
Here it is two passes:

1. :func:`_quantize_tile_kernel` on Q and K, one program per (tile, batch * head): load
   the tile, rotate it with one ``tl.dot`` against Sylvester's +-1 matrix H (exact bf16/fp16
   products, float32 sums: no rounding between the butterflies of a fast transform), take
   its absolute maximum, store the descale and the e4m3 tile. For V the same kernel only
   stores each tile's absolute maximum (``AMAX_ONLY``).
2. :func:`_quantize_tile_kernel` on V again with the descales given (floored at
   ``V_SCALE_FLOOR`` of the head's largest, computed in between on the tiny (B, H, tiles)
   array), gathering the keys in the kernel's order and storing the tile transposed.

The result matches the PyTorch path up to the rotation's rounding (float32 here, the
input's dtype there) and so to one e4m3 step at most, in a few values.
"""
from __future__ import annotations

import functools

import torch

from ..fp8 import E4M3_MAX
from . import interpreting, load_triton


def _kernel():
    """Build (once) and return the Triton kernel; Triton is imported only when it is needed."""
    global _QUANTIZE_TILE_KERNEL
    if _QUANTIZE_TILE_KERNEL is not None:
        return _QUANTIZE_TILE_KERNEL
    triton = load_triton()
    import triton.language as tl

    @triton.jit
    def _quantize_tile_kernel(x_ptr, out_ptr, descale_ptr, amax_ptr, hadamard_ptr, signs_ptr, seqlen, out_keys,
                              stride_xbh, stride_xn, stride_obh, stride_orow, rsqrt_d,
                              BLOCK: tl.constexpr = 128, HEAD_DIM: tl.constexpr = 128,
                              ROTATE: tl.constexpr = False, AMAX_ONLY: tl.constexpr = False,
                              V_TRANSPOSED: tl.constexpr = False, FLOAT32_DOT: tl.constexpr = False):
        """One (BLOCK, HEAD_DIM) tile of x (B * H, N, d) -> e4m3, its descale stored per (bh, tile).

        V_TRANSPOSED: the tile's rows are the keys at positions [tile * BLOCK, +BLOCK) of the kernel's
        key order (position 16h + 4c + 2a + b of each 32 holds key 16h + 8a + 2c + b), the descale is
        read, not computed, and the tile is stored as out[bh, column, position] for positions < out_keys.
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
                tl.store(amax_ptr + bh * n_tiles + tile, amax)
                return
            descale = tl.where(amax > 0, amax / 448.0, 1.0)  # e4m3's largest finite value
            tl.store(descale_ptr + bh * n_tiles + tile, descale)
        x8 = tl.clamp(x / descale, -448.0, 448.0).to(tl.float8e4nv)
        if V_TRANSPOSED:  # transposed in registers first, so that consecutive threads store consecutive keys
            tl.store(out_ptr + bh * stride_obh + col[:, None] * stride_orow + position[None, :], tl.trans(x8),
                     mask=position[None, :] < out_keys)
        else:
            tl.store(out_ptr + bh * stride_obh + row[:, None] * stride_orow + col[None, :], x8, mask=inside)

    _QUANTIZE_TILE_KERNEL = _quantize_tile_kernel
    return _QUANTIZE_TILE_KERNEL


_QUANTIZE_TILE_KERNEL = None


@functools.lru_cache(maxsize=None)
def sylvester_hadamard(head_dim: int, device: torch.device) -> torch.Tensor:
    """Sylvester's +-1 matrix H (head_dim, head_dim), head_dim a power of 2: x @ H / sqrt(d) is
    what :func:`fa_lab.fp8.hadamard_transform` computes with butterflies. Cached per device (a copy
    to the GPU on every call would cost more than the quantization)."""
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < head_dim:
        hadamard = torch.cat((torch.cat((hadamard, hadamard), 1), torch.cat((hadamard, -hadamard), 1)), 0)
    return hadamard.to(device)


def fused_quantization_applies(q: torch.Tensor, block_m: int, block_n: int) -> bool:
    """The two passes handle head_dim 64 and 128 with 128-row tiles of Q, K and V (the Gluon kernel's)."""
    return q.shape[-1] in (64, 128) and block_m == block_n == 128


def quantize_fp8_operands(q, k, v, signs, block: int, v_scale_floor: float):
    """(q8, k8, vt8, (q_descale, k_descale, v_exponent, v_descale_max)) as quantize_for_kernel(gluon=True).

    q: (B, H, Nq, d), k, v: (B, H, Nk, d), bf16 or fp16; signs: (d,) of +-1, or None for no rotation.
    q8, k8: (B, H, N, d) e4m3; vt8: (B, H, d, Nk rounded up to 32) e4m3 in the Gluon kernel's key
    order; descales (B, H, tiles) float32, v_descale_max (B, H).
    """
    kernel = _kernel()
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    device = q.device
    rotate = signs is not None
    rsqrt_d = head_dim ** -0.5
    hadamard = sylvester_hadamard(head_dim, device) if rotate else q  # (not read without rotation)
    signs = signs.to(device=device, dtype=torch.float32) if rotate else q

    def quantize_rows(x, rotate_rows):
        x = x.reshape(batch * heads, x.shape[2], head_dim)
        if x.stride(-1) != 1:
            x = x.contiguous()
        tiles = -(-x.shape[1] // block)
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
        descale = torch.empty(batch * heads, tiles, dtype=torch.float32, device=device)
        kernel[(tiles, batch * heads)](x, out, descale, descale, hadamard, signs, x.shape[1], 0,
                                       x.stride(0), x.stride(1), out.stride(0), out.stride(1), rsqrt_d,
                                       BLOCK=block, HEAD_DIM=head_dim, ROTATE=rotate_rows, FLOAT32_DOT=interpreting(),
                                       num_warps=8)
        return out.view(batch, heads, x.shape[1], head_dim), descale.view(batch, heads, tiles)

    q8, q_descale = quantize_rows(q, rotate)
    k8, k_descale = quantize_rows(k, rotate)

    v3 = v.reshape(batch * heads, seqlen_k, head_dim)
    if v3.stride(-1) != 1:
        v3 = v3.contiguous()
    tiles = -(-seqlen_k // block)
    amax = torch.empty(batch * heads, tiles, dtype=torch.float32, device=device)
    common = dict(BLOCK=block, HEAD_DIM=head_dim, num_warps=8)
    kernel[(tiles, batch * heads)](v3, amax, amax, amax, hadamard, signs, seqlen_k, 0, v3.stride(0), v3.stride(1),
                                   0, 0, 1.0, AMAX_ONLY=True, **common)
    amax = torch.maximum(amax, v_scale_floor * amax.amax(dim=-1, keepdim=True))
    v_descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    v_descale_max = v_descale.amax(dim=-1)
    keys = -(-seqlen_k // 32) * 32
    vt8 = torch.empty(batch * heads, head_dim, keys, dtype=torch.float8_e4m3fn, device=device)
    kernel[(-(-keys // block), batch * heads)](v3, vt8, v_descale, v_descale, hadamard, signs, seqlen_k, keys,
                                               v3.stride(0), v3.stride(1), vt8.stride(0), vt8.stride(1), 1.0,
                                               V_TRANSPOSED=True, **common)
    v_exponent = torch.log2(v_descale / v_descale_max[:, None])
    descales = (q_descale, k_descale, v_exponent.view(batch, heads, tiles), v_descale_max.view(batch, heads))
    return q8, k8, vt8.view(batch, heads, head_dim, keys), descales
