"""The plain-Triton kernels' loop bounds: jit copies of :class:`fa_lab.block_info.BlockInfo`.

BlockInfo is the source of truth for which keys each query sees; kernels cannot call Python, so
the arithmetic they need lives here once, and tests/test_block_info_kernels.py runs it in the
interpreter on every tile of many shapes and compares it with BlockInfo. Causal masking is
bottom-right aligned: query row i sees keys j <= i + seqlen_k - seqlen_q.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def key_range(start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr):
    """(full_end, end) of the Q tile starting at row ``start_m``: ``BlockInfo.key_blocks(start_m, BLOCK_M, BLOCK_N)``,
    except that a causal tile whose rows see no key may get negative values instead of 0 (its loops
    are empty either way, and the clamp would cost instructions in every program).

    Keys [0, full_end) are visible to every row of the tile and need no mask (whole
    tiles only); keys [full_end, end) sit on the causal diagonal or past seqlen_k and
    are masked; a causal tile skips every key from ``end`` on. Used by the forward kernels and
    the dQ kernel.
    """
    if CAUSAL:
        causal_offset = seqlen_k - seqlen_q
        end = tl.minimum(seqlen_k, start_m + BLOCK_M + causal_offset)
        full_end = tl.maximum(start_m + causal_offset + 1, 0)
    else:
        end = seqlen_k
        full_end = seqlen_k
    return tl.minimum(full_end, end) // BLOCK_N * BLOCK_N, end


@triton.jit
def query_range(start_n, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr):
    """(begin, full_begin, end) of the K tile starting at key ``start_n``:
    ``BlockInfo.query_blocks(start_n, BLOCK_N, BLOCK_M)`` (the dK/dV kernel's loop over Q tiles).

    Q tiles starting in [begin, full_begin) cross the causal diagonal and need the mask, those in
    [full_begin, end) see every key of the tile; end covers the last, ragged Q tile.
    """
    end = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        # Row i sees key j when i >= j - offset: Q tiles above the first row that sees key start_n are skipped.
        causal_offset = seqlen_k - seqlen_q
        begin = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
        full_begin = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0), BLOCK_M) * BLOCK_M
        full_begin = tl.minimum(full_begin, end)
    else:
        begin = 0
        full_begin = 0
    return begin, full_begin, end


@triton.jit
def window_key_range(start_m, seqlen_q, seqlen_k, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(begin, full_begin, full_end, end) of the Q tile starting at row ``start_m`` under a window:
    ``BlockInfo.key_tiles(start_m, BLOCK_M, BLOCK_N)``, with left, right = ``BlockInfo.window_bounds()``.

    Key tiles starting in [begin, full_begin) and [full_end, end) need the band's mask, those in
    [full_begin, full_end) none. Used by the forward and dQ kernels when WINDOW is set.
    """
    offset = seqlen_k - seqlen_q
    last_row = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    start = tl.minimum(tl.maximum(start_m + offset - left, 0), seqlen_k)
    end = tl.minimum(tl.maximum(last_row + offset + right + 1, 0), seqlen_k)
    full_start = tl.minimum(tl.maximum(last_row + offset - left, 0), seqlen_k)
    full_stop = tl.minimum(tl.maximum(start_m + offset + right + 1, 0), seqlen_k)
    empty = end <= start
    begin = start // BLOCK_N * BLOCK_N
    end_tile = tl.cdiv(end, BLOCK_N) * BLOCK_N
    full_begin = tl.minimum(tl.maximum(tl.cdiv(full_start, BLOCK_N) * BLOCK_N, begin), end_tile)
    full_end = tl.maximum(tl.minimum(full_stop, end) // BLOCK_N * BLOCK_N, full_begin)
    return (tl.where(empty, 0, begin), tl.where(empty, 0, full_begin), tl.where(empty, 0, full_end),
            tl.where(empty, 0, end))


@triton.jit
def window_query_range(start_n, seqlen_q, seqlen_k, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(begin, full_begin, full_end, end) of the K tile starting at key ``start_n`` under a window:
    ``BlockInfo.query_tiles(start_n, BLOCK_N, BLOCK_M)`` (the windowed dK/dV kernel's loop over Q tiles)."""
    offset = seqlen_k - seqlen_q
    last_key = start_n + BLOCK_N - 1
    rows_end = tl.minimum(tl.maximum(last_key - offset + left + 1, 0), seqlen_q)
    end = tl.cdiv(rows_end, BLOCK_M) * BLOCK_M
    begin = tl.minimum(tl.maximum(start_n - offset - right, 0) // BLOCK_M * BLOCK_M, end)
    full_begin = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(last_key - offset - right, 0), BLOCK_M) * BLOCK_M, begin),
                            end)
    full_end = tl.minimum(tl.maximum(tl.maximum(start_n - offset + left + 1, 0) // BLOCK_M * BLOCK_M, full_begin),
                          end)
    return begin, full_begin, full_end, end


@triton.jit
def row_key_end(row, seqlen_q, seqlen_k, CAUSAL: tl.constexpr):
    """One past the last key that query ``row`` sees, and so every row before it: ``BlockInfo.key_end(row)``,
    except that a causal row which sees no key may get a negative end (every range cut to it is empty
    either way). The selected-blocks kernels cut each selected block to it."""
    end = seqlen_k
    if CAUSAL:
        end = row + (seqlen_k - seqlen_q) + 1
    return end


@triton.jit
def split_key_range(length, seqlen_q, left, split, splits, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """(begin, end) of split ``split`` of ``splits`` over a sequence's ``length`` keys (the decode kernel):
    whole tiles of BLOCK_N keys by :func:`fa_lab.kvcache.split_ranges`' formula, cut to ``length`` (a split
    past the last tile is empty). Under a window (``left`` as ``BlockInfo.window_bounds`` gives it) it starts
    no earlier than the tile of ``BlockInfo.key_start(0)``: no query row sees a key before it."""
    blocks = tl.cdiv(length, BLOCK_N)
    begin = blocks * split // splits * BLOCK_N
    end = tl.minimum(blocks * (split + 1) // splits * BLOCK_N, length)
    if WINDOW:
        begin = tl.maximum(begin, tl.maximum(length - seqlen_q - left, 0) // BLOCK_N * BLOCK_N)
    return begin, end
