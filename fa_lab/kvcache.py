"""Attention at inference time: a KV cache, dense or paged, appended in place, and split-KV decoding.

Layouts are flash-attn's ``flash_attn_with_kvcache``: ``q`` (batch, seqlen_q, heads, d); the cache
``k_cache``, ``v_cache`` (batch, capacity, heads_kv, d), or with ``block_table`` a pool of pages
(num_pages, page_size, heads_kv, d) where ``block_table[b, p]`` is the physical page holding tokens
``p * page_size`` to ``(p + 1) * page_size - 1`` of sequence ``b``; ``cache_seqlens`` int32 (batch,)
counts the tokens already cached. ``k_new``, ``v_new`` (batch, seqlen_new, heads_kv, d) are written into
the cache at ``cache_seqlens`` first (in place; the caller's ``cache_seqlens`` is not changed), then the
queries attend to the ``cache_seqlens + seqlen_new`` keys of their sequence, bottom-right aligned.

Split-KV (flash-decoding): a sequence's keys are cut into ``num_splits`` ranges of whole key blocks,
each range's attention is computed on its own (output and LSE), and the partial results are merged by
their LSE (:func:`fa_lab.online_softmax.merge_splits`). It pays when batch x heads_kv is too small to
fill the GPU with one program per (sequence, KV head): :func:`choose_num_splits` picks the count.
Forward only: nothing here has a backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_info import cdiv
from .inputs import SUPPORTED_DTYPES, check_flag, check_head_dims, check_heads, check_options
from .online_softmax import merge_splits

SPLIT_BLOCK = 128  # keys per split are whole blocks of this many (the kernels' key tile)
MAX_SPLITS = 128
DECODE_ROWS = 64  # packed query rows per program of the decode kernel (its largest tile)
H200_SMS = 132
# A program's fixed time (its Q tile, the latency before its first key block arrives, its partial result and
# its share of the merge) in key blocks' worth of loads, fitted to the forced sweep at batch 1 x 4K:
# critical_path_splits says how it is used.
PROGRAM_OVERHEAD_BLOCKS = 6
MAX_PAGES_AHEAD = 256  # the most block-table entries the decode kernel reads ahead of a split's key loop
# The decode kernel's small key tile and the programs of that tile one H200 SM holds (its SMALL_TILE config,
# fa_lab/kernels/portable/decode.py): pages of a multiple of it hold whole tiles.
SMALL_TILE_KEYS, SMALL_TILES_PER_SM = 64, 3
PAGED_SPLIT_KEYS = 4096  # a split of a paged cache longer than this is cut in two (choose_num_splits)


@dataclass(frozen=True)
class CacheLayout:
    """What a call's cache looks like: sizes, and (paged) the page size and pages per sequence."""

    batch: int
    seqlen_q: int
    heads: int
    heads_kv: int
    head_dim: int
    paged: bool
    page_size: int  # capacity when the cache is dense
    capacity: int  # tokens one sequence can hold
    seqlen_new: int = 0  # tokens appended to each sequence before attending

    @property
    def row_tiles(self) -> int:
        """Tiles of DECODE_ROWS packed query rows (group x seqlen_q) per (sequence, KV head): 1 for decode."""
        return cdiv(self.heads // self.heads_kv * self.seqlen_q, DECODE_ROWS)

    @property
    def programs(self) -> int:
        """The decode kernel's programs per split: batch x heads_kv x row_tiles."""
        return self.batch * self.heads_kv * self.row_tiles


def _tensor(name: str, value, ndim: int, layout: str):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(value.shape)}")
    return value


def check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, block_table=None) -> CacheLayout:
    """Check every argument of :func:`attention_with_kvcache` that shapes the call (types, shapes, devices,
    dtypes); raises ValueError or TypeError naming the argument before anything is computed or written.
    The values inside cache_seqlens and block_table are :func:`check_cache_values`' job."""
    _tensor("q", q, 4, "(batch, seqlen_q, heads, head_dim)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t, 4, "(batch, capacity, heads_kv, head_dim), or (num_pages, page_size, heads_kv, "
                            "head_dim) with block_table")
    for name, t in (("k_new", k_new), ("v_new", v_new), ("block_table", block_table)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; attention needs float32, float16 or bfloat16")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if t is not None and (t.dtype != q.dtype or t.device != q.device):
            raise TypeError(f"{name} is {t.dtype} on {t.device} but q is {q.dtype} on {q.device}; they must match")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous: the cache is appended to in place, through "
                         "views of its token rows (a slice such as cache[:, :n] is not; pass the whole buffer "
                         "and cache_seqlens)")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache {tuple(k_cache.shape)}; they "
                         "must match")
    batch, seqlen_q, heads, head_dim = q.shape
    if batch < 1 or seqlen_q < 1:
        raise ValueError(f"q must hold at least one query per sequence, got shape {tuple(q.shape)}")
    if min(heads, head_dim, *k_cache.shape[1:]) < 1:
        raise ValueError(f"q's heads and head_dim and k_cache's last three dimensions must be >= 1, got q "
                         f"{tuple(q.shape)} and k_cache {tuple(k_cache.shape)}")
    check_heads(heads, k_cache.shape[2], v_cache.shape[2])
    check_head_dims(head_dim, k_cache.shape[3], v_cache.shape[3])
    _tensor("cache_seqlens", cache_seqlens, 1, "(batch,)")
    for name, t in (("cache_seqlens", cache_seqlens), ("block_table", block_table)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must match")
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens must be int32 of shape ({batch},) (q's batch), got {cache_seqlens.dtype} "
                         f"of shape {tuple(cache_seqlens.shape)}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new come together: give both or neither")
    seqlen_new = 0
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            _tensor(name, t, 4, "(batch, seqlen_new, heads_kv, head_dim)")
            if t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:]:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({batch}, seqlen_new, "
                                 f"{k_cache.shape[2]}, {k_cache.shape[3]})")
        if k_new.shape != v_new.shape:
            raise ValueError(f"v_new has shape {tuple(v_new.shape)} but k_new {tuple(k_new.shape)}")
        seqlen_new = k_new.shape[1]
    paged = block_table is not None
    if paged:
        _tensor("block_table", block_table, 2, "(batch, max_pages)")
        if block_table.dtype != torch.int32 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be int32 of shape ({batch}, max_pages), got {block_table.dtype} "
                             f"of shape {tuple(block_table.shape)}")
        page_size, capacity = k_cache.shape[1], block_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences but q {batch}; a paged pool needs "
                             "block_table")
        page_size = capacity = k_cache.shape[1]
    return CacheLayout(batch, seqlen_q, heads, k_cache.shape[2], head_dim, paged, page_size, capacity, seqlen_new)


def check_cache_values(layout: CacheLayout, cache_seqlens, block_table, num_pages: int) -> list[int]:
    """The keys per sequence after the append (cache_seqlens + seqlen_new), once every sequence fits its
    capacity (or its pages) and, paged, the pages each one uses exist and belong to it alone; raises
    ValueError naming the first offender otherwise. Reads the values back from the device once."""
    summary = cache_seqlens.long()
    if layout.paged:
        summary = torch.cat([summary, _block_table_is_bad(layout, cache_seqlens, block_table, num_pages)[None]])
    values = summary.tolist()
    seqlen_new = layout.seqlen_new
    for b, n in enumerate(values[:layout.batch]):
        if n < 0 or n + seqlen_new > layout.capacity:
            where = (f"its {layout.capacity // layout.page_size} pages of {layout.page_size}" if layout.paged
                     else f"its capacity {layout.capacity}")
            raise ValueError(f"sequence {b} would hold cache_seqlens[{b}] + seqlen_new = {n} + {seqlen_new} tokens, "
                             f"more than {where}" if n >= 0 else f"cache_seqlens[{b}] = {n} is negative")
    lengths = [n + seqlen_new for n in values[:layout.batch]]
    if layout.paged and values[-1]:
        _explain_block_table(block_table, lengths, layout.page_size, num_pages)
    return lengths


def _block_table_is_bad(layout: CacheLayout, cache_seqlens, block_table, num_pages: int) -> torch.Tensor:
    """A 0-d int64 tensor, 1 when a page in use is out of the pool or used twice (computed on the device)."""
    used = (cache_seqlens.long().clamp(min=0) + layout.seqlen_new + layout.page_size - 1) // layout.page_size
    slots = torch.arange(block_table.shape[1], device=block_table.device)
    in_use = slots[None, :] < used[:, None]
    pages = block_table.long()
    outside = in_use & ((pages < 0) | (pages >= num_pages))
    # Slots not in use get distinct negative values, so that only pages in use can repeat.
    keyed = torch.where(in_use, pages, -1 - torch.arange(pages.numel(), device=pages.device).view(pages.shape))
    ordered = keyed.flatten().sort().values
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    return (outside.any() | repeated.any()).long()


def _explain_block_table(block_table, lengths, page_size: int, num_pages: int) -> None:
    """Raise the ValueError that names the first bad entry of a block table (the slow path, on error only)."""
    owner = {}
    table = block_table.tolist()
    for b, n in enumerate(lengths):
        for p in range(cdiv(n, page_size)):
            page = table[b][p]
            if not 0 <= page < num_pages:
                raise ValueError(f"block_table[{b}, {p}] = {page} is not a page of the pool (0 to {num_pages - 1})")
            if page in owner:
                raise ValueError(f"page {page} is used by sequence {owner[page][0]} (block_table[{owner[page][0]}, "
                                 f"{owner[page][1]}]) and by sequence {b} (block_table[{b}, {p}]): two sequences "
                                 "cannot share a page they write")
            owner[page] = (b, p)


def cache_rows(layout: CacheLayout, block_table, batch_index, positions: torch.Tensor) -> torch.Tensor:
    """The rows of the cache's flattened (pages * page_size) token axis that hold tokens ``positions`` of
    sequence ``batch_index``: through the block table when paged, else batch_index * capacity + position.
    batch_index is an int, or a (B, 1) tensor of indices with positions (B, n): every sequence at once."""
    if not layout.paged:
        return batch_index * layout.capacity + positions
    pages = block_table.long()[batch_index, positions // layout.page_size]
    return pages * layout.page_size + positions % layout.page_size


def append_kv(layout: CacheLayout, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table) -> None:
    """Write k_new, v_new into the cache at each sequence's cache_seqlens, in place (through the pages):
    one scatter for the whole batch, with no value read back from the device."""
    flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    batch, seqlen_new = k_new.shape[:2]
    positions = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=k_cache.device)
    rows = cache_rows(layout, block_table, torch.arange(batch, device=k_cache.device)[:, None], positions).flatten()
    flat_k.index_copy_(0, rows, k_new.reshape(-1, *k_new.shape[2:]))
    flat_v.index_copy_(0, rows, v_new.reshape(-1, *v_new.shape[2:]))


def gather_kv(layout: CacheLayout, cache, block_table, batch_index: int, length: int) -> torch.Tensor:
    """Tokens 0 .. length - 1 of sequence ``batch_index`` as a (length, heads_kv, d) tensor (a copy when paged)."""
    rows = cache_rows(layout, block_table, batch_index, torch.arange(length, device=cache.device))
    return cache.view(-1, *cache.shape[2:])[rows]


def split_ranges(seqlen_k: int, num_splits: int, block: int = SPLIT_BLOCK) -> list[tuple[int, int]]:
    """The key ranges of ``num_splits`` splits: whole blocks of ``block`` keys, as even as possible, none
    empty (fewer splits when there are fewer blocks than splits)."""
    blocks = cdiv(seqlen_k, block)
    splits = max(1, min(num_splits, blocks))
    edges = [blocks * s // splits * block for s in range(splits + 1)]
    return [(start, min(end, seqlen_k)) for start, end in zip(edges, edges[1:])]


def _split_limit(programs: int, seqlen_k: int, num_sms: int, block: int, max_splits: int) -> int | None:
    """None when ``programs`` already make about one wave (80% of the SMs: no split), else the most splits
    a call may take: one key block of ``block`` keys each at least, at most max_splits and the SMs."""
    if programs >= 0.8 * num_sms:
        return None
    return max(1, min(max_splits, cdiv(seqlen_k, block), num_sms))


def wave_splits(programs: int, seqlen_k: int, num_sms: int = H200_SMS, block: int = SPLIT_BLOCK,
                max_splits: int = MAX_SPLITS) -> int:
    """Chapter 02's waves applied to split-KV: 1 when ``programs`` already make ~one wave (80% of the SMs);
    otherwise the smallest count whose waves are at least 85% as full as the best count's, never more than
    the key blocks of ``block`` keys there are (nor max_splits, nor the SMs).

    With P programs and s splits there are P x s programs in ceil(P x s / num_sms) waves, and the
    efficiency of a count is P x s / (waves x num_sms). This is the rule notebook 06 derives (and lab 06
    asks for); :func:`choose_num_splits` adds what the H200 measured.
    """
    limit = _split_limit(programs, seqlen_k, num_sms, block, max_splits)
    if limit is None:
        return 1

    def efficiency(s):
        return programs * s / (cdiv(programs * s, num_sms) * num_sms)
    best = max(efficiency(s) for s in range(1, limit + 1))
    return next(s for s in range(1, limit + 1) if efficiency(s) >= 0.85 * best)


def critical_path_splits(programs: int, seqlen_k: int, num_sms: int = H200_SMS, block: int = SPLIT_BLOCK,
                         max_splits: int = MAX_SPLITS, overhead: int = PROGRAM_OVERHEAD_BLOCKS) -> int:
    """The split count whose slowest SM finishes first: 1 when ``programs`` already make ~one wave,
    otherwise the count s up to :func:`_split_limit`'s bound with the least ``waves(s) x (blocks of the
    longest split + overhead)``, in key blocks (an SM runs its waves' programs one after another, each
    walking its split's blocks after a fixed cost of ``overhead`` blocks); the fewer splits on a tie."""
    limit = _split_limit(programs, seqlen_k, num_sms, block, max_splits)
    if limit is None:
        return 1
    blocks = cdiv(seqlen_k, block)
    return min(range(1, limit + 1), key=lambda s: (cdiv(programs * s, num_sms) * (cdiv(blocks, s) + overhead), s))


def split_page_span(capacity: int, page_size: int, splits: int, block: int = SPLIT_BLOCK) -> int:
    """The most pages one of ``splits`` splits of a sequence of ``capacity`` keys touches, as a power of two:
    a split holds at most cdiv(blocks, splits) blocks of ``block`` keys and starts on a block, so it spans
    at most one page more than it fills."""
    keys = cdiv(cdiv(capacity, block), splits) * block
    return 1 << cdiv(keys, page_size).bit_length()  # pages + 1, rounded up to a power of two


def fits_one_wave(programs: int, splits: int, per_sm: int, num_sms: int = H200_SMS) -> bool:
    """Whether ``programs x splits`` programs all fit on the SMs at once, ``per_sm`` of them per SM."""
    return programs * splits <= num_sms * per_sm


def pages_read_ahead(programs: int, capacity: int, page_size: int, splits: int, block: int, per_sm: int,
                     num_sms: int = H200_SMS) -> int:
    """The block-table entries each split's program reads before its key loop, 0 when it reads each tile's
    entry in the loop instead: that happens past :data:`MAX_PAGES_AHEAD` entries (:func:`split_page_span` on
    tiles of ``block`` keys), and when the ``programs x splits`` programs outnumber one wave of ``per_sm``
    programs per SM, where other programs hide the loop's table loads and picking a tile's page from the
    registers cost more (batch 32 x 16K, pages of 256: 0.83-0.96 of dense read ahead, 0.98 in the loop;
    docs/experiments/interfaces.md)."""
    if not fits_one_wave(programs, splits, per_sm, num_sms):
        return 0
    span = split_page_span(capacity, page_size, splits, block)
    return span if span <= MAX_PAGES_AHEAD else 0


def choose_num_splits(batch: int, heads_kv: int, seqlen_k: int, num_sms: int = H200_SMS,
                      block: int = SPLIT_BLOCK, max_splits: int = MAX_SPLITS, row_tiles: int = 1,
                      page_size: int | None = None) -> int:
    """How many splits a decode call takes for its batch x heads_kv x row_tiles programs (row_tiles: the
    tiles of the group's packed query rows, 1 for decode): :func:`wave_splits` refined by what the H200
    measured.

    A dense cache takes :func:`critical_path_splits`: the waves, and also how many key blocks the longest
    split walks. At batch 1 x 4K (32 blocks) the waves alone give 14 splits, whose longest has 3 blocks;
    16 splits of 2 finish sooner, and were the fastest count of the forced sweep once the merge read its
    splits a chunk per load (docs/experiments/interfaces.md, "Decode: a merge in few loads, and the split
    count by its critical path").

    A paged cache (``page_size``) takes the same count when its pages hold whole key tiles (a multiple of
    :data:`SPLIT_BLOCK` keys, the kernels' key tile) and each split touches at most :data:`MAX_PAGES_AHEAD` pages
    (:func:`split_page_span`): the kernel then reads a split's block-table
    entries before its key loop, and the loop runs as on a dense cache (docs/experiments/interfaces.md,
    "Decode: a split's pages read ahead"), but a split longer than :data:`PAGED_SPLIT_KEYS` keys is cut in
    two: at batch 8 x 16K, 4 splits of pages of 256 ran at 0.98-0.99 of the dense figure and 2 at 0.94-0.96,
    in every run (docs/experiments/interfaces.md, "Decode: one split writes the output, and 64-key tiles
    past one wave"); pages are scattered, and twice the programs in flight hide more of their latency.

    Otherwise it gets about two waves, never less than a page per split, rounded down to a power of two:
    such a program gathers its keys page by page through the block table, a chain of dependent loads, and
    twice the programs in flight hide its latency; the power of two avoids uneven splits and a merge whose
    vector of splits is padded past the next power of two.

    Pages of 64-key tiles (64 keys, not a multiple of 128) whose entries the kernel cannot read ahead at
    that count (:func:`pages_read_ahead`) have each tile's entry loaded in the loop, and then take at least
    the fewest splits, a power of two, whose programs fill the :data:`SMALL_TILES_PER_SM` slots of every SM:
    pages of 64 at 32 x 16K read 4.44 TB/s with 2 splits against 3.87 with one, and at 8 x 64K 4.45 with 8
    against 3.93 with 4 (``benchmarks/h200_decode_page64.json``). The forced sweep of
    ``benchmarks/h200_decode.json`` measured both rules (docs/experiments/interfaces.md, "Decode: paged
    caches at batch 8 want more splits" and "Decode: two refinements of the split count, from the same
    sweep"). ``block`` only bounds the count: each impl cuts its splits on its own key tile
    (:func:`split_ranges`).
    """
    programs = batch * heads_kv * row_tiles
    dense_count = critical_path_splits(programs, seqlen_k, num_sms, block, max_splits)
    if not page_size:
        return dense_count
    limit = _split_limit(programs, seqlen_k, num_sms, block, max_splits)
    if page_size % block == 0 and split_page_span(seqlen_k, page_size, dense_count, block) <= MAX_PAGES_AHEAD:
        if dense_count > 1 and cdiv(seqlen_k, dense_count) > PAGED_SPLIT_KEYS:
            return min(2 * dense_count, limit)
        return dense_count
    count = 1
    if limit is not None:
        two_waves = max(1, min(limit, cdiv(seqlen_k, page_size), 2 * num_sms // programs))
        count = 1 << (two_waves.bit_length() - 1)
    small_tile_pages = page_size % SMALL_TILE_KEYS == 0 and page_size % block != 0  # pages of 64, 192, ...
    if not small_tile_pages or pages_read_ahead(programs, seqlen_k, page_size, count, SMALL_TILE_KEYS,
                                                SMALL_TILES_PER_SM, num_sms):
        return count
    # 64-key tiles whose entries are loaded in the loop: programs enough for every slot of the SMs.
    fill = cdiv(SMALL_TILES_PER_SM * num_sms, programs)
    return max(count, min(1 << (fill - 1).bit_length(), max_splits, cdiv(seqlen_k, page_size)))


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, block_table=None,
                           causal: bool = True, scale: float | None = None, window=(-1, -1), softcap: float = 0.0,
                           num_splits: int = 0, impl: str = "torch", return_lse: bool = False,
                           check_values: bool = True):
    """Attention of new queries over a KV cache (flash-attn's flash_attn_with_kvcache). Forward only.

    q: (batch, seqlen_q, heads, d); k_cache, v_cache: (batch, capacity, heads_kv, d), or a paged pool
    (num_pages, page_size, heads_kv, d) with block_table int32 (batch, max_pages); cache_seqlens int32
    (batch,), not modified. k_new, v_new: (batch, seqlen_new, heads_kv, d), written into the cache in
    place at cache_seqlens before attending. causal, window: bottom-right aligned over the
    cache_seqlens + seqlen_new keys of each sequence. num_splits: 0 picks it (:func:`choose_num_splits`),
    1 does not split, more forces it. impl: "torch" (gathers each sequence's keys and runs the tiled
    forward per split) or "triton" (the split-KV decode kernel, which reads the pages itself).
    Returns out (batch, seqlen_q, heads, d), or (out, lse) with lse (batch, heads, seqlen_q) float32.
    A refused call raises before anything is written.

    check_values: read cache_seqlens (and the block table's verdict) back from the device to refuse a
    sequence that would overflow or a bad page before writing (:func:`check_cache_values`). That one
    read waits for the GPU's queue to drain. A serving loop that guarantees those values, or captures
    decode steps in a CUDA graph (which cannot hold a read-back), passes False: impl="triton" then
    reads nothing from the device (flash-attn never checks them), and an automatic split count is
    chosen for the cache's capacity instead of the longest sequence. impl="torch" always reads them.
    """
    layout = check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
    causal, scale, window, softcap = check_options(layout.head_dim, causal, scale, window, softcap)
    check_flag("return_lse", return_lse)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= layout.capacity:
        raise ValueError(f"num_splits must be an int from 0 (0: chosen for the GPU) to the cache's capacity "
                         f"{layout.capacity} (a split holds at least one key), got {num_splits!r}")
    if impl not in ("torch", "triton"):
        raise ValueError(f"impl must be 'torch' or 'triton' for attention_with_kvcache, got {impl!r}")
    if impl == "triton":  # what the kernels refuse, refused before the cache is written
        from .kernels import load_triton
        load_triton()
        from .kernels.common import check_triton_inputs
        check_triton_inputs(q)
    check_flag("check_values", check_values)
    if check_values or impl == "torch":
        lengths = check_cache_values(layout, cache_seqlens, block_table, k_cache.shape[0])
    if k_new is not None:
        append_kv(layout, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
    longest = max(lengths) if check_values or impl == "torch" else layout.capacity
    splits = num_splits or choose_num_splits(layout.batch, layout.heads_kv, longest, row_tiles=layout.row_tiles,
                                             page_size=layout.page_size if layout.paged else None)
    if impl == "triton":
        from .kernels import triton_decode
        keys = (cache_seqlens + layout.seqlen_new if layout.seqlen_new else cache_seqlens).contiguous()
        out, lse = triton_decode(q, k_cache, v_cache, keys, block_table, layout, causal, scale, window,
                                 softcap, splits)
        return (out, lse) if return_lse else out
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((layout.batch, layout.heads, layout.seqlen_q), float("-inf"), device=q.device)
    for b, length in enumerate(lengths):
        if length == 0:
            continue  # no key at all: zeros and lse = -inf
        keys, values = (gather_kv(layout, t, block_table, b, length).transpose(0, 1)[None]
                        for t in (k_cache, v_cache))  # (1, heads_kv, length, d)
        queries = q[b].transpose(0, 1)[None]  # (1, heads, seqlen_q, d)
        parts = [_split_attention(queries, keys, values, split, causal, scale, window, softcap)
                 for split in split_ranges(length, splits)]
        merged, merged_lse = merge_splits(torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts]))
        out[b], lse[b] = merged.transpose(0, 1).to(q.dtype), merged_lse
    return (out, lse) if return_lse else out


def _split_attention(q, k, v, keys, causal, scale, window, softcap):
    """One split: q (1, heads, seqlen_q, d) over keys [first, stop) of k, v (1, heads_kv, length, d),
    through the tiled forward with the whole sequence's masks. Returns float32 (out, lse)."""
    from .flash_torch import flash_forward

    out, lse = flash_forward(q.float(), k.float(), v.float(), causal, scale, window=window, softcap=softcap,
                             keys=keys)
    return out[0], lse[0]
