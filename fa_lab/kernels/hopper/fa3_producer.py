"""The Gluon FA3 kernel's producer partition: one warp that only issues TMA copies.

For each work tile of its CTA it copies every consumer's Q rows into the Q slot and K_j, V_j
(V_j^T in FP8) of the tile's K/V head (grouped-query attention: one per group of query heads) into the
K and V rings, running up to STAGES K/V tiles ahead of the consumers.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .fa3_config import ROWS_PER_CONSUMER


@gluon.jit
def producer(state, CAUSAL: gl.constexpr, FP8: gl.constexpr, PERSISTENT: gl.constexpr, WINDOW: gl.constexpr,
             VARLEN: gl.constexpr):
    """TMA copies only, for every work tile of this CTA (one tile, or its share of the schedule when
    persistent). state: the :class:`.fa3_state.KernelState`."""
    BLOCK_N: gl.constexpr = state.k_desc.block_type.shape[2]
    CONSUMERS: gl.constexpr = state.q.bufs.type.shape[0]
    BLOCK_M: gl.constexpr = ROWS_PER_CONSUMER * CONSUMERS
    if PERSISTENT:
        kv_count = 0  # K/V tiles loaded by this CTA so far: the ring's position and phases run across work tiles
        first, last, tiles_ptr = state.work.cta_tiles()
        for k in range(first, last):
            tile = state.work.tile(gl.load(tiles_ptr + k), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL,
                                   WINDOW=WINDOW, VARLEN=VARLEN)
            # k - first: work tiles of this CTA before this one, the Q slot's count
            _producer_tile(state, tile, kv_count, k - first, FP8=FP8, PERSISTENT=PERSISTENT)
            kv_count += tile.n_iter
    else:  # one tile per CTA: the counts are constants
        tile = state.work.tile(gl.program_id(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL,
                               WINDOW=WINDOW, VARLEN=VARLEN)
        _producer_tile(state, tile, 0, 0, FP8=FP8, PERSISTENT=PERSISTENT)


@gluon.jit
def _producer_tile(state, tile, kv_count, local, FP8: gl.constexpr, PERSISTENT: gl.constexpr):
    """The producer's copies for one WorkTile; kv_count / local: K/V tiles and work tiles this CTA loaded
    before it. A packed batch's tiles read rows from the sequence's offsets (rows past its end belong to
    the next sequence: the consumers mask those keys and store none of those query rows). Q goes first,
    except in a persistent CTA, where the Q buffers may still be busy with the previous tile: there Q
    follows K_0 and V_0, which need no free Q buffer."""
    BLOCK_N: gl.constexpr = state.k_desc.block_type.shape[2]
    if not PERSISTENT:
        state.q.fill(local, state.q_desc, tile.batch, tile.head, tile.q_offset + tile.start_m)
    for j in range(tile.n_iter):  # the tile's j-th K/V tile is tile first + j of the sequence
        key = tile.k_offset + (tile.first + j) * BLOCK_N
        state.k.at(kv_count + j).fill(state.k_desc, [tile.batch, tile.kv_head, key, 0])
        if FP8:  # V^T: the keys run along the last dim
            state.v.at(kv_count + j).fill(state.v_desc, [tile.batch, tile.kv_head, 0, key])
        else:
            state.v.at(kv_count + j).fill(state.v_desc, [tile.batch, tile.kv_head, key, 0])
        if PERSISTENT:
            if j == 0:
                state.q.fill(local, state.q_desc, tile.batch, tile.head, tile.q_offset + tile.start_m)
