"""The FP8 quantization of the Gluon FA3 kernel's operands in one pass and a tiny finish.

:func:`fa_lab.kernels.hopper.fp8_attention.quantize_for_kernel` prepares what ``impl="triton_hopper_fp8"``
feeds the Gluon kernel: Q and K rotated by M = diag(signs) H / sqrt(d) and quantized to
e4m3 with one scale per 128-row tile, and V quantized per 128-key tile and stored
transposed, its keys renumbered (:func:`fa_lab.kernels.common.gluon_fp8_key_order`).
Written as PyTorch operations that is a dozen passes over memory, several times the attention
kernel's own time at long sequences. Here it is one pass over Q, K and V and a finish, two launches:

1. On an sm_90 GPU the Gluon pass of :mod:`.fp8_quant_gluon` (Q's and K's tiles by TMA, the next one's copy
   in flight while this one finishes); elsewhere, and in the CPU interpreter,
   :func:`_quantize_qkv_kernel`, a fixed number of programs (two per SM on a GPU) walking the (batch * head,
   tile) lists of Q, K and V: for each tile, load it, for Q and K rotate it with one ``tl.dot`` against
   diag(signs) H, H Sylvester's +-1 matrix made in registers once per program (:func:`signed_hadamard`;
   exact bf16/fp16 products, float32 sums: no rounding between the butterflies of a fast transform),
   take its absolute maximum, store the descale and the e4m3 tile; a V tile's keys are gathered in the
   kernel's order and the tile is stored transposed.
2. :func:`_v_exponent_kernel`, one program per (batch, head) on the tiny (B * H, tiles) array of V's
   descales: the head's largest, and each tile's exponent log2(descale / largest), which the Gluon
   kernel adds to P's. The ratio is floored at ``V_SCALE_FLOOR``: a tile quieter than that
   fraction of its head (an all-zero tile, say) then weighs at most that fraction of the head's largest
   V too much, where the PyTorch path raises its scale to the floor instead.

Q and K match the PyTorch path (:func:`fa_lab.fp8.quantize_e4m3`) up to the rotation's rounding (float32
here, the input's dtype there), so to one e4m3 step at most, in a few values. V's bytes match it exactly
(both take the IEEE quotient amax / 448 as a tile's scale and divide by it with IEEE division), but in a
tile below the floor. This module's kernels are plain Triton, so the CPU tests run them in the interpreter; a
gpu test holds the Gluon pass to their bytes. Like the other kernel modules it imports triton: import it after
:func:`fa_lab.kernels.load_triton` (``quantize_for_kernel`` does, for the Gluon kernel's operands on sm_90 only).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import common, interpreting, load_triton
from ..common import cdiv, sm_count
from ..launch import cached_launch

E4M3_MAX = tl.constexpr(common.E4M3_MAX)  # e4m3's largest finite value (a constexpr: read in the kernel)


@triton.jit
def hadamard_sign(row, col):
    """H[row, col] of Sylvester's +-1 matrix (HEAD_DIM <= 256) as float32: (-1) to the number of bits row and col
    share (their AND's parity, folded by shifts). Plain integer arithmetic on tensors of any layout, so the Gluon
    pass (:mod:`.fp8_quant_gluon`) calls it too."""
    shared = row & col
    shared = shared ^ (shared >> 4)
    shared = shared ^ (shared >> 2)
    shared = shared ^ (shared >> 1)
    return (1 - 2 * (shared & 1)).to(tl.float32)


@triton.jit
def fp8_key_of_position(position):
    """The key the Gluon FP8 kernel expects at V^T's position ``position``: position 16h + 4c + 2a + b of each
    32 holds key 16h + 8a + 2c + b (common.gluon_fp8_key_order; shared with the Gluon pass)."""
    r = position % 32
    return position - r + 16 * (r // 16) + 8 * (r % 4 // 2) + 2 * (r % 16 // 4) + r % 2


@triton.jit
def e4m3_descale(amax):
    """A tile's descale from its absolute maximum: the IEEE quotient amax / 448 as quantize_e4m3's (1 for an
    all-zero tile; shared with the Gluon pass)."""
    return tl.where(amax > 0, tl.div_rn(amax, E4M3_MAX), 1.0)


@triton.jit
def signed_hadamard(signs_ptr, HEAD_DIM: tl.constexpr):
    """diag(signs) H (HEAD_DIM, HEAD_DIM) float32, made in registers: a few integer operations per entry per
    program instead of a 64 KB read."""
    i = tl.arange(0, HEAD_DIM)
    signs = tl.load(signs_ptr + i)
    return signs[:, None] * hadamard_sign(i[:, None], tl.arange(0, HEAD_DIM)[None, :])


@triton.jit
def _rotate(x, rotation, rsqrt_d, FLOAT32_DOT: tl.constexpr):
    """x diag(signs) H / sqrt(d), float32: the +-1 products are exact in x's dtype."""
    if FLOAT32_DOT:  # (the CPU interpreter: numpy has no bf16 matmul)
        x = x.to(tl.float32)
    return tl.dot(x, rotation.to(x.dtype)) * rsqrt_d


@triton.jit
def _to_e4m3(x, IEEE_DIVISION: tl.constexpr):
    """(amax, descale, x8) of a float32 tile: its absolute maximum, the IEEE quotient amax / 448 as quantize_e4m3's
    (1 for an all-zero tile), and x / descale in e4m3. IEEE_DIVISION: divide x with IEEE division too (a plain /
    is approximate on a GPU), for bytes equal to the PyTorch path's."""
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    descale = e4m3_descale(amax)
    if IEEE_DIVISION:
        x8 = tl.clamp(tl.div_rn(x, descale), -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
    else:
        x8 = tl.clamp(x / descale, -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
    return amax, descale, x8


@triton.jit
def _quantize_tile(x_ptr, out_ptr, descale_ptr, rotation, tile, seqlen, out_keys, stride_xn,
                   stride_orow, rsqrt_d, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr,
                   V_TRANSPOSED: tl.constexpr, FLOAT32_DOT: tl.constexpr):
    """Tile ``tile`` (BLOCK, HEAD_DIM) of one (batch, head) of x (pointers already at that head) -> e4m3,
    its descale stored at descale_ptr. rotation: :func:`signed_hadamard`'s matrix when ROTATE (unread otherwise).

    V_TRANSPOSED: the tile's rows are the keys at positions [tile * BLOCK, +BLOCK) of the kernel's
    key order (common.gluon_fp8_key_order: position 16h + 4c + 2a + b of each 32 holds key
    16h + 8a + 2c + b), and the tile is stored as out[column, position] for positions < out_keys. Its
    descale is 0 for an all-zero tile (:func:`_v_exponent_kernel` reads it), 1 for Q's and K's.
    """
    position = tile * BLOCK + tl.arange(0, BLOCK)
    if V_TRANSPOSED:
        row = fp8_key_of_position(position)
    else:
        row = position
    col = tl.arange(0, HEAD_DIM)
    inside = row[:, None] < seqlen
    x = tl.load(x_ptr + row[:, None] * stride_xn + col[None, :], mask=inside, other=0.0)
    x = _rotate(x, rotation, rsqrt_d, FLOAT32_DOT) if ROTATE else x.to(tl.float32)
    amax, descale, x8 = _to_e4m3(x, V_TRANSPOSED)  # (V's bytes are the PyTorch path's)
    if V_TRANSPOSED:  # transposed in registers first, so that consecutive threads store consecutive keys
        tl.store(descale_ptr, tl.where(amax > 0, descale, 0.0))
        tl.store(out_ptr + col[:, None] * stride_orow + position[None, :], tl.trans(x8),
                 mask=position[None, :] < out_keys)
    else:
        tl.store(descale_ptr, descale)
        tl.store(out_ptr + row[:, None] * stride_orow + col[None, :], x8, mask=inside)


@triton.jit
def _walk_tiles(x_ptr, out_ptr, descale_ptr, rotation, tiles, seqlen, out_keys, bh_count, stride_xbh, stride_xn,
                stride_obh, stride_orow, rsqrt_d, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr,
                V_TRANSPOSED: tl.constexpr, FLOAT32_DOT: tl.constexpr, STAGES: tl.constexpr):
    """This program's share of one tensor's (bh, tile) list, ``tiles`` per head: entries p, p + programs, ...
    (descales (B * H, tiles), so entry ``work``'s descale sits at descale_ptr + work)."""
    for work in tl.range(tl.program_id(0), bh_count * tiles, tl.num_programs(0), num_stages=STAGES):
        bh, t = (work // tiles).to(tl.int64), work % tiles  # (a head's offset may pass 2^31 elements)
        _quantize_tile(x_ptr + bh * stride_xbh, out_ptr + bh * stride_obh, descale_ptr + work, rotation, t, seqlen,
                       out_keys, stride_xn, stride_orow, rsqrt_d, BLOCK, HEAD_DIM, ROTATE, V_TRANSPOSED, FLOAT32_DOT)


@triton.jit
def _quantize_qkv_kernel(q_ptr, k_ptr, v_ptr, q8_ptr, k8_ptr, vt8_ptr, q_descale_ptr, k_descale_ptr, v_descale_ptr,
                         signs_ptr, seqlen_q, seqlen_k, keys, bh_count, stride_qbh, stride_qn, stride_kbh, stride_kn,
                         stride_vbh, stride_vn, stride_q8bh, stride_k8bh, stride_vt8bh, rsqrt_d, BLOCK: tl.constexpr,
                         HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr, FLOAT32_DOT: tl.constexpr,
                         STAGES: tl.constexpr):
    """Grid (programs,): program p quantizes tiles p, p + programs, ... of Q's (bh, tile) list, then of K's, then
    of V's, with the rotation's matrix made once. q, k, v: (B * H, N, d) rows; q8, k8 the same in e4m3,
    contiguous; vt8 (B * H, d, keys); descales (B * H, tiles) float32. STAGES: the loops' software pipeline."""
    q_tiles = tl.cdiv(seqlen_q, BLOCK)
    k_tiles = tl.cdiv(seqlen_k, BLOCK)
    rotation = signed_hadamard(signs_ptr, HEAD_DIM) if ROTATE else 0.0
    _walk_tiles(q_ptr, q8_ptr, q_descale_ptr, rotation, q_tiles, seqlen_q, 0, bh_count, stride_qbh, stride_qn,
                stride_q8bh, HEAD_DIM, rsqrt_d, BLOCK, HEAD_DIM, ROTATE, False, FLOAT32_DOT, STAGES)
    _walk_tiles(k_ptr, k8_ptr, k_descale_ptr, rotation, k_tiles, seqlen_k, 0, bh_count, stride_kbh, stride_kn,
                stride_k8bh, HEAD_DIM, rsqrt_d, BLOCK, HEAD_DIM, ROTATE, False, FLOAT32_DOT, STAGES)
    _walk_tiles(v_ptr, vt8_ptr, v_descale_ptr, rotation, k_tiles, seqlen_k, keys, bh_count, stride_vbh, stride_vn,
                stride_vt8bh, keys, 1.0, BLOCK, HEAD_DIM, False, True, FLOAT32_DOT, STAGES)


@triton.jit
def _v_exponent_kernel(v_descale_ptr, v_exponent_ptr, v_descale_max_ptr, tiles, floor,
                       BLOCK_T: tl.constexpr):
    """Program bh: v_descale_max[bh] = the largest of V's tile descales (1 for an all-zero head) and
    v_exponent[bh, t] = log2(max(descale_t / largest, floor))."""
    bh = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_T)
    largest = tl.zeros([BLOCK_T], dtype=tl.float32)
    for start in range(0, tiles, BLOCK_T):
        largest = tl.maximum(largest, tl.load(v_descale_ptr + bh * tiles + start + offs,
                                              mask=start + offs < tiles, other=0.0))
    largest = tl.max(largest, axis=0)
    largest = tl.where(largest > 0, largest, 1.0)
    tl.store(v_descale_max_ptr + bh, largest)
    for start in range(0, tiles, BLOCK_T):
        inside = start + offs < tiles
        descale = tl.load(v_descale_ptr + bh * tiles + start + offs, mask=inside, other=1.0)
        exponent = tl.log2(tl.maximum(descale / largest, floor))  # (an all-zero tile's descale is 0)
        tl.store(v_exponent_ptr + bh * tiles + start + offs, exponent, mask=inside)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x: (B, H, N, d) as (B * H, N, d) with unit stride along d (what the kernel indexes)."""
    x = x.reshape(-1, *x.shape[2:])
    return x if x.stride(-1) == 1 else x.contiguous()


def quantize_fp8_operands(q, k, v, signs, block: int, v_scale_floor: float, programs: int | None = None,
                          num_warps: int = 8, maxnreg: int | None = 128, stages: int = 1, kernel: str | None = None):
    """(q8, k8, vt8, (q_descale, k_descale, v_descale, v_descale_max)) as quantize_for_kernel(gluon=True).

    kernel: "gluon" (:mod:`.fp8_quant_gluon`: Q's and K's next tile copied by TMA while this one finishes), or
    "triton" (:func:`_quantize_qkv_kernel`, the threads' loads; the interpreter's and every other input's); None
    takes the Gluon pass where :func:`.fp8_quant_gluon.gluon_quantization_applies`. On the H200 the protocol's
    shapes took 112 to 113 us with the Gluon pass, 0.74 to 0.75 of a copy's bandwidth, against 144 us for this
    module's kernel (benchmarks/h200_fp8_quant.json). programs (default: two per SM on a GPU, four in the interpreter);
    num_warps, maxnreg, stages: the Triton kernel's launch (8 warps capped at 128 registers fit two programs an
    SM; loops pipelined over two tiles and one program per SM measured slower: docs/experiments/hopper_forward.md).
    Both kernels and V's finish go through :func:`fa_lab.kernels.launch.cached_launch`, so from 4K an eager call takes
    about the GPU's time (113 us; at 1K-2K the eager call is host-bound, 173-201 us).

    q: (B, H, Nq, d), k, v: (B, H, Nk, d), bf16 or fp16, d a power of 2; signs: (d,) of +-1, or None
    for no rotation. q8, k8: (B, H, N, d) e4m3; vt8: (B, H, d, Nk rounded up to 32) e4m3 in the Gluon
    kernel's key order; descales (B, H, tiles) float32, v_descale_max (B, H). Two launches.
    """
    from .fp8_quant_gluon import gluon_quantization_applies, launch_gluon_quantization

    load_triton()
    batch, heads, _, head_dim = q.shape
    device = q.device
    rotate = signs is not None
    signs = signs.to(device=device, dtype=torch.float32) if rotate else q  # (q: not read without the rotation)
    q_rows, k_rows, v_rows = _as_rows(q), _as_rows(k), _as_rows(v)
    (bh, seqlen_q, _), seqlen_k = q_rows.shape, k_rows.shape[1]
    q_tiles, k_tiles, keys = cdiv(seqlen_q, block), cdiv(seqlen_k, block), cdiv(seqlen_k, 32) * 32
    q8 = torch.empty(q_rows.shape, dtype=torch.float8_e4m3fn, device=device)
    k8 = torch.empty(k_rows.shape, dtype=torch.float8_e4m3fn, device=device)
    vt8 = torch.empty(bh, head_dim, keys, dtype=torch.float8_e4m3fn, device=device)
    # One float32 buffer holds the five small outputs: Q's, K's and V's descales, V's exponents, V's largest.
    small = torch.empty(bh * (q_tiles + 3 * k_tiles + 1), dtype=torch.float32, device=device)
    q_descale, k_descale, v_descale, v_exponent, v_descale_max = small.split(
        [bh * q_tiles, bh * k_tiles, bh * k_tiles, bh * k_tiles, bh])
    if kernel is None:
        gluon = not interpreting() and gluon_quantization_applies(q_rows, k_rows, block, rotate)
        kernel = "gluon" if gluon else "triton"
    if bh and q_tiles + k_tiles:
        if programs is None:
            programs = 4 if interpreting() else 2 * sm_count(device)
        if kernel == "gluon":
            launch_gluon_quantization(q_rows, k_rows, v_rows, q8, k8, vt8, q_descale, k_descale, v_descale, signs,
                                      programs)
        else:
            cached_launch(_quantize_qkv_kernel)[(min(programs, bh * (q_tiles + 2 * k_tiles)),)](
                q_rows, k_rows, v_rows, q8, k8, vt8, q_descale, k_descale, v_descale, signs, seqlen_q, seqlen_k, keys,
                bh, q_rows.stride(0), q_rows.stride(1), k_rows.stride(0), k_rows.stride(1), v_rows.stride(0),
                v_rows.stride(1), q8.stride(0), k8.stride(0), vt8.stride(0), head_dim ** -0.5, BLOCK=block,
                HEAD_DIM=head_dim, ROTATE=rotate, FLOAT32_DOT=interpreting(), STAGES=stages, num_warps=num_warps,
                **({} if maxnreg is None or interpreting() else {"maxnreg": maxnreg}))
        cached_launch(_v_exponent_kernel)[(bh,)](v_descale, v_exponent, v_descale_max, k_tiles, v_scale_floor,
                                                 BLOCK_T=128)
    descales = (q_descale.view(batch, heads, q_tiles), k_descale.view(batch, heads, k_tiles),
                v_exponent.view(batch, heads, k_tiles), v_descale_max.view(batch, heads))
    return (q8.view(batch, heads, seqlen_q, head_dim), k8.view(batch, heads, seqlen_k, head_dim),
            vt8.view(batch, heads, head_dim, keys), descales)
