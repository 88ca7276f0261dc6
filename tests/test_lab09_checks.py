"""Lab 09's checks accept the solution and reject typical wrong solutions with the right diagnosis.

Every mutant is the solution notebook's own code with one edit a learner might make (the test fails
if the edit no longer applies), run in-process through the same judges the grader uses, on the public
cases and the hidden cases of two seeds.
"""
from __future__ import annotations

import pytest
from labkit import LabChecks, Mutant, mutant_params

LAB = LabChecks("lab09", prelude="import torch\n\n")


@pytest.mark.parametrize("exercise", LAB.exercise_names)
def test_solution_passes_public_and_hidden_cases(exercise):
    LAB.assert_solution_passes(exercise, seeds=(3, 4, 5))


MAX = "m = torch.maximum(lse_acc, lse_step)"
GUARD = "m = torch.where(torch.isinf(m), 0.0, m)  # a row that no part has seen: no shift, and no NaN"
LSE = "lse = m + torch.log(total)"
OUT = ("out = (w_acc[..., None] * out_acc + w_step[..., None] * out_step) / torch.where(total > 0, total, 1.0)"
       "[..., None]")
SECOND = "first, second = rank, 2 * world - 1 - rank"
CAT = ("return torch.cat([x[:, :, first * size:(first + 1) * size], x[:, :, second * size:(second + 1) * size]], "
       "dim=2)")
MINE, THEIRS = "mine = (rank, 2 * world - 1 - rank)", "theirs = (source, 2 * world - 1 - source)"
DIAGONAL, FULL = "if kc == qc:", "elif kc < qc:"
# (exercise, what the learner got wrong, edits of the solution, words the diagnosis must contain)
CASES = [
    ("merge_step", "merge without subtracting the max",
     [("merge_step", MAX, "m = torch.zeros_like(lse_acc)"), ("merge_step", GUARD, "")], "without subtracting"),
    ("merge_step", "weights not normalized", [("merge_step", OUT, OUT.split(" / ")[0])], "not normalized"),
    ("merge_step", "merged lse is the max", [("merge_step", LSE, "lse = m")], "larger of the two"),
    ("merge_step", "merged lse is the max and the output unnormalized",
     [("merge_step", LSE, "lse = torch.maximum(lse_acc, lse_step)"), ("merge_step", OUT, OUT.split(" / ")[0])],
     "larger of the two"),
    ("merge_step", "the max not added back to the lse", [("merge_step", LSE, "lse = torch.log(total)")],
     "missing the max"),
    ("merge_step", "both parts weigh the same", [("merge_step", OUT, "out = (out_acc + out_step) / 2")],
     "weigh the same"),
    ("merge_step", "weights swapped",
     [("merge_step", OUT, OUT.replace("w_acc[..., None] * out_acc + w_step[..., None] * out_step",
                                      "w_step[..., None] * out_acc + w_acc[..., None] * out_step"))], "swapped"),
    ("merge_step", "no guard for rows that neither part has seen", [("merge_step", GUARD, "")],
     "neither part has seen"),
    ("zigzag_shard", "chunks r and W - 1 - r",
     [("zigzag_shard", SECOND, SECOND.replace("2 * world - 1 - rank", "world - 1 - rank"))], "W - 1 - r"),
    ("zigzag_shard", "chunks r and 2W - r",
     [("zigzag_shard", SECOND, SECOND.replace("2 * world - 1 - rank", "2 * world - rank"))], "2W - r"),
    ("zigzag_shard", "the two chunks in the wrong order",
     [("zigzag_shard", SECOND, "second, first = rank, 2 * world - 1 - rank")], "wrong order"),
    ("zigzag_shard", "contiguous halves", [("zigzag_shard", SECOND, "first, second = 2 * rank, 2 * rank + 1")],
     "contiguous layout"),
    ("zigzag_shard", "chunks of N / W", [("zigzag_shard", "size = x.shape[2] // (2 * world)",
                                          "size = x.shape[2] // world")], "contiguous layout"),
    ("zigzag_cases", "chunks r and W - 1 - r",
     [("zigzag_cases", MINE, "mine = (rank, world - 1 - rank)"),
      ("zigzag_cases", THEIRS, "theirs = (source, world - 1 - source)")], "W - 1 - r"),
    ("zigzag_cases", "the causal triangle on the local diagonal of another rank's shard",
     [("zigzag_cases", DIAGONAL, "if mine.index(qc) == theirs.index(kc) and kc <= qc:")], "never the causal triangle"),
    ("zigzag_cases", "a chunk against itself counted as full", [("zigzag_cases", DIAGONAL, "if False:"),
                                                                ("zigzag_cases", FULL, "elif kc <= qc:")],
     "not 'full'"),
    ("zigzag_cases", "the causal rule reversed", [("zigzag_cases", FULL, "elif kc > qc:")], "reversed"),
    ("zigzag_cases", "rows and columns swapped",
     [("zigzag_cases", MINE, "mine = (source, 2 * world - 1 - source)"),
      ("zigzag_cases", THEIRS, "theirs = (rank, 2 * world - 1 - rank)")], "swapped"),
    ("zigzag_cases", "contiguous halves",
     [("zigzag_cases", MINE, "mine = (2 * rank, 2 * rank + 1)"),
      ("zigzag_cases", THEIRS, "theirs = (2 * source, 2 * source + 1)")], "contiguous layout"),
]
MUTANTS = [Mutant(exercise, mistake, edits, words, seeds=(11, 12)) for exercise, mistake, edits, words in CASES]


@pytest.mark.parametrize("mutant", mutant_params(MUTANTS))
def test_mutant_fails_with_its_diagnosis(mutant):
    LAB.assert_mutant_diagnosed(mutant)
