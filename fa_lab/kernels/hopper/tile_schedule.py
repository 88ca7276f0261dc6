"""Which work tiles each CTA of the persistent FA3 kernel computes, and in what order.

A persistent kernel launches one CTA per SM and lets each loop over work tiles (BLOCK_M query rows
of one (batch, head)). Without causal masking every tile costs the same and a round robin is
balanced. With it, tile i of a head visits about i + 1 K/V tiles, and a round robin leaves the
SMs unevenly loaded (notebook 04 plots by how much). The schedule here is built on the host, once per shape, by
*list scheduling*: tiles are handed out in a fixed order, each to the CTA that would be free first,
with a tile's cost taken as its K/V tiles plus a fixed cost. The order takes heads in groups
(their K and V stay in L2 while the group runs) and, within a group, the longest tiles first
(LPT), so that the short ones fill the tail. This is what a dynamic scheduler with an atomic
counter (FA3's) does, computed ahead: no atomics, and the kernel reads its tiles from one array.
"""
from __future__ import annotations

import functools
import heapq

import torch

from ...block_info import BlockInfo
from ..common import cdiv

FIXED_TILE_COST = 1.0  # per work tile, in K/V tiles: Q load, first Q K^T, epilogue (what the pipeline does not hide)


def kv_tiles_visited(start_m: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool) -> int:
    """K/V tiles a work tile starting at query row start_m visits: at least one, so that rows that see
    no key still leave with O = 0 and lse = -inf (the Gluon kernel's n_iter, :func:`.block_range.tile_plan`)."""
    end = BlockInfo(seqlen_q, seqlen_k, causal).key_blocks(start_m, block_m, block_n).end
    return max(cdiv(end, block_n), 1)


def encode_tile(pid_bh: int, pid_m: int, m_tiles: int, causal: bool) -> int:
    """The tile number the kernel decodes (:meth:`.fa3_state.WorkList.tile`): causal numbers a head's tiles
    backwards."""
    return pid_bh * m_tiles + (m_tiles - 1 - pid_m if causal else pid_m)


def group_count(batch_heads: int, tiles_per_head: int, ctas: int) -> int:
    """In how many groups to hand out the (batch, head) pairs: as many as give each group at least two tiles per
    CTA, so that the longest-first order can balance within each while the group's K and V (or, in the backward,
    Q and dO) stay in L2."""
    return min(max(batch_heads * tiles_per_head // (2 * ctas), 1), batch_heads)


def heads_per_group(batch_heads: int, tiles_per_head: int, ctas: int) -> int:
    """The Gluon backward's head_group (:func:`.fa3_backward.key_tile_of_cta`) for a causal launch of
    tiles_per_head key tiles per (batch, K/V head) on ``ctas`` SMs: the smallest divisor of batch_heads that makes
    at most :func:`group_count` groups (the kernel's order needs equal groups)."""
    least = cdiv(batch_heads, group_count(batch_heads, tiles_per_head, ctas))
    return next(size for size in range(least, batch_heads + 1) if batch_heads % size == 0)


def head_groups(batch_heads: int, m_tiles: int, ctas: int) -> list[range]:
    """The (batch, head) pairs handed out together: :func:`group_count` equal groups (a small last group would
    leave a ragged tail)."""
    groups = group_count(batch_heads, m_tiles, ctas)
    bounds = [round(i * batch_heads / groups) for i in range(groups + 1)]
    return [range(first, end) for first, end in zip(bounds, bounds[1:])]


def persistent_schedule(batch_heads: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool,
                        ctas: int) -> list[list[int]]:
    """Per CTA, the tile numbers it computes, in order. Every tile appears exactly once."""
    m_tiles = cdiv(seqlen_q, block_m)
    cost = [kv_tiles_visited(pid_m * block_m, seqlen_q, seqlen_k, block_m, block_n, causal) + FIXED_TILE_COST
            for pid_m in range(m_tiles)]
    by_cost = sorted(range(m_tiles), key=lambda pid_m: -cost[pid_m])  # stable: ties keep row order
    plan: list[list[int]] = [[] for _ in range(ctas)]
    free_at = [(0.0, cta) for cta in range(ctas)]  # (time the CTA runs out of work, CTA): a heap
    for heads in head_groups(batch_heads, m_tiles, ctas):
        for pid_m in by_cost:
            for pid_bh in heads:
                time, cta = heapq.heappop(free_at)
                plan[cta].append(encode_tile(pid_bh, pid_m, m_tiles, causal))
                heapq.heappush(free_at, (time + cost[pid_m], cta))
    return plan


@functools.lru_cache(maxsize=64)
def schedule_tensor(batch_heads: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool,
                    ctas: int, device: torch.device) -> torch.Tensor:
    """The kernel's int32 array: ctas + 1 offsets, then every CTA's tiles back to back.

    CTA c computes tiles[offsets[c]:offsets[c + 1]], where tiles starts at index ctas + 1.
    """
    plan = persistent_schedule(batch_heads, seqlen_q, seqlen_k, block_m, block_n, causal, ctas)
    offsets = [0]
    for tiles in plan:
        offsets.append(offsets[-1] + len(tiles))
    flat = offsets + [tile for tiles in plan for tile in tiles]
    return torch.tensor(flat, dtype=torch.int32, device=device)
