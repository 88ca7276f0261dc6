"""Lab 06: attention at inference time (goes with notebook 06).

================  ==================================================================================
exercise          the learner's function, as the harness calls it
================  ==================================================================================
paged_gather      paged_gather(pool, block_table, b, length) -> (length, heads_kv, d): sequence b's tokens
merge_splits      merge_splits(outs, lses) -> (out, lse): S partial results merged by their LSE
split_attention   split_attention(q, k, v, num_splits, causal, scale) -> (out, lse): split-KV attention
choose_splits     choose_splits(batch, heads_kv, seqlen_k, num_sms) -> int: the split heuristic
================  ==================================================================================

Judged against :mod:`fa_lab.kvcache` (``gather_kv``'s page arithmetic, ``wave_splits``),
:func:`fa_lab.online_softmax.merge_splits` and :func:`fa_lab.reference.reference_attention`, in the
grader's process; fa_lab's own versions are forbidden in every exercise, so they are absent while grading.
"""
from __future__ import annotations

import torch

from ...block_info import BlockInfo, cdiv
from ...inputs import resolve_scale
from ...kvcache import split_ranges, wave_splits
from ...online_softmax import merge_splits
from ...reference import reference_attention
from ...testing import LSE_FLOOR
from ..judge import PASS, Expected, exact_verdict, judge_outputs, outcome_problem
from ..registry import Case, Exercise, Lab, Verdict
from . import attention_judges as judges
from . import attention_mistakes as mistakes
from .attention_cases import draw_choice, draw_int

FORBIDDEN = ("fa_lab.kvcache", "fa_lab.attention_with_kvcache")
SPLIT_BLOCK = 16  # keys per block of the lab's split_attention (splits are whole blocks)


# ----------------------------------------------------------------------------- paged_gather

def _pool_case(generator, name, page_size, pages_per_sequence, batch, b, length) -> Case:
    pool_pages = batch * pages_per_sequence + 2
    pool = torch.randn(pool_pages, page_size, 2, 4, generator=generator)
    table = torch.randperm(pool_pages, generator=generator)[:batch * pages_per_sequence]
    return Case(name, (pool, table.reshape(batch, pages_per_sequence).to(torch.int32), b, length))


def public_gather_cases() -> list[Case]:
    g = torch.Generator().manual_seed(6100)
    return [_pool_case(g, "pages of 4, sequence 1 of 3, 10 tokens (a partial last page)", 4, 3, 3, 1, 10),
            _pool_case(g, "pages of 4, sequence 0, 8 tokens (two whole pages)", 4, 3, 3, 0, 8),
            _pool_case(g, "pages of 1, sequence 2, 5 tokens", 1, 6, 3, 2, 5),
            _pool_case(g, "pages of 16, sequence 0, 3 tokens", 16, 2, 2, 0, 3),
            _pool_case(g, "an empty sequence", 4, 2, 2, 1, 0)]


def hidden_gather_cases(generator) -> list[Case]:
    cases = []
    for _ in range(5):
        page_size, pages = draw_choice(generator, (1, 2, 4, 8, 16)), draw_int(generator, 1, 4)
        batch = draw_int(generator, 1, 3)
        b, length = draw_int(generator, 0, batch - 1), draw_int(generator, 0, page_size * pages)
        cases.append(_pool_case(generator, f"pages of {page_size}, sequence {b} of {batch}, {length} tokens",
                                page_size, pages, batch, b, length))
    return cases


def _gather(pool, table, b, length, page_of=lambda j, size: j // size, slot_of=lambda j, size: j % size):
    size = pool.shape[1]
    rows = [pool[int(table[b, page_of(j, size)]), slot_of(j, size)] for j in range(length)]
    return torch.stack(rows) if rows else pool.new_zeros(0, *pool.shape[2:])


def judge_gather(case, outcome) -> Verdict:
    """paged_gather(pool, block_table, b, length) -> (length, heads_kv, d)."""
    pool, table, b, length = case.args
    size = pool.shape[1]
    expected = _gather(pool, table, b, length)
    problem = outcome_problem(outcome)
    value = outcome["outputs"]
    if not problem and isinstance(value, torch.Tensor) and value.shape[0] == cdiv(length, size) * size != length:
        return Verdict(False, f"you returned {value.shape[0]} tokens, whole pages: the last page is only partly "
                              f"used, so stop at `length` = {length} (the tokens after it are not this "
                              "sequence's, or not written yet).")
    mistakes = []
    if length > size:
        pages = table.shape[1]
        mistakes.append(("off by one page: token j of the sequence is on logical page j // page_size, the "
                         "block table's entry block_table[b, j // page_size] (not j // page_size + 1).",
                         _gather(pool, table, b, length, page_of=lambda j, s: min(j // s + 1, pages - 1))))
    mistakes += [
        ("the slot in the page is j % page_size (the position inside its page), not j // page_size.",
         _gather(pool, table, b, length, slot_of=lambda j, s: (j // s) % s)),
        ("the block table is skipped: logical page p of sequence b is physical page block_table[b, p], "
         "not page b * pages + p of the pool.",
         torch.stack([pool[b * table.shape[1] + j // size, j % size] for j in range(length)])
         if length and b * table.shape[1] + (length - 1) // size < pool.shape[0] else None),
    ]
    mistakes = [(m, w) for m, w in mistakes if w is not None]
    return exact_verdict(outcome, expected, "the gathered tokens", mistakes,
                         where=lambda i: f"token {i[0]}, head {i[1]}, dim {i[2]}")


# ----------------------------------------------------------------------------- merge_splits

def _split_case(generator, name, splits, heads, rows, gain, empty_split=False, empty_row=False) -> Case:
    outs = torch.randn(splits, heads, rows, 8, generator=generator)
    lses = torch.randn(splits, heads, rows, generator=generator) * gain
    if empty_split:
        lses[0] = float("-inf")
        outs[0] = 0.0
    if empty_row:
        lses[:, :, 0] = float("-inf")
        outs[:, :, 0] = 0.0
    return Case(name, (outs, lses))


def public_merge_cases() -> list[Case]:
    g = torch.Generator().manual_seed(6200)
    return [_split_case(g, "2 splits, LSEs of a few units", 2, 2, 3, 2.0),
            _split_case(g, "5 splits", 5, 3, 4, 3.0),
            _split_case(g, "LSEs in the hundreds (exp overflows float32 past 88.7)", 3, 2, 3, 300.0),
            _split_case(g, "a split that saw no key (lse = -inf)", 3, 2, 3, 2.0, empty_split=True),
            _split_case(g, "a row that no split saw", 4, 2, 3, 2.0, empty_row=True)]


def hidden_merge_cases(generator) -> list[Case]:
    return [_split_case(generator, f"{s} splits, gain {gain}", s, 2, draw_int(generator, 1, 5), gain,
                        empty_split=(i == 2), empty_row=(i == 3))
            for i, (s, gain) in enumerate(((2, 1.0), (7, 5.0), (4, 1.0), (3, 2.0), (6, 500.0)))]


def judge_merge(case, outcome) -> Verdict:
    """merge_splits(outs (S, ..., N, d), lses (S, ..., N)) -> (out, lse)."""
    outs, lses = case.args

    def expected():
        ref_out, ref_lse = merge_splits(outs.double(), lses.double())
        base_out, base_lse = merge_splits(outs, lses)
        dims = tuple(f"dim {i}" for i in range(outs.ndim - 1))
        return {"out": Expected(ref_out, base_out, torch.float32, dims),
                "lse": Expected(ref_lse, base_lse, torch.float32, dims[:-1], LSE_FLOOR)}

    def candidates():
        o, l = outs.double(), lses.double()

        def unshifted():  # in float32, as the learner's code runs
            raw = torch.exp(lses)
            return {"out": ((raw / raw.sum(0))[..., None] * outs).sum(0), "lse": torch.log(raw.sum(0))}
        yield ("the weights are exp(lse_s) / sum of exp(lse_s) without subtracting the largest LSE first: exp "
               "overflows float32 once an LSE passes 88.7 (inf / inf = NaN). Use lse = logsumexp over the "
               "splits and weights exp(lse_s - lse).", unshifted)
        yield ("every split weighs the same: a split's output is normalized over its own keys only, so it must be "
               "weighted by its share of the softmax mass, exp(lse_s - lse).",
               lambda: {"out": o.mean(0), "lse": torch.logsumexp(l, 0)})
        yield ("the merged lse is the largest split LSE; it is log sum_s exp(lse_s) (torch.logsumexp over the "
               "splits), and the weights exp(lse_s - lse) measured from it sum to 1.",
               lambda: {"out": (torch.exp(l - l.amax(0))[..., None] * o).sum(0), "lse": l.amax(0)})
        yield ("the weights are exp(lse_s - max_s lse_s), not normalized: divide by their sum, or use "
               "exp(lse_s - lse) with lse = logsumexp.",
               lambda: {"out": (torch.exp(l - l.amax(0))[..., None] * o).sum(0), "lse": torch.logsumexp(l, 0)})

    return judge_outputs(case, outcome, ("out", "lse"), expected, candidates=candidates,
                         detectors=(judges.nan_detector,))


# ----------------------------------------------------------------------------- split_attention

def _attention_case(generator, name, heads, seqlen_q, seqlen_k, splits, causal, scale=None, gain=1.0) -> Case:
    q = torch.randn(1, heads, seqlen_q, 16, generator=generator) * gain
    k, v = (torch.randn(1, heads, seqlen_k, 16, generator=generator) for _ in range(2))
    return Case(name, (q, k, v, splits, causal, scale))


def public_split_cases() -> list[Case]:
    g = torch.Generator().manual_seed(6300)
    return [_attention_case(g, "decode: 1 query, 70 keys, 3 splits", 2, 1, 70, 3, True),
            _attention_case(g, "4 queries, 50 keys, 2 splits, causal", 2, 4, 50, 2, True),
            _attention_case(g, "3 queries, 45 keys, 4 splits, full, scale 0.2", 1, 3, 45, 4, False, 0.2),
            _attention_case(g, "1 query, 20 keys, 5 splits (more splits than blocks)", 2, 1, 20, 5, True),
            _attention_case(g, "large scores", 2, 2, 64, 3, True, None, 30.0)]


def hidden_split_cases(generator) -> list[Case]:
    cases = []
    for causal in (True, True, False, True):
        seqlen_q, seqlen_k = draw_choice(generator, (1, 1, 3, 6)), draw_int(generator, 17, 90)
        splits = draw_int(generator, 1, 6)
        cases.append(_attention_case(generator, f"{seqlen_q} queries, {seqlen_k} keys, {splits} splits, "
                                                f"{'causal' if causal else 'full'}", 2, seqlen_q, seqlen_k,
                                     splits, causal))
    return cases


def judge_split_attention(case, outcome) -> Verdict:
    """split_attention(q, k, v, num_splits, causal, scale) -> (out, lse)."""
    q, k, v, splits, causal, scale = case.args
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    used = resolve_scale(scale, q.shape[-1])

    def candidates():
        ranges = split_ranges(seqlen_k, splits, SPLIT_BLOCK)
        whole = seqlen_k // SPLIT_BLOCK * SPLIT_BLOCK
        if 0 < whole < seqlen_k:
            kept = BlockInfo(seqlen_q, seqlen_k, causal).mask() & (torch.arange(seqlen_k) < whole)[None, :]
            yield ("the last, partial block of keys is dropped: the splits must cover every key, the last one "
                   f"ending at seqlen_k = {seqlen_k}, not at a multiple of the block.",
                   lambda: dict(zip(("out", "lse"), mistakes.attention(q, k, v, used, kept))))
        if causal and len(ranges) > 1:
            def per_split():
                parts = [reference_attention(q, k[..., a:b, :], v[..., a:b, :], True, scale) for a, b in ranges]
                out, lse = merge_splits(torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts]))
                return {"out": out, "lse": lse}
            yield ("each split is masked as if its keys were a whole sequence (its own bottom-right diagonal): "
                   "the causal diagonal is the whole sequence's, query i sees keys j <= i + seqlen_k - "
                   "seqlen_q, wherever the split starts.", per_split)
        yield from judges.forward_candidates(q, k, v, causal, scale)

    return judge_outputs(case, outcome, ("out", "lse"), lambda: judges.forward_expected(q, k, v, causal, scale),
                         candidates=candidates, detectors=judges.forward_detectors(q, k, causal, scale))


# ----------------------------------------------------------------------------- choose_splits

PUBLIC_CHOICES = ((1, 8, 65536, 132), (32, 8, 4096, 132), (4, 8, 16384, 132), (1, 8, 100, 132),
                  (2, 4, 8192, 108), (16, 8, 2048, 132), (27, 4, 16384, 132))


def public_choice_cases() -> list[Case]:
    return [Case(f"batch {b}, {h} KV heads, {n} keys, {sms} SMs", (b, h, n, sms)) for b, h, n, sms in PUBLIC_CHOICES]


def hidden_choice_cases(generator) -> list[Case]:
    cases = []
    for _ in range(6):
        b, h = draw_choice(generator, (1, 2, 3, 4, 8, 12)), draw_choice(generator, (1, 2, 4, 8))
        n, sms = draw_choice(generator, (256, 1000, 4096, 32768, 131072)), draw_choice(generator, (108, 132))
        cases.append(Case(f"batch {b}, {h} KV heads, {n} keys, {sms} SMs", (b, h, n, sms)))
    return cases


def _efficiency(programs: int, splits: int, sms: int) -> float:
    return programs * splits / (cdiv(programs * splits, sms) * sms)


def judge_choice(case, outcome) -> Verdict:
    """choose_splits(batch, heads_kv, seqlen_k, num_sms) -> int."""
    batch, heads_kv, seqlen_k, sms = case.args
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    value = outcome["outputs"]
    want = wave_splits(batch * heads_kv, seqlen_k, num_sms=sms)
    if isinstance(value, bool) or not isinstance(value, int):
        return Verdict(False, f"expected an int (the number of splits), got {type(value).__name__}.")
    if value == want:
        return PASS
    programs, blocks = batch * heads_kv, cdiv(seqlen_k, 128)
    limit = max(1, min(128, blocks, sms))
    best = max(range(1, limit + 1), key=lambda s: (_efficiency(programs, s, sms), -s))
    if programs >= 0.8 * sms and value > 1:
        why = f"{programs} programs already fill 80% of the {sms} SMs: do not split (1)."
    elif value > blocks:
        why = f"there are only {blocks} key blocks of 128: more splits than blocks leave splits without keys."
    elif value == best and value != want:
        why = ("you took the most efficient count; the rule takes the smallest count whose efficiency is at least "
               "85% of the best (fewer splits: less merging and less re-reading of the queries).")
    else:
        why = (f"efficiency(s) = P * s / (ceil(P * s / SMs) * SMs) with P = batch * heads_kv = {programs}: "
               f"your {value} gives {_efficiency(programs, value, sms):.2f}, the rule's {want} gives "
               f"{_efficiency(programs, want, sms):.2f}.")
    return Verdict(False, f"{value} splits, expected {want}: {why}")


LAB = Lab(
    id="lab06",
    title="Attention at inference time: a paged KV cache, split-KV decoding and its heuristic",
    notebook="lab06_inference.ipynb",
    exercises=(
        Exercise("paged_gather", "paged_gather", 2.5, public_gather_cases, hidden_gather_cases, judge_gather,
                 forbidden=FORBIDDEN),
        Exercise("merge_splits", "merge_splits", 2.5, public_merge_cases, hidden_merge_cases, judge_merge,
                 forbidden=FORBIDDEN),
        Exercise("split_attention", "split_attention", 3, public_split_cases, hidden_split_cases,
                 judge_split_attention, forbidden=FORBIDDEN),
        Exercise("choose_splits", "choose_splits", 2, public_choice_cases, hidden_choice_cases, judge_choice,
                 forbidden=FORBIDDEN),
    ),
)
