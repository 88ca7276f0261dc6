"""Judges of lab 09: one ring step's LSE merge, the zig-zag shard and the causal cases of a ring step.

The merge is compared with the float64 merge of the same partial results under the tolerance rule; a
failing merge is compared with the float32 outputs of the known mistakes (weights without the larger LSE
subtracted, weights not normalized, the larger LSE taken as the merged one, the two parts weighed alike or
swapped). The shard and the case table must equal fa_lab.context_parallel's exactly, and a wrong one is
compared with what the known wrong pairings of chunks (r and W - 1 - r, r and 2W - r, contiguous halves)
and the known slips of the causal rule produce. Chunks r and 2W - r are a mistake of the shard only: they
keep every comparison of chunk indices, so the case table they give is the right one.
"""
from __future__ import annotations

import torch

from ...context_parallel import chunk_cases, shard
from ...testing import LSE_FLOOR
from ..judge import Expected, describe, judge_outputs, mistakes_message, outcome_problem, tensor_problem
from ..registry import Verdict
from . import attention_judges as judges

NEG_INF = float("-inf")
PASS = Verdict(True, "ok")
CASE_WORDS = ("full", "diagonal", "skip")


# ----------------------------------------------------------------------------- merge_step

def merge(out_a, lse_a, out_b, lse_b, how: str = "right", dtype=torch.float32) -> dict:
    """The merge of two partial results in ``dtype``: right, or one of the known mistakes."""
    out_a, out_b, lse_a, lse_b = (t.to(dtype) for t in (out_a, out_b, lse_a, lse_b))
    top = torch.maximum(lse_a, lse_b)
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # rows empty in both: no shift
    if how == "unshifted":  # exp(lse) without the larger LSE subtracted
        safe = torch.zeros_like(top)
    if how == "unguarded":  # the shift by the max, but -inf - (-inf) = NaN in rows empty in both
        safe = top
    w_a, w_b = torch.exp(lse_a - safe), torch.exp(lse_b - safe)
    total = w_a + w_b
    lse = safe + torch.log(total)
    if how in ("unnormalized", "max"):
        out = w_a[..., None] * out_a + w_b[..., None] * out_b
        return {"out": out, "lse": top if how == "max" else lse}
    if how in ("max_lse", "shift_lse"):  # a normalized output, but the max (or its shift) as the lse
        lse = top if how == "max_lse" else safe
    if how == "no_shift_back":
        lse = torch.log(total)
    if how == "equal":
        return {"out": (out_a + out_b) / 2, "lse": lse}
    if how == "swapped":
        w_a, w_b = w_b, w_a
    divisor = torch.where(total > 0, total, torch.ones_like(total))
    return {"out": (w_a[..., None] * out_a + w_b[..., None] * out_b) / divisor[..., None], "lse": lse}


LSE_IS_MAX = ("the merged lse is the larger of the two LSEs; it is m + log(exp(lse_acc - m) + exp(lse_step - m)), the "
              "log of the softmax mass of both parts' keys together.")
MERGE_MISTAKES = (
    ("unshifted", "the weights are exp(lse_acc) / (exp(lse_acc) + exp(lse_step)) without subtracting the larger LSE "
                  "first: exp overflows float32 once an LSE passes 88.7 (inf / inf = NaN). Subtract m = "
                  "max(lse_acc, lse_step): the weights exp(lse - m) are then at most 1."),
    ("unnormalized", "the weights exp(lse_acc - m) and exp(lse_step - m), m the larger LSE, are not normalized: divide "
                     "the weighted sum by their sum (or use exp(lse_s - lse) with the merged lse)."),
    ("max", LSE_IS_MAX),
    ("max_lse", LSE_IS_MAX),
    ("shift_lse", LSE_IS_MAX),
    ("no_shift_back", "the merged lse is missing the max: lse = m + log(exp(lse_acc - m) + exp(lse_step - m)), not "
                      "log(exp(lse_acc - m) + exp(lse_step - m))."),
    ("equal", "both parts weigh the same: each output is normalized over its own keys only, so each must be weighted "
              "by its share of the softmax mass, exp(lse_s - lse)."),
    ("swapped", "the weights are swapped: out_acc must be weighted by exp(lse_acc - lse) and out_step by "
                "exp(lse_step - lse)."),
)


def judge_merge(case, outcome) -> Verdict:
    """merge_step(out_acc, lse_acc, out_step, lse_step) -> (out, lse), both float32."""
    out_a, lse_a, out_b, lse_b = case.args
    empty = torch.isinf(lse_a) & torch.isinf(lse_b)

    def expected():
        ref, base = merge(*case.args, dtype=torch.float64), merge(*case.args)
        return {"out": Expected(ref["out"], base["out"], torch.float32, judges.OUT_DIMS),
                "lse": Expected(ref["lse"], base["lse"], torch.float32, judges.LSE_DIMS, LSE_FLOOR)}

    def candidates():
        for how, message in MERGE_MISTAKES:
            yield message, lambda how=how: merge(*case.args, how=how)

    def empty_rows(actual, expected_outputs, comparisons):
        bad = torch.isnan(actual["out"]).any(dim=-1) | torch.isnan(actual["lse"])
        if bool(bad.any()) and bool((bad <= empty).all()):
            return ("NaN only in the rows that neither part has seen a key for (both LSEs -inf): there m = -inf and "
                    "exp(lse - m) = exp(-inf - (-inf)) = NaN. Such a row must stay out = 0, lse = -inf: shift by 0 "
                    "where m is -inf, and divide by the weights' sum only where it is positive.")
        return None

    row_max = torch.maximum(lse_a, lse_b)
    detectors = (empty_rows, judges.overflow_detector(row_max, (("out", -2), ("lse", -1))), judges.nan_detector)
    return judge_outputs(case, outcome, ("out", "lse"), expected, candidates=candidates, detectors=detectors)


# ----------------------------------------------------------------------------- zigzag_shard

def chunks_of(x, pieces, chunk_count):
    """x's chunks ``pieces`` (of ``chunk_count`` equal chunks along dim 2), concatenated; None if one is missing."""
    size = x.shape[2] // chunk_count
    if any(not 0 <= c < chunk_count for c in pieces):
        return None
    return torch.cat([x[:, :, c * size:(c + 1) * size] for c in pieces], dim=2)


def _shard_mistakes(x, rank, world):
    chunks = 2 * world
    yield (f"chunk {rank} is paired with chunk W - 1 - r = {world - 1 - rank}, but the sequence is cut into 2W = "
           f"{chunks} chunks: rank r holds chunks r and 2W - 1 - r = {chunks - 1 - rank}, the mirror image of chunk r "
           "about the middle.", chunks_of(x, (rank, world - 1 - rank), chunks))
    yield (f"chunk {rank} is paired with chunk 2W - r = {chunks - rank}; the chunks are numbered 0 .. 2W - 1 = "
           f"{chunks - 1}, so the mirror image of chunk r is 2W - 1 - r = {chunks - 1 - rank}.",
           chunks_of(x, (rank, chunks - rank), chunks))
    yield (f"the two chunks are in the wrong order: rank r holds chunk r first, then chunk 2W - 1 - r (here {rank}, "
           f"then {chunks - 1 - rank}), so that its positions stay in increasing order and the diagonal step is one "
           "causal call.", chunks_of(x, (chunks - 1 - rank, rank), chunks))
    yield ("this is the contiguous layout (positions [r N / W, (r + 1) N / W)): the zig-zag layout cuts the sequence "
           f"into 2W = {chunks} chunks and gives rank r chunks r and 2W - 1 - r.",
           chunks_of(x, (2 * rank, 2 * rank + 1), chunks))


def judge_shard(case, outcome) -> Verdict:
    """zigzag_shard(x, rank, world) -> chunks r and 2W - 1 - r of x along dim 2, concatenated."""
    x, rank, world = case.args
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    value, want = outcome["outputs"], shard(x, rank, world, "zigzag")
    if isinstance(value, torch.Tensor) and value.ndim == 4 and value.shape[2] == 2 * want.shape[2] != x.shape[2]:
        return Verdict(False, f"your shard holds {value.shape[2]} positions; a rank holds N / W = {want.shape[2]}: "
                              f"two chunks of N / (2W) = {want.shape[2] // 2} positions (the sequence is cut into 2W "
                              f"= {2 * world} chunks, not W).")
    size = want.shape[2] // 2
    if (rank == 0 and world > 0 and isinstance(value, torch.Tensor) and value.ndim == 4 and value.shape[2] == size
            and value.shape[:2] == want.shape[:2] and torch.equal(value, want[:, :, :size])):
        return Verdict(False, f"rank 0's shard holds only chunk 0: its second chunk, 2W - r = {2 * world}, lies past "
                              f"the end (the chunks are numbered 0 .. 2W - 1 = {2 * world - 1}). Rank r holds chunks r "
                              "and 2W - 1 - r.")
    problem = tensor_problem(value, tuple(want.shape), want.dtype, "the shard")
    if problem:
        return Verdict(False, problem)
    if torch.equal(value, want):
        return PASS
    found = [message for message, wrong in _shard_mistakes(x, rank, world)
             if wrong is not None and wrong.shape == value.shape and not torch.equal(wrong, want)
             and torch.equal(value, wrong)]
    if found:
        return Verdict(False, mistakes_message(found))
    first = int(torch.nonzero((value != want).any(dim=(0, 1, 3)))[0])
    return Verdict(False, f"the shard is wrong from its position {first} on (chunk {first // size} of the shard's two, "
                          f"which must be global chunk {(rank, 2 * world - 1 - rank)[first // size]}, of positions "
                          f"{(rank, 2 * world - 1 - rank)[first // size] * size} .. "
                          f"{(rank, 2 * world - 1 - rank)[first // size] * size + size - 1}).", explained=False)


# ----------------------------------------------------------------------------- zigzag_cases

def table(query_chunks, key_chunks, rule) -> tuple[tuple[str, ...], ...]:
    """The case of every (query chunk, key chunk) pair by ``rule(a, b, qc, kc)`` on local and global indices."""
    return tuple(tuple(rule(a, b, qc, kc) for b, kc in enumerate(key_chunks)) for a, qc in enumerate(query_chunks))


def causal(a, b, qc, kc) -> str:
    return "full" if kc < qc else "diagonal" if kc == qc else "skip"


def _case_mistakes(rank, source, world):
    chunks = 2 * world
    mine, theirs = (rank, chunks - 1 - rank), (source, chunks - 1 - source)
    yield (f"your chunks are r and W - 1 - r (rank {rank}: {(rank, world - 1 - rank)}); with 2W = {chunks} chunks, "
           f"rank r holds chunks r and 2W - 1 - r (rank {rank}: {mine}, the shard of rank {source}: {theirs}).",
           table((rank, world - 1 - rank), (source, world - 1 - source), causal))
    yield ("these are the cases of the contiguous layout (rank r holding positions [r N / W, (r + 1) N / W) as two "
           f"halves); in the zig-zag layout rank r holds chunks r and 2W - 1 - r (rank {rank}: {mine}, the shard of "
           f"rank {source}: {theirs}).", table((2 * rank, 2 * rank + 1), (2 * source, 2 * source + 1), causal))
    yield ("a pair of chunks is diagonal only when the query chunk and the key chunk are the same global chunk (the "
           "rank's own shard, at step 0). In a step that brings another rank's shard, local pair (a, a) holds "
           f"different global chunks (here {mine} against {theirs}): full when the key chunk comes first, skip when "
           "it comes later, never the causal triangle.",
           table(mine, theirs, lambda a, b, qc, kc: "diagonal" if a == b and causal(a, b, qc, kc) != "skip"
                 else causal(a, b, qc, kc)))
    yield ("a chunk against itself is not 'full': under the causal mask query i sees only the keys j <= i of its own "
           "chunk, the chunk's causal triangle ('diagonal').",
           table(mine, theirs, lambda a, b, qc, kc: "full" if qc == kc else causal(a, b, qc, kc)))
    yield ("a chunk against itself is not 'skip': each query sees the keys of its own chunk up to itself, so the pair "
           "is 'diagonal'.", table(mine, theirs, lambda a, b, qc, kc: "skip" if qc == kc else causal(a, b, qc, kc)))
    yield ("the causal rule is reversed: a key chunk that comes before the query chunk is 'full' (every key precedes "
           "every query), one that comes after is 'skip'.",
           table(mine, theirs, lambda a, b, qc, kc: causal(b, a, kc, qc)))
    yield (f"rows and columns are swapped: row a is the rank's query chunk {mine}[a], column b the key chunk "
           f"{theirs}[b] of the visiting shard of rank {source}.", table(theirs, mine, causal))
    yield (f"you compared the chunks' local indices (0 and 1), not their global ones: the rank's chunks are {mine} and "
           f"the visiting shard's {theirs}.", table((0, 1), (0, 1), causal))


def _as_table(value):
    """value as a tuple of tuples of strings, or None when it is not a 2 x 2 nested sequence of strings."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    rows = []
    for row in value:
        if isinstance(row, (str, bytes)) or not isinstance(row, (list, tuple)) or len(row) != 2:
            return None
        if not all(isinstance(word, str) for word in row):
            return None
        rows.append(tuple(row))
    return tuple(rows)


def judge_cases(case, outcome) -> Verdict:
    """zigzag_cases(rank, source, world) -> ((case, case), (case, case)), rows the rank's query chunks."""
    rank, source, world = case.args
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    value, want = _as_table(outcome["outputs"]), chunk_cases(rank, source, world)
    if value is None:
        return Verdict(False, "expected a 2 x 2 table (a tuple or list of two rows of two strings): row a for the "
                              "rank's query chunk a, column b for the visiting shard's key chunk b; got "
                              f"{describe(outcome['outputs'])}.")
    odd = sorted({word for row in value for word in row} - set(CASE_WORDS))
    if odd:
        return Verdict(False, f"the table holds {', '.join(map(repr, odd))}; each entry is 'full', 'diagonal' or "
                              "'skip'.")
    if value == want:
        return PASS
    found = [message for message, wrong in _case_mistakes(rank, source, world) if wrong != want and value == wrong]
    where = next((a, b) for a in range(2) for b in range(2) if value[a][b] != want[a][b])
    mine, theirs = (rank, 2 * world - 1 - rank), (source, 2 * world - 1 - source)
    detail = (f"Rank {rank}, shard of rank {source}: entry [{where[0]}][{where[1]}] (query chunk {mine[where[0]]}, key "
              f"chunk {theirs[where[1]]}) is {value[where[0]][where[1]]!r}, expected {want[where[0]][where[1]]!r}.")
    if found:
        return Verdict(False, f"{mistakes_message(found)} {detail}")
    return Verdict(False, f"the table is wrong. {detail}", explained=False)
