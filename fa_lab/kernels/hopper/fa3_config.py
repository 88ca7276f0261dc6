"""The Gluon FA3 kernel's fixed shapes, register budgets and constants, for the device and the host.

The kernel modules read the constexprs; the launcher (:mod:`.attention`) and the offline build
(:mod:`.sm90_offline`) read :func:`descriptor_blocks`, :func:`launch_maxnreg` and CONSUMER_REGS.
"""
from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .. import common

ROWS_PER_CONSUMER = gl.constexpr(64)  # one warpgroup's WGMMA covers 64 rows (4 warps x 16)
Q_QUANT_ROWS = gl.constexpr(128)  # FP8: rows of Q per quantization block (descale)
KV_BLOCK = gl.constexpr(128)  # keys per K/V tile (the launcher's choice; the kernel reads it off k_desc)
PRODUCER_REGS = gl.constexpr(24)  # the minimum setmaxnreg allows: the producer holds only scalars
CONSUMER_REGS = {2: 240, 3: 160}  # per consumer thread: 2 x 240 + 24 (x 128 threads) fills the 64K registers

# FP8: P in [0, 1] is stored times P_SCALE = 2^8 (exp2(x + 8)), below e4m3's maximum, so small
# probabilities keep their bits (the P_SCALE of fa_lab.fp8's emulation and the portable kernel).
P_SCALE = gl.constexpr(common.P_SCALE)
LOG2_P_SCALE = gl.constexpr(math.log2(common.P_SCALE))
LN2 = gl.constexpr(common.LN2)
LOG2E = gl.constexpr(common.LOG2E)


def descriptor_blocks(head_dim: int, fp8: bool) -> dict[str, list[int]]:
    """TMA block shapes of the q, k, v and o descriptors for a padded head_dim (v's is V^T's in FP8)."""
    rows, keys = ROWS_PER_CONSUMER.value, KV_BLOCK.value
    v_block = [1, 1, head_dim, keys] if fp8 else [1, 1, keys, head_dim]
    return {"q": [1, 1, rows, head_dim], "k": [1, 1, keys, head_dim], "v": v_block, "o": [1, 1, rows, head_dim]}


SM90_SHARED_MEMORY = 232448  # bytes of shared memory one CTA may allocate on sm_90 (227 KB)
BARRIER_ALLOWANCE = 1024  # bytes kept for the mbarriers and the allocator's alignment


@gluon.constexpr_function
def separate_o_fits(q_bytes, kv_bytes, o_bytes) -> bool:
    """Whether O's own buffers (o_bytes) fit in shared memory beside Q's and the K/V ring's."""
    return q_bytes + kv_bytes + o_bytes + BARRIER_ALLOWANCE <= SM90_SHARED_MEMORY


SM90_REGISTERS_PER_SM = 65536  # 32-bit registers an SM holds, for all its resident CTAs


def launch_maxnreg(consumers: int) -> int:
    """Registers per thread at launch: the 64K of an SM over every warpgroup (the producer's single warp
    counts as one), in steps of 8. ``setmaxnreg`` then moves them from the producer to the consumers."""
    return SM90_REGISTERS_PER_SM // (128 * (consumers + 1)) // 8 * 8
