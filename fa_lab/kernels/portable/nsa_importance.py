"""NSA's selection scores as a Triton kernel: the compressed branch's probabilities, summed per selection block and
over the GQA group, without materializing them.

:func:`fa_lab.sparse.nsa_importance` defines the scores: query ``i`` of query head ``h`` attends over the mean keys
of the compressed blocks wholly in its past (compressed key ``j`` is visible iff ``(j + 1) * block_cmp - 1 <= i``);
a selection block of ``block_sel = per * block_cmp`` tokens scores the sum of those probabilities over its ``per``
compressed keys and over the ``group`` query heads of its KV head. A block that starts after the query scores
-inf (never selectable). In PyTorch that is a (B, H, N, N / block_cmp) tensor of probabilities, 34 GB at 64K
tokens and 64 heads; here one program takes a tile of queries of one KV head, walks the compressed keys BLOCK_N
at a time, recomputes each row's probabilities from the compressed branch's LSE (p = 2^(s log2 e - lse log2 e),
as the backward recomputes P), adds them over the group's query heads in registers, and stores the tile's scores
(B, H_kv, N, selection blocks) in float32. Steps whose compressed keys all lie after the tile's last query store
-inf or 0 without a product; the steps whose keys every row of the tile sees (all but a tile's last one or two) run
first, in a loop of their own without masks (UNMASKED_FULL_STEPS). Grid: ``(cdiv(N, queries), B * H_kv)``, the
tiles with the most keys first.

The tile's rows are ``queries * members`` packed rows, query-major (packed row ``p`` is member ``p % members`` of
query ``p // members``, as the selected-blocks kernel packs its tile): ``members`` heads of the group are scored
per product and the group is walked ``members`` heads at a time. The default is one head a pass over 64 queries,
Q read again at each step; packing the whole group (Q read once per program) measured slower (the record "NSA's
selection and compressed branch" in docs/experiments/sparse_kernels.md).

With ``top_n`` the kernel returns the selection itself: each query's running top, merged with every step's blocks
and stored once at the end; the scores are never stored. By default (TOP_BY_MERGE) the step's best top_n come from a
bitonic top-k and one bitonic merge joins them to the top (:func:`merged_top`); :func:`running_top` sorts the top
and the step's blocks together instead, about three times the kernel's code at NSA's sizes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import LOG2E, cdiv, descriptor, head_dim_bucket, on_device, tma_readable

IMPORTANCE_ROWS, IMPORTANCE_KEYS = 64, 64  # packed rows (queries x members) a program; compressed keys a step
SELECTION_KEYS = 128  # compressed keys a step when keeping a running top (64 blocks: half the merges of 64 keys)
IMPORTANCE_MEMBERS = 1  # group heads per product (None: the whole group)
# warps storing the scores; keeping a running top by running_top's sort (its registers: 4 warps spill), by merged_top
IMPORTANCE_WARPS, SELECTION_WARPS, MERGE_WARPS = 4, 8, 4
TOP_BY_MERGE = True  # the running top by merged_top (a top-k of the step, then a merge) rather than one sort of both
UNMASKED_FULL_STEPS = True  # the steps a whole tile sees run in a loop of their own without masks (full_steps)
# Three programs an SM for the kernel keeping its top (0.94-0.95x its time at 64K on an H100, against the settings
# of TWO_PROGRAMS; docs/experiments/sparse_kernels.md, "The importance kernel at three programs an SM"):
# - each pass's probabilities summed per selection block before they join the group's sum (pass_sum), which halves
#   the accumulator's registers;
BLOCKS_FIRST = True
# - the unmasked steps read a pass's Q rows through a tensor descriptor (a TMA copy into shared memory) rather than
#   pointer loads (with one head a pass and q in a layout a descriptor can describe);
Q_BY_DESCRIPTOR = True
# - registers a thread and Triton's stages at the default tile (None: Triton's choice, 255 and 3 stages, two programs
#   an SM); 168 and 2 fit three (registers and shared memory).
SELECTION_MAXNREG, SELECTION_STAGES = 168, 2
# the settings before: two programs an SM (the A/B's and the tests' other case)
TWO_PROGRAMS = dict(BLOCKS_FIRST=False, Q_BY_DESCRIPTOR=False, SELECTION_MAXNREG=None, SELECTION_STAGES=None)
INDEX_MASK = tl.constexpr(0x7FFFFFFF)  # a top key's low word: INDEX_MASK - block (:func:`running_top`)


def check_blocks_per_selection(block_cmp: int, block_sel: int) -> int:
    """The compressed blocks per selection block, ``block_sel // block_cmp``, which the kernel sums in registers:
    a power of two up to IMPORTANCE_KEYS (ValueError otherwise, before anything runs)."""
    per = block_sel // block_cmp
    if block_sel % block_cmp or per > IMPORTANCE_KEYS or per & (per - 1):
        raise ValueError(f"impl='triton' scores selection blocks of a power-of-two number (up to {IMPORTANCE_KEYS}) "
                         f"of compressed blocks: block_sel {block_sel} over block_cmp {block_cmp}")
    return per


def top_widths(top_n: int, keys: int, per: int) -> tuple[int, int]:
    """(TOP, SORT) of a launch keeping a running top_n over steps of ``keys`` compressed keys (``per`` a selection
    block): the top's slots, a power of two >= top_n, and the sorted row's, a power of two holding them and a step's
    keys // per blocks; (0, 1) when top_n is 0 (the scores stored)."""
    if top_n <= 0:
        return 0, 1
    top = triton.next_power_of_2(top_n)
    return top, triton.next_power_of_2(top + keys // per)


def packed_tile(group: int, rows: int = IMPORTANCE_ROWS, members: int | None = IMPORTANCE_MEMBERS) -> tuple[int, int]:
    """(queries, members) of a program's tile of ``rows`` packed rows for a GQA group of ``group`` query heads:
    ``members`` a power of two (1: one head a pass, a tile of ``rows`` queries), or None for the group rounded up
    to a power of two, at most ``rows`` (a larger group is walked in chunks)."""
    members = members or min(triton.next_power_of_2(group), rows)
    return rows // members, members


@triton.jit
def nsa_importance_kernel(q_ptr, q_desc, k_cmp_ptr, lse_ptr, out_ptr, seqlen, blocks_cmp, sel_blocks, heads, group,
                          head_dim, top_n, qk_scale_log2, log2e, BLOCK_CMP: tl.constexpr, PER: tl.constexpr,
                          QUERIES: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_N: tl.constexpr,
                          HEAD_DIM: tl.constexpr, TOP: tl.constexpr, SORT: tl.constexpr, MERGE: tl.constexpr,
                          FULL_STEPS: tl.constexpr, BLOCKS_FIRST: tl.constexpr = False):
    """q (B, H, N, d), k_cmp (B, H_kv, blocks_cmp, d), lse (B, H, N) float32, all contiguous. A tile of QUERIES
    queries x MEMBERS group heads (:func:`packed_tile`). TOP = 0: out (B, H_kv, N, sel_blocks) float32, the
    scores. TOP > 0 (a power of two >= top_n; SORT the power of two >= TOP + BLOCK_N // PER): out
    (B, H_kv, N, top_n) int64, each query's top_n blocks (:func:`running_top`, or :func:`merged_top` with MERGE),
    best first, -1 past its last selectable block; steps wholly after the tile are skipped. FULL_STEPS: the steps
    whose keys every row of a whole tile sees run first, in a loop of their own without masks (:func:`full_steps`).
    BLOCKS_FIRST: each pass's probabilities are summed per selection block before the group's sum (:func:`pass_sum`).
    q_desc: None, or a descriptor over q seen as (1, B * H, N, d), tiles (1, 1, QUERIES, HEAD_DIM), through which
    the unmasked steps read Q (MEMBERS = 1)."""
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
    first_head = batch * heads + kv_head * group
    steps_end = sel_blocks * PER
    if TOP > 0:  # only the blocks that start at or before the tile's last query can be chosen
        out_base = out_ptr + pid_bkv.to(tl.int64) * seqlen * top_n
        steps_end = tl.minimum(steps_end, (last_row // (PER * BLOCK_CMP) + 1) * PER)
    else:
        out_base = out_ptr + pid_bkv.to(tl.int64) * seqlen * sel_blocks
    best = tl.zeros((QUERIES, TOP if TOP > 0 else 1), dtype=tl.int64)  # the running top, as keys (0: none)
    masked_from = 0
    if FULL_STEPS:
        masked_from = full_steps(pid_m * QUERIES, seqlen, blocks_cmp, group, BLOCK_CMP, QUERIES, MEMBERS, BLOCK_N)
        for start in range(0, masked_from, BLOCK_N):
            best = importance_step(best, start, q_ptr, q_desc, k_base, lse_ptr, out_base, rows, row_ok, dims,
                                   dim_ok, queries, pid_m * QUERIES, packed, first_head, seqlen, blocks_cmp,
                                   sel_blocks, group, head_dim, top_n, qk_scale_log2, log2e, last_row, BLOCK_CMP, PER,
                                   QUERIES, MEMBERS, BLOCK_N, HEAD_DIM, TOP, SORT, MERGE, BLOCKS_FIRST, MASKED=False)
    for start in range(masked_from, steps_end, BLOCK_N):
        best = importance_step(best, start, q_ptr, q_desc, k_base, lse_ptr, out_base, rows, row_ok, dims, dim_ok,
                               queries, pid_m * QUERIES, packed, first_head, seqlen, blocks_cmp, sel_blocks, group,
                               head_dim, top_n, qk_scale_log2, log2e, last_row, BLOCK_CMP, PER, QUERIES, MEMBERS,
                               BLOCK_N, HEAD_DIM, TOP, SORT, MERGE, BLOCKS_FIRST, MASKED=True)
    if TOP > 0:
        slots = tl.arange(0, TOP)
        chosen = tl.where(best > 0, INDEX_MASK.value - (best & 0xFFFFFFFF), -1)
        tl.store(out_base + queries[:, None] * top_n + slots[None, :], chosen,
                 mask=(queries[:, None] < seqlen) & (slots[None, :] < top_n))


@triton.jit
def full_steps(first_query, seqlen, blocks_cmp, group, BLOCK_CMP: tl.constexpr, QUERIES: tl.constexpr,
               MEMBERS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where a tile's masked steps begin: the steps before it hold only compressed keys in the past of the tile's
    first query (so of every row), none past the last compressed key, and the tile's rows are all queries of
    heads of the group (0 where a tile runs past the sequence or the group's last pass is partial)."""
    seen = tl.minimum((first_query + 1) // BLOCK_CMP, blocks_cmp)  # keys j with (j + 1) BLOCK_CMP - 1 <= first
    whole = (first_query + QUERIES <= seqlen) & (group % MEMBERS == 0)
    return tl.where(whole, seen // BLOCK_N * BLOCK_N, 0)


@triton.jit
def importance_step(best, start, q_ptr, q_desc, k_base, lse_ptr, out_base, rows, row_ok, dims, dim_ok, queries,
                    first_query, packed, first_head, seqlen, blocks_cmp, sel_blocks, group, head_dim, top_n,
                    qk_scale_log2, log2e, last_row, BLOCK_CMP: tl.constexpr, PER: tl.constexpr, QUERIES: tl.constexpr,
                    MEMBERS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, TOP: tl.constexpr,
                    SORT: tl.constexpr, MERGE: tl.constexpr, BLOCKS_FIRST: tl.constexpr, MASKED: tl.constexpr):
    """One step of :func:`nsa_importance_kernel`: the BLOCK_N compressed keys from ``start`` scored for the tile's
    queries, their probabilities summed over the group and per selection block, then merged into ``best`` (TOP > 0,
    returned) or stored. Without MASKED every key is visible to every row and every row is a query of the group
    (:func:`full_steps`): no masks are built or applied. A masked step none of whose keys is in the past of the
    tile's ``last_row`` skips the products (its blocks score 0, or -inf in a row's future)."""
    cols = start + tl.arange(0, BLOCK_N)  # compressed keys of this step
    SEL_STEP: tl.constexpr = BLOCK_N // PER
    summed = tl.zeros((QUERIES, SEL_STEP if BLOCKS_FIRST else BLOCK_N), dtype=tl.float32)
    if not MASKED:
        keys = row_tile(k_base, cols, head_dim, dims, dim_ok)
        # each pass's LSE rows are loaded one pass ahead (the last pass loads its own again): a load in flight
        # across the pass instead of a wait for it before the exponentials
        lse_next = tl.load(lse_ptr + (first_head + packed % MEMBERS).to(tl.int64) * seqlen + rows)
        for chunk in range(0, group, MEMBERS):
            if q_desc is None:
                head = (first_head + chunk + packed % MEMBERS).to(tl.int64)
                q_tile = row_tile(q_ptr, head * seqlen + rows, head_dim, dims, dim_ok)
            else:  # one head a pass, the whole tile in the sequence (full_steps)
                q_tile = q_desc.load([0, first_head + chunk, first_query, 0]).reshape(QUERIES, HEAD_DIM)
            lse2 = lse_next * log2e
            ahead = first_head + tl.minimum(chunk + MEMBERS, group - MEMBERS) + packed % MEMBERS
            lse_next = tl.load(lse_ptr + ahead.to(tl.int64) * seqlen + rows)
            probs = tl.exp2(tl.dot(q_tile, tl.trans(keys)) * qk_scale_log2 - lse2[:, None])
            summed += pass_sum(probs, QUERIES, MEMBERS, PER, BLOCKS_FIRST)
    elif (start + 1) * BLOCK_CMP - 1 <= last_row:  # some key of the step is in some row's past
        keys = row_tile(k_base, cols, head_dim, dims, dim_ok, cols < blocks_cmp)
        visible = ((cols[None, :] + 1) * BLOCK_CMP - 1 <= rows[:, None]) & (cols[None, :] < blocks_cmp)
        for chunk in range(0, group, MEMBERS):
            member = chunk + packed % MEMBERS
            ok = row_ok & (member < group)
            head = (first_head + member).to(tl.int64)
            q_tile = row_tile(q_ptr, head * seqlen + rows, head_dim, dims, dim_ok, ok)
            lse2 = tl.load(lse_ptr + head * seqlen + rows, mask=ok, other=0.0) * log2e
            scores = tl.dot(q_tile, tl.trans(keys)) * qk_scale_log2
            probs = tl.where(visible & ok[:, None], tl.exp2(scores - lse2[:, None]), 0.0)
            summed += pass_sum(probs, QUERIES, MEMBERS, PER, BLOCKS_FIRST)
    per_block = summed if BLOCKS_FIRST else tl.sum(tl.reshape(summed, (QUERIES, SEL_STEP, PER)), axis=2)
    sel = start // PER + tl.arange(0, SEL_STEP)
    if MASKED:
        future = sel[None, :] * (PER * BLOCK_CMP) > queries[:, None]
    else:
        future = tl.zeros((QUERIES, SEL_STEP), dtype=tl.int1)
    if TOP > 0:
        selectable = ~future & (sel[None, :] < sel_blocks)
        if MERGE:
            best = merged_top(best, per_block, sel, selectable, TOP=TOP)
        else:
            best = running_top(best, per_block, sel, selectable, TOP=TOP, SORT=SORT)
    else:
        per_block = tl.where(future, float("-inf"), per_block)
        tl.store(out_base + queries[:, None] * sel_blocks + sel[None, :], per_block,
                 mask=(queries[:, None] < seqlen) & (sel[None, :] < sel_blocks))
    return best


@triton.jit
def pass_sum(probs, QUERIES: tl.constexpr, MEMBERS: tl.constexpr, PER: tl.constexpr, BLOCKS_FIRST: tl.constexpr):
    """A pass's (QUERIES * MEMBERS, BLOCK_N) probabilities summed over its members: (QUERIES, BLOCK_N), or with
    BLOCKS_FIRST also over each selection block's PER compressed keys: (QUERIES, BLOCK_N // PER). A thread holds
    neighbouring keys of a row in the MMA's layout, so the block sums stay in its registers."""
    BLOCK_N: tl.constexpr = probs.shape[1]
    if BLOCKS_FIRST:
        probs = tl.sum(tl.reshape(probs, (QUERIES * MEMBERS, BLOCK_N // PER, PER)), axis=2)
    return tl.sum(tl.reshape(probs, (QUERIES, MEMBERS, probs.shape[1])), axis=1)


@triton.jit
def row_tile(base, row_index, head_dim, dims, dim_ok, row_ok=None):
    """The (R, HEAD_DIM) tile of rows ``row_index`` (R,) of a row-major (rows, head_dim) tensor at ``base``: a pass's
    Q rows or a step's compressed keys. Zeros in the columns past head_dim (``dim_ok`` (HEAD_DIM,)) and, given
    ``row_ok`` (R,), in the rows it leaves out."""
    pointers = base + row_index[:, None] * head_dim + dims[None, :]
    mask = dim_ok[None, :]
    if row_ok is not None:
        mask = row_ok[:, None] & mask
    return tl.load(pointers, mask=mask, other=0.0)


@triton.jit
def top_keys(scores, blocks, selectable):
    """(Q, S) int64 keys of the step's float32 ``scores`` of ``blocks`` (S,) where ``selectable``: a key orders by
    score, then by the lower block: the score's bits (non-negative floats order as their bit patterns) plus one in
    the high word, INDEX_MASK - block in the low; 0 for none."""
    bits = scores.to(tl.int32, bitcast=True).to(tl.int64) + 1
    return tl.where(selectable, (bits << 32) | (INDEX_MASK.value - blocks[None, :]).to(tl.int64), 0)


@triton.jit
def merged_top(best, scores, blocks, selectable, TOP: tl.constexpr):
    """:func:`running_top` by a merge instead of a sort of both: the step's best TOP keys by ``tl.topk`` (a bitonic
    top-k of the step's S keys, padded with none to TOP when S < TOP), then the TOP best of the two lists, both
    sorted best first: max(best[i], step[TOP - 1 - i]) holds them as a bitonic sequence, which one bitonic merge
    of log2(TOP) rounds sorts."""
    keys = top_keys(scores, blocks, selectable)
    STEP: tl.constexpr = scores.shape[1]
    if STEP < TOP:
        column = tl.broadcast_to(tl.arange(0, TOP)[None, :], (best.shape[0], TOP))
        keys = tl.where(column < STEP, tl.gather(keys, tl.minimum(column, STEP - 1), axis=1), 0)
    step_best = tl.topk(keys, TOP)
    return tl.bitonic_merge(tl.maximum(best, tl.flip(step_best, 1)), descending=True)


@triton.jit
def running_top(best, scores, blocks, selectable, TOP: tl.constexpr, SORT: tl.constexpr):
    """best (Q, TOP) int64 keys (:func:`top_keys`), the top so far, sorted best first, after the step's (Q, S)
    float32 ``scores`` of ``blocks`` (S,) where ``selectable``. The TOP keys and the step's S are laid side by side
    in a row of SORT and sorted."""
    keys = top_keys(scores, blocks, selectable)
    QUERIES: tl.constexpr = best.shape[0]
    STEP: tl.constexpr = scores.shape[1]
    column = tl.broadcast_to(tl.arange(0, SORT)[None, :], (QUERIES, SORT))
    from_best = tl.gather(best, tl.minimum(column, TOP - 1), axis=1)
    from_step = tl.gather(keys, tl.minimum(tl.maximum(column - TOP, 0), STEP - 1), axis=1)
    row = tl.where(column < TOP, from_best, tl.where(column < TOP + STEP, from_step, 0))
    ordered = tl.sort(row, dim=1, descending=True)
    return tl.gather(ordered, tl.broadcast_to(tl.arange(0, TOP)[None, :], (QUERIES, TOP)), axis=1)


def budgeted_tile(top: int, merge: bool, rows: int, keys: int, num_warps: int) -> bool:
    """Whether a launch keeping a top of ``top`` slots is the default tile keeping it by a merge: the one whose
    registers and stages SELECTION_MAXNREG and SELECTION_STAGES set."""
    return bool(top) and merge and (rows, keys, num_warps) == (IMPORTANCE_ROWS, SELECTION_KEYS, MERGE_WARPS)


def descriptor_readable(members: int, q: torch.Tensor) -> bool:
    """Whether the unmasked steps can read q (B, H, N, d) through a descriptor (Q_BY_DESCRIPTOR): one head a pass,
    and q in a layout a descriptor can describe (:func:`tma_readable`: 16-byte aligned start and row strides)."""
    return members == 1 and tma_readable(q)


def triton_nsa_importance(q: torch.Tensor, k_cmp: torch.Tensor, lse_cmp: torch.Tensor, block_cmp: int,
                          block_sel: int, scale: float, top_n: int = 0, *, rows: int = IMPORTANCE_ROWS,
                          members: int | None = IMPORTANCE_MEMBERS, keys: int | None = None,
                          num_warps: int | None = None, num_stages: int | None = None,
                          merge: bool | None = None, unmasked_full_steps: bool | None = None,
                          blocks_first: bool | None = None, maxnreg: int | None = None,
                          q_by_descriptor: bool | None = None) -> torch.Tensor:
    """:func:`nsa_importance_kernel` on q (B, H, N, d) float16/bfloat16, the compressed keys k_cmp
    (B, H_kv, N // block_cmp, d) and the compressed branch's lse (B, H, N) (natural log, -inf where no
    compressed key is visible): float32 (B, H_kv, N, cdiv(N, block_sel)), or with ``top_n`` > 0 each query's
    top_n selection blocks, int64 (B, H_kv, N, top_n), best first, -1 where fewer are in its past
    (:func:`fa_lab.sparse.nsa_select`'s result, ties to the lower block). block_sel: see
    :func:`check_blocks_per_selection`; rows, members: the tile (:func:`packed_tile`); keys: compressed keys a
    step (a power of two, at least block_sel // block_cmp; IMPORTANCE_KEYS or SELECTION_KEYS when None);
    num_warps its warps (IMPORTANCE_WARPS, MERGE_WARPS or SELECTION_WARPS when None), num_stages Triton's and maxnreg
    the registers a thread (when None: SELECTION_STAGES and SELECTION_MAXNREG for the default tile keeping a top by
    a merge, else Triton's choice); merge: the running top by :func:`merged_top` rather than :func:`running_top`
    (TOP_BY_MERGE when None); unmasked_full_steps: the steps every row of a tile sees in a loop without masks
    (UNMASKED_FULL_STEPS when None); blocks_first: each pass summed per selection block first (BLOCKS_FIRST when
    None); q_by_descriptor: the unmasked steps read Q through a descriptor (Q_BY_DESCRIPTOR when None; only where
    :func:`descriptor_readable`)."""
    batch, heads, seqlen, head_dim = q.shape
    heads_kv, blocks_cmp = k_cmp.shape[1], k_cmp.shape[2]
    per = check_blocks_per_selection(block_cmp, block_sel)
    keys = keys or (SELECTION_KEYS if top_n > 0 else IMPORTANCE_KEYS)
    if keys < per or keys & (keys - 1):
        raise ValueError(f"keys ({keys}) must be a power of two of at least {per} compressed blocks")
    queries, members = packed_tile(heads // heads_kv, rows, members)
    sel_blocks = cdiv(seqlen, block_sel)
    top, sort = top_widths(top_n, keys, per)
    merge = TOP_BY_MERGE if merge is None else merge
    unmasked = UNMASKED_FULL_STEPS if unmasked_full_steps is None else unmasked_full_steps
    blocks_first = BLOCKS_FIRST if blocks_first is None else blocks_first
    num_warps = num_warps or (IMPORTANCE_WARPS if not top else MERGE_WARPS if merge else SELECTION_WARPS)
    if budgeted_tile(top, merge, queries * members, keys, num_warps):
        maxnreg = maxnreg or SELECTION_MAXNREG
        num_stages = num_stages or SELECTION_STAGES
    launch = {name: value for name, value in (("num_stages", num_stages), ("maxnreg", maxnreg)) if value}
    q_by_descriptor = Q_BY_DESCRIPTOR if q_by_descriptor is None else q_by_descriptor
    out = (torch.empty((batch, heads_kv, seqlen, top_n), dtype=torch.int64, device=q.device) if top else
           torch.empty((batch, heads_kv, seqlen, sel_blocks), dtype=torch.float32, device=q.device))
    q, k_cmp, lse_cmp = q.contiguous(), k_cmp.to(q.dtype).contiguous(), lse_cmp.float().contiguous()
    # the heads of every batch as one dimension, so that a pass's head is one coordinate
    by_descriptor = q_by_descriptor and descriptor_readable(members, q)
    q_desc = descriptor(q.view(1, batch * heads, seqlen, head_dim), queries) if by_descriptor else None
    with on_device(q):
        nsa_importance_kernel[(triton.cdiv(seqlen, queries), batch * heads_kv)](
            q, q_desc, k_cmp, lse_cmp, out, seqlen, blocks_cmp, sel_blocks, heads, heads // heads_kv, head_dim, top_n,
            scale * LOG2E, LOG2E, BLOCK_CMP=block_cmp, PER=per, QUERIES=queries, MEMBERS=members,
            BLOCK_N=keys, HEAD_DIM=head_dim_bucket(head_dim), TOP=top, SORT=sort, MERGE=merge,
            FULL_STEPS=unmasked, BLOCKS_FIRST=blocks_first, num_warps=num_warps, **launch)
    return out
