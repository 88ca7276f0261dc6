"""Lab 02's checks accept the solution and reject typical wrong answers with the right diagnosis.

Every mutant is the solution notebook's own code with one edit a learner might make (the test fails
if the edit no longer applies), run in-process through the same judges the grader uses, on the public
cases and the hidden cases of two seeds.
"""
from __future__ import annotations

import pytest
from labkit import LabChecks, Mutant, mutant_params

LAB = LabChecks("lab02", prelude="import heapq\nimport math\n")


@pytest.mark.parametrize("exercise", LAB.exercise_names)
def test_solution_passes_public_and_hidden_cases(exercise):
    LAB.assert_solution_passes(exercise, seeds=(3, 4, 5))


WAVES = "return grid, -(-math.prod(grid) // sm_count)"
KEYS = "keys = min(max(last_row + seqlen_k - seqlen_q + 1, 0), seqlen_k)  # keys 0 .. keys - 1 are seen"
# (exercise, what the learner got wrong, edits of the solution, words the diagnosis must contain)
CASES = [
    ("grid_and_waves", "waves rounded down", [("grid_and_waves", WAVES, "return grid, math.prod(grid) // sm_count")],
     "rounded down"),
    ("grid_and_waves", "FA1's grid",
     [("grid_and_waves", "grid = (-(-seqlen_q // block_q), heads, batch)", "grid = (batch, heads)")],
     "FlashAttention-1"),
    ("kv_tiles", "causal tiles counted as full", [("kv_tiles", "if not causal:", "if True:")], "counted as full"),
    ("kv_tiles", "top-left alignment", [("kv_tiles", KEYS, KEYS.replace(" + seqlen_k - seqlen_q", ""))], "top-left"),
    ("makespan", "round robin",
     [("makespan", "time, slot = heapq.heappop(free)", "time, slot = free.pop(0)"),
      ("makespan", "heapq.heappush(free, (time + duration, slot))", "free.append((time + duration, slot))")],
     "round robin"),
    ("lpt_order", "row-major order", [("lpt_order", "return sorted(range(len(work)), key=lambda i: -work[i])",
                                       "return list(range(len(work)))")], "row-major"),
    ("lpt_order", "lightest first", [("lpt_order", "key=lambda i: -work[i]", "key=lambda i: work[i]")],
     "lightest programs come first"),
]
MUTANTS = [Mutant(exercise, mistake, edits, words, seeds=(11, 12)) for exercise, mistake, edits, words in CASES]


@pytest.mark.parametrize("mutant", mutant_params(MUTANTS))
def test_mutant_fails_with_its_diagnosis(mutant):
    LAB.assert_mutant_diagnosed(mutant)
