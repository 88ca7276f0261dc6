"""A FlashAttention-3-style forward in plain Triton: TMA, intra-warpgroup pipelining, FP8.

``impl="triton_hopper"`` and ``"triton_hopper_fp8"`` run it wherever the Gluon kernel of
:mod:`fa_lab.kernels.hopper` does not apply (the CPU interpreter, head_dims outside the
Gluon kernel's buckets of 64 and 128, other GPUs), for calls without score options.
It computes the same thing as :mod:`fa_lab.kernels.portable.forward` and differs
in how the loop over K/V tiles is written, following FlashAttention-3:

* **Two-stage GEMM-softmax pipelining** (``PIPELINE``): the scores of tile j+1,
  ``S_next = Q K_{j+1}^T``, are issued before the softmax of tile j. On Hopper a
  ``tl.dot`` becomes an asynchronous WGMMA, so the tensor cores compute S_next
  while the same warps run the exponentials of tile j; the price is a second
  (BLOCK_M, BLOCK_N) score tile held in registers.
* **Warp specialization** (``WARP_SPECIALIZE``): asks Triton's Hopper
  warp-specialization pass to split the loop into producer warps (TMA loads) and
  consumer warps (WGMMA + softmax), with the loads running ahead through a
  circular shared-memory buffer of ``num_stages`` slots.
* **FP8** (``FP8``): Q, K, V arrive in e4m3 with one descale factor per tile
  (per-block quantization, tiles aligned with BLOCK_M / BLOCK_N). S is descaled
  after the FP8 WGMMA; P (in [0, 1]) is multiplied by ``P_SCALE`` before its cast
  to e4m3 so that small probabilities keep their bits, and the P V product is
  descaled by ``v_descale / P_SCALE``. Hopper's FP8 WGMMA reads its B operand
  K-major, so V comes transposed, (B, H, d, N), from the quantization step.

Tiles move through tensor descriptors (TMA), as in the forward of :mod:`.forward`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import common
from .block_range import key_range
from .forward import online_softmax_tile, write_output

# P in [0, 1] times P_SCALE stays below e4m3's maximum and keeps small probabilities representable.
P_SCALE = tl.constexpr(common.P_SCALE)


@triton.jit
def _scores(q, desc_k, k_descale_ptr, kv_tile_base, batch, head, start_n,
            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """S = Q K^T for the K tile at ``start_n`` (descaled by the tile's K factor in FP8)."""
    k = desc_k.load([batch, head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    s = tl.dot(q, tl.trans(k))
    if FP8:
        s = s * tl.load(k_descale_ptr + kv_tile_base + start_n // BLOCK_N)
    return s


@triton.jit
def _fold_tile(acc, l_i, m_i, s, desc_v, v_descale_ptr, kv_tile_base, batch, head, start_n, qk_scale,
               offs_m, seqlen_k, causal_offset,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, FP8: tl.constexpr):
    """Online-softmax update with the score tile ``s`` of keys [start_n, start_n + BLOCK_N)."""
    p, alpha, l_i, m_new = online_softmax_tile(s, l_i, m_i, qk_scale, offs_m, start_n, seqlen_k, causal_offset,
                                               BLOCK_N=BLOCK_N, MASKED=MASKED, CAUSAL=CAUSAL)
    if FP8:
        v_t = desc_v.load([batch, head, 0, start_n]).reshape(HEAD_DIM, BLOCK_N)
        pv = tl.dot((p * P_SCALE).to(v_t.dtype), tl.trans(v_t))
        v_descale = tl.load(v_descale_ptr + kv_tile_base + start_n // BLOCK_N) / P_SCALE
        acc = acc * alpha[:, None] + pv * v_descale
    else:
        v = desc_v.load([batch, head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def attention_fwd_pipelined_kernel(desc_q, desc_k, desc_v, desc_o, lse_ptr,
                                   q_descale_ptr, k_descale_ptr, v_descale_ptr,
                                   heads, seqlen_q, seqlen_k, qk_scale,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                                   CAUSAL: tl.constexpr, PIPELINE: tl.constexpr,
                                   WARP_SPECIALIZE: tl.constexpr, FP8: tl.constexpr):
    """O and lse for one Q tile. desc_v is over V (B, H, N, d), or V^T (B, H, d, N) in FP8.

    q/k/v_descale_ptr: (B, H, tiles) float32 per-tile descale factors (FP8 only).
    """
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // heads
    head = pid_bh % heads
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    causal_offset = seqlen_k - seqlen_q
    kv_tile_base = pid_bh * tl.cdiv(seqlen_k, BLOCK_N)
    if FP8:  # Q's per-tile descale is one number for this program: fold it into the scale
        qk_scale = qk_scale * tl.load(q_descale_ptr + pid_bh * tl.cdiv(seqlen_q, BLOCK_M) + pid_m)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    q = desc_q.load([batch, head, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    full_end, end = key_range(start_m, seqlen_q, seqlen_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)

    if PIPELINE:
        if full_end > 0:
            s_next = _scores(q, desc_k, k_descale_ptr, kv_tile_base, batch, head, 0, BLOCK_N=BLOCK_N,
                             HEAD_DIM=HEAD_DIM, FP8=FP8)
            for start_n in tl.range(0, full_end - BLOCK_N, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
                s = s_next
                # Issue tile j+1's QK^T first: the tensor cores run it while tile j's softmax runs.
                s_next = _scores(q, desc_k, k_descale_ptr, kv_tile_base, batch, head, start_n + BLOCK_N,
                                 BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, FP8=FP8)
                acc, l_i, m_i = _fold_tile(acc, l_i, m_i, s, desc_v, v_descale_ptr, kv_tile_base, batch, head,
                                           start_n, qk_scale, offs_m, seqlen_k, causal_offset,
                                           BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, MASKED=False, CAUSAL=CAUSAL, FP8=FP8)
            acc, l_i, m_i = _fold_tile(acc, l_i, m_i, s_next, desc_v, v_descale_ptr, kv_tile_base, batch, head,
                                       full_end - BLOCK_N, qk_scale, offs_m, seqlen_k, causal_offset,
                                       BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, MASKED=False, CAUSAL=CAUSAL, FP8=FP8)
    else:
        for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            s = _scores(q, desc_k, k_descale_ptr, kv_tile_base, batch, head, start_n, BLOCK_N=BLOCK_N,
                        HEAD_DIM=HEAD_DIM, FP8=FP8)
            acc, l_i, m_i = _fold_tile(acc, l_i, m_i, s, desc_v, v_descale_ptr, kv_tile_base, batch, head,
                                       start_n, qk_scale, offs_m, seqlen_k, causal_offset,
                                       BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, MASKED=False, CAUSAL=CAUSAL, FP8=FP8)
    for start_n in tl.range(full_end, end, BLOCK_N):
        s = _scores(q, desc_k, k_descale_ptr, kv_tile_base, batch, head, start_n, BLOCK_N=BLOCK_N,
                    HEAD_DIM=HEAD_DIM, FP8=FP8)
        acc, l_i, m_i = _fold_tile(acc, l_i, m_i, s, desc_v, v_descale_ptr, kv_tile_base, batch, head,
                                   start_n, qk_scale, offs_m, seqlen_k, causal_offset,
                                   BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, MASKED=True, CAUSAL=CAUSAL, FP8=FP8)

    write_output(acc, l_i, m_i, desc_o, lse_ptr, batch, head, pid_bh, start_m, offs_m, seqlen_q,
                 BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM)
