"""Split-KV decoding (flash-decoding) as a Triton kernel that reads a paged KV cache itself.

One program computes one split of one (sequence, KV head): the keys of its split, read through the
block table, against every query row of the KV head's group packed into one tile (pack_gqa: the
``group * seqlen_q`` rows of the group's query heads, so each K/V tile is read once per group, and a
decode step with one query per head still fills a tile). It writes the split's normalized output and
its LSE; :func:`fa_lab.online_softmax.merge_splits` merges the splits. Grid:
``(splits, batch * heads_kv, row_tiles)``.

A dense cache is the paged case with one page per sequence (page b holds sequence b), so there is one
kernel. Keys are gathered one row at a time (``page * page_size + position % page_size``), so any page
size works. Split ``s`` of a sequence with ``L`` keys in ``blocks = cdiv(L, BLOCK_N)`` blocks covers
keys ``[blocks * s // splits * BLOCK_N, blocks * (s + 1) // splits * BLOCK_N)`` cut to ``L``:
:func:`fa_lab.kvcache.split_ranges`'s formula (empty splits are fine: they weigh 0 in the merge).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import common
from .score_mod import in_window, softcap_tanh

LN2 = tl.constexpr(common.LN2)
LOG2E = tl.constexpr(common.LOG2E)


@triton.jit
def decode_split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, out_ptr, lse_ptr,
                        stride_qb, stride_qs, stride_qh, stride_row, stride_head,
                        heads, group, seqlen_q, page_size, max_pages, head_dim, qk_scale,
                        left, right, softcap_scale, softcap_log2,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                        CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """One split of one (sequence, KV head), rows ``row_tile * BLOCK_M ...`` of its packed group.

    q_ptr: (B, seqlen_q, H, head_dim) with the given strides; k_ptr, v_ptr: the cache's token rows
    (pages * page_size, heads_kv, head_dim), strides stride_row, stride_head, 1; table_ptr: int32
    (B, max_pages); lengths_ptr: int32 (B,) keys per sequence; out_ptr: float32 (splits, B, H,
    seqlen_q, head_dim) and lse_ptr (splits, B, H, seqlen_q), both contiguous. qk_scale = scale *
    log2(e). WINDOW: (left, right) as ``BlockInfo.window_bounds`` gives them, causal folded in.
    """
    split = tl.program_id(0)
    splits = tl.num_programs(0)
    batch = tl.program_id(1) // (heads // group)
    kv_head = tl.program_id(1) % (heads // group)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid_rows = rows < group * seqlen_q
    head = kv_head * group + rows // seqlen_q  # the packed tile: head-major, then the query position
    query = rows % seqlen_q
    cols = tl.arange(0, HEAD_DIM)
    col_ok = cols < head_dim

    length = tl.load(lengths_ptr + batch)
    offset = length - seqlen_q  # bottom-right alignment over the sequence's keys
    blocks = tl.cdiv(length, BLOCK_N)
    key_begin = blocks * split // splits * BLOCK_N
    key_end = tl.minimum(blocks * (split + 1) // splits * BLOCK_N, length)
    if WINDOW:  # no row of the tile sees keys before the band of its first query
        key_begin = tl.maximum(key_begin, tl.maximum(offset - left, 0) // BLOCK_N * BLOCK_N)

    q = tl.load(q_ptr + batch * stride_qb + query[:, None] * stride_qs + head[:, None] * stride_qh + cols[None, :],
                mask=valid_rows[:, None] & col_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in tl.range(key_begin, key_end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        key_ok = keys < key_end
        page = tl.load(table_ptr + batch * max_pages + keys // page_size, mask=key_ok, other=0)
        token = (page.to(tl.int64) * page_size + keys % page_size) * stride_row + kv_head * stride_head
        k = tl.load(k_ptr + token[:, None] + cols[None, :], mask=key_ok[:, None] & col_ok[None, :], other=0.0)
        v = tl.load(v_ptr + token[:, None] + cols[None, :], mask=key_ok[:, None] & col_ok[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k))
        if SOFTCAP:
            s = softcap_tanh(qk, softcap_scale) * softcap_log2
        else:
            s = qk * qk_scale
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= query[:, None] + offset)
        if WINDOW:
            visible = visible & in_window(query[:, None], keys[None, :], offset, left, right)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    batches = tl.num_programs(1) // (heads // group)
    row = ((split * batches + batch) * heads + head) * seqlen_q + query  # (splits, B, H, seqlen_q)
    tl.store(lse_ptr + row, lse, mask=valid_rows)
    tl.store(out_ptr + row[:, None] * head_dim + cols[None, :], acc / l_safe[:, None],
             mask=valid_rows[:, None] & col_ok[None, :])


def triton_decode(q, k_cache, v_cache, lengths: list[int], block_table, layout, causal: bool, scale: float,
                  window, softcap: float, splits: int, block_n: int | None = None):
    """Launch :func:`decode_split_kernel` over ``splits`` splits and merge them.

    q: (B, seqlen_q, H, d) float16/bfloat16; the cache as :func:`fa_lab.attention_with_kvcache` takes it
    (already appended); lengths: keys per sequence; layout: its :class:`fa_lab.kvcache.CacheLayout`.
    Returns (out (B, seqlen_q, H, d) in q.dtype, lse (B, H, seqlen_q) float32).
    """
    import torch

    from ...block_info import BlockInfo
    from ...kvcache import DECODE_ROWS
    from ...online_softmax import merge_splits
    from .. import interpreting
    from ..common import check_triton_inputs, head_dim_bucket, on_device

    check_triton_inputs(q)
    q = q if q.stride(-1) == 1 else q.contiguous()
    if k_cache.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("impl='triton' reads the KV cache in place and needs it contiguous")
    batch, seqlen_q, heads, head_dim = q.shape
    group = heads // layout.heads_kv
    block_n = block_n or (16 if interpreting() else 64)
    rows = group * seqlen_q
    block_m = min(DECODE_ROWS, max(16, triton.next_power_of_2(rows)))
    if layout.paged:
        table, page_size = block_table, layout.page_size
    else:  # one page per sequence: page b is sequence b
        table = torch.arange(batch, dtype=torch.int32, device=q.device)[:, None]
        page_size = layout.capacity
    info = BlockInfo(seqlen_q, seqlen_q, causal, tuple(window))  # (which path; bounds are per sequence)
    left, right = (info.left if info.left is not None else 1 << 30,
                   info.right if info.right is not None else 1 << 30) if info.banded else (0, 0)
    k_rows, v_rows = (t.reshape(-1, layout.heads_kv, head_dim) for t in (k_cache, v_cache))
    out = torch.empty((splits, batch, heads, seqlen_q, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((splits, batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    with on_device(q):
        decode_split_kernel[(splits, batch * layout.heads_kv, triton.cdiv(rows, block_m))](
            q, k_rows, v_rows, table.contiguous(), lengths_t, out, lse,
            q.stride(0), q.stride(1), q.stride(2), k_rows.stride(0), k_rows.stride(1),
            heads, group, seqlen_q, page_size, table.shape[1], head_dim, scale * common.LOG2E,
            left, right, scale / softcap if softcap else 0.0, softcap * common.LOG2E,
            BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim_bucket(head_dim),
            CAUSAL=causal and not info.banded, WINDOW=info.banded, SOFTCAP=bool(softcap))
    merged, merged_lse = merge_splits(out, lse)
    return merged.transpose(1, 2).to(q.dtype), merged_lse
