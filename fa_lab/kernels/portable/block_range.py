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
