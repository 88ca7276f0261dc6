"""Context parallelism: ring attention over a torch.distributed process group (chapter 09).

A sequence too long for one device is cut along its length. Each of the W ranks of a process group
holds ``N_local = N / W`` queries and the keys and values of the same positions, in SDPA's layout
(batch, heads, N_local, head_dim). Every query must meet every key, so the K/V shards travel round a
ring: at step t rank r holds the shard of rank ``(r - t) mod W``, attends its queries to it with one
call of :func:`fa_lab.attention` (``return_lse=True``), passes the shard on to rank r + 1 and receives
the next one from rank r - 1. Each step's result is exact over that shard's keys, and the partial
results merge by their log-sum-exp (:func:`fa_lab.online_softmax.merge_splits`): FlashAttention's loop
over K/V blocks, carried from one device to the next. The next shard's transfer is posted before the
step's compute (two K/V buffers), so the ring overlaps communication with computation.

Causal masking and the two layouts
----------------------------------
``layout="contiguous"``: rank r holds positions ``[r N_local, (r + 1) N_local)``. Under a causal mask the
shard of rank s is fully visible to rank r when s < r, causal on its diagonal when s = r and invisible
when s > r: rank r computes r + 1/2 blocks' worth of pairs, rank W - 1 2W - 1 times as many as rank 0.

``layout="zigzag"`` balances that: the sequence is cut into 2W chunks of ``N_local / 2`` positions and
rank r holds chunks r and 2W - 1 - r, in that order. At the step that brings rank s's shard (chunks s and
2W - 1 - s), each pair of local chunks is full, diagonal (causal) or skipped (:func:`chunk_cases`), and
the table is one call (:func:`step_call`; :func:`ring_schedule` lists every rank's steps):

    shard    q chunk r vs k chunk    q chunk 2W-1-r vs k chunk    the step's one call
             s         2W-1-s        s         2W-1-s
    s == r   diagonal  skip          full      diagonal           all queries x all keys, causal
    s <  r   full      skip          full      skip               all queries x the first half of the keys
    s >  r   skip      skip          full      full               the second half of the queries x all keys

Every rank thus computes about N_local^2 / 2 pairs at every step. The diagonal step is causal over the
whole local block because both halves are in increasing global order. Without ``causal`` every step is
one full call. No mask tensor is built: each call's own causal flag is the mask.

The backward
------------
:class:`RingAttentionFunction` saves q, k, v, the merged output O and the global LSE. Its backward sends
the K/V shards round the ring once more, with a dK/dV accumulator travelling beside each shard. At each
step a rank recomputes its part of the visiting block given the global O and LSE (:func:`step_backward`):
P = exp(S - lse) is then already the final softmax, D = rowsum(dO * O) is the global one, and the
block's (dQ, dK, dV) are exactly its share of the gradients. dQ stays local; the block's dK/dV is added
to the accumulator, which moves on with the shard and reaches its owner after W steps. The step is the
Triton backward kernel for impl "triton" and "triton_hopper" on a GPU, else the torch impl's tiled
recomputation (:func:`fa_lab.flash_torch.flash_backward`, tiles of at most 512 x 256 scores). Gradients
are summed in float32 and cast to the inputs' dtypes at the end.

One rank, no process group
--------------------------
A group of one rank is plain attention: :func:`ring_attention` checks its inputs as every rank does and
then returns ``fa_lab.attention`` (a one-rank zig-zag holds chunks 0 and 1 in order: the whole
sequence). With no initialized process group it raises: a script that forgot
``init_process_group`` would otherwise compute attention within each process's shard and return a wrong
answer without a word.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .block_info import BlockInfo
from .flash_torch import flash_backward
from .impls import IMPLS
from .inputs import SUPPORTED_DTYPES, check_options, check_qkv
from .online_softmax import merge_splits

LAYOUTS = ("contiguous", "zigzag")
_CASES = {"full": "full", "masked": "diagonal", "skipped": "skip"}  # BlockInfo.tile_kind's words -> ours
_KV_TAG, _DKV_TAG = 17, 18  # P2P tags: a K/V shard, a dK/dV accumulator


# ---- layouts: which positions a rank holds ------------------------------------------------------------

def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'contiguous' or 'zigzag' (how the sequence is cut over the ranks; "
                         f"q, k and v are always SDPA's (batch, heads, seqlen_local, head_dim)), got {layout!r}")


def _check_rank(rank, world) -> None:
    for name, value in (("rank", rank), ("world", world)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need world >= 1 and 0 <= rank < world, got rank={rank}, world={world}")


def num_chunks(world: int, layout: str = "contiguous") -> int:
    """How many equal chunks the global sequence is cut into: W (contiguous) or 2W (zigzag)."""
    _check_layout(layout)
    return world if layout == "contiguous" else 2 * world


def local_chunks(rank: int, world: int, layout: str = "contiguous") -> tuple[int, ...]:
    """The global chunk indices that ``rank`` holds, in local order: (r,) or (r, 2W - 1 - r)."""
    _check_rank(rank, world)
    return (rank,) if num_chunks(world, layout) == world else (rank, 2 * world - 1 - rank)


def shard(x: torch.Tensor, rank: int, world: int, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The part of the global tensor ``x`` that ``rank`` holds, cut along ``dim`` (SDPA's sequence dim).

    contiguous: a view of positions [r n, (r + 1) n), n = N / W. zigzag: chunks r and 2W - 1 - r of
    N / (2W) positions, concatenated (a copy). N must be a multiple of the chunk count.
    """
    chunks, dim = num_chunks(world, layout), dim % x.ndim
    if x.shape[dim] % chunks:
        raise ValueError(f"shard: x has {x.shape[dim]} positions along dim {dim}; the {layout} layout over "
                         f"{world} ranks cuts them into {chunks} equal chunks, so it needs a multiple of {chunks}")
    size = x.shape[dim] // chunks
    pieces = [x.narrow(dim, c * size, size) for c in local_chunks(rank, world, layout)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def unshard(shards, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The global tensor from every rank's shard (a sequence ordered by rank): the inverse of :func:`shard`."""
    shards = list(shards)
    if not shards:
        raise ValueError("unshard needs one shard per rank, got none")
    world, dim = len(shards), dim % shards[0].ndim
    if any(t.shape != shards[0].shape for t in shards):
        raise ValueError(f"unshard: every shard must have the same shape, got {[tuple(t.shape) for t in shards]}")
    per_rank = len(local_chunks(0, world, layout))
    if shards[0].shape[dim] % per_rank:
        raise ValueError(f"unshard: a zigzag shard holds two equal chunks, so its length along dim {dim} "
                         f"must be even, got {shards[0].shape[dim]}")
    size = shards[0].shape[dim] // per_rank
    chunks = [None] * num_chunks(world, layout)
    for rank, t in enumerate(shards):
        for chunk, piece in zip(local_chunks(rank, world, layout), t.split(size, dim)):
            chunks[chunk] = piece
    return torch.cat(chunks, dim)


# ---- which pairs of chunks meet at a ring step ------------------------------------------------------

class StepCall(NamedTuple):
    """The one attention call of a ring step: local query rows [rows), keys [keys) of the visiting shard."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    causal: bool

    def pairs(self) -> int:
        """How many (query, key) pairs the call computes (its share of the work)."""
        info = BlockInfo(self.rows[1] - self.rows[0], self.keys[1] - self.keys[0], self.causal)
        return info.visible_pairs()


def chunk_cases(rank: int, source: int, world: int, layout: str = "zigzag", causal: bool = True,
                chunk_len: int = 2) -> tuple[tuple[str, ...], ...]:
    """How the query chunks of ``rank`` meet the key chunks of ``source``'s shard.

    ``cases[a][b]`` is "full" (every query of local chunk a sees every key of local chunk b), "diagonal"
    (the chunk's own causal triangle) or "skip" (no query sees any key). The global mask decides it
    (:meth:`BlockInfo.tile_kind` on global positions); ``chunk_len`` positions per chunk (with 1, a
    diagonal chunk is one query and its own key: "full").
    """
    _check_rank(source, world)
    total = num_chunks(world, layout) * chunk_len
    info = BlockInfo(total, total, causal)
    return tuple(tuple(_CASES[info.tile_kind(a * chunk_len, (a + 1) * chunk_len, b * chunk_len, (b + 1) * chunk_len)]
                       for b in local_chunks(source, world, layout))
                 for a in local_chunks(rank, world, layout))


def _local_causal(chunks: int, chunk_len: int) -> tuple[tuple[str, ...], ...]:
    """The cases of a causal call over a local block of ``chunks`` chunks (rows and keys in one order)."""
    n = chunks * chunk_len
    info = BlockInfo(n, n, True)
    return tuple(tuple(_CASES[info.tile_kind(a * chunk_len, (a + 1) * chunk_len, b * chunk_len, (b + 1) * chunk_len)]
                       for b in range(chunks)) for a in range(chunks))


def step_call(cases, chunk_len: int) -> StepCall | None:
    """The single attention call that computes exactly the pairs of a case table, or None when all skip.

    Either the cells that are not skipped form a rectangle of "full" chunks (a call without mask over
    those rows and keys), or the table is that of one causal call over the whole local block. A table
    that is neither cannot be one call: ValueError.
    """
    live = [(a, b) for a, row in enumerate(cases) for b, case in enumerate(row) if case != "skip"]
    if not live:
        return None
    a0, a1 = min(a for a, _ in live), max(a for a, _ in live) + 1
    b0, b1 = min(b for _, b in live), max(b for _, b in live) + 1
    if all(cases[a][b] == "full" for a in range(a0, a1) for b in range(b0, b1)):
        return StepCall((a0 * chunk_len, a1 * chunk_len), (b0 * chunk_len, b1 * chunk_len), False)
    if tuple(map(tuple, cases)) == _local_causal(len(cases), chunk_len):
        n = len(cases) * chunk_len
        return StepCall((0, n), (0, n), True)
    raise ValueError(f"no single attention call computes the chunk cases {cases}")


def ring_step(rank: int, source: int, world: int, layout: str, causal: bool, seqlen_local: int) -> StepCall | None:
    """The call that ``rank`` makes when the K/V shard of ``source`` visits it (None: nothing to compute)."""
    per_rank = len(local_chunks(rank, world, layout))
    if seqlen_local < 1 or seqlen_local % per_rank:
        raise ValueError(f"seqlen_local must be a positive multiple of {per_rank} for the {layout} layout, "
                         f"got {seqlen_local}")
    chunk_len = seqlen_local // per_rank
    return step_call(chunk_cases(rank, source, world, layout, causal, chunk_len), chunk_len)


def ring_schedule(world: int, layout: str = "zigzag", causal: bool = True, seqlen_local: int = 2):
    """``schedule[rank][step]``: the :class:`StepCall` (or None) of every rank at every ring step, where
    step t brings the shard of rank (rank - t) mod W."""
    return [[ring_step(rank, (rank - step) % world, world, layout, causal, seqlen_local) for step in range(world)]
            for rank in range(world)]


# ---- the ring: neighbours, transfers, agreement -------------------------------------------------------

class _Pending(NamedTuple):
    works: list
    tensors: tuple  # kept alive until the transfer is done
    what: str
    step: int


class _Ring:
    """This rank's place in the group: its rank, the world size, and the global ranks of its neighbours."""

    def __init__(self, group):
        if not dist.is_available():
            raise RuntimeError("ring_attention needs torch.distributed, which this build of torch does not have")
        if not dist.is_initialized():
            raise RuntimeError("ring_attention needs an initialized process group: call "
                               "torch.distributed.init_process_group(...) in every process first (one process "
                               "may use world_size=1), or call fa_lab.attention on the whole sequence")
        self.group = dist.group.WORLD if group is None else group
        if not isinstance(self.group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError("ring_attention: this process is not a member of the group it was given")
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def source(self, step: int) -> int:
        """The rank whose K/V shard this rank holds at ``step``."""
        return (self.rank - step) % self.world

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int, what: str, step: int) -> _Pending:
        """Post ``send`` to the next rank and a receive into ``recv`` from the previous one; don't wait."""
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return _Pending(dist.batch_isend_irecv(ops), (send, recv), what, step)

    def wait(self, pending: _Pending) -> None:
        try:
            for work in pending.works:
                work.wait()
        except RuntimeError as error:
            raise RuntimeError(self._gave_up(f"{pending.what} at ring step {pending.step}", error)) from error

    def _gave_up(self, what: str, error: Exception) -> str:
        return (f"ring_attention: rank {self.rank} of {self.world} gave up waiting for {what} "
                f"({type(error).__name__}: {error}). Another rank has probably failed or not called "
                "ring_attention (every rank of the group must call it, with the same shapes and options); "
                "the wait is bounded by the timeout given to init_process_group")

    def agree(self, q, k, v, causal, scale, layout, impl, problem: Exception | None) -> None:
        """One all_gather of every rank's shapes and options; every rank raises if any rank's differ or
        any rank refused its inputs, so that no rank is left waiting for the others."""
        if problem is None:
            row = [1, *q.shape, *k.shape[1:], SUPPORTED_DTYPES.index(q.dtype), int(causal),
                   LAYOUTS.index(layout), IMPLS.index(impl), scale]
        else:
            row = [0] * 13
        device = torch.device("cpu")
        if dist.get_backend(self.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        mine = torch.tensor(row, dtype=torch.float64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        try:
            dist.all_gather(everyone, mine, group=self.group)
        except RuntimeError as error:
            raise RuntimeError(self._gave_up("the other ranks' shapes", error)) from error
        if problem is not None:
            raise problem
        rows = [tuple(t.tolist()) for t in everyone]
        refused = [rank for rank, r in enumerate(rows) if not r[0]]
        if refused:
            raise ValueError(f"ring_attention: rank(s) {refused} of the group refused their inputs (their own "
                             "error says why); every rank must pass valid q, k, v")
        if any(r != rows[0] for r in rows):
            raise ValueError("ring_attention: the ranks disagree; every rank must pass q (B, H, N_local, d) and "
                             "k, v (B, H_kv, N_local, d) of the same sizes and dtype, with the same causal, "
                             "scale, layout and impl. Got:\n" + "\n".join(_describe(rank, r) for rank, r in
                                                                          enumerate(rows)))


def _describe(rank: int, row) -> str:
    """One line of :meth:`_Ring.agree`'s message from a rank's row of sizes and option codes."""
    b, h, n, d, hkv, nk, dk, dtype, causal, layout, impl = (int(x) for x in row[1:12])
    return (f"  rank {rank}: q ({b}, {h}, {n}, {d}), k/v ({b}, {hkv}, {nk}, {dk}), {SUPPORTED_DTYPES[dtype]}, "
            f"causal={bool(causal)}, scale={row[12]:g}, layout={LAYOUTS[layout]!r}, impl={IMPLS[impl]!r}")


# ---- forward and backward -----------------------------------------------------------------------------

def _ring_forward(q, k, v, causal, scale, impl, ring: _Ring, layout):
    """(out in q's dtype, lse float32) of this rank's queries over the whole sequence."""
    from . import attention

    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc_lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    kv, spare = torch.stack([k, v]), None  # two buffers: the shard in use and the one arriving
    for step in range(ring.world):
        pending = None
        if step + 1 < ring.world:  # post the next shard's transfer before this step's compute
            spare = torch.empty_like(kv) if spare is None else spare
            pending = ring.exchange(kv, spare, _KV_TAG, "the next K/V shard", step)
        call = ring_step(ring.rank, ring.source(step), ring.world, layout, causal, q.shape[2])
        if call is not None:
            (r0, r1), (j0, j1) = call.rows, call.keys
            part, part_lse = attention(q[:, :, r0:r1], kv[0, :, :, j0:j1], kv[1, :, :, j0:j1], call.causal, scale,
                                       impl=impl, return_lse=True)
            merged, merged_lse = merge_splits(torch.stack([acc[:, :, r0:r1], part.float()]),
                                              torch.stack([acc_lse[:, :, r0:r1], part_lse]))
            acc[:, :, r0:r1], acc_lse[:, :, r0:r1] = merged, merged_lse
        if pending is not None:
            ring.wait(pending)
            kv, spare = spare, kv
    return acc.to(q.dtype), acc_lse


def step_backward(q, k, v, out, lse, grad_out, causal: bool, scale: float, impl: str):
    """One ring step's share of the gradients, (dq, dk, dv) float32, given the global out and LSE.

    q, out, grad_out (B, H, n, d); k, v (B, Hkv, m, d); lse (B, H, n) float32. impl "triton" or
    "triton_hopper" on a GPU, with float16/bfloat16 inputs, runs the Triton backward kernel
    (:func:`fa_lab.kernels.triton_backward_from_lse`); everything else the torch impl's tiled
    recomputation (:func:`fa_lab.flash_torch.flash_backward`) in float32.
    """
    if impl in ("triton", "triton_hopper") and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        from .kernels import triton_backward_from_lse

        return tuple(g.float() for g in triton_backward_from_lse(q, k, v, out, lse, grad_out, causal, scale))
    return flash_backward(q.float(), k.float(), v.float(), out, lse, grad_out, causal, scale)


def _ring_backward(q, k, v, out, lse, grad_out, causal, scale, impl, ring: _Ring, layout):
    """(dq, dk, dv) of this rank's shards: K/V go round again, each with its dK/dV accumulator."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv, spare = torch.stack([k, v]), None
    arriving = None  # the transfer of the dK/dV accumulator of the shard that visits at the next step
    for step in range(ring.world):
        pending = None
        if step + 1 < ring.world:
            spare = torch.empty_like(kv) if spare is None else spare
            pending = ring.exchange(kv, spare, _KV_TAG, "the next K/V shard", step)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # this block's dK, dV
        call = ring_step(ring.rank, ring.source(step), ring.world, layout, causal, q.shape[2])
        if call is not None:
            (r0, r1), (j0, j1) = call.rows, call.keys
            rows = slice(r0, r1)
            dq_part, dk_part, dv_part = step_backward(
                q[:, :, rows], kv[0, :, :, j0:j1], kv[1, :, :, j0:j1], out[:, :, rows], lse[:, :, rows],
                grad_out[:, :, rows], call.causal, scale, impl)
            dq[:, :, rows] += dq_part
            dkv[0, :, :, j0:j1] += dk_part
            dkv[1, :, :, j0:j1] += dv_part
        if arriving is not None:  # what the ranks this shard visited before have added
            ring.wait(arriving)
            dkv += arriving.tensors[1]
        # On to the next rank; after the last step the accumulator reaches the shard's owner.
        arriving = ring.exchange(dkv, torch.empty_like(dkv), _DKV_TAG, "a dK/dV accumulator", step)
        if pending is not None:
            ring.wait(pending)
            kv, spare = spare, kv
    ring.wait(arriving)
    dk, dv = arriving.tensors[1]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Autograd for :func:`ring_attention` on two or more ranks: saves q, k, v, O and the global LSE."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, impl, ring, layout):
        out, lse = _ring_forward(q, k, v, causal, scale, impl, ring, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, impl, ring, layout)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, lse, grad_out, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def _check_local(q, k, v, causal, scale, layout, impl):
    """This rank's own inputs: those of fa_lab.attention, plus what the ring needs. Returns (causal, scale)."""
    check_qkv(q, k, v)
    causal, scale, _, _ = check_options(q.shape[-1], causal, scale, (-1, -1), 0.0)
    _check_layout(layout)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}; got {impl!r}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k and v hold {k.shape[2]} positions but q holds {q.shape[2]}: ring attention shards one "
                         "sequence, so each rank holds the queries, keys and values of the same positions")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"the zigzag layout gives each rank two equal chunks (r and 2W - 1 - r), so seqlen_local "
                         f"must be even; q has shape {tuple(q.shape)}")
    return causal, scale


def ring_attention(q, k, v, causal: bool = False, scale: float | None = None, group=None,
                   layout: str = "contiguous", impl: str = "torch", return_lse: bool = False):
    """Exact attention over a sequence sharded along its length across the ranks of a process group.

    q: (batch, heads, seqlen_local, head_dim), k, v: (batch, heads_kv, seqlen_local, head_dim) on every
        rank (grouped-query attention as in :func:`fa_lab.attention`), the shard of the global sequence
        that the rank holds: ``shard(x, rank, world, layout)`` of the global tensor.
    causal: causal over the global sequence (query i sees keys j <= i).
    group: a torch.distributed ProcessGroup, default the whole world; it must be initialized. Every rank
        of it must call ring_attention with the same shapes and options (checked once, by an all_gather).
    layout: "contiguous" (rank r holds positions [r N_local, (r + 1) N_local)) or "zigzag" (2W chunks,
        rank r holds chunks r and 2W - 1 - r; seqlen_local even): the module docstring has the cases.
    impl: which fa_lab impl computes each step's attention; its backward is the Triton kernel's for
        "triton" and "triton_hopper" on a GPU, else the torch impl's (:func:`step_backward`).
    Returns out (dtype of q, this rank's queries) or, with return_lse, (out, lse) with lse (batch, heads,
    seqlen_local) float32, detached. Gradients flow to q, k, v; dk and dv end on the rank that holds k, v.
    A group of one rank returns fa_lab.attention(q, k, v, ...).
    """
    ring = _Ring(group)
    problem = None
    try:
        causal, scale = _check_local(q, k, v, causal, scale, layout, impl)
    except (TypeError, ValueError) as error:
        problem = error
    ring.agree(q, k, v, causal, scale, layout, impl, problem)
    if ring.world == 1:
        from . import attention
        out, lse = attention(q, k, v, causal, scale, impl=impl, return_lse=True)
    else:
        out, lse = RingAttentionFunction.apply(q, k, v, causal, scale, impl, ring, layout)
    return (out, lse.detach()) if return_lse else out
