"""Lab 06's checks accept the solution and reject typical wrong solutions with the right diagnosis.

Every mutant is the solution notebook's own code with one edit a learner might make (the test fails
if the edit no longer applies), run in-process through the same judges the grader uses, on the public
cases and the hidden cases of two seeds.
"""
from __future__ import annotations

import pytest
from labkit import LabChecks, Mutant, mutant_params

LAB = LabChecks("lab06", prelude="import torch\n\nBLOCK = 16\n")


@pytest.mark.parametrize("exercise", LAB.exercise_names)
def test_solution_passes_public_and_hidden_cases(exercise):
    LAB.assert_solution_passes(exercise, seeds=(3, 4, 5))


PAGES = "pages = block_table[b].long()[positions // page_size]"
GATHER = "return pool[pages, positions % page_size]"
WEIGHTS = "weights = torch.exp(lses - safe)"
MASK = "scores = scores.masked_fill(cols > rows + seqlen_k - seqlen_q, float(\"-inf\"))"
SPLIT = "start, end = blocks * s // splits * BLOCK, min(blocks * (s + 1) // splits * BLOCK, seqlen_k)"
CHOICE = "return next(s for s in range(1, limit + 1) if efficiency(s) >= 0.85 * best)"
# (exercise, what the learner got wrong, edits of the solution, words the diagnosis must contain)
CASES = [
    ("paged_gather", "off by one page",
     [("paged_gather", PAGES,
       "pages = block_table[b].long()[(positions // page_size + 1).clamp(max=block_table.shape[1] - 1)]")],
     "off by one page"),
    ("paged_gather", "slot by division",
     [("paged_gather", GATHER, "return pool[pages, (positions // page_size) % page_size]")], "j % page_size"),
    ("paged_gather", "whole pages",
     [("paged_gather", "positions = torch.arange(length)",
       "positions = torch.arange(-(-length // page_size) * page_size)")], "whole pages"),
    ("merge_splits", "no max subtracted",
     [("merge_splits", WEIGHTS, "weights = torch.exp(lses) / torch.exp(lses).sum(0)"),
      ("merge_splits", "lse = torch.logsumexp(lses, dim=0)", "lse = torch.log(torch.exp(lses).sum(0))")],
     "without subtracting"),
    ("merge_splits", "equal weights",
     [("merge_splits", WEIGHTS, "weights = torch.ones_like(lses) / lses.shape[0]")], "weighs the same"),
    ("merge_splits", "lse is the max",
     [("merge_splits", "lse = torch.logsumexp(lses, dim=0)", "lse = lses.amax(dim=0)")], "largest split LSE"),
    ("split_attention", "tail dropped",
     [("split_attention", SPLIT, SPLIT.replace("min(blocks * (s + 1) // splits * BLOCK, seqlen_k)",
                                               "min(blocks * (s + 1) // splits * BLOCK, seqlen_k // BLOCK * BLOCK)"))],
     "partial block of keys is dropped"),
    ("split_attention", "per-split causal alignment",
     [("split_attention", MASK, MASK.replace("cols > rows + seqlen_k - seqlen_q", "cols > rows + end - seqlen_q"))],
     "own bottom-right diagonal"),
    ("choose_splits", "the best count, not the smallest good one",
     [("choose_splits", CHOICE, "return max(range(1, limit + 1), key=lambda s: (efficiency(s), -s))")],
     "smallest count"),
    ("choose_splits", "no early return",
     [("choose_splits", "if programs >= 0.8 * num_sms:\n        return 1", "if False:\n        return 1")], "80%"),
]
MUTANTS = [Mutant(exercise, mistake, edits, words, seeds=(11, 12)) for exercise, mistake, edits, words in CASES]


@pytest.mark.parametrize("mutant", mutant_params(MUTANTS))
def test_mutant_fails_with_its_diagnosis(mutant):
    LAB.assert_mutant_diagnosed(mutant)
