"""The launch settings of the linear-attention kernels (:mod:`.linear_chunk`, :mod:`.linear_chunk_bwd`,
:mod:`.linear_delta`): tile widths, and the warps and pipeline stages of every launch, each the fastest
measured on the H200. One table per knob, read through :func:`launch_meta`; ``fa-lab bench linear --tune``
rewrites the tables in place while it times candidates.
"""
from __future__ import annotations

import triton


def block_size(dim: int, cap: int = 64) -> int:
    """A power-of-two tile width for a head dim: at least 16 (tl.dot's minimum), at most ``cap``."""
    return min(cap, max(16, triton.next_power_of_2(dim)))


# The launch settings of the linear kernels at chunks of up to 64 tokens, each the fastest measured on the H200
# (the logs in benchmarks/ named below; docs/experiments/linear_and_ring.md has the figures). Entries are by
# kernel name, or by "name/variant" where one kind of launch of a kernel differs (a gate kind, "delta", the dv
# pass with its carried term, the WY factors recomputed from the forward's T); the
# offline sm_90 build (tests/test_portable_sm90_builds.py) checks each for shared memory and bounds the two
# spills that timed faster than the settings without them (simple GLA's dh pass at 2 warps, and the gated delta
# rule's dh pass, which holds all d_k rows of its state slice and h_{c+1}'s tile).
#
# num_warps: `fa-lab bench linear --tune` (h200_linear_tuning.json) over 2, 4 and 8; GLA's score kernel one warp
# per 16-row sub-chunk (gla_tile_sweep.py, h200_gla_tile_sweep.json); the state passes of simple GLA and of the
# delta rule from benchmarks/linear_bwd_sweep.py (h200_linear_bwd_sweep.json) with their tiles.
LAUNCH_WARPS = {
    "chunk_fwd_h_kernel": 4, "chunk_fwd_o_kernel": 4, "chunk_gla_fwd_a_kernel": 1, "chunk_gla_fwd_o_kernel": 4,
    "chunk_bwd_dh_kernel": 2, "chunk_bwd_dh_kernel/per_dim": 4, "chunk_bwd_dv_kernel": 4, "chunk_bwd_dqk_kernel": 4,
    "chunk_bwd_dqk_kernel/delta": 8, "chunk_bwd_da_kernel": 4, "chunk_gla_bwd_dv_kernel": 4,
    "chunk_gla_bwd_dqk_kernel": 4, "chunk_wy_kernel": 4, "chunk_wy_kernel/recompute": 2, "chunk_wy_bwd_kernel": 4,
    "chunk_delta_fwd_h_kernel": 4, "chunk_delta_bwd_dh_kernel": 4,
}

# num_stages where Triton's default 3 is not the fastest: the same sweeps at 1 to 4 stages
# (h200_linear_stages.json, h200_gla_tile_sweep.json, h200_linear_bwd_sweep.json). The delta rule's dh pass runs
# unpipelined (deeper pipelines spill at d_k = 128), GLA's h pass too, whose programs hold 128-wide row blocks.
LAUNCH_STAGES = {"chunk_delta_bwd_dh_kernel": 1, "chunk_gla_fwd_a_kernel": 2, "chunk_fwd_h_kernel": 2,
                 "chunk_fwd_h_kernel/per_dim": 1, "chunk_bwd_dh_kernel": 2, "chunk_bwd_dh_kernel/per_dim": 3,
                 "chunk_bwd_dqk_kernel/delta": 2, "chunk_bwd_dv_kernel/carried": 2}


def h_pass_tiles(kind: str, d_k: int, d_v: int) -> dict:
    """BLOCK_K, BLOCK_V of :func:`.linear_chunk.chunk_fwd_h_kernel` by gate kind (``fa_lab.linear``'s): a
    program holds a 128-row block of the state and 64 of its columns, or, under GLA's per-dim gate, 64 rows
    and 128 columns (the fastest tiles of benchmarks/linear_bwd_sweep.py and benchmarks/gla_tile_sweep.py)."""
    if kind == "per_dim":
        return dict(BLOCK_K=block_size(d_k), BLOCK_V=block_size(d_v, 128))
    return dict(BLOCK_K=block_size(d_k, 128), BLOCK_V=block_size(d_v))


# GLA's intra-chunk score kernel: 64-wide key blocks (gla_tile_sweep.py), one warp per 16-row sub-chunk.
SCORE_BLOCK_K = 64


# The d_v-wide slice of one head's state that a program of the delta rule's state passes (the h pass, forward
# and backward, and the dh pass) holds, with all d_k rows (w h sums over the whole key dimension): the fastest
# of 16, 32 and 64 in both passes (benchmarks/linear_bwd_sweep.py, log benchmarks/h200_linear_bwd_sweep.json).
STATE_SLICE = 64


def state_pass_tiles(d_k: int, d_v: int) -> dict:
    """BLOCK_K (the whole padded d_k) and BLOCK_V (:data:`STATE_SLICE`) of the delta rule's state passes
    (:mod:`.linear_delta`)."""
    return dict(BLOCK_K=block_size(d_k, 256), BLOCK_V=block_size(d_v, STATE_SLICE))


# The value columns of simple GLA's (and plain linear attention's) dv pass per program, and the width of the d_v
# loop of its dq/dk pass (:mod:`.linear_chunk_bwd`): the fastest tiles at d = 128 in benchmarks/linear_bwd_sweep.py.
DV_BLOCK_V, DQK_BLOCK_V = 128, 32


def _launch_entry(table: dict, kernel, variant: str | None):
    """``table``'s entry for a launch of ``kernel`` (a jit function of these modules): that of its variant,
    else of its name, else None."""
    name = kernel.__name__
    if variant is not None and f"{name}/{variant}" in table:
        return table[f"{name}/{variant}"]
    return table.get(name)


def launch_stages(kernel, variant: str | None = None) -> int | None:
    """num_stages of a launch of ``kernel``: its :data:`LAUNCH_STAGES` entry, else None (Triton's default)."""
    return _launch_entry(LAUNCH_STAGES, kernel, variant)


def launch_meta(kernel, chunk_size: int, variant: str | None = None) -> dict:
    """The launch options of ``kernel`` at ``chunk_size``: num_warps (:func:`launch_warps`) and, where
    :func:`launch_stages` has one, num_stages."""
    stages = launch_stages(kernel, variant)
    return dict(num_warps=launch_warps(kernel, chunk_size, variant),
                **({} if stages is None else {"num_stages": stages}))


def launch_warps(kernel, chunk_size: int, variant: str | None = None) -> int:
    """num_warps of a launch of ``kernel`` at ``chunk_size``: its :data:`LAUNCH_WARPS` entry, and at least 8 for
    chunks of 128 (the (C, C) tiles grow with the chunk)."""
    warps = _launch_entry(LAUNCH_WARPS, kernel, variant)
    return warps if chunk_size <= 64 else max(warps, 8)
