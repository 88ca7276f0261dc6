"""The FP8 quantization of the Gluon FA3 kernel's operands in one Triton pass and a tiny finish.

:func:`fa_lab.kernels.hopper.fp8_attention.quantize_for_kernel` prepares what ``impl="triton_hopper_fp8"``
feeds the Gluon kernel: Q and K rotated by M = diag(signs) H / sqrt(d) and quantized to
e4m3 with one scale per 128-row tile, and V quantized per 128-key tile and stored
transposed, its keys renumbered (:func:`fa_lab.kernels.common.gluon_fp8_key_order`).
Written as PyTorch operations that is a dozen passes over memory, several times the attention
kernel's own time at long sequences. Here it is one pass over Q, K and V and a finish, two launches:

1. :func:`_quantize_qkv_kernel`, a fixed number of programs (two per SM on a GPU) walking the (batch * head,
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
tile below the floor. The kernels are
plain Triton, so the CPU tests run them in the interpreter. Like the other kernel modules it imports
triton: import it after :func:`fa_lab.kernels.load_triton` (``quantize_for_kernel`` does, on a GPU only).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import common, interpreting, load_triton
from ..common import cdiv, descriptor, sm_count, tma_readable
from ..launch import cached_launch

E4M3_MAX = tl.constexpr(common.E4M3_MAX)  # e4m3's largest finite value (a constexpr: read in the kernel)


@triton.jit
def signed_hadamard(signs_ptr, HEAD_DIM: tl.constexpr):
    """diag(signs) H (HEAD_DIM, HEAD_DIM) float32, H Sylvester's +-1 matrix, made in registers: H[i, j] is
    (-1) to the number of bits i and j share (their AND's parity, folded by shifts; HEAD_DIM <= 256). Made
    here, the matrix costs each program a few integer operations per entry instead of a 64 KB read."""
    i = tl.arange(0, HEAD_DIM)[:, None]
    shared = i & tl.arange(0, HEAD_DIM)[None, :]
    shared = shared ^ (shared >> 4)
    shared = shared ^ (shared >> 2)
    shared = shared ^ (shared >> 1)
    signs = tl.load(signs_ptr + tl.arange(0, HEAD_DIM))
    return signs[:, None] * (1 - 2 * (shared & 1)).to(tl.float32)


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
    descale = tl.where(amax > 0, tl.div_rn(amax, E4M3_MAX), 1.0)
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
        r = position % 32
        row = position - r + 16 * (r // 16) + 8 * (r % 4 // 2) + 2 * (r % 16 // 4) + r % 2
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
def _quantize_tile_by_tma(x_desc, out_desc, descale_ptr, rotation, bh, tile, rsqrt_d, out_ptr, stride_orow, seqlen,
                          BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, FLOAT32_DOT: tl.constexpr,
                          TMA_STORE: tl.constexpr):
    x = _rotate(x_desc.load([0, bh, tile * BLOCK, 0]).reshape(BLOCK, HEAD_DIM), rotation, rsqrt_d, FLOAT32_DOT)
    _amax, descale, x8 = _to_e4m3(x, False)
    tl.store(descale_ptr, descale)
    if TMA_STORE:
        out_desc.store([0, bh, tile * BLOCK, 0], x8.reshape(1, 1, BLOCK, HEAD_DIM))
    else:
        row = tile * BLOCK + tl.arange(0, BLOCK)
        col = tl.arange(0, HEAD_DIM)
        tl.store(out_ptr + row[:, None] * stride_orow + col[None, :], x8, mask=row[:, None] < seqlen)


@triton.jit
def _quantize_v_by_tma(v_desc, out_ptr, descale_ptr, bh, tile, seqlen, out_keys, stride_orow, BLOCK: tl.constexpr,
                       HEAD_DIM: tl.constexpr):
    """V's tile through a 5-D TMA view whose box arrives in the kernel's key order."""
    position = tile * BLOCK + tl.arange(0, BLOCK)
    x = v_desc.load([(bh * seqlen + tile * BLOCK) // 16, 0, 0, 0, 0]).reshape(BLOCK, HEAD_DIM).to(tl.float32)
    amax, descale, x8 = _to_e4m3(x, True)
    col = tl.arange(0, HEAD_DIM)
    tl.store(descale_ptr, tl.where(amax > 0, descale, 0.0))
    tl.store(out_ptr + col[:, None] * stride_orow + position[None, :], tl.trans(x8),
             mask=position[None, :] < out_keys)


@triton.jit
def _walk_tiles(x_ptr, out_ptr, descale_ptr, rotation, tiles, seqlen, out_keys, bh_count, stride_xbh, stride_xn,
                stride_obh, stride_orow, rsqrt_d, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr,
                V_TRANSPOSED: tl.constexpr, FLOAT32_DOT: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
                out_desc=None, TMA_STORE: tl.constexpr = True):
    for work in tl.range(tl.program_id(0), bh_count * tiles, tl.num_programs(0), num_stages=STAGES):
        bh, t = work // tiles, work % tiles
        if TMA:
            if V_TRANSPOSED:
                _quantize_v_by_tma(x_ptr, out_ptr + bh * stride_obh, descale_ptr + work, bh, t, seqlen, out_keys,
                                   stride_orow, BLOCK, HEAD_DIM)
            else:
                _quantize_tile_by_tma(x_ptr, out_desc, descale_ptr + work, rotation, bh, t, rsqrt_d,
                                      out_ptr + bh * stride_obh, stride_orow, seqlen, BLOCK, HEAD_DIM, FLOAT32_DOT,
                                      TMA_STORE)
        else:
            _quantize_tile(x_ptr + bh * stride_xbh, out_ptr + bh * stride_obh, descale_ptr + work, rotation, t,
                           seqlen, out_keys, stride_xn, stride_orow, rsqrt_d, BLOCK, HEAD_DIM, ROTATE, V_TRANSPOSED,
                           FLOAT32_DOT)


@triton.jit
def _quantize_qkv_kernel(q_ptr, k_ptr, v_ptr, q8_ptr, k8_ptr, vt8_ptr, q_descale_ptr, k_descale_ptr, v_descale_ptr,
                         signs_ptr, seqlen_q, seqlen_k, keys, bh_count, stride_qbh, stride_qn, stride_kbh, stride_kn,
                         stride_vbh, stride_vn, stride_q8bh, stride_k8bh, stride_vt8bh, rsqrt_d, q8_desc, k8_desc,
                         v_desc, BLOCK: tl.constexpr,
                         HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr, FLOAT32_DOT: tl.constexpr,
                         STAGES: tl.constexpr, TMA: tl.constexpr, TMA_STORE: tl.constexpr, V_TMA: tl.constexpr):
    q_tiles = tl.cdiv(seqlen_q, BLOCK)
    k_tiles = tl.cdiv(seqlen_k, BLOCK)
    rotation = signed_hadamard(signs_ptr, HEAD_DIM) if ROTATE else 0.0
    _walk_tiles(q_ptr, q8_ptr, q_descale_ptr, rotation, q_tiles, seqlen_q, 0, bh_count, stride_qbh, stride_qn,
                stride_q8bh, HEAD_DIM, rsqrt_d, BLOCK, HEAD_DIM, ROTATE, False, FLOAT32_DOT, STAGES, TMA, q8_desc,
                TMA_STORE)
    _walk_tiles(k_ptr, k8_ptr, k_descale_ptr, rotation, k_tiles, seqlen_k, 0, bh_count, stride_kbh, stride_kn,
                stride_k8bh, HEAD_DIM, rsqrt_d, BLOCK, HEAD_DIM, ROTATE, False, FLOAT32_DOT, STAGES, TMA, k8_desc,
                TMA_STORE)
    if V_TMA:
        _walk_tiles(v_desc, vt8_ptr, v_descale_ptr, rotation, k_tiles, seqlen_k, keys, bh_count, stride_vbh,
                    stride_vn, stride_vt8bh, keys, 1.0, BLOCK, HEAD_DIM, False, True, FLOAT32_DOT, STAGES, True)
    else:
        _walk_tiles(v_ptr, vt8_ptr, v_descale_ptr, rotation, k_tiles, seqlen_k, keys, bh_count, stride_vbh,
                    stride_vn, stride_vt8bh, keys, 1.0, BLOCK, HEAD_DIM, False, True, FLOAT32_DOT, STAGES, False)


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
                          num_warps: int = 8, maxnreg: int | None = 128, stages: int = 1, tma: bool = True,
                          tma_store: bool = True, v_tma: bool = False):
    """(q8, k8, vt8, (q_descale, k_descale, v_descale, v_descale_max)) as quantize_for_kernel(gluon=True).

    programs (default: two per SM on a GPU, four in the interpreter), num_warps, maxnreg, stages: the
    quantization kernel's launch. Its offline sm_90 build takes at most 128 registers a thread at 8 warps (the cap,
    so that two programs fit an SM) and 64 KB of shared memory. tma (the default, where TMA can read Q and K and
    with a rotation): Q's and K's tiles move between global and shared memory by TMA
    (:func:`_quantize_tile_by_tma`), else by the threads' loads and stores. On the H200 the protocol's shapes took
    126 to 127 us with TMA and 140 to 141 us without, where one program per tile took 164 to 165 us
    (benchmarks/h200_fp8_quant.json; loops pipelined over two tiles and one program per SM measured slower:
    docs/experiments/hopper_forward.md). Both launches go through :func:`fa_lab.kernels.launch.cached_launch`,
    which brought an eager call from 231-338 us, bound by the host, to the GPU's time.

    q: (B, H, Nq, d), k, v: (B, H, Nk, d), bf16 or fp16, d a power of 2; signs: (d,) of +-1, or None
    for no rotation. q8, k8: (B, H, N, d) e4m3; vt8: (B, H, d, Nk rounded up to 32) e4m3 in the Gluon
    kernel's key order; descales (B, H, tiles) float32, v_descale_max (B, H). Two launches.
    """
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
    if bh and q_tiles + k_tiles:
        if programs is None:
            programs = 4 if interpreting() else 2 * sm_count(device)
        tma = tma and rotate and tma_readable(q_rows) and tma_readable(k_rows)
        q_src, k_src = ((descriptor(t.unsqueeze(0), block) for t in (q_rows, k_rows)) if tma else (q_rows, k_rows))
        q8_desc, k8_desc = ((descriptor(t.unsqueeze(0), block) for t in (q8, k8)) if tma else (None, None))
        q8_dst, k8_dst = q8, k8
        v_desc = None
        if v_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor
            flat = v_rows.reshape(-1, head_dim)
            view = flat.as_strided((flat.shape[0] // 16, 4, 2, 2, head_dim),
                                   (16 * head_dim, 2 * head_dim, 8 * head_dim, head_dim, 1))
            v_desc = TensorDescriptor.from_tensor(view, [block // 16, 4, 2, 2, head_dim])
        cached_launch(_quantize_qkv_kernel)[(min(programs, bh * (q_tiles + 2 * k_tiles)),)](
            q_src, k_src, v_rows, q8_dst, k8_dst, vt8, q_descale, k_descale, v_descale, signs, seqlen_q, seqlen_k, keys,
            bh, q_rows.stride(0), q_rows.stride(1), k_rows.stride(0), k_rows.stride(1), v_rows.stride(0),
            v_rows.stride(1), q8.stride(0), k8.stride(0), vt8.stride(0), head_dim ** -0.5, q8_desc, k8_desc, v_desc,
            BLOCK=block, HEAD_DIM=head_dim, ROTATE=rotate, FLOAT32_DOT=interpreting(), STAGES=stages, TMA=tma,
            TMA_STORE=tma_store, V_TMA=v_tma, num_warps=num_warps,
            **({} if maxnreg is None or interpreting() else {"maxnreg": maxnreg}))
        cached_launch(_v_exponent_kernel)[(bh,)](v_descale, v_exponent, v_descale_max, k_tiles, v_scale_floor,
                                  BLOCK_T=128)
    descales = (q_descale.view(batch, heads, q_tiles), k_descale.view(batch, heads, k_tiles),
                v_exponent.view(batch, heads, k_tiles), v_descale_max.view(batch, heads))
    return (q8.view(batch, heads, seqlen_q, head_dim), k8.view(batch, heads, seqlen_k, head_dim),
            vt8.view(batch, heads, head_dim, keys), descales)
