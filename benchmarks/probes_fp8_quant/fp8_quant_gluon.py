"""Probe: the FP8 quantization pass in Gluon, Q's and K's tiles prefetched through a ring of TMA slots."""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .. import common, load_triton
from ..common import cdiv, gluon_descriptor, sm_count
from ..launch import cached_launch

E4M3_MAX = gl.constexpr(common.E4M3_MAX)


@gluon.jit
def _signed_hadamard(signs_ptr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    i = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, layout))[:, None]
    shared = i & gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))[None, :]
    shared = shared ^ (shared >> 4)
    shared = shared ^ (shared >> 2)
    shared = shared ^ (shared >> 1)
    signs = gl.load(signs_ptr + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, layout)))
    return signs[:, None] * (1 - 2 * (shared & 1)).to(gl.float32)


@gluon.jit
def _issue(i, slots, ready, q_desc, k_desc, q_work, qk_work, q_tiles, k_tiles, SLOTS: gl.constexpr,
           BLOCK: gl.constexpr):
    """This program's i-th Q/K tile into slot i % SLOTS (nothing past the list)."""
    work = gl.program_id(0) + i * gl.num_programs(0)
    slot = i % SLOTS
    if work < qk_work:
        bar = ready.index(slot)
        mbarrier.expect(bar, q_desc.block_type.nbytes)
        if work < q_work:
            tma.async_copy_global_to_shared(q_desc, [0, work // q_tiles, (work % q_tiles) * BLOCK, 0], bar,
                                            slots.index(slot))
        else:
            rest = work - q_work
            tma.async_copy_global_to_shared(k_desc, [0, rest // k_tiles, (rest % k_tiles) * BLOCK, 0], bar,
                                            slots.index(slot))


@gluon.jit
def quantize_qkv_gluon_kernel(q_desc, k_desc, q8_desc, k8_desc, v_ptr, vt8_ptr, q_descale_ptr, k_descale_ptr,
                              v_descale_ptr, signs_ptr, seqlen_k, keys, bh_count, q_tiles, k_tiles, stride_vbh,
                              stride_vn, stride_vt8bh, rsqrt_d, SLOTS: gl.constexpr, V_ROWS: gl.constexpr,
                              V_ASYNC: gl.constexpr = False, SKIP_V: gl.constexpr = False,
                              SKIP_QK: gl.constexpr = False, V_DIRECT: gl.constexpr = False):
    BLOCK: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    build_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    rotation = _signed_hadamard(signs_ptr, HEAD_DIM, build_layout).to(q_desc.dtype)
    r_smem = gl.allocate_shared_memory(q_desc.dtype, [HEAD_DIM, HEAD_DIM],
                                       gl.NVMMASharedLayout.get_default_for([HEAD_DIM, HEAD_DIM], q_desc.dtype),
                                       rotation)
    slots = gl.allocate_shared_memory(q_desc.dtype, [SLOTS] + q_desc.block_type.shape, q_desc.layout)
    staging = gl.allocate_shared_memory(q8_desc.dtype, q8_desc.block_type.shape, q8_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(SLOTS):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()
    q_work = bh_count * q_tiles
    qk_work = q_work + bh_count * k_tiles
    for s in gl.static_range(SLOTS):
        _issue(s, slots, ready, q_desc, k_desc, q_work, qk_work, q_tiles, k_tiles, SLOTS, BLOCK)
    count = gl.cdiv(gl.maximum(qk_work - gl.program_id(0), 0), gl.num_programs(0))
    if SKIP_QK:
        count = 0
    for i in range(count):
        work = gl.program_id(0) + i * gl.num_programs(0)
        slot = i % SLOTS
        mbarrier.wait(ready.index(slot), (i // SLOTS) & 1)
        x_smem = slots.index(slot).reshape([BLOCK, HEAD_DIM])
        acc = warpgroup_mma(x_smem, r_smem, gl.zeros([BLOCK, HEAD_DIM], gl.float32, mma_layout), is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()  # every warpgroup is done reading the slot
        _issue(i + SLOTS, slots, ready, q_desc, k_desc, q_work, qk_work, q_tiles, k_tiles, SLOTS, BLOCK)
        y = acc * rsqrt_d
        amax = gl.max(gl.max(gl.abs(y), axis=1), axis=0)
        descale = gl.where(amax > 0, gl.div_rn(amax, E4M3_MAX), 1.0)
        y8 = gl.minimum(gl.maximum(y / descale, -E4M3_MAX), E4M3_MAX).to(gl.float8e4nv)
        tma.store_wait(0)  # the last tile's store has read the staging buffer
        staging.reshape([BLOCK, HEAD_DIM]).store(y8)
        fence_async_shared()
        if work < q_work:
            gl.store(q_descale_ptr + work, descale)
            tma.async_copy_shared_to_global(q8_desc, [0, work // q_tiles, (work % q_tiles) * BLOCK, 0], staging)
        else:
            rest = work - q_work
            gl.store(k_descale_ptr + rest, descale)
            tma.async_copy_shared_to_global(k8_desc, [0, rest // k_tiles, (rest % k_tiles) * BLOCK, 0], staging)
    tma.store_wait(0)
    for s in gl.static_range(SLOTS):
        mbarrier.invalidate(ready.index(s))
    # V: the threads' loads, rows gathered in the FP8 kernel's key order, stored transposed.
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    store_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])
    v_work = bh_count * k_tiles
    if SKIP_V:
        v_work = 0
    v_slot = slots.index(0).reshape([BLOCK, HEAD_DIM])
    if V_ASYNC:
        _issue_v(gl.program_id(0), v_work, v_slot, v_ptr, seqlen_k, k_tiles, stride_vbh, stride_vn, V_ROWS, HEAD_DIM,
                 load_layout)
    for work in range(gl.program_id(0), v_work, gl.num_programs(0)):
        bh = work // k_tiles
        t = work % k_tiles
        if V_ASYNC:
            async_copy.wait_group(0)
            gl.thread_barrier()
            x = v_slot.load(load_layout).to(gl.float32)
            gl.thread_barrier()
            _issue_v(work + gl.num_programs(0), v_work, v_slot, v_ptr, seqlen_k, k_tiles, stride_vbh, stride_vn,
                     V_ROWS, HEAD_DIM, load_layout)
        elif V_DIRECT:  # each thread loads 16 keys x 2 columns and stores 16 consecutive keys per column
            direct_layout: gl.constexpr = gl.BlockedLayout([16, 2], [1, 32], [NUM_WARPS, 1], [1, 0])
            _v_direct(work, bh, t, v_ptr, vt8_ptr, v_descale_ptr, seqlen_k, keys, stride_vbh, stride_vn,
                      stride_vt8bh, V_ROWS, HEAD_DIM, direct_layout)
        else:
            row = _v_rows(t, V_ROWS, load_layout)
            col = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load_layout))
            x = gl.load(v_ptr + bh * stride_vbh + row[:, None] * stride_vn + col[None, :],
                        mask=row[:, None] < seqlen_k, other=0.0).to(gl.float32)
        if not V_DIRECT:
            amax = gl.max(gl.max(gl.abs(x), axis=1), axis=0)
            descale = gl.where(amax > 0, gl.div_rn(amax, E4M3_MAX), 1.0)
            x8 = gl.minimum(gl.maximum(gl.div_rn(x, descale), -E4M3_MAX), E4M3_MAX).to(gl.float8e4nv)
            gl.store(v_descale_ptr + work, gl.where(amax > 0, descale, 0.0))
            x8t = gl.convert_layout(gl.permute(x8, [1, 0]), store_layout)
            pos = t * V_ROWS + gl.arange(0, V_ROWS, layout=gl.SliceLayout(0, store_layout))
            dim = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, store_layout))
            gl.store(vt8_ptr + bh * stride_vt8bh + dim[:, None] * keys + pos[None, :], x8t, mask=pos[None, :] < keys)


@gluon.jit
def _v_direct(work, bh, t, v_ptr, vt8_ptr, v_descale_ptr, seqlen_k, keys, stride_vbh, stride_vn, stride_vt8bh,
              V_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    row = _v_rows(t, V_ROWS, layout)
    pos = t * V_ROWS + gl.arange(0, V_ROWS, layout=gl.SliceLayout(1, layout))
    col = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    x = gl.load(v_ptr + bh * stride_vbh + row[:, None] * stride_vn + col[None, :],
                mask=row[:, None] < seqlen_k, other=0.0).to(gl.float32)
    amax = gl.max(gl.max(gl.abs(x), axis=1), axis=0)
    descale = gl.where(amax > 0, gl.div_rn(amax, E4M3_MAX), 1.0)
    x8 = gl.minimum(gl.maximum(gl.div_rn(x, descale), -E4M3_MAX), E4M3_MAX).to(gl.float8e4nv)
    gl.store(v_descale_ptr + work, gl.where(amax > 0, descale, 0.0))
    # the same threads' elements, held keys first: 16-byte stores along each column of V^T
    keys_first: gl.constexpr = gl.BlockedLayout(layout.size_per_thread, layout.threads_per_warp, layout.warps_per_cta,
                                                [0, 1])
    x8 = gl.convert_layout(x8, keys_first)
    pos = gl.convert_layout(pos, gl.SliceLayout(1, keys_first))
    col = gl.convert_layout(col, gl.SliceLayout(0, keys_first))
    gl.store(vt8_ptr + bh * stride_vt8bh + col[None, :] * keys + pos[:, None], x8, mask=pos[:, None] < keys)


@gluon.jit
def _v_rows(t, V_ROWS: gl.constexpr, layout: gl.constexpr):
    position = t * V_ROWS + gl.arange(0, V_ROWS, layout=gl.SliceLayout(1, layout))
    r = position % 32
    return position - r + 16 * (r // 16) + 8 * (r % 4 // 2) + 2 * (r % 16 // 4) + r % 2


@gluon.jit
def _issue_v(work, v_work, v_slot, v_ptr, seqlen_k, k_tiles, stride_vbh, stride_vn, V_ROWS: gl.constexpr,
             HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    if work < v_work:
        bh = work // k_tiles
        row = _v_rows(work % k_tiles, V_ROWS, layout)
        col = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        async_copy.async_copy_global_to_shared(v_slot, v_ptr + bh * stride_vbh + row[:, None] * stride_vn + col[None, :],
                                               mask=row[:, None] < seqlen_k)
    async_copy.commit_group()


def quantize_fp8_operands(q, k, v, signs, block: int, v_scale_floor: float, programs: int | None = None,
                          slots: int = 2, num_warps: int = 8, maxnreg: int | None = 128, **flags):
    """As fp8_quant.quantize_fp8_operands (with the rotation), on sm_90."""
    from .fp8_quant import _as_rows, _v_exponent_kernel

    load_triton()
    batch, heads, _, head_dim = q.shape
    device = q.device
    signs = signs.to(device=device, dtype=torch.float32)
    q_rows, k_rows, v_rows = _as_rows(q), _as_rows(k), _as_rows(v)
    (bh, seqlen_q, _), seqlen_k = q_rows.shape, k_rows.shape[1]
    q_tiles, k_tiles, keys = cdiv(seqlen_q, block), cdiv(seqlen_k, block), cdiv(seqlen_k, 32) * 32
    q8 = torch.empty(q_rows.shape, dtype=torch.float8_e4m3fn, device=device)
    k8 = torch.empty(k_rows.shape, dtype=torch.float8_e4m3fn, device=device)
    vt8 = torch.empty(bh, head_dim, keys, dtype=torch.float8_e4m3fn, device=device)
    small = torch.empty(bh * (q_tiles + 3 * k_tiles + 1), dtype=torch.float32, device=device)
    q_descale, k_descale, v_descale, v_exponent, v_descale_max = small.split(
        [bh * q_tiles, bh * k_tiles, bh * k_tiles, bh * k_tiles, bh])
    programs = programs or 2 * sm_count(device)
    blk = [1, 1, block, head_dim]
    descs = [gluon_descriptor(t.unsqueeze(0), blk) for t in (q_rows, k_rows, q8, k8)]
    cached_launch(quantize_qkv_gluon_kernel)[(min(programs, bh * (q_tiles + 2 * k_tiles)),)](
        *descs, v_rows, vt8, q_descale, k_descale, v_descale, signs, seqlen_k, keys, bh, q_tiles, k_tiles,
        v_rows.stride(0), v_rows.stride(1), vt8.stride(0), head_dim ** -0.5, SLOTS=slots, V_ROWS=block, **flags,
        num_warps=num_warps, **({} if maxnreg is None else {"maxnreg": maxnreg}))
    cached_launch(_v_exponent_kernel)[(bh,)](v_descale, v_exponent, v_descale_max, k_tiles, v_scale_floor,
                                             BLOCK_T=128)
    descales = (q_descale.view(batch, heads, q_tiles), k_descale.view(batch, heads, k_tiles),
                v_exponent.view(batch, heads, k_tiles), v_descale_max.view(batch, heads))
    return (q8.view(batch, heads, seqlen_q, head_dim), k8.view(batch, heads, seqlen_k, head_dim),
            vt8.view(batch, heads, head_dim, keys), descales)


@gluon.jit
def _key_permutation(HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, layout: gl.constexpr):
    """(BLOCK, BLOCK) float32: 1 at [key(p), p], key(p) the key the FP8 kernel expects at position p."""
    p = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, layout))
    r = p % 32
    key = p - r + 16 * (r // 16) + 8 * (r % 4 // 2) + 2 * (r % 16 // 4) + r % 2
    k = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    return gl.where(k[:, None] == key[None, :], 1.0, 0.0)


@gluon.jit
def _issue_any(i, slot_buf, bar, q_desc, k_desc, v_desc, q_work, qk_work, all_work, q_tiles, k_tiles,
               BLOCK: gl.constexpr):
    work = gl.program_id(0) + i * gl.num_programs(0)
    if work < all_work:
        mbarrier.expect(bar, q_desc.block_type.nbytes)
        if work < q_work:
            tma.async_copy_global_to_shared(q_desc, [0, work // q_tiles, (work % q_tiles) * BLOCK, 0], bar, slot_buf)
        elif work < qk_work:
            rest = work - q_work
            tma.async_copy_global_to_shared(k_desc, [0, rest // k_tiles, (rest % k_tiles) * BLOCK, 0], bar, slot_buf)
        else:
            rest = work - qk_work
            tma.async_copy_global_to_shared(v_desc, [0, rest // k_tiles, (rest % k_tiles) * BLOCK, 0], bar, slot_buf)


@gluon.jit
def quantize_all_mma_kernel(q_desc, k_desc, v_desc, q8_desc, k8_desc, vt8_desc, q_descale_ptr, k_descale_ptr,
                            v_descale_ptr, signs_ptr, bh_count, q_tiles, k_tiles, rsqrt_d):
    """Every tile of Q, K and V through one TMA slot and one WGMMA: Q and K times diag(signs) H, V^T times the
    key permutation (V's transpose and the FP8 kernel's key order, exact in float32)."""
    BLOCK: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, BLOCK, 16])
    build_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    square: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, HEAD_DIM], q_desc.dtype)
    r_smem = gl.allocate_shared_memory(q_desc.dtype, [HEAD_DIM, HEAD_DIM], square,
                                       _signed_hadamard(signs_ptr, HEAD_DIM, build_layout).to(q_desc.dtype))
    p_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK, BLOCK], square,
                                       _key_permutation(HEAD_DIM, BLOCK, build_layout).to(q_desc.dtype))
    slot = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    staging = gl.allocate_shared_memory(q8_desc.dtype, q8_desc.block_type.shape, q8_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    fence_async_shared()
    q_work = bh_count * q_tiles
    qk_work = q_work + bh_count * k_tiles
    all_work = qk_work + bh_count * k_tiles
    _issue_any(0, slot, ready, q_desc, k_desc, v_desc, q_work, qk_work, all_work, q_tiles, k_tiles, BLOCK)
    count = gl.cdiv(gl.maximum(all_work - gl.program_id(0), 0), gl.num_programs(0))
    x_smem = slot.reshape([BLOCK, HEAD_DIM])
    zeros = gl.zeros([BLOCK, HEAD_DIM], gl.float32, mma_layout)
    for i in range(count):
        work = gl.program_id(0) + i * gl.num_programs(0)
        mbarrier.wait(ready, i & 1)
        if work < qk_work:
            acc = warpgroup_mma(x_smem, r_smem, zeros, is_async=True)
        else:  # (HEAD_DIM, BLOCK): V^T's columns in the FP8 kernel's key order
            acc = warpgroup_mma(x_smem.permute((1, 0)), p_smem, zeros, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()  # every warpgroup is done reading the slot
        _issue_any(i + 1, slot, ready, q_desc, k_desc, v_desc, q_work, qk_work, all_work, q_tiles, k_tiles, BLOCK)
        if work < qk_work:
            y = acc * rsqrt_d
        else:
            y = acc
        amax = gl.max(gl.max(gl.abs(y), axis=1), axis=0)
        descale = gl.where(amax > 0, gl.div_rn(amax, E4M3_MAX), 1.0)
        if work < qk_work:
            y8 = gl.minimum(gl.maximum(y / descale, -E4M3_MAX), E4M3_MAX).to(gl.float8e4nv)
        else:
            y8 = gl.minimum(gl.maximum(gl.div_rn(y, descale), -E4M3_MAX), E4M3_MAX).to(gl.float8e4nv)
        tma.store_wait(0)  # the last tile's store has read the staging buffer
        staging.reshape([BLOCK, HEAD_DIM]).store(y8)
        fence_async_shared()
        if work < q_work:
            gl.store(q_descale_ptr + work, descale)
            tma.async_copy_shared_to_global(q8_desc, [0, work // q_tiles, (work % q_tiles) * BLOCK, 0], staging)
        elif work < qk_work:
            rest = work - q_work
            gl.store(k_descale_ptr + rest, descale)
            tma.async_copy_shared_to_global(k8_desc, [0, rest // k_tiles, (rest % k_tiles) * BLOCK, 0], staging)
        else:
            rest = work - qk_work
            gl.store(v_descale_ptr + rest, gl.where(amax > 0, descale, 0.0))
            tma.async_copy_shared_to_global(vt8_desc, [0, rest // k_tiles, 0, (rest % k_tiles) * BLOCK], staging)
    tma.store_wait(0)
    mbarrier.invalidate(ready)


def quantize_all_mma(q, k, v, signs, block: int, v_scale_floor: float, programs: int | None = None,
                     num_warps: int = 8, maxnreg: int | None = 128):
    from .fp8_quant import _as_rows, _v_exponent_kernel

    load_triton()
    batch, heads, _, head_dim = q.shape
    device = q.device
    signs = signs.to(device=device, dtype=torch.float32)
    q_rows, k_rows, v_rows = _as_rows(q), _as_rows(k), _as_rows(v)
    (bh, seqlen_q, _), seqlen_k = q_rows.shape, k_rows.shape[1]
    q_tiles, k_tiles, keys = cdiv(seqlen_q, block), cdiv(seqlen_k, block), cdiv(seqlen_k, 32) * 32
    q8 = torch.empty(q_rows.shape, dtype=torch.float8_e4m3fn, device=device)
    k8 = torch.empty(k_rows.shape, dtype=torch.float8_e4m3fn, device=device)
    vt8 = torch.empty(bh, head_dim, keys, dtype=torch.float8_e4m3fn, device=device)
    small = torch.empty(bh * (q_tiles + 3 * k_tiles + 1), dtype=torch.float32, device=device)
    q_descale, k_descale, v_descale, v_exponent, v_descale_max = small.split(
        [bh * q_tiles, bh * k_tiles, bh * k_tiles, bh * k_tiles, bh])
    programs = programs or 2 * sm_count(device)
    blk = [1, 1, block, head_dim]
    descs = [gluon_descriptor(t.unsqueeze(0), blk) for t in (q_rows, k_rows, v_rows, q8, k8)]
    descs.append(gluon_descriptor(vt8.unsqueeze(0), [1, 1, head_dim, block]))
    cached_launch(quantize_all_mma_kernel)[(min(programs, bh * (q_tiles + 2 * k_tiles)),)](
        *descs, q_descale, k_descale, v_descale, signs, bh, q_tiles, k_tiles, head_dim ** -0.5,
        num_warps=num_warps, **({} if maxnreg is None else {"maxnreg": maxnreg}))
    cached_launch(_v_exponent_kernel)[(bh,)](v_descale, v_exponent, v_descale_max, k_tiles, v_scale_floor,
                                             BLOCK_T=128)
    descales = (q_descale.view(batch, heads, q_tiles), k_descale.view(batch, heads, k_tiles),
                v_exponent.view(batch, heads, k_tiles), v_descale_max.view(batch, heads))
    return (q8.view(batch, heads, seqlen_q, head_dim), k8.view(batch, heads, seqlen_k, head_dim),
            vt8.view(batch, heads, head_dim, keys), descales)
