"""Lab 09: ring attention simulated in one process (goes with notebook 09).

====================  ===============================================================================
exercise              the learner's function, as the harness calls it
====================  ===============================================================================
merge_step            merge_step(out_acc, lse_acc, out_step, lse_step) -> (out, lse): one ring step's partial
                      result merged into the running one by their LSEs, the larger LSE subtracted first
zigzag_shard          zigzag_shard(x, rank, world) -> the rank's zig-zag shard of x (B, H, N, d): chunks r and
                      2W - 1 - r of 2W, in that order
zigzag_cases          zigzag_cases(rank, source, world) -> 2 x 2 table of "full" / "diagonal" / "skip": how the
                      rank's query chunks meet the key chunks of the shard of rank ``source`` under a causal mask
====================  ===============================================================================

Judged in the grader's process (:mod:`.lab09_judges`): the merge against the float64 merge of the same
partials, the shard and the cases exactly against :mod:`fa_lab.context_parallel`'s, each failure compared
with the outputs of the known mistakes. fa_lab's ring (:mod:`fa_lab.context_parallel`) and its merge
(:mod:`fa_lab.online_softmax`) are forbidden in every exercise. The ring here runs in one process: the
grader starts no process group, so torch.distributed has nothing to offer (its collectives raise there).
"""
from __future__ import annotations

import torch

from ..registry import Case, Exercise, Lab
from . import lab09_judges as judges
from .attention_cases import draw_int

FORBIDDEN = ("fa_lab.context_parallel",)
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- merge_step

def partial_results(generator, batch, heads, seqlen, head_dim=8, keys=12, gain=1.0, empty_acc=(), empty_step=(),
                    first_step=False):
    """Two attention results of the same queries over disjoint key sets, float32: (out_acc, lse_acc, out_step,
    lse_step), each out (B, H, seqlen, d) normalized over its own keys and lse (B, H, seqlen). Query rows in
    ``empty_acc`` / ``empty_step`` saw no key in that part (out 0, lse -inf); ``first_step``: the accumulator
    is the empty one the ring starts from."""
    q = torch.randn(batch, heads, seqlen, head_dim, generator=generator, dtype=torch.float64) * gain
    parts = []
    for empty, whole in ((empty_acc, first_step), (empty_step, False)):
        k = torch.randn(batch, heads, keys, head_dim, generator=generator, dtype=torch.float64)
        v = torch.randn(batch, heads, keys, head_dim, generator=generator, dtype=torch.float64)
        s = q @ k.transpose(-2, -1) * head_dim ** -0.5
        lse = torch.logsumexp(s, dim=-1)
        out = torch.softmax(s, dim=-1) @ v
        rows = list(range(seqlen)) if whole else list(empty)
        out[:, :, rows], lse[:, :, rows] = 0.0, NEG_INF
        parts += [out.float(), lse.float()]
    return tuple(parts)


def _merge_case(generator, name, *shape, **options) -> Case:
    return Case(name, partial_results(generator, *shape, **options))


def public_merge_cases() -> list[Case]:
    g = torch.Generator().manual_seed(9100)
    return [
        _merge_case(g, "one head, 6 queries, every row seen by both parts", 1, 1, 6),
        _merge_case(g, "batch 2, 3 heads, 10 queries", 2, 3, 10, 16),
        _merge_case(g, "the ring's first step: the accumulator is empty (out 0, lse -inf)", 1, 2, 8, first_step=True),
        _merge_case(g, "rows 1 and 4 see no key of this step (a skipped part: lse -inf)", 1, 2, 6, empty_step=(1, 4)),
        _merge_case(g, "rows 0 and 2 empty in both parts (out 0, lse -inf)", 1, 1, 5, empty_acc=(0, 2, 3),
                    empty_step=(0, 2)),
        _merge_case(g, "scores far above 88 (q x 60): LSEs past float32's exp limit", 1, 2, 8, gain=60.0),
    ]


def hidden_merge_cases(generator) -> list[Case]:
    cases = []
    for gain, first, empties in ((1.0, False, 0), (1.0, True, 0), (1.0, False, 2), (60.0, False, 1),
                                 (60.0, True, 0)):
        seqlen = draw_int(generator, 3, 12)
        rows = torch.randperm(seqlen, generator=generator)[:empties].tolist()
        cases.append(_merge_case(generator, f"{seqlen} queries" + (", first step" if first else "")
                                 + (f", rows {sorted(rows)} empty in the step" if rows else "")
                                 + (f", q x {gain:g}" if gain != 1.0 else ""),
                                 draw_int(generator, 1, 2), draw_int(generator, 1, 3), seqlen,
                                 first_step=first, empty_step=rows, empty_acc=rows[:1], gain=gain))
    return cases


# ----------------------------------------------------------------------------- zigzag_shard

def _shard_case(generator, name, rank, world, chunk_len=2, batch=1, heads=2, head_dim=3) -> Case:
    x = torch.randn(batch, heads, 2 * world * chunk_len, head_dim, generator=generator)
    return Case(name, (x, rank, world))


def public_shard_cases() -> list[Case]:
    g = torch.Generator().manual_seed(9200)
    return [
        _shard_case(g, "rank 1 of 4, chunks of 2 (16 positions)", 1, 4),
        _shard_case(g, "rank 0 of 4: the first chunk and the last", 0, 4),
        _shard_case(g, "rank 3 of 4: the two middle chunks", 3, 4),
        _shard_case(g, "rank 2 of 3, chunks of 5", 2, 3, 5),
        _shard_case(g, "one rank: the whole sequence", 0, 1, 4),
        _shard_case(g, "batch 2, 3 heads, rank 1 of 2, chunks of 1", 1, 2, 1, 2, 3),
    ]


def hidden_shard_cases(generator) -> list[Case]:
    cases = []
    for _ in range(6):
        world = draw_int(generator, 2, 6)
        rank, chunk_len = draw_int(generator, 0, world - 1), draw_int(generator, 1, 4)
        cases.append(_shard_case(generator, f"rank {rank} of {world}, chunks of {chunk_len}", rank, world, chunk_len))
    return cases


# ----------------------------------------------------------------------------- zigzag_cases

def public_case_tables() -> list[Case]:
    return [Case("rank 2 of 4, its own shard (step 0)", (2, 2, 4)),
            Case("rank 2 of 4, the shard of rank 0 (an earlier rank)", (2, 0, 4)),
            Case("rank 2 of 4, the shard of rank 3 (a later rank)", (2, 3, 4)),
            Case("rank 0 of 3, the shard of rank 2", (0, 2, 3)),
            Case("rank 3 of 4, the shard of rank 1", (3, 1, 4)),
            Case("one rank: its own shard", (0, 0, 1))]


def hidden_case_tables(generator) -> list[Case]:
    cases = []
    for relation in ("same", "earlier", "later", "earlier", "later"):
        world = draw_int(generator, 2, 8)
        rank = draw_int(generator, 1 if relation == "earlier" else 0, world - 2 if relation == "later" else world - 1)
        source = {"same": rank, "earlier": draw_int(generator, 0, max(rank - 1, 0)),
                  "later": draw_int(generator, min(rank + 1, world - 1), world - 1)}[relation]
        cases.append(Case(f"rank {rank} of {world}, the shard of rank {source}", (rank, source, world)))
    return cases


LAB = Lab(
    id="lab09",
    title="Ring attention in one process: the step merge, the zig-zag layout and its causal cases",
    notebook="lab09_ring.ipynb",
    exercises=(
        Exercise("merge_step", "merge_step", 4, public_merge_cases, hidden_merge_cases, judges.judge_merge,
                 forbidden=FORBIDDEN),
        Exercise("zigzag_shard", "zigzag_shard", 3, public_shard_cases, hidden_shard_cases, judges.judge_shard,
                 forbidden=FORBIDDEN),
        Exercise("zigzag_cases", "zigzag_cases", 3, public_case_tables, hidden_case_tables, judges.judge_cases,
                 forbidden=FORBIDDEN),
    ),
)
