"""NSA's selection scores as a Triton kernel: the compressed branch's probabilities, summed per selection block and
over the GQA group, without materializing them.

:func:`fa_lab.sparse.nsa_importance` defines the scores: query ``i`` of query head ``h`` attends over the mean keys
of the compressed blocks wholly in its past (compressed key ``j`` is visible iff ``(j + 1) * block_cmp - 1 <= i``);
a selection block of ``block_sel = per * block_cmp`` tokens scores the sum of those probabilities over its ``per``
compressed keys and over the ``group`` query heads of its KV head. A block that starts after the query scores
-inf (never selectable). In PyTorch that is a (B, H, N, N / block_cmp) tensor of probabilities, 34 GB at 64K
tokens and 64 heads; here one program takes a tile of queries of one KV head with the group's query heads packed
into its rows (``queries * members`` rows, query-major: packed row ``p`` is member ``p % members`` of query
``p // members``, as the selected-blocks kernel packs its tile), walks the compressed keys BLOCK_N at a time,
recomputes each row's probabilities from the compressed branch's LSE (p = 2^(s log2 e - lse log2 e), as the
backward recomputes P), adds the rows of each query over its members in registers, and stores the tile's scores
(B, H_kv, N, selection blocks) in float32. Q is read once per program where the group fits the tile
(``members == group``); a larger group walks its heads ``members`` at a time at each step. Steps whose compressed
keys all lie after the tile's last query store -inf or 0 without a product. Grid:
``(cdiv(N, queries), B * H_kv)``, the tiles with the most keys first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import LOG2E, cdiv, head_dim_bucket, on_device

IMPORTANCE_ROWS, IMPORTANCE_KEYS = 128, 64  # packed rows (queries x members) a program; compressed keys a step
IMPORTANCE_WARPS = 8


def check_blocks_per_selection(block_cmp: int, block_sel: int) -> int:
    """The compressed blocks per selection block, ``block_sel // block_cmp``, which the kernel sums in registers:
    a power of two up to IMPORTANCE_KEYS (ValueError otherwise, before anything runs)."""
    per = block_sel // block_cmp
    if block_sel % block_cmp or per > IMPORTANCE_KEYS or per & (per - 1):
        raise ValueError(f"impl='triton' scores selection blocks of a power-of-two number (up to {IMPORTANCE_KEYS}) "
                         f"of compressed blocks: block_sel {block_sel} over block_cmp {block_cmp}")
    return per


def packed_tile(group: int, rows: int = IMPORTANCE_ROWS, members: int | None = None) -> tuple[int, int]:
    """(queries, members) of a program's tile of ``rows`` packed rows for a GQA group of ``group`` query heads:
    members the group rounded up to a power of two, at most ``rows`` (a larger group is walked in chunks), unless
    given (a power of two: ``members=1`` walks the group one head at a time, a tile of ``rows`` queries)."""
    members = members or min(triton.next_power_of_2(group), rows)
    return rows // members, members


@triton.jit
def nsa_importance_kernel(q_ptr, k_cmp_ptr, lse_ptr, out_ptr, seqlen, blocks_cmp, sel_blocks, heads, group,
                          head_dim, qk_scale_log2, log2e, BLOCK_CMP: tl.constexpr, PER: tl.constexpr,
                          QUERIES: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_N: tl.constexpr,
                          HEAD_DIM: tl.constexpr):
    """q (B, H, N, d), k_cmp (B, H_kv, blocks_cmp, d), lse (B, H, N) float32, out (B, H_kv, N, sel_blocks)
    float32, all contiguous. A tile of QUERIES queries x MEMBERS group heads (:func:`packed_tile`)."""
    pid_m, pid_bkv = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)  # most keys first
    heads_kv = heads // group
    batch, kv_head = pid_bkv // heads_kv, pid_bkv % heads_kv
    BLOCK_M: tl.constexpr = QUERIES * MEMBERS
    packed = tl.arange(0, BLOCK_M)
    rows = pid_m * QUERIES + packed // MEMBERS  # each packed row's query
    queries = pid_m * QUERIES + tl.arange(0, QUERIES)
    row_ok = rows < seqlen
    dims = tl.arange(0, HEAD_DIM)
    dim_ok = dims < head_dim
    last_row = tl.minimum(pid_m * QUERIES + QUERIES, seqlen) - 1
    k_base = k_cmp_ptr + pid_bkv.to(tl.int64) * blocks_cmp * head_dim
    out_base = out_ptr + pid_bkv.to(tl.int64) * seqlen * sel_blocks
    first_head = batch * heads + kv_head * group
    SEL_STEP: tl.constexpr = BLOCK_N // PER
    for start in range(0, sel_blocks * PER, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)  # compressed keys of this step
        summed = tl.zeros((QUERIES, BLOCK_N), dtype=tl.float32)
        if (start + 1) * BLOCK_CMP - 1 <= last_row:  # some key of the step is in some row's past
            keys = tl.load(k_base + cols[:, None] * head_dim + dims[None, :],
                           mask=(cols[:, None] < blocks_cmp) & dim_ok[None, :], other=0.0)
            visible = ((cols[None, :] + 1) * BLOCK_CMP - 1 <= rows[:, None]) & (cols[None, :] < blocks_cmp)
            for chunk in range(0, group, MEMBERS):
                member = chunk + packed % MEMBERS
                ok = row_ok & (member < group)
                head = (first_head + member).to(tl.int64)
                q_tile = tl.load(q_ptr + (head * seqlen + rows)[:, None] * head_dim + dims[None, :],
                                 mask=ok[:, None] & dim_ok[None, :], other=0.0)
                lse2 = tl.load(lse_ptr + head * seqlen + rows, mask=ok, other=0.0) * log2e
                scores = tl.dot(q_tile, tl.trans(keys)) * qk_scale_log2
                probs = tl.where(visible & ok[:, None], tl.exp2(scores - lse2[:, None]), 0.0)
                summed += tl.sum(tl.reshape(probs, (QUERIES, MEMBERS, BLOCK_N)), axis=1)
        per_block = tl.sum(tl.reshape(summed, (QUERIES, SEL_STEP, PER)), axis=2)
        sel = start // PER + tl.arange(0, SEL_STEP)
        future = sel[None, :] * (PER * BLOCK_CMP) > queries[:, None]
        per_block = tl.where(future, float("-inf"), per_block)
        tl.store(out_base + queries[:, None] * sel_blocks + sel[None, :], per_block,
                 mask=(queries[:, None] < seqlen) & (sel[None, :] < sel_blocks))


def triton_nsa_importance(q: torch.Tensor, k_cmp: torch.Tensor, lse_cmp: torch.Tensor, block_cmp: int,
                          block_sel: int, scale: float, *, rows: int = IMPORTANCE_ROWS, members: int | None = None,
                          num_warps: int = IMPORTANCE_WARPS) -> torch.Tensor:
    """:func:`nsa_importance_kernel` on q (B, H, N, d) float16/bfloat16, the compressed keys k_cmp
    (B, H_kv, N // block_cmp, d) and the compressed branch's lse (B, H, N) (natural log, -inf where no
    compressed key is visible): float32 (B, H_kv, N, cdiv(N, block_sel)). block_sel: see
    :func:`check_blocks_per_selection`; rows, members: the tile (:func:`packed_tile`); num_warps its warps."""
    batch, heads, seqlen, head_dim = q.shape
    heads_kv, blocks_cmp = k_cmp.shape[1], k_cmp.shape[2]
    per = check_blocks_per_selection(block_cmp, block_sel)
    queries, members = packed_tile(heads // heads_kv, rows, members)
    sel_blocks = cdiv(seqlen, block_sel)
    out = torch.empty((batch, heads_kv, seqlen, sel_blocks), dtype=torch.float32, device=q.device)
    q, k_cmp, lse_cmp = q.contiguous(), k_cmp.to(q.dtype).contiguous(), lse_cmp.float().contiguous()
    with on_device(q):
        nsa_importance_kernel[(triton.cdiv(seqlen, queries), batch * heads_kv)](
            q, k_cmp, lse_cmp, out, seqlen, blocks_cmp, sel_blocks, heads, heads // heads_kv, head_dim,
            scale * LOG2E, LOG2E, BLOCK_CMP=block_cmp, PER=per, QUERIES=queries, MEMBERS=members,
            BLOCK_N=IMPORTANCE_KEYS, HEAD_DIM=head_dim_bucket(head_dim), num_warps=num_warps)
    return out
