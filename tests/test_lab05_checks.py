"""Lab 05's checks accept the solution and reject typical wrong solutions with the right diagnosis.

Every mutant is the solution notebook's own code with one edit a learner might make (the test fails
if the edit no longer applies), run in-process through the same judges the grader uses, on the public
cases and the hidden cases of two seeds.
"""
from __future__ import annotations

import pytest
from labkit import LabChecks, Mutant, mutant_params

from fa_lab.grading.check import run_exercise

LAB = LabChecks("lab05", prelude="import itertools\n\nimport torch\n")


@pytest.mark.parametrize("exercise", LAB.exercise_names)
def test_solution_passes_public_and_hidden_cases(exercise):
    LAB.assert_solution_passes(exercise, seeds=(3, 4, 5))


EXPAND = "return k.repeat_interleave(heads // k.shape[1], dim=1)"
GROUP = "return grad.reshape(batch, heads_kv, heads // heads_kv, n, d).sum(dim=2)"
CU = "return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)"
SLICE = "views = [t[a:e].transpose(0, 1)[None] for t, (a, e) in ((q, (q0, q1)), (k, (k0, k1)), (v, (k0, k1)))]"
LEFT, RIGHT = "visible &= cols >= diagonal - left", "visible &= cols <= diagonal + right"
ALIBI = "return -slope * (rows + seqlen_k - seqlen_q - cols).abs().float()"
# (exercise, what the learner got wrong, edits of the solution, words the diagnosis must contain)
CASES = [
    ("expand_kv", "h % g mapping", [("expand_kv", EXPAND, "return k.repeat(1, heads // k.shape[1], 1, 1)")],
     "h % heads_kv"),
    ("group_sum", "mean over the group", [("group_sum", GROUP, GROUP.replace(".sum(", ".mean("))], "averaged"),
    ("group_sum", "h % g grouping",
     [("group_sum", GROUP, "return grad.reshape(batch, heads // heads_kv, heads_kv, n, d).sum(dim=1)")],
     "h % heads_kv"),
    ("group_sum", "one head of the group", [("group_sum", GROUP, GROUP.replace(".sum(dim=2)", "[:, :, 0]"))],
     "kept one query head"),
    ("gqa_attention", "h % g mapping in attention",
     [("gqa_attention", "k, v = expand_kv(k, heads).float(), expand_kv(v, heads).float()",
       "k, v = (t.repeat(1, heads // t.shape[1], 1, 1).float() for t in (k, v))")], "h % heads_kv"),
    ("gqa_attention", "causal aligned top-left",
     [("gqa_attention", "cols > rows + seqlen_k - seqlen_q", "cols > rows")], "top-left"),
    ("cu_seqlens", "no leading 0",
     [("cu_seqlens", CU, "return torch.tensor(list(itertools.accumulate(lengths)), dtype=torch.int32)")],
     "leading 0 is missing"),
    ("cu_seqlens", "int64 offsets", [("cu_seqlens", CU, CU.replace("torch.int32", "torch.int64"))], "int32"),
    ("varlen_attention", "sequences see the whole batch",
     [("varlen_attention", SLICE,
       "views = [t.transpose(0, 1)[None] if t is not q else t[q0:q1].transpose(0, 1)[None] for t in (q, k, v)]"),
      ("varlen_attention", "o, l = gqa_attention(*views, causal, scale)",
       "o, l = gqa_attention(*views, False, scale)")],
     "whole packed batch"),
    ("varlen_attention", "one key too many",
     [("varlen_attention", "bounds_k[b], bounds_k[b + 1]\n", "bounds_k[b], bounds_k[b + 1] + 1\n")],
     "first key of the next"),
    ("varlen_attention", "lse transposed",
     [("varlen_attention", "return out, lse", "return out, lse.t()")], "(heads, total_q)"),
    ("varlen_attention", "lse of a sequence without keys left at 0",
     [("varlen_attention", 'lse = torch.full((heads, total_q), float("-inf"))', "lse = torch.zeros(heads, total_q)")],
     "no key"),
    ("window_tile_mask", "left edge off by one", [("window_tile_mask", LEFT, LEFT.replace(">=", ">"))],
     "left edge"),
    ("window_tile_mask", "right edge off by one", [("window_tile_mask", RIGHT, RIGHT.replace("<=", "<"))],
     "right edge"),
    ("window_tile_mask", "top-left alignment",
     [("window_tile_mask", "diagonal = rows + seqlen_k - seqlen_q", "diagonal = rows")], "top-left"),
    ("window_tile_mask", "-1 taken as a size",
     [("window_tile_mask", "if left >= 0:", "if True:"), ("window_tile_mask", "if right >= 0:", "if True:")],
     "-1 is not a window size"),
    ("alibi_tile_bias", "sign flipped", [("alibi_tile_bias", ALIBI, ALIBI.replace("-slope", "slope"))],
     "sign is flipped"),
    ("alibi_tile_bias", "no absolute value", [("alibi_tile_bias", ALIBI, ALIBI.replace(".abs()", ""))],
     "absolute value"),
    ("alibi_tile_bias", "top-left alignment",
     [("alibi_tile_bias", ALIBI, ALIBI.replace(" + seqlen_k - seqlen_q", ""))], "top-left"),
]
MUTANTS = [Mutant(exercise, mistake, edits, words, seeds=(11, 12))
           for exercise, mistake, edits, words in CASES]


@pytest.mark.parametrize("mutant", mutant_params(MUTANTS))
def test_mutant_fails_with_its_diagnosis(mutant):
    LAB.assert_mutant_diagnosed(mutant)


def test_fa_labs_own_answers_are_forbidden():
    """Calling fa_lab's chapter-05 code from an exercise scores 0 (and the view hides it while grading)."""
    import fa_lab

    def varlen(q, k, v, cu_q, cu_k, causal=False, scale=None):
        return fa_lab.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, scale=scale, return_lse=True)

    exercise = LAB.exercise("varlen_attention")
    verdicts = run_exercise(exercise, varlen, exercise.public_cases())
    assert verdicts and all("write the computation yourself" in v.message for _, v in verdicts)
