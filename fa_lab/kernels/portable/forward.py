"""The FlashAttention forward as a Triton kernel.

One program computes one tile of ``BLOCK_M`` query rows of one (batch, head):
it loads its Q tile once, streams the K/V tiles of that head through the online
softmax, and writes O and the log-sum-exp. The grid is
``(cdiv(seqlen_q, BLOCK_M), batch * heads)``: FlashAttention-2's parallelism over
the sequence as well as over batch and heads.

Tiles move through tensor descriptors: on Hopper they become TMA copies, and for
every target they read zeros outside the tensor and drop writes outside it, so
a ragged last tile needs no pointer arithmetic (a 4-D descriptor over
(batch, heads, seqlen, head_dim) keeps one head's edge from spilling into the next).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import common
from .block_range import key_range, window_key_range
from .score_mod import modified_scores, visible_keys

LN2 = tl.constexpr(common.LN2)  # (jit code reads module-level numbers only as constexprs)
LOG2E = tl.constexpr(common.LOG2E)


@triton.jit
def online_softmax_tile(qk, l_i, m_i, qk_scale, offs_m, start_n, seqlen_k, causal_offset,
                        BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                        left=0, right=0, WINDOW: tl.constexpr = False):
    """The online-softmax update for one tile of raw scores qk = Q K^T: (BLOCK_M, BLOCK_N).

    Returns (p, alpha, l_i, m_new): the unnormalized probabilities exp2(qk * qk_scale - m_new),
    the factor exp2(m_old - m_new) that rescales everything accumulated so far, and the
    new running sum and max (in log2 units, since qk_scale = scale * log2(e)).
    WINDOW: mask with the band (left, right) too (:func:`.score_mod.visible_keys`).
    """
    if MASKED:
        # Only the tiles on the causal diagonal or at the ragged end pay for a mask.
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = visible_keys(offs_m[:, None], offs_n[None, :], seqlen_k, causal_offset, left, right, CAUSAL, WINDOW)
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 there so exp2 gives 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_sub[:, None])
    else:
        # The scale (with 1/ln 2 folded in) is applied inside the max and the subtraction,
        # so S is never scaled as a separate pass over the tile.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = m_new
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def write_output(acc, l_i, m_i, desc_o, lse_ptr, batch, head, pid_bh, start_m, offs_m, seqlen_q,
                 BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The epilogue: O = acc / l, normalized once (FA2's deferred rescale), and lse = ln 2 (m + log2 l).

    A row that saw no key (l = 0) gets O = 0 and lse = -inf. lse_ptr: (B, H, seqlen_q) float32.
    """
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    tl.store(lse_ptr + pid_bh * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
    desc_o.store([batch, head, start_m, 0], out.to(desc_o.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))


@triton.jit
def write_output_rows(acc, l_i, m_i, o_ptr, head_dim, lse_ptr, row0, head, heads, total_q, offs_m, seqlen_q,
                      HEAD_DIM: tl.constexpr):
    """The epilogue of a packed (varlen) batch: rows row0 + offs_m of o_ptr, (total_q, heads,
    head_dim) contiguous, and of lse_ptr, (heads, total_q) float32; only the sequence's own rows
    (offs_m < seqlen_q) are written, since the next sequence's rows follow them."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    rows = offs_m < seqlen_q
    tl.store(lse_ptr + head * total_q + row0 + offs_m, lse, mask=rows)
    cols = tl.arange(0, HEAD_DIM)
    o_rows = o_ptr + ((row0 + offs_m)[:, None] * heads + head) * head_dim + cols[None, :]
    tl.store(o_rows, out.to(o_ptr.dtype.element_ty), mask=rows[:, None] & (cols[None, :] < head_dim))


@triton.jit
def _softmax_step(acc, l_i, m_i, q, desc_k, desc_v, batch, kv_head, k_row0, start_n, qk_scale, offs_m,
                  seqlen_k, causal_offset, mods,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                  SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SEQUSED: tl.constexpr = False):
    """Fold the K/V tile starting at key ``start_n`` into (acc, l_i, m_i).

    mods: (left, right, softcap_scale, softcap_log2, slope_log2), read only where WINDOW, SOFTCAP, ALIBI say.
    k_row0: the sequence's first key row in a packed batch (0 otherwise); start_n counts from it.
    SEQUSED: rows past seqlen_k are a cache's unwritten slots, not zeros: a masked tile zeroes them in V,
    since p = 0 does not cancel a NaN there.
    """
    k = desc_k.load([batch, kv_head, k_row0 + start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    qk = tl.dot(q, tl.trans(k))
    left, right, softcap_scale, softcap_log2, slope_log2 = mods
    if SOFTCAP or ALIBI:  # the scores, modified and in log2 units: the softmax then scales by 1
        offs_n = start_n + tl.arange(0, BLOCK_N)
        qk = modified_scores(qk, offs_m[:, None], offs_n[None, :], qk_scale, softcap_scale, softcap_log2,
                             slope_log2, causal_offset, SOFTCAP=SOFTCAP, ALIBI=ALIBI)
        p, alpha, l_i, m_new = online_softmax_tile(qk, l_i, m_i, 1.0, offs_m, start_n, seqlen_k, causal_offset,
                                                   BLOCK_N=BLOCK_N, MASKED=MASKED, CAUSAL=CAUSAL, left=left,
                                                   right=right, WINDOW=WINDOW)
    else:
        p, alpha, l_i, m_new = online_softmax_tile(qk, l_i, m_i, qk_scale, offs_m, start_n, seqlen_k,
                                                   causal_offset, BLOCK_N=BLOCK_N, MASKED=MASKED, CAUSAL=CAUSAL,
                                                   left=left, right=right, WINDOW=WINDOW)
    v = desc_v.load([batch, kv_head, k_row0 + start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    if SEQUSED and MASKED:
        v = tl.where((start_n + tl.arange(0, BLOCK_N) < seqlen_k)[:, None], v, 0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def attention_fwd_kernel(desc_q, desc_k, desc_v, desc_o, lse_ptr,
                         heads, seqlen_q, seqlen_k, qk_scale,
                         group, left, right, softcap_scale, softcap_log2, slopes_ptr,
                         cu_q_ptr, cu_k_ptr, tiles_ptr, o_ptr, head_dim,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                         CAUSAL: tl.constexpr, REVERSE_GRID: tl.constexpr,
                         WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                         GQA: tl.constexpr, VARLEN: tl.constexpr, SEQUSED: tl.constexpr = False):
    """O = softmax(scale * Q K^T) V for one Q tile; lse (natural log) saved for the backward.

    desc_q, desc_o: descriptors over (B, H, Nq, HEAD_DIM), desc_k, desc_v over (B, H // group, Nk,
    HEAD_DIM), block shape (1, 1, BLOCK, HEAD_DIM); query head h reads K/V head h // group (GQA:
    group > 1).
    lse_ptr: (B, H, seqlen_q) float32, contiguous. qk_scale = scale * log2(e).
    WINDOW: keys outside the band (left, right) (``BlockInfo.window_bounds``; causal folded in) are
    skipped by tile and masked at the band's edges. SOFTCAP: softcap_scale = scale / softcap,
    softcap_log2 = softcap * log2(e). ALIBI: slopes_ptr (B, H) float32.
    VARLEN: a packed batch. The descriptors are over (1, H, total, HEAD_DIM) views of the packed
    (total, H, HEAD_DIM) tensors, seqlen_q holds total_q, program t of the grid's first axis takes
    query tile tiles_ptr[t] = (sequence, first row) (the launcher's schedule), cu_q_ptr and cu_k_ptr
    hold the int32 offsets, and O goes to o_ptr ((total_q, H, head_dim)) and lse to (H, total_q) by rows
    (:func:`write_output_rows`).
    SEQUSED (dense batch only): K and V are a KV cache of seqlen_k slots per sequence, of which batch b
    uses the first cu_k_ptr[b] (int32 (B,); flash-attn's ``seqused_k``): causal and windows align to that.
    """
    pid_m = tl.program_id(0)
    if VARLEN:
        head = tl.program_id(1)
        pid_bh = head
        batch = 0
        total_q = seqlen_q
        sequence = tl.load(tiles_ptr + 2 * pid_m)
        start_m = tl.load(tiles_ptr + 2 * pid_m + 1)
        q_row0 = tl.load(cu_q_ptr + sequence)
        k_row0 = tl.load(cu_k_ptr + sequence)
        seqlen_q = tl.load(cu_q_ptr + sequence + 1) - q_row0
        seqlen_k = tl.load(cu_k_ptr + sequence + 1) - k_row0
        slope_index = sequence * heads + head
    else:
        if REVERSE_GRID:
            # Causal tiles near the bottom see the most keys: launch them first so that the
            # short tiles fill the gaps at the end instead of leaving a long tail.
            pid_m = tl.num_programs(0) - 1 - pid_m
        pid_bh = tl.program_id(1)
        batch = pid_bh // heads
        head = pid_bh % heads
        start_m = pid_m * BLOCK_M
        q_row0 = 0
        k_row0 = 0
        slope_index = pid_bh
        if SEQUSED:
            seqlen_k = tl.load(cu_k_ptr + batch)
    kv_head = head // group if GQA else head
    offs_m = start_m + tl.arange(0, BLOCK_M)
    causal_offset = seqlen_k - seqlen_q  # bottom-right alignment: row i sees keys j <= i + offset
    slope_log2 = 0.0
    if ALIBI:
        slope_log2 = tl.load(slopes_ptr + slope_index) * LOG2E
    mods = (left, right, softcap_scale, softcap_log2, slope_log2)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    q = desc_q.load([batch, head, q_row0 + start_m, 0]).reshape(BLOCK_M, HEAD_DIM)

    if WINDOW:
        begin, full_begin, full_end, end = window_key_range(start_m, seqlen_q, seqlen_k, left, right,
                                                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        for start_n in tl.range(begin, full_begin, BLOCK_N):  # the band's left edge
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, desc_k, desc_v, batch, kv_head, k_row0, start_n,
                                          qk_scale, offs_m, seqlen_k, causal_offset, mods,
                                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, MASKED=True,
                                          CAUSAL=CAUSAL, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI, SEQUSED=SEQUSED)
    else:
        full_end, end = key_range(start_m, seqlen_q, seqlen_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
        full_begin = 0
    for start_n in tl.range(full_begin, full_end, BLOCK_N):
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, desc_k, desc_v, batch, kv_head, k_row0, start_n,
                                      qk_scale, offs_m, seqlen_k, causal_offset, mods,
                                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, MASKED=False, CAUSAL=CAUSAL,
                                      WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI, SEQUSED=SEQUSED)
    for start_n in tl.range(full_end, end, BLOCK_N):
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, q, desc_k, desc_v, batch, kv_head, k_row0, start_n,
                                      qk_scale, offs_m, seqlen_k, causal_offset, mods,
                                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, MASKED=True, CAUSAL=CAUSAL,
                                      WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI, SEQUSED=SEQUSED)

    if VARLEN:
        write_output_rows(acc, l_i, m_i, o_ptr, head_dim, lse_ptr, q_row0, head, heads, total_q, offs_m,
                          seqlen_q, HEAD_DIM=HEAD_DIM)
    else:
        write_output(acc, l_i, m_i, desc_o, lse_ptr, batch, head, pid_bh, start_m, offs_m, seqlen_q,
                     BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM)
