"""Which keys each query sees: the one owner of masks and block ranges.

Query row ``i`` may see key ``j`` when ``key_start(i) <= j < key_end(i)``. Every piece of
code that needs those ranges asks :class:`BlockInfo`: the reference builds its dense mask
from it, the tiled PyTorch code its per-tile masks and loop bounds, the schedulers and
models their tile kinds and costs, the graders their right (and deliberately wrong) masks.
Chapters that change which keys a query sees (windows, varlen, paged KV, sparse tiles,
ring steps) extend this class rather than adding a copy.

Causal masking is aligned to the bottom-right corner, as in flash-attn >= 2.1: with
``offset = seqlen_k - seqlen_q`` query ``i`` sees keys ``j <= i + offset``, so with
``seqlen_q > seqlen_k`` the first ``seqlen_q - seqlen_k`` rows see no key at all.
A local window ``(left, right)`` (flash-attn's ``window_size``, same alignment) keeps keys
``i + offset - left <= j <= i + offset + right``; -1 leaves a side unbounded, and causal
means ``right = 0``. Every row's visible keys are one contiguous range.

Kernels cannot call Python, so each keeps a jit copy of the arithmetic it needs; the
tests compare every copy with :meth:`BlockInfo.key_blocks` and :meth:`BlockInfo.query_blocks`,
which state the kernels' conventions (whole tiles of ``block_n`` keys, a ragged end masked).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


def causal_visible(rows, cols, offset: int):
    """True where query ``rows`` sees key ``cols`` under a causal mask with this offset.

    rows, cols: ints or broadcastable integer tensors. ``offset = seqlen_k - seqlen_q`` is the
    course's mask; the graders pass other offsets to build the masks of typical mistakes.
    """
    return cols <= rows + offset


def band_visible(rows, cols, offset: int, left: int | None, right: int | None) -> torch.Tensor:
    """Bool (broadcast of rows, cols): True where query ``rows`` sees key ``cols`` under a window
    ``rows + offset - left <= cols <= rows + offset + right``, a side of None unbounded.

    rows, cols: broadcastable integer tensors. :meth:`BlockInfo.mask` passes its own offset and sides; the
    graders pass others (a side shifted by one, offset 0) to build the masks of typical mistakes.
    """
    visible = torch.ones(torch.broadcast_shapes(rows.shape, cols.shape), dtype=torch.bool, device=rows.device)
    if right is not None:
        visible &= causal_visible(rows, cols, offset + right)
    if left is not None:
        visible &= cols >= rows + offset - left
    return visible


class KeyBlocks(NamedTuple):
    """The keys a query tile visits: ``[0, full_end)`` in whole tiles that need no mask,
    ``[full_end, end)`` with a mask (the causal diagonal, the ragged last tile); none from ``end`` on."""
    full_end: int
    end: int


class KeyTiles(NamedTuple):
    """A query tile's key loop under a window: tiles starting in ``[begin, full_begin)`` and
    ``[full_end, end)`` need a mask (the band's two edges, a ragged end), ``[full_begin, full_end)``
    none; keys before ``begin`` and from ``end`` on are never visited."""
    begin: int
    full_begin: int
    full_end: int
    end: int


class QueryTiles(NamedTuple):
    """A key tile's query loop under a window (the dK/dV kernel): query tiles starting in
    ``[begin, full_begin)`` and ``[full_end, end)`` need a mask, those in ``[full_begin, full_end)`` see
    every key of the tile; the others see none of it."""
    begin: int
    full_begin: int
    full_end: int
    end: int


class QueryBlocks(NamedTuple):
    """The query rows a key tile meets (the dK/dV loop): tiles starting in ``[begin, full_begin)``
    need a mask, those in ``[full_begin, end)`` see every key of the tile; rows before ``begin`` none."""
    begin: int
    full_begin: int
    end: int


MAX_WINDOW = 2 ** 30  # a window side the kernels' int32 bounds (row + offset + side) hold; -1 is unbounded


def check_window(window) -> tuple[int, int]:
    """``window`` as (left, right) ints, each -1 (unbounded) or 0 to MAX_WINDOW; raises ValueError/TypeError."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right), got {window!r}")
    for side, value in zip(("left", "right"), window, strict=True):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"window's {side} size must be an int, got {value!r}")
        if value < -1:
            raise ValueError(f"window's {side} size must be -1 (unbounded) or >= 0, got {value}")
        if value > MAX_WINDOW:
            raise ValueError(f"window's {side} size must be at most 2**30 (-1 means unbounded), got {value}")
    return int(window[0]), int(window[1])


def canonical_mask(causal: bool, window) -> tuple[bool, tuple[int, int]]:
    """(causal, window) with a right bound of 0 written as causal: ``window=(left, 0)`` is the causal
    mask with a left bound, so every impl takes its causal path for it (flash-attn's interface does the
    same), and ``causal=True`` leaves the window's right side unbounded, since causal already bounds it."""
    left, right = check_window(window)
    if causal or right == 0:
        return True, (left, -1)
    return False, (left, right)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints."""
    return -(-a // b)


@dataclass(frozen=True)
class BlockInfo:
    """The visible keys of every query of one (batch, head): seqlen_q rows, seqlen_k keys."""

    seqlen_q: int
    seqlen_k: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)

    def __post_init__(self):
        for name in ("seqlen_q", "seqlen_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be True or False, got {self.causal!r}")
        check_window(self.window)

    @property
    def offset(self) -> int:
        """seqlen_k - seqlen_q: the diagonal's shift in bottom-right alignment."""
        return self.seqlen_k - self.seqlen_q

    @property
    def left(self) -> int | None:
        """How many keys before its diagonal a query sees (None: all of them)."""
        return None if self.window[0] < 0 else self.window[0]

    @property
    def right(self) -> int | None:
        """How many keys after its diagonal a query sees (None: all of them); 0 when causal."""
        if self.causal:
            return 0 if self.window[1] < 0 else min(self.window[1], 0)
        return None if self.window[1] < 0 else self.window[1]

    @property
    def banded(self) -> bool:
        """Whether the window hides keys that causal masking alone would not: a left bound, or a
        right bound without causal (the kernels then take their windowed path)."""
        return self.left is not None or (self.right is not None and not self.causal)

    @property
    def causal_only(self) -> bool:
        """Causal masking with no band: the kernels' CAUSAL (a band folds causal into its window bounds)."""
        return self.causal and not self.banded

    @property
    def masked(self) -> bool:
        """Whether any query may miss a key: causal, or a bounded window side."""
        return self.left is not None or self.right is not None

    # ---- per row ----------------------------------------------------------------------------

    def key_start(self, row):
        """The first key that query ``row`` sees (an int, or a tensor of rows); 0 without a left bound."""
        if isinstance(row, torch.Tensor):
            if self.left is None:
                return torch.zeros_like(row)
            return torch.clamp(row + self.offset - self.left, 0, self.seqlen_k)
        if self.left is None:
            return 0
        return min(max(row + self.offset - self.left, 0), self.seqlen_k)

    def key_end(self, row):
        """One past the last key that query ``row`` sees (an int, or a tensor of rows)."""
        if isinstance(row, torch.Tensor):
            if self.right is None:
                return torch.full_like(row, self.seqlen_k)
            return torch.clamp(row + self.offset + self.right + 1, 0, self.seqlen_k)
        if self.right is None:
            return self.seqlen_k
        return min(max(row + self.offset + self.right + 1, 0), self.seqlen_k)

    def first_query(self, key: int) -> int:
        """The first query row that sees ``key`` (seqlen_q when none does)."""
        first = 0 if self.right is None else max(key - self.offset - self.right, 0)
        last = self.seqlen_q - 1 if self.left is None else min(key - self.offset + self.left, self.seqlen_q - 1)
        return first if first <= last and 0 <= key < self.seqlen_k else self.seqlen_q

    def visible_pairs(self) -> int:
        """How many (query, key) pairs are visible: seqlen_q * seqlen_k without a mask, about half
        of it when causal, about seqlen_q * (left + right + 1) with a window."""
        if not self.masked:
            return self.seqlen_q * self.seqlen_k
        rows = torch.arange(self.seqlen_q, dtype=torch.int64)
        return int((self.key_end(rows) - self.key_start(rows)).clamp(min=0).sum())

    # ---- masks ------------------------------------------------------------------------------

    def mask(self, q0: int = 0, q1: int | None = None, k0: int = 0, k1: int | None = None,
             device=None) -> torch.Tensor:
        """(q1 - q0, k1 - k0) bool, True where a key is visible: rows [q0, q1), keys [k0, k1).

        Built from two aranges, so a tile's mask costs the tile, never (seqlen_q, seqlen_k).
        Bounds past the sequence are clipped to it.
        """
        q1 = self.seqlen_q if q1 is None else min(q1, self.seqlen_q)
        k1 = self.seqlen_k if k1 is None else min(k1, self.seqlen_k)
        rows = torch.arange(q0, max(q1, q0), device=device)[:, None]
        cols = torch.arange(k0, max(k1, k0), device=device)[None, :]
        return band_visible(rows, cols, self.offset, self.left, self.right)

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        """(start, end): the keys that at least one query of rows [q0, q1) sees; (0, 0) for none."""
        q1 = min(q1, self.seqlen_q)
        if q1 <= q0:
            return 0, 0
        return self.key_start(q0), self.key_end(q1 - 1)  # the ranges only grow down the rows

    def full_key_end(self, q0: int) -> int:
        """Keys [0, full_key_end) are visible to every query from row q0 on (without a left bound)."""
        return self.key_end(q0)

    def full_keys(self, q0: int, q1: int) -> tuple[int, int]:
        """(start, end): the keys every query of rows [q0, q1) sees; start >= end when there are none."""
        q1 = min(q1, self.seqlen_q)
        return self.key_start(q1 - 1), self.key_end(q0)

    def tile_kind(self, q0: int, q1: int, k0: int, k1: int) -> str:
        """"full", "masked" or "skipped": rows [q0, q1) x keys [k0, k1), clipped to the sequence.

        "full" when every query of the tile sees every key of it (no mask needed), "skipped" when
        none sees any (the loop never visits it), "masked" otherwise.
        """
        q1, k1 = min(q1, self.seqlen_q), min(k1, self.seqlen_k)
        start, end = self.key_range(q0, q1)
        if q1 <= q0 or k1 <= k0 or k0 >= end or k1 <= start:
            return "skipped"
        full_start, full_end = self.full_keys(q0, q1)
        if full_start <= k0 and k1 <= full_end:
            return "full"
        return "masked"

    # ---- the kernels' loop bounds -------------------------------------------------------------

    def key_blocks(self, start_m: int, block_m: int, block_n: int) -> KeyBlocks:
        """The key loop of the query tile that starts at row ``start_m`` (block_m rows, block_n keys per
        step), as every forward kernel and the dQ kernel run it: the unmasked tiles first, then the
        masked ones. Without causal only a ragged last tile is masked."""
        self._no_left_bound("key_blocks")
        _, end = self.key_range(start_m, start_m + block_m)
        full_end = min(self.full_key_end(start_m), end) // block_n * block_n
        return KeyBlocks(full_end, end)

    def query_blocks(self, start_n: int, block_n: int, block_m: int) -> QueryBlocks:
        """The query loop of the key tile that starts at key ``start_n`` (the dK/dV kernel): the
        masked tiles first, then the full ones. Rows past seqlen_q (the last tile's padding) count
        as full; their probabilities are zero."""
        self._no_left_bound("query_blocks")
        if self.right not in (None, 0):
            raise NotImplementedError("query_blocks: a right window bound other than causal's is not in the "
                                      "kernels' loops yet")
        end = cdiv(self.seqlen_q, block_m) * block_m
        if self.right is None:
            return QueryBlocks(0, 0, end)
        # Row i sees key j when i >= j - offset: tiles above the first such row are skipped.
        begin = min(max(start_n - self.offset, 0) // block_m * block_m, end)
        last_key = start_n + block_n - 1  # the tile's last key, padding included
        full_begin = min(cdiv(max(last_key - self.offset, 0), block_m) * block_m, end)
        return QueryBlocks(begin, full_begin, end)

    def _no_left_bound(self, what: str) -> None:
        if self.left is not None:
            raise NotImplementedError(f"{what}: windows with a left bound are not in the kernels' loops yet")

    # ---- the windowed kernels' loop bounds ----------------------------------------------------

    def window_bounds(self) -> tuple[int, int]:
        """(left, right) with each unbounded side replaced by a bound no query reaches
        (seqlen_q + seqlen_k): what the windowed kernels take, so that they need no flag per side."""
        unbounded = self.seqlen_q + self.seqlen_k
        return (unbounded if self.left is None else self.left,
                unbounded if self.right is None else self.right)

    def key_tiles(self, start_m: int, block_m: int, block_n: int) -> KeyTiles:
        """The key loop of the query tile starting at row ``start_m`` in the windowed kernels
        (whole tiles of block_n keys from ``begin``; the ragged last tile is masked)."""
        q1 = min(start_m + block_m, self.seqlen_q)
        start, end = self.key_range(start_m, q1)
        if end <= start:
            return KeyTiles(0, 0, 0, 0)
        begin = start // block_n * block_n
        full_start, full_stop = self.full_keys(start_m, q1)
        end_tile = cdiv(end, block_n) * block_n  # (keeps every bound on the tile grid)
        full_begin = min(max(cdiv(full_start, block_n) * block_n, begin), end_tile)
        full_end = max(min(full_stop, end) // block_n * block_n, full_begin)
        return KeyTiles(begin, full_begin, full_end, end)

    def key_tile_edges(self, start_m: int, block_m: int, block_n: int) -> KeyTiles | None:
        """The windowed key loop split in three, as flash-attn-4 walks it (the Gluon forward's ``split_loops``):
        tiles in ``[begin, full_begin)`` need the lower bound only (key >= key_start), ``[full_begin, full_end)`` no
        mask, ``[full_end, end)`` the upper bound only (key < key_end: the band's edge, the causal diagonal, the
        ragged end). That holds when the query tile has a full key tile. Without one (a band narrower than a tile,
        or the ragged end before the band's first full tile) :meth:`key_tiles` raises full_end to full_begin, a tile
        before full_begin may need both bounds, and this returns None: one loop tests both."""
        tiles = self.key_tiles(start_m, block_m, block_n)
        return tiles if tiles.full_end > tiles.full_begin else None

    def query_tiles(self, start_n: int, block_n: int, block_m: int) -> QueryTiles:
        """The query loop of the key tile starting at key ``start_n`` in the windowed dK/dV kernel.
        Keys past seqlen_k count as keys of the tile (the kernel drops their results); rows past
        seqlen_q as rows that see them (their probabilities are zero)."""
        left, right = self.window_bounds()
        last_key = start_n + block_n - 1
        # Row i sees key j when j - offset - right <= i <= j - offset + left.
        rows_end = min(max(last_key - self.offset + left + 1, 0), self.seqlen_q)
        end = cdiv(rows_end, block_m) * block_m
        begin = min(max(start_n - self.offset - right, 0) // block_m * block_m, end)
        full_begin = min(max(cdiv(max(last_key - self.offset - right, 0), block_m) * block_m, begin), end)
        full_end = min(max(max(start_n - self.offset + left + 1, 0) // block_m * block_m, full_begin), end)
        return QueryTiles(begin, full_begin, full_end, end)
