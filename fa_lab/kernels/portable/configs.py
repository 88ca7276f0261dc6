"""Tile sizes, warps and pipeline stages of the plain-Triton kernels, as a small table.

Autotuning at every import would cost minutes of compilation; instead the table
holds the configurations measured best on an H200 (see benchmarks/) per padded
head_dim, and a separate, small configuration for the CPU interpreter, where
bigger tiles only mean more padding work in numpy.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..common import head_dim_bucket


@dataclass(frozen=True)
class TileConfig:
    """block_m: query rows per tile; block_n: keys per tile; num_warps, num_stages: launch options."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


# Forward, by padded head_dim: (non-causal, causal). d=64 and d=128 are the winners of
# `fa-lab bench gpu --tune` on an H200 at 8K (benchmarks/h200_triton_tuning.json);
# the other sizes follow their neighbours, with smaller tiles where shared memory runs out.
FWD_CUDA = {
    16: (TileConfig(128, 64, 4, 3), TileConfig(64, 64, 4, 3)),
    32: (TileConfig(128, 64, 4, 3), TileConfig(64, 64, 4, 3)),
    64: (TileConfig(128, 64, 4, 3), TileConfig(64, 64, 4, 3)),
    128: (TileConfig(128, 128, 8, 3), TileConfig(128, 128, 8, 3)),
    256: (TileConfig(64, 64, 4, 2), TileConfig(64, 64, 4, 2)),
}
# Backward (the dK/dV and dQ kernels share the tile shape), by padded head_dim. Small tiles won
# at d=64 and d=128 (the dK, dV accumulators of a larger K tile crowd out the registers).
BWD_CUDA = {
    16: TileConfig(64, 64, 4, 2),
    32: TileConfig(64, 64, 4, 2),
    64: TileConfig(64, 64, 4, 2),
    128: TileConfig(64, 64, 4, 2),
    256: TileConfig(32, 64, 8, 1),
}
INTERPRETER = TileConfig(32, 32)


def forward_config(head_dim: int, causal: bool, interpret: bool) -> TileConfig:
    if interpret:
        return INTERPRETER
    return FWD_CUDA[head_dim_bucket(head_dim)][int(causal)]


def backward_config(head_dim: int, interpret: bool) -> TileConfig:
    if interpret:
        return INTERPRETER
    return BWD_CUDA[head_dim_bucket(head_dim)]


# Candidates that ``fa-lab bench gpu --tune`` times on the GPU, per padded head_dim.
TUNING_CANDIDATES_FWD = {
    64: [TileConfig(128, 64, 4, 3), TileConfig(128, 64, 4, 4), TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3)],
    128: [TileConfig(128, 128, 8, 3), TileConfig(128, 128, 8, 2), TileConfig(128, 64, 4, 3),
          TileConfig(128, 64, 8, 3)],
}
TUNING_CANDIDATES_BWD = {
    64: [TileConfig(64, 128, 8, 2), TileConfig(64, 128, 4, 2), TileConfig(128, 128, 8, 2), TileConfig(64, 64, 4, 2)],
    128: [TileConfig(64, 128, 8, 2), TileConfig(64, 128, 4, 2), TileConfig(128, 128, 8, 2),
          TileConfig(64, 64, 4, 2)],
}
