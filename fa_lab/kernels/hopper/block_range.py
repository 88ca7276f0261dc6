"""The Gluon kernel's loop bounds and mask bounds: jit copies of :class:`fa_lab.block_info.BlockInfo`.

BlockInfo is the source of truth for which keys each query sees; kernels cannot call Python, so
the arithmetic the Gluon FA3 kernel needs lives here once. tests/test_block_info_kernels.py
compiles probe kernels calling these functions for sm_90 on any machine and, on a GPU, runs them
on every tile of many shapes against BlockInfo. Causal masking is bottom-right aligned: query
row i sees keys j <= i + seqlen_k - seqlen_q; a window (left, right) (``BlockInfo.window_bounds``,
causal folded in) keys i + offset - left <= j <= i + offset + right.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def tile_plan(start_m, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(n_iter, first_masked): the K/V tiles a work tile of rows [start_m, +BLOCK_M) visits, and the first
    that needs a mask. With ``BlockInfo.key_blocks(start_m, BLOCK_M, BLOCK_N) = (full_end, end)``:
    n_iter = max(cdiv(end, BLOCK_N), 1), first_masked = full_end // BLOCK_N.

    A work tile whose rows see no key at all still visits one (fully masked) tile, so every
    row leaves with l = 0 and gets O = 0, lse = -inf.
    """
    if CAUSAL:
        offset = seqlen_k - seqlen_q
        end = gl.minimum(seqlen_k, gl.maximum(start_m + BLOCK_M + offset, 0))
        full_end = gl.minimum(gl.maximum(start_m + offset + 1, 0), end)
    else:
        end = seqlen_k
        full_end = seqlen_k
    n_tiles = gl.cdiv(end, BLOCK_N)
    return gl.maximum(n_tiles, 1), gl.minimum(full_end // BLOCK_N, n_tiles)


@gluon.jit
def visible_key_end(offs_m, seqlen_q, seqlen_k, CAUSAL: gl.constexpr):
    """Per query row of offs_m, one past its last visible key: ``BlockInfo.key_end(row)``, except that a row
    which sees no key may get a negative end instead of 0 (its mask is all False either way, and the
    clamp would cost an instruction per row)."""
    if CAUSAL:
        return gl.minimum(offs_m + (seqlen_k - seqlen_q + 1), seqlen_k)
    else:
        return gl.full(offs_m.shape, seqlen_k, gl.int32, offs_m.type.layout)


@gluon.jit
def window_tile_plan(start_m, seqlen_q, seqlen_k, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(first, n_iter, full_begin, full_end) in K/V tiles of the work tile of rows [start_m, +BLOCK_M) under a
    window: ``BlockInfo.key_tiles(start_m, BLOCK_M, BLOCK_N)`` divided by BLOCK_N, with n_iter tiles from
    ``first``; tiles before ``full_begin`` or from ``full_end`` on need the band's mask.

    A work tile whose rows see no key visits one tile, fully masked (first 0, full_begin 1, full_end 0),
    so every row leaves with l = 0 and gets O = 0, lse = -inf.
    """
    offset = seqlen_k - seqlen_q
    last_row = gl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    start = gl.minimum(gl.maximum(start_m + offset - left, 0), seqlen_k)
    end = gl.minimum(gl.maximum(last_row + offset + right + 1, 0), seqlen_k)
    full_start = gl.minimum(gl.maximum(last_row + offset - left, 0), seqlen_k)
    full_stop = gl.minimum(gl.maximum(start_m + offset + right + 1, 0), seqlen_k)
    first = start // BLOCK_N
    end_tile = gl.cdiv(end, BLOCK_N)
    full_begin = gl.minimum(gl.maximum(gl.cdiv(full_start, BLOCK_N), first), end_tile)
    full_end = gl.maximum(gl.minimum(full_stop, end) // BLOCK_N, full_begin)
    empty = end <= start
    return (gl.where(empty, 0, first), gl.where(empty, 1, end_tile - first), gl.where(empty, 1, full_begin),
            gl.where(empty, 0, full_end))


@gluon.jit
def visible_key_start(offs_m, seqlen_q, seqlen_k, left):
    """Per query row of offs_m, its first visible key under the window, ``BlockInfo.key_start(row)`` except
    that it may be negative instead of 0 (the mask compares it with keys >= 0 either way)."""
    return offs_m + (seqlen_k - seqlen_q - left)


@gluon.jit
def window_key_end(offs_m, seqlen_q, seqlen_k, right):
    """Per query row of offs_m, one past its last visible key under the window: ``BlockInfo.key_end(row)``,
    except that a row which sees no key may get an end below its start (its mask is all False either way)."""
    return gl.minimum(offs_m + (seqlen_k - seqlen_q + right + 1), seqlen_k)


@gluon.jit
def window_query_plan(start_n, seqlen_q, seqlen_k, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(first, count) in query tiles of BLOCK_M rows: the steps of the backward's CTA for the key tile
    [start_n, +BLOCK_N) under a window, ``BlockInfo.query_tiles(start_n, BLOCK_N, BLOCK_M)``'s begin and end
    divided by BLOCK_M (count 0 when no row sees the tile)."""
    offset = seqlen_k - seqlen_q
    rows_end = gl.minimum(gl.maximum(start_n + BLOCK_N - 1 - offset + left + 1, 0), seqlen_q)
    end = gl.cdiv(rows_end, BLOCK_M)
    first = gl.minimum(gl.maximum(start_n - offset - right, 0) // BLOCK_M, end)
    return first, end - first
