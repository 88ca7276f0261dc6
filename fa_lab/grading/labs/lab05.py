"""Lab 05: the interfaces of an attention library (goes with notebook 05).

=================  ==================================================================================
exercise           the learner's function, as the harness calls it
=================  ==================================================================================
expand_kv          expand_kv(k, heads) -> (B, heads, N, d): K/V head h // (heads // heads_kv) per query head
group_sum          group_sum(grad, heads_kv) -> (B, heads_kv, N, d): a K/V head's gradient over its group
gqa_attention      gqa_attention(q, k, v, causal, scale) -> (out, lse), k, v with heads_kv heads
cu_seqlens         cu_seqlens(lengths) -> int32 (batch + 1,)
varlen_attention   varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale) -> (out, lse),
                   q (total_q, H, d), k, v (total_k, Hkv, d), lse (H, total_q)
window_tile_mask   window_tile_mask(i0, i1, j0, j1, seqlen_q, seqlen_k, window) -> (i1 - i0, j1 - j0) bool
alibi_tile_bias    alibi_tile_bias(i0, i1, j0, j1, seqlen_q, seqlen_k, slope) -> (i1 - i0, j1 - j0) float32
=================  ==================================================================================

The judges are in :mod:`.lab05_judges`. fa_lab's own answers (the modules of chapter 05 and the
references, which take grouped heads and windows) are forbidden in every exercise, so they are
absent while grading.
"""
from __future__ import annotations

import torch

from ...testing import make_qkv
from ..registry import Case, Exercise, Lab
from . import lab05_judges as judges
from .attention_cases import draw_choice, draw_int, draw_seqlens

FORBIDDEN = ("fa_lab.block_info", "fa_lab.score_mods", "fa_lab.varlen", "fa_lab.impls",
             "fa_lab.reference.expand_kv", "fa_lab.reference.attention_scores", "fa_lab.attention_varlen")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- GQA

def _kv(generator, batch, heads_kv, n, d):
    return torch.randn(batch, heads_kv, n, d, generator=generator)


def public_expand_cases() -> list[Case]:
    g = _generator(5100)
    return [Case("8 query heads, 2 K/V heads (groups of 4)", (_kv(g, 1, 2, 5, 4), 8)),
            Case("6 query heads, 3 K/V heads, batch 2", (_kv(g, 2, 3, 4, 8), 6)),
            Case("MQA: 4 query heads, 1 K/V head", (_kv(g, 1, 1, 3, 4), 4)),
            Case("MHA: 3 query heads, 3 K/V heads (nothing to expand)", (_kv(g, 1, 3, 2, 4), 3))]


def hidden_expand_cases(generator) -> list[Case]:
    cases = []
    for _ in range(4):
        heads_kv, group = draw_int(generator, 1, 4), draw_choice(generator, (2, 3, 4))
        cases.append(Case(f"{heads_kv * group} query heads, {heads_kv} K/V heads",
                          (_kv(generator, draw_int(generator, 1, 2), heads_kv, draw_int(generator, 1, 9), 8),
                           heads_kv * group)))
    return cases


def public_group_cases() -> list[Case]:
    g = _generator(5200)
    return [Case("8 query heads into 2 K/V heads", (torch.randn(1, 8, 5, 4, generator=g), 2)),
            Case("6 query heads into 3 K/V heads, batch 2", (torch.randn(2, 6, 3, 8, generator=g), 3)),
            Case("MQA: 4 query heads into 1 K/V head", (torch.randn(1, 4, 3, 4, generator=g), 1))]


def hidden_group_cases(generator) -> list[Case]:
    cases = []
    for _ in range(4):
        heads_kv, group = draw_int(generator, 2, 4), draw_choice(generator, (2, 3, 4))
        grad = torch.randn(draw_int(generator, 1, 2), heads_kv * group, draw_int(generator, 1, 9), 8,
                           generator=generator)
        cases.append(Case(f"{heads_kv * group} query heads into {heads_kv} K/V heads", (grad, heads_kv)))
    return cases


def _gqa_case(generator, name, batch, heads, heads_kv, seqlen_q, seqlen_k, causal, scale=None,
              dtype=torch.float32) -> Case:
    q, k, v = make_qkv(batch, heads, seqlen_q, seqlen_k, 16, generator=generator, requires_grad=False,
                       heads_kv=heads_kv)
    return Case(name, (q.to(dtype), k.to(dtype), v.to(dtype), causal, scale))


def public_gqa_cases() -> list[Case]:
    g = _generator(5300)
    return [_gqa_case(g, "4 query heads, 2 K/V heads, Nq = Nk = 12", 1, 4, 2, 12, 12, False),
            _gqa_case(g, "6 query heads, 3 K/V heads, causal, Nq = 7, Nk = 13", 2, 6, 3, 7, 13, True),
            _gqa_case(g, "MQA: 4 query heads, 1 K/V head, causal", 1, 4, 1, 9, 9, True, 0.3),
            _gqa_case(g, "8 query heads, 2 K/V heads, bfloat16", 1, 8, 2, 10, 6, False, None, torch.bfloat16)]


def hidden_gqa_cases(generator) -> list[Case]:
    cases = []
    for causal, relation in ((True, "more queries"), (True, "fewer queries"), (False, "any"), (True, "square")):
        heads_kv, group = draw_int(generator, 2, 3), draw_choice(generator, (2, 4))
        seqlen_q, seqlen_k = draw_seqlens(generator, relation, longest=24, step=12)
        cases.append(_gqa_case(generator, f"{heads_kv * group} query heads, {heads_kv} K/V heads, "
                                          f"{'causal' if causal else 'full'}, Nq = {seqlen_q}, Nk = {seqlen_k}",
                               1, heads_kv * group, heads_kv, seqlen_q, seqlen_k, causal))
    return cases


# ----------------------------------------------------------------------------- varlen

def public_cu_cases() -> list[Case]:
    return [Case("three sequences of 3, 5 and 2 tokens", ([3, 5, 2],)),
            Case("one sequence of 7 tokens", ([7],)),
            Case("an empty sequence in the middle: 4, 0, 6", ([4, 0, 6],)),
            Case("no sequence at all", ([],))]


def hidden_cu_cases(generator) -> list[Case]:
    return [Case(f"{count} sequences", ([draw_int(generator, 0, 40) for _ in range(count)],))
            for count in (1, 3, 6, 9)]


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _varlen_case(generator, name, lengths_q, lengths_k, heads, heads_kv, causal, scale=None,
                 dtype=torch.float32) -> Case:
    d = 16
    q = torch.randn(sum(lengths_q), heads, d, generator=generator).to(dtype)
    k, v = (torch.randn(sum(lengths_k), heads_kv, d, generator=generator).to(dtype) for _ in range(2))
    return Case(name, (q, k, v, _cu(lengths_q), _cu(lengths_k), causal, scale))


def public_varlen_cases() -> list[Case]:
    g = _generator(5400)
    return [
        _varlen_case(g, "3 sequences of 5, 9, 3 tokens, full", [5, 9, 3], [5, 9, 3], 2, 2, False),
        _varlen_case(g, "3 sequences, causal, queries 4, 6, 2 and keys 4, 10, 7", [4, 6, 2], [4, 10, 7], 2, 2, True),
        _varlen_case(g, "GQA: 4 query heads, 2 K/V heads, causal", [6, 3], [6, 8], 4, 2, True, 0.3),
        _varlen_case(g, "an empty query sequence and a sequence with no key", [5, 0, 4], [5, 3, 0], 2, 1, True),
        _varlen_case(g, "bfloat16, 4 sequences", [3, 7, 1, 5], [3, 7, 2, 5], 2, 2, False, None, torch.bfloat16),
    ]


def hidden_varlen_cases(generator) -> list[Case]:
    cases = []
    for causal, count in ((True, 3), (False, 4), (True, 5), (True, 2)):
        lengths_q = [draw_int(generator, 1, 14) for _ in range(count)]
        lengths_k = [n + draw_int(generator, 0, 6) for n in lengths_q]
        heads_kv = draw_int(generator, 1, 2)
        cases.append(_varlen_case(generator, f"{count} sequences, {'causal' if causal else 'full'}, queries "
                                             f"{lengths_q}, keys {lengths_k}",
                                  lengths_q, lengths_k, heads_kv * 2, heads_kv, causal))
    cases.append(_varlen_case(generator, "with empty sequences", [3, 0, 5, 2], [3, 4, 5, 0], 2, 2, True))
    return cases


# ----------------------------------------------------------------------------- tile masks

PUBLIC_WINDOWS = (
    ("Nq = Nk = 16, window (2, 0), queries 8-15 x keys 4-15", 8, 16, 4, 16, 16, 16, (2, 0)),
    ("Nq = Nk = 12, window (1, 1), queries 0-5 x keys 0-7", 0, 6, 0, 8, 12, 12, (1, 1)),
    ("Nq = 4, Nk = 10, window (3, 0): bottom-right aligned", 0, 4, 0, 10, 4, 10, (3, 0)),
    ("Nq = Nk = 10, window (-1, 2): no left bound", 0, 10, 0, 10, 10, 10, (-1, 2)),
    ("Nq = Nk = 10, window (3, -1): no right bound", 2, 9, 0, 10, 10, 10, (3, -1)),
    ("Nq = 10, Nk = 6, window (0, 0): only the diagonal", 0, 10, 0, 6, 10, 6, (0, 0)),
)


def public_window_cases() -> list[Case]:
    return [Case(name, args) for name, *args in PUBLIC_WINDOWS]


def _tile(generator, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int, int]:
    block_q, block_k = draw_choice(generator, (4, 6, 8)), draw_choice(generator, (4, 5, 8))
    i0 = draw_int(generator, 0, (seqlen_q - 1) // block_q) * block_q
    j0 = draw_int(generator, 0, (seqlen_k - 1) // block_k) * block_k
    return i0, min(i0 + block_q, seqlen_q), j0, min(j0 + block_k, seqlen_k)


def hidden_window_cases(generator) -> list[Case]:
    cases = []
    for relation, window in (("square", (3, 0)), ("fewer queries", (2, 2)), ("more queries", (4, 1)),
                             ("any", (-1, 3)), ("any", (5, -1)), ("square", (0, 0))):
        seqlen_q, seqlen_k = draw_seqlens(generator, relation, longest=24, step=12)
        i0, i1, j0, j1 = _tile(generator, seqlen_q, seqlen_k)
        cases.append(Case(f"Nq = {seqlen_q}, Nk = {seqlen_k}, window {window}, queries {i0}-{i1 - 1} x keys "
                          f"{j0}-{j1 - 1}", (i0, i1, j0, j1, seqlen_q, seqlen_k, window)))
    return cases


PUBLIC_ALIBI = (
    ("Nq = Nk = 8, slope 0.5, queries 0-7 x keys 0-7", 0, 8, 0, 8, 8, 8, 0.5),
    ("Nq = 4, Nk = 10, slope 0.25: bottom-right aligned", 0, 4, 0, 10, 4, 10, 0.25),
    ("Nq = Nk = 16, slope 0.125, queries 8-11 x keys 12-15 (keys after the diagonal)", 8, 12, 12, 16, 16, 16, 0.125),
)


def public_alibi_cases() -> list[Case]:
    return [Case(name, args) for name, *args in PUBLIC_ALIBI]


def hidden_alibi_cases(generator) -> list[Case]:
    cases = []
    for relation in ("square", "fewer queries", "more queries", "any"):
        seqlen_q, seqlen_k = draw_seqlens(generator, relation, longest=24, step=12)
        slope = 2.0 ** -draw_int(generator, 1, 8)
        i0, i1, j0, j1 = _tile(generator, seqlen_q, seqlen_k)
        cases.append(Case(f"Nq = {seqlen_q}, Nk = {seqlen_k}, slope {slope:g}, queries {i0}-{i1 - 1} x keys "
                          f"{j0}-{j1 - 1}", (i0, i1, j0, j1, seqlen_q, seqlen_k, slope)))
    return cases


LAB = Lab(
    id="lab05",
    title="The interfaces of an attention library: grouped heads, packed batches, windows and ALiBi",
    notebook="lab05_interfaces.ipynb",
    exercises=(
        Exercise("expand_kv", "expand_kv", 1, public_expand_cases, hidden_expand_cases, judges.judge_expand,
                 forbidden=FORBIDDEN),
        Exercise("group_sum", "group_sum", 1.5, public_group_cases, hidden_group_cases, judges.judge_group_sum,
                 forbidden=FORBIDDEN),
        Exercise("gqa_attention", "gqa_attention", 1.5, public_gqa_cases, hidden_gqa_cases,
                 judges.judge_gqa_attention, forbidden=FORBIDDEN),
        Exercise("cu_seqlens", "cu_seqlens", 1, public_cu_cases, hidden_cu_cases, judges.judge_cu_seqlens,
                 forbidden=FORBIDDEN),
        Exercise("varlen_attention", "varlen_attention", 2.5, public_varlen_cases, hidden_varlen_cases,
                 judges.judge_varlen, forbidden=FORBIDDEN),
        Exercise("window_tile_mask", "window_tile_mask", 1.5, public_window_cases, hidden_window_cases,
                 judges.judge_window_mask, forbidden=FORBIDDEN),
        Exercise("alibi_tile_bias", "alibi_tile_bias", 1, public_alibi_cases, hidden_alibi_cases,
                 judges.judge_alibi, forbidden=FORBIDDEN),
    ),
)
