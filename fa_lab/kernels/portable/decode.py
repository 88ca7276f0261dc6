"""Split-KV decoding (flash-decoding) as a Triton kernel that reads a paged KV cache itself.

One program computes one split of one (sequence, KV head): the keys of its split, read through the
block table, against every query row of the KV head's group packed into one tile (pack_gqa: the
``group * seqlen_q`` rows of the group's query heads, so each K/V tile is read once per group, and a
decode step with one query per head still fills a tile). It writes the split's normalized output and
its LSE, and :func:`merge_splits_kernel` merges the splits in one more launch (its math is
:func:`fa_lab.online_softmax.merge_splits`', which the tests hold it to: done in PyTorch, the merge was a
chain of small kernels that cost as much as the attention at batch 1; docs/experiments/interfaces.md). Grid:
``(splits, batch * heads_kv, row_tiles)``.

How a key tile finds its rows (``GATHER``): a dense cache holds sequence b's tokens at rows
``b * capacity + position``; a paged cache whose pages hold whole key tiles reads one block-table
entry per tile; smaller pages read one entry per key (``page * page_size + position % page_size``),
so any page size works. Split ``s`` of a sequence with ``L`` keys in ``blocks = cdiv(L, BLOCK_N)``
blocks covers keys ``[blocks * s // splits * BLOCK_N, blocks * (s + 1) // splits * BLOCK_N)`` cut to
``L``: :func:`fa_lab.kvcache.split_ranges`'s formula (empty splits are fine: they weigh 0 in the merge).
The lengths are read on the device, so a launch needs no value from the GPU (CUDA graphs capture it).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ...block_info import BlockInfo, cdiv
from ...kvcache import DECODE_ROWS, SMALL_TILE_KEYS, SMALL_TILES_PER_SM, fits_one_wave, pages_read_ahead
from .. import common
from .block_range import split_key_range
from .score_mod import in_window, softcap_tanh

LN2 = tl.constexpr(common.LN2)
LOG2E = tl.constexpr(common.LOG2E)
DENSE, PAGE_PER_TILE, PAGE_PER_KEY = 0, 1, 2  # the GATHER modes
MERGE_CHUNK = 16  # splits the merge reads per load


@dataclass(frozen=True)
class DecodeConfig:
    """block_n: keys per tile (and the split granularity); num_warps, num_stages: launch options; pdl: launch
    the merge as a programmatic dependent of the split kernel where the GPU has it (sm_90 and later; off by
    default: at the split counts the heuristic picks it measured no faster, and at 32 splits slower,
    docs/experiments/interfaces.md); pages_ahead: a paged call whose pages hold whole key tiles reads each
    split's block-table entries before its key loop (:func:`pages_ahead`) while its programs fit in one wave;
    per_sm: the programs one SM holds at head_dim 128 (by the shared memory of ``num_stages - 1`` K and V
    tiles, as the sm_90 build measures it: a CPU test holds the two together), what makes a wave."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    pdl: bool = False
    pages_ahead: bool = True
    per_sm: int = 1
    tma: bool = False  # a dense cache's whole key tiles by tensor descriptors (TMA, sm_90 and later)


# The H200's choices (benchmarks/h200_decode_tuning.json, h200_decode_sweep.json; decode_config says which
# call runs which): DECODE_CUDA within a few percent of the best config at most shapes and page sizes, but
# for short dense splits, where SHORT_SPLIT's smaller tiles and deeper pipeline were 8% faster (batch 1 x
# 4K, 16 splits of 256 keys); SMALL_TILE where DECODE_CUDA's programs (one per SM: its three stages take
# 139 KB of shared memory) would run in two waves, and for pages of 64 keys, which then hold whole tiles;
# and the interpreter's small tiles.
DECODE_CUDA = DecodeConfig(128, 4, 3, per_sm=1)  # 139 KB of shared memory
# A dense cache in one split (batch 32 on the H200 grid), where every kernel reads at HBM's roofline: TMA copies
# of 128-key tiles, two stages, read 4.36 / 4.59 / 4.63 TB/s at 4K / 16K / 64K keys against DECODE_CUDA's or
# SMALL_TILE's 4.31 / 4.53 / 4.60 and SDPA's 4.31 / 4.57 / 4.62 in the same rounds (benchmarks/h200_decode_tma.json).
TMA_DENSE = DecodeConfig(128, 4, 2, per_sm=1, tma=True)
SHORT_SPLIT = DecodeConfig(64, 4, 4, per_sm=2)
SHORT_SPLIT_KEYS = 512  # a dense split of at most this many keys runs SHORT_SPLIT
SMALL_TILE = DecodeConfig(SMALL_TILE_KEYS, 4, 3, per_sm=SMALL_TILES_PER_SM)  # 72 KB of shared memory
SMALL_TILE_WAVE_KEYS = 4096  # more programs than SMs, splits of at most this many keys: SMALL_TILE
INTERPRETER = DecodeConfig(16, 4, 1)
# What ``fa-lab bench decode --tune`` times on the GPU.
DECODE_CANDIDATES = (DecodeConfig(64, 4, 2), DecodeConfig(64, 4, 3), DecodeConfig(64, 4, 4), DecodeConfig(128, 4, 2),
                     DecodeConfig(128, 4, 3), DecodeConfig(128, 8, 3), DecodeConfig(64, 8, 3), DecodeConfig(32, 4, 4))


@triton.jit
def _load_kv_tile(k_ptr, v_ptr, table_ptr, batch, kv_head, start_n, key_end, page_size, max_pages, stride_row,
                  stride_head, cols, col_ok, first_page, BLOCK_N: tl.constexpr, GATHER: tl.constexpr,
                  EVEN_D: tl.constexpr, PAGES_AHEAD: tl.constexpr, split_pages=0):
    """The K and V tiles (BLOCK_N, HEAD_DIM) of keys [start_n, +BLOCK_N) through the GATHER mode (the kernel's
    docstring), keys from key_end on zeroed; split_pages: the split's block-table entries from first_page on,
    when PAGES_AHEAD read them before the loop."""
    keys = start_n + tl.arange(0, BLOCK_N)
    key_ok = keys < key_end
    if GATHER == 0:  # DENSE
        row = batch.to(tl.int64) * page_size + keys
    elif GATHER == 1:  # PAGE_PER_TILE: the tile lies in one page
        if PAGES_AHEAD > 0:
            slots = tl.arange(0, PAGES_AHEAD)
            page = tl.sum(tl.where(slots == start_n // page_size - first_page, split_pages, 0), 0)
        else:
            page = tl.load(table_ptr + batch * max_pages + start_n // page_size)
        row = page.to(tl.int64) * page_size + start_n % page_size + tl.arange(0, BLOCK_N)
    else:  # PAGE_PER_KEY
        page = tl.load(table_ptr + batch * max_pages + keys // page_size, mask=key_ok, other=0)
        row = page.to(tl.int64) * page_size + keys % page_size
    token = row * stride_row + kv_head * stride_head
    if EVEN_D:  # a mask constant along the row: the loads stay vectorized and asynchronous
        kv_ok = key_ok[:, None]
    else:
        kv_ok = key_ok[:, None] & col_ok[None, :]
    k = tl.load(k_ptr + token[:, None] + cols[None, :], mask=kv_ok, other=0.0)
    v = tl.load(v_ptr + token[:, None] + cols[None, :], mask=kv_ok, other=0.0)
    return k, v


@triton.jit
def _attend_tile(q, k, v, keys, key_end, query, offset, left, right, qk_scale, softcap_scale, softcap_log2,
                 m_i, l_i, acc, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """One key tile's step of online softmax for the packed query rows: (m_i, l_i, acc) after keys ``keys``
    (those from key_end on, and those the mask hides, weigh 0)."""
    qk = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        s = softcap_tanh(qk, softcap_scale) * softcap_log2
    else:
        s = qk * qk_scale
    # score_mod.visible_keys' rule, its key-end test made before the broadcast: that order is the tuned SASS.
    visible = (keys < key_end)[None, :]
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
    return m_new, l_i, acc


@triton.jit
def decode_split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, out_ptr, lse_ptr,
                        stride_qb, stride_qs, stride_qh, stride_row, stride_head,
                        heads, group, seqlen_q, page_size, max_pages, head_dim, qk_scale,
                        left, right, softcap_scale, softcap_log2,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                        CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, GATHER: tl.constexpr,
                        EVEN_D: tl.constexpr, PAGES_AHEAD: tl.constexpr, PDL: tl.constexpr,
                        FINAL: tl.constexpr = False, k_desc=None, v_desc=None):
    """One split of one (sequence, KV head), rows ``row_tile * BLOCK_M ...`` of its packed group.

    q_ptr: (B, seqlen_q, H, head_dim) with the given strides; k_ptr, v_ptr: the cache's token rows
    (pages * page_size, heads_kv, head_dim), strides stride_row, stride_head, 1; table_ptr: int32
    (B, max_pages) (unread when GATHER is DENSE, where page_size is the capacity); lengths_ptr: int32
    (B,) keys per sequence; out_ptr: float32 (splits, B, H, seqlen_q, head_dim) and lse_ptr (splits, B, H,
    seqlen_q), both contiguous; with FINAL (one split, no merge to follow) out_ptr is the call's output
    instead, (B, seqlen_q, H, head_dim) in q's dtype, so that no cast kernel follows either. qk_scale =
    scale * log2(e). WINDOW: (left, right) as ``BlockInfo.window_bounds`` gives them, causal folded in. EVEN_D:
    head_dim == HEAD_DIM, so that K and V rows load unmasked along d: a mask that varies along a row's
    contiguous elements keeps Triton from loading the tiles with asynchronous copies, and the loop from
    being pipelined (docs/experiments/interfaces.md, "Decode: the pipelined key loop"). PAGES_AHEAD (> 0
    with PAGE_PER_TILE only): the split's block-table entries are loaded into registers before the key
    loop, PAGES_AHEAD of them (enough for any split of the call), so that a tile's address needs no load
    in the loop. PDL: let the merge launch now (a programmatic dependent launch, sm_90), so that its
    start-up overlaps this kernel; it still waits for this grid's results. k_desc, v_desc (DENSE, EVEN_D, no
    WINDOW; None otherwise): tensor descriptors over the cache's (B * capacity, heads_kv * head_dim) rows with
    blocks (BLOCK_N, HEAD_DIM), through which the split's whole key tiles are read; its partial last tile, whose
    rows past the sequence may hold anything (a NaN there would survive P = 0 in P V), takes the masked loads.
    """
    if PDL:
        gdc_launch_dependents()
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
    key_begin, key_end = split_key_range(length, seqlen_q, left, split, splits, BLOCK_N=BLOCK_N, WINDOW=WINDOW)

    q = tl.load(q_ptr + batch * stride_qb + query[:, None] * stride_qs + head[:, None] * stride_qh + cols[None, :],
                mask=valid_rows[:, None] & col_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if k_desc is not None:  # whole tiles by TMA, then the partial last one (at most) by masked loads
        whole_end = key_begin + (key_end - key_begin) // BLOCK_N * BLOCK_N
        for start_n in tl.range(key_begin, whole_end, BLOCK_N):
            k = k_desc.load([batch * page_size + start_n, kv_head * HEAD_DIM])
            v = v_desc.load([batch * page_size + start_n, kv_head * HEAD_DIM])
            m_i, l_i, acc = _attend_tile(q, k, v, start_n + tl.arange(0, BLOCK_N), key_end, query, offset, left,
                                         right, qk_scale, softcap_scale, softcap_log2, m_i, l_i, acc,
                                         CAUSAL, WINDOW, SOFTCAP)
        for start_n in tl.range(whole_end, key_end, BLOCK_N, num_stages=1):
            k, v = _load_kv_tile(k_ptr, v_ptr, table_ptr, batch, kv_head, start_n, key_end, page_size, max_pages,
                                 stride_row, stride_head, cols, col_ok, 0, BLOCK_N, GATHER, EVEN_D, 0)
            m_i, l_i, acc = _attend_tile(q, k, v, start_n + tl.arange(0, BLOCK_N), key_end, query, offset, left,
                                         right, qk_scale, softcap_scale, softcap_log2, m_i, l_i, acc,
                                         CAUSAL, WINDOW, SOFTCAP)
    else:
        first_page = 0
        split_pages = 0
        if PAGES_AHEAD > 0:
            first_page = key_begin // page_size
            slots = tl.arange(0, PAGES_AHEAD)
            split_pages = tl.load(table_ptr + batch * max_pages + first_page + slots,
                                  mask=first_page + slots < tl.cdiv(key_end, page_size), other=0)
        for start_n in tl.range(key_begin, key_end, BLOCK_N):
            k, v = _load_kv_tile(k_ptr, v_ptr, table_ptr, batch, kv_head, start_n, key_end, page_size, max_pages,
                                 stride_row, stride_head, cols, col_ok, first_page, BLOCK_N, GATHER, EVEN_D,
                                 PAGES_AHEAD, split_pages)
            m_i, l_i, acc = _attend_tile(q, k, v, start_n + tl.arange(0, BLOCK_N), key_end, query, offset, left,
                                         right, qk_scale, softcap_scale, softcap_log2, m_i, l_i, acc,
                                         CAUSAL, WINDOW, SOFTCAP)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    batches = tl.num_programs(1) // (heads // group)
    row = ((split * batches + batch) * heads + head) * seqlen_q + query  # (splits, B, H, seqlen_q)
    tl.store(lse_ptr + row, lse, mask=valid_rows)
    if FINAL:  # the call's output itself: (B, seqlen_q, H, head_dim) in its dtype
        row = (batch * seqlen_q + query) * heads + head
    tl.store(out_ptr + row[:, None] * head_dim + cols[None, :], (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
             mask=valid_rows[:, None] & col_ok[None, :])


@triton.jit
def merge_splits_kernel(out_ptr, lse_ptr, merged_ptr, merged_lse_ptr, splits, heads, seqlen_q, head_dim,
                        SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
                        PDL: tl.constexpr):
    """One query row's merge of its splits: the jit copy of :func:`fa_lab.online_softmax.merge_splits`.

    out_ptr: float32 (splits, B, H, seqlen_q, head_dim), lse_ptr: (splits, B, H, seqlen_q), as
    :func:`decode_split_kernel` writes them; program r merges row r of (B, H, seqlen_q) into merged_ptr
    ((B, seqlen_q, H, head_dim), its dtype) and merged_lse_ptr ((B, H, seqlen_q) float32). SPLITS: splits
    rounded up to a power of two; the partial outputs are read SPLIT_CHUNK splits per load, so a row costs
    a few memory round trips rather than one per split. Splits that saw no key (lse = -inf) weigh 0; a row
    no split saw gets zeros and lse = -inf. PDL: launched as a programmatic dependent of the split kernel,
    so it waits here, already resident, for the splits' results.
    """
    if PDL:
        gdc_wait()
    row = tl.program_id(0)
    rows = tl.num_programs(0)
    split = tl.arange(0, SPLITS)
    lses = tl.load(lse_ptr + split * rows + row, mask=split < splits, other=float("-inf"))
    top = tl.max(lses, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.math.exp2((lses - top) * LOG2E), 0)
    cols = tl.arange(0, HEAD_DIM)
    chunk = tl.arange(0, SPLIT_CHUNK)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for first in tl.range(0, splits, SPLIT_CHUNK):
        part = first + chunk
        part_ok = part < splits
        part_lse = tl.load(lse_ptr + part * rows + row, mask=part_ok, other=float("-inf"))
        outs = tl.load(out_ptr + (part[:, None] * rows + row) * head_dim + cols[None, :],
                       mask=part_ok[:, None] & (cols < head_dim)[None, :], other=0.0)
        acc += tl.sum(tl.math.exp2((part_lse - top) * LOG2E)[:, None] * outs, 0)
    empty = total == 0.0
    acc = acc / tl.where(empty, 1.0, total)
    tl.store(merged_lse_ptr + row, tl.where(empty, float("-inf"), top + tl.log(tl.where(empty, 1.0, total))))
    query = row % seqlen_q
    batch_head = row // seqlen_q  # the output is (B, seqlen_q, H, d): move the query before the head
    batch, head = batch_head // heads, batch_head % heads
    tl.store(merged_ptr + ((batch * seqlen_q + query) * heads + head) * head_dim + cols,
             acc.to(merged_ptr.dtype.element_ty), mask=cols < head_dim)


def triton_decode(q, k_cache, v_cache, lengths, block_table, layout, causal: bool, scale: float,
                  window, softcap: float, splits: int, config: DecodeConfig | None = None):
    """Launch :func:`decode_split_kernel` over ``splits`` splits and merge them.

    q: (B, seqlen_q, H, d) float16/bfloat16; the cache as :func:`fa_lab.attention_with_kvcache` takes it
    (already appended); lengths: int32 (B,) keys per sequence, on q's device; layout: its
    :class:`fa_lab.kvcache.CacheLayout`. Returns (out (B, seqlen_q, H, d) in q.dtype, lse (B, H, seqlen_q)
    float32). Nothing here reads a value back from the GPU.
    """
    import torch

    from .. import interpreting
    from ..common import check_triton_inputs, device_capability, head_dim_bucket, on_device

    check_triton_inputs(q)
    q = q if q.stride(-1) == 1 else q.contiguous()
    if k_cache.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("impl='triton' reads the KV cache in place and needs it contiguous")
    batch, seqlen_q, heads, head_dim = q.shape
    group = heads // layout.heads_kv
    info = BlockInfo(seqlen_q, layout.capacity, causal, tuple(window))
    tma_ok = (not interpreting() and device_capability(q.device)[0] >= 9 and reads_by_tma(layout, info.banded))
    config = config or (INTERPRETER if interpreting() else decode_config(layout, splits, tma_ok))
    pdl = config.pdl and splits > 1 and not interpreting() and device_capability(q.device)[0] >= 9
    rows = group * seqlen_q
    block_m = min(DECODE_ROWS, max(16, triton.next_power_of_2(rows)))
    if prefills_by_query_tiles(layout, splits):
        return cache_prefill(q, k_cache, v_cache, lengths, causal, scale, window, softcap)
    if not layout.paged:
        table, page_size, gather = lengths, layout.capacity, DENSE  # (the table is not read)
    else:
        table, page_size = block_table.contiguous(), layout.page_size
        gather = PAGE_PER_TILE if page_size % config.block_n == 0 else PAGE_PER_KEY
    # Which path, and the window's bounds with an unbounded side beyond every sequence's keys (the
    # capacity); the kernel aligns them per sequence.
    left, right = info.window_bounds() if info.banded else (0, 0)
    ahead = 0
    if config.pages_ahead and layout.paged and gather == PAGE_PER_TILE and not info.banded:
        ahead = pages_ahead(layout, splits, config)
    k_rows, v_rows = (t.reshape(-1, layout.heads_kv, head_dim) for t in (k_cache, v_cache))
    descriptors = {}
    if config.tma:  # (a config given by a caller may ask for it where the layout does not allow it)
        if not reads_by_tma(layout, info.banded):
            raise ValueError("a TMA decode config reads a dense cache of head_dim a power of two from 16 to 256 "
                             "without a window")
        from triton.tools.tensor_descriptor import TensorDescriptor

        descriptors = {name: TensorDescriptor.from_tensor(t.view(t.shape[0], -1), [config.block_n, head_dim])
                       for name, t in (("k_desc", k_rows), ("v_desc", v_rows))}
    final = splits == 1  # the kernel writes the output itself
    out = (torch.empty((batch, seqlen_q, heads, head_dim), dtype=q.dtype, device=q.device) if final else
           torch.empty((splits, batch, heads, seqlen_q, head_dim), dtype=torch.float32, device=q.device))
    lse = torch.empty((splits, batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    with on_device(q):
        decode_split_kernel[(splits, batch * layout.heads_kv, triton.cdiv(rows, block_m))](
            q, k_rows, v_rows, table, lengths, out, lse,
            q.stride(0), q.stride(1), q.stride(2), k_rows.stride(0), k_rows.stride(1),
            heads, group, seqlen_q, page_size, table.shape[-1], head_dim, scale * common.LOG2E,
            left, right, scale / softcap if softcap else 0.0, softcap * common.LOG2E,
            BLOCK_M=block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim_bucket(head_dim),
            CAUSAL=info.causal_only, WINDOW=info.banded, SOFTCAP=bool(softcap), GATHER=gather,
            EVEN_D=head_dim == head_dim_bucket(head_dim), PAGES_AHEAD=ahead,
            PDL=pdl, FINAL=final, num_warps=config.num_warps, num_stages=config.num_stages, **descriptors)
    if final:
        return out, lse[0]
    return merge_split_results(out, lse, q.dtype, pdl)


def pages_ahead(layout, splits: int, config: DecodeConfig) -> int:
    """The kernel's PAGES_AHEAD for a paged call with ``config``'s tiles
    (:func:`fa_lab.kvcache.pages_read_ahead`; a window's splits cut the band, not the cache: the caller
    leaves it at 0 there)."""
    return pages_read_ahead(layout.programs, layout.capacity, layout.page_size, splits, config.block_n,
                            config.per_sm)


def reads_by_tma(layout, banded: bool) -> bool:
    """Whether the decode kernel can read a call's cache through tensor descriptors: a dense cache whose rows
    a descriptor addresses (head_dim a power of two from 16 to 256, so the tile is its full width), no window."""
    return not layout.paged and not banded and layout.head_dim in (16, 32, 64, 128, 256)


def decode_config(layout, splits: int, tma: bool = False) -> DecodeConfig:
    """The H200's config for a call on a CUDA GPU (docs/experiments/interfaces.md, "Decode: one split writes
    the output, and 64-key tiles past one wave", "Decode: pages of 64 keys read in the loop" and "Decode: TMA
    reads in one split"):

    - TMA_DENSE for a dense cache in one split where ``tma`` (the GPU has TMA and :func:`reads_by_tma`);
    - SHORT_SPLIT when a dense cache's capacity cut in ``splits`` leaves at most SHORT_SPLIT_KEYS keys per split;
    - SMALL_TILE for pages of 64 keys (a multiple of 64 but not of DECODE_CUDA's 128: a 128-key tile would
      gather its keys one by one), each tile's page entry read ahead (:func:`pages_ahead`) or in the loop;
    - SMALL_TILE when its 64-key tiles can serve the cache (dense, or pages of a multiple of 128 keys whose
      split's entries it reads ahead) and the call's programs outnumber the SMs with splits of at most
      SMALL_TILE_WAVE_KEYS keys (DECODE_CUDA runs one program per SM, so those would take two waves, a tail
      the short splits do not amortize);
    - DECODE_CUDA otherwise (its 128-key tiles lie in one page of a multiple of kvcache.SPLIT_BLOCK keys, or
      gather the keys of smaller pages one by one).
    """
    split_keys = cdiv(layout.capacity, splits)
    if tma and splits == 1 and not layout.paged:
        return TMA_DENSE
    if not layout.paged and split_keys <= SHORT_SPLIT_KEYS:
        return SHORT_SPLIT
    if layout.paged:
        if layout.page_size % SMALL_TILE.block_n:
            return DECODE_CUDA
        if layout.page_size % DECODE_CUDA.block_n:
            return SMALL_TILE
        if not pages_ahead(layout, splits, SMALL_TILE):
            return DECODE_CUDA
    two_waves = not fits_one_wave(layout.programs, splits, DECODE_CUDA.per_sm)
    return SMALL_TILE if two_waves and split_keys <= SMALL_TILE_WAVE_KEYS else DECODE_CUDA


def prefills_by_query_tiles(layout, splits: int) -> bool:
    """Whether a call is a chunked prefill that the prefill forward serves better than the decode kernel:
    one split, a dense cache whose rows a tensor descriptor can read (head_dim a multiple of 8), and at
    least one whole query tile of the forward's per head. The decode kernel's packed tiles are sized
    for a few query rows per head; with hundreds, the forward's larger tiles (and its unmasked inner
    loop) win (docs/experiments/interfaces.md, "Decode: chunked prefill on the prefill forward")."""
    from .. import interpreting
    from .configs import forward_config

    tile = forward_config(layout.head_dim, True, interpreting()).block_m
    return splits == 1 and not layout.paged and layout.head_dim % 8 == 0 and layout.seqlen_q >= tile


def cache_prefill(q, k_cache, v_cache, lengths, causal: bool, scale: float, window, softcap: float):
    """Queries over a dense cache through :func:`.attention.triton_forward`, the cache's lengths as its
    ``seqused_k``: q (B, seqlen_q, H, d), k_cache, v_cache (B, capacity, heads_kv, d), lengths int32 (B,).
    Returns (out (B, seqlen_q, H, d) in q.dtype, a view; lse (B, H, seqlen_q) float32). Reads nothing back."""
    from ..common import kernel_operand
    from .attention import ScoreOptions, triton_forward

    out, lse = triton_forward(kernel_operand(q.transpose(1, 2)), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                              causal, scale, options=ScoreOptions(tuple(window), float(softcap)), seqused_k=lengths)
    return out.transpose(1, 2), lse


def merge_split_results(out, lse, dtype, pdl: bool = False):
    """Merge the splits with :func:`merge_splits_kernel`: out float32 (splits, B, H, seqlen_q, d), lse
    (splits, B, H, seqlen_q), contiguous -> (merged (B, seqlen_q, H, d) in ``dtype``, lse (B, H, seqlen_q)).
    pdl: launch it as a programmatic dependent launch (sm_90; the kernel before it allows it, as
    :func:`decode_split_kernel` does with PDL)."""
    import torch

    from ..common import head_dim_bucket, on_device

    splits, batch, heads, seqlen_q, head_dim = out.shape
    merged = torch.empty((batch, seqlen_q, heads, head_dim), dtype=dtype, device=out.device)
    merged_lse = torch.empty(lse.shape[1:], dtype=torch.float32, device=out.device)
    with on_device(out):
        merge_splits_kernel[(batch * heads * seqlen_q,)](out, lse, merged, merged_lse, splits, heads, seqlen_q,
                                                         head_dim, SPLITS=triton.next_power_of_2(splits),
                                                         SPLIT_CHUNK=min(MERGE_CHUNK, triton.next_power_of_2(splits)),
                                                         HEAD_DIM=head_dim_bucket(head_dim), PDL=pdl, launch_pdl=pdl)
    return merged, merged_lse
