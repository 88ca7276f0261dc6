"""Grading lab 09 in real kernels: the solution gets full marks (the lab as handed out, 0, is graded
with the other labs in test_grading.py), and a submission that calls fa_lab's own zig-zag shard or merge loses
exactly that exercise."""
from __future__ import annotations

import nbformat
import pytest
from labkit import ROOT, assert_full_marks, grade_unchanged

from fa_lab.grading.registry import get_lab

LAB = get_lab("lab09")
SOLUTION = ROOT / "solutions" / LAB.notebook

pytestmark = pytest.mark.slow


def test_the_solution_gets_full_marks(tmp_path):
    assert_full_marks(LAB, grade_unchanged(SOLUTION, tmp_path))


CALLS_FA_LAB = '''
import fa_lab.context_parallel


def zigzag_shard(x, rank, world):
    return fa_lab.context_parallel.shard(x, rank, world, "zigzag")
'''

CALLS_MERGE = '''
from fa_lab.online_softmax import merge_partials


def merge_step(out_acc, lse_acc, out_step, lse_step):
    return merge_partials(out_acc, lse_acc, out_step, lse_step)
'''


@pytest.mark.parametrize("function, replacement, points", [("zigzag_shard", CALLS_FA_LAB, 3),
                                                          ("merge_step", CALLS_MERGE, 4)])
def test_calling_a_forbidden_function_costs_that_exercise_only(tmp_path, function, replacement, points):
    nb = nbformat.read(SOLUTION, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith(f"def {function}("):
            cell.source = replacement
    path = tmp_path / "calls_forbidden.ipynb"
    nbformat.write(nb, path)
    exercises = {e["name"]: e for e in grade_unchanged(path, tmp_path)["exercises"]}
    assert exercises[function]["points"] == 0
    assert sum(e["points"] for e in exercises.values()) == 10 - points
