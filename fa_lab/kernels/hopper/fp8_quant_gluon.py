"""The FP8 quantization pass on sm_90, in Gluon: Q's and K's next tile copied by TMA while this one finishes.

The plain-Triton pass (:mod:`.fp8_quant`) has each program load a tile, rotate it, reduce, convert and store,
and only then ask for the next tile: the tile's copy from memory is never in flight while the program computes,
and Triton's own software pipeline of the loop issued the next copy at the end of the body, where it hid
nothing (docs/experiments/hopper_forward.md). Here the order is written out:

1. Q's and K's tiles, one list walked by a fixed grid (two programs per SM, 8 warps). Each program owns one
   shared-memory slot that a TMA copy fills (``mbarrier.expect`` / ``wait``). Once the rotation's WGMMA has
   read the slot (every warp past a barrier), the program issues the copy of its next tile into it, and only
   then takes this tile's absolute maximum, scales it, converts it to e4m3 and hands it to a TMA store through
   a staging buffer (whose previous store is waited for just before it is overwritten). diag(signs) H is made
   in registers once per program and kept in shared memory as the product's B operand.
2. V's tiles, as the Triton pass does them: the threads load each tile's rows in the FP8 kernel's key order,
   convert, and store V^T through a layout change (keys innermost, 16-byte stores).

The arithmetic is the Triton pass's, through the same jit helpers (:func:`.fp8_quant.hadamard_sign`,
:func:`.fp8_quant.fp8_key_of_position`, :func:`.fp8_quant.e4m3_descale`), so the bytes are the same; one
difference in form: the conversion to e4m3 saturates (``cvt.rn.satfinite``), which makes the Triton pass's clamp
to +-448 unnecessary here. A gpu test holds the two passes' outputs equal, byte for byte. The kernel needs
sm_90 (TMA, WGMMA); the CPU tests build it offline (:func:`.sm90_offline.fp8_quant_gluon_job`).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..common import cdiv, device_capability, gluon_descriptor, tma_readable
from ..launch import cached_launch
from .fp8_quant import e4m3_descale, fp8_key_of_position, hadamard_sign

TILE_ROWS = 128  # rows of a tile: the FP8 kernel's 128-row quantization blocks (one descale each)
HEAD_DIMS = (64, 128)  # where this pass runs (fp8_quant.quantize_fp8_operands takes the Triton pass otherwise)
NUM_WARPS = 8
MAXNREG = 128  # at 8 warps, two programs fit an SM's 64K registers


@gluon.jit
def _copy_qk_tile(i, slot, ready, q_desc, k_desc, q_work, qk_work, q_tiles, k_tiles):
    """Start the TMA copy of this program's i-th tile of the Q-then-K list into ``slot`` (none past the list)."""
    BLOCK: gl.constexpr = q_desc.block_type.shape[2]
    work = gl.program_id(0) + i * gl.num_programs(0)
    if work < qk_work:
        mbarrier.expect(ready, q_desc.block_type.nbytes)
        if work < q_work:
            tma.async_copy_global_to_shared(q_desc, [0, work // q_tiles, (work % q_tiles) * BLOCK, 0], ready, slot)
        else:
            k_work = work - q_work
            tma.async_copy_global_to_shared(k_desc, [0, k_work // k_tiles, (k_work % k_tiles) * BLOCK, 0], ready,
                                            slot)


@gluon.jit
def quantize_qkv_gluon_kernel(q_desc, k_desc, q8_desc, k8_desc, v_ptr, vt8_ptr, q_descale_ptr, k_descale_ptr,
                              v_descale_ptr, signs_ptr, seqlen_k, keys, bh_count, q_tiles, k_tiles, stride_vbh,
                              stride_vn, stride_vt8bh, rsqrt_d):
    """Grid (programs,), 8 warps. q/k_desc: TMA descriptors over Q, K as (1, B * H, N, d), blocks (1, 1, 128, d);
    q8/k8_desc the same over their e4m3 outputs. v: (B * H, Nk, d) rows (strides stride_vbh, stride_vn, unit
    along d); vt8: (B * H, d, keys) e4m3. Descales (B * H, tiles) float32 (V's 0 for an all-zero tile, for
    fp8_quant._v_exponent_kernel). rsqrt_d: 1 / sqrt(d)."""
    BLOCK: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    WARPS: gl.constexpr = gl.num_warps()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    # (rows, HEAD_DIM) tiles in 16-byte pieces along HEAD_DIM: the matrix's making and V's loads
    row_layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [WARPS, 1], [1, 0])
    # (HEAD_DIM, BLOCK) V^T, 16 keys a thread: 16-byte stores of e4m3
    vt_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])

    dims_down = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, row_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, row_layout))
    rotation = gl.load(signs_ptr + dims_down)[:, None] * hadamard_sign(dims_down[:, None], cols[None, :])  # diag(s) H
    rotation_smem = gl.allocate_shared_memory(q_desc.dtype, [HEAD_DIM, HEAD_DIM],
                                              gl.NVMMASharedLayout.get_default_for([HEAD_DIM, HEAD_DIM], q_desc.dtype),
                                              rotation.to(q_desc.dtype))
    slot = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    staging = gl.allocate_shared_memory(q8_desc.dtype, q8_desc.block_type.shape, q8_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    fence_async_shared()

    # 1. Q's and K's tiles: entries p, p + programs, ... of the Q-then-K list
    q_work = bh_count * q_tiles
    qk_work = q_work + bh_count * k_tiles
    _copy_qk_tile(0, slot, ready, q_desc, k_desc, q_work, qk_work, q_tiles, k_tiles)
    tile = slot.reshape([BLOCK, HEAD_DIM])
    for i in range(gl.cdiv(gl.maximum(qk_work - gl.program_id(0), 0), gl.num_programs(0))):
        work = gl.program_id(0) + i * gl.num_programs(0)
        mbarrier.wait(ready, i & 1)
        acc = warpgroup_mma(tile, rotation_smem, gl.zeros([BLOCK, HEAD_DIM], gl.float32, acc_layout),
                            is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()  # both warpgroups' products have read the slot: refill it
        _copy_qk_tile(i + 1, slot, ready, q_desc, k_desc, q_work, qk_work, q_tiles, k_tiles)
        x = acc * rsqrt_d
        descale = e4m3_descale(gl.max(gl.max(gl.abs(x), axis=1), axis=0))
        tma.store_wait(0)  # the previous tile's store has read the staging buffer
        staging.reshape([BLOCK, HEAD_DIM]).store((x / descale).to(gl.float8e4nv))
        fence_async_shared()
        if work < q_work:
            gl.store(q_descale_ptr + work, descale)
            tma.async_copy_shared_to_global(q8_desc, [0, work // q_tiles, (work % q_tiles) * BLOCK, 0], staging)
        else:
            k_work = work - q_work
            gl.store(k_descale_ptr + k_work, descale)
            tma.async_copy_shared_to_global(k8_desc, [0, k_work // k_tiles, (k_work % k_tiles) * BLOCK, 0], staging)
    tma.store_wait(0)
    mbarrier.invalidate(ready)

    # 2. V's tiles: rows gathered in the FP8 kernel's key order, stored transposed
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, vt_layout))
    for work in range(gl.program_id(0), bh_count * k_tiles, gl.num_programs(0)):
        bh = (work // k_tiles).to(gl.int64)  # (a head's offset may pass 2^31 elements)
        first = (work % k_tiles) * BLOCK
        row = fp8_key_of_position(first + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, row_layout)))
        x = gl.load(v_ptr + bh * stride_vbh + row[:, None] * stride_vn + cols[None, :],
                    mask=row[:, None] < seqlen_k, other=0.0).to(gl.float32)
        amax = gl.max(gl.max(gl.abs(x), axis=1), axis=0)
        descale = e4m3_descale(amax)
        gl.store(v_descale_ptr + work, gl.where(amax > 0, descale, 0.0))
        x8t = gl.convert_layout(gl.permute(gl.div_rn(x, descale).to(gl.float8e4nv), [1, 0]), vt_layout)
        position = first + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, vt_layout))
        gl.store(vt8_ptr + bh * stride_vt8bh + dims[:, None] * keys + position[None, :], x8t,
                 mask=position[None, :] < keys)


def gluon_quantization_applies(q_rows: torch.Tensor, k_rows: torch.Tensor, block: int, rotate: bool) -> bool:
    """Whether :func:`launch_gluon_quantization` takes these (B * H, N, d) rows: on an sm_90 GPU, with the rotation,
    128-row tiles, d in HEAD_DIMS, bf16 or fp16, and Q and K readable by TMA."""
    return (q_rows.is_cuda and rotate and block == TILE_ROWS and q_rows.shape[-1] in HEAD_DIMS
            and q_rows.dtype in (torch.bfloat16, torch.float16) and device_capability(q_rows.device) == (9, 0)
            and tma_readable(q_rows) and tma_readable(k_rows))


def launch_gluon_quantization(q_rows, k_rows, v_rows, q8, k8, vt8, q_descale, k_descale, v_descale, signs,
                              programs: int):
    """:func:`quantize_qkv_gluon_kernel` over the (B * H, N, d) rows, into the outputs that
    :func:`.fp8_quant.quantize_fp8_operands` allocated (q8, k8 like the rows, vt8 (B * H, d, keys), descales
    (B * H * tiles,) float32)."""
    bh, _, head_dim = q_rows.shape
    q_tiles, k_tiles = cdiv(q_rows.shape[1], TILE_ROWS), cdiv(k_rows.shape[1], TILE_ROWS)
    block = [1, 1, TILE_ROWS, head_dim]
    descriptors = [gluon_descriptor(t.unsqueeze(0), block) for t in (q_rows, k_rows, q8, k8)]
    cached_launch(quantize_qkv_gluon_kernel)[(min(programs, bh * (q_tiles + 2 * k_tiles)),)](
        *descriptors, v_rows, vt8, q_descale, k_descale, v_descale, signs, k_rows.shape[1], vt8.shape[-1], bh,
        q_tiles, k_tiles, v_rows.stride(0), v_rows.stride(1), vt8.stride(0), head_dim ** -0.5, num_warps=NUM_WARPS,
        maxnreg=MAXNREG)
