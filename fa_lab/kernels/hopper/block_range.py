"""The Gluon kernel's loop bounds and mask bounds: jit copies of :class:`fa_lab.block_info.BlockInfo`.

BlockInfo is the source of truth for which keys each query sees; kernels cannot call Python, so
the arithmetic the Gluon FA3 kernel needs lives here once. tests/test_block_info_kernels.py
compiles a probe kernel calling both functions for sm_90 on any machine and, on a GPU, runs it
on every tile of many shapes against BlockInfo. Causal masking is bottom-right aligned: query
row i sees keys j <= i + seqlen_k - seqlen_q.
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
