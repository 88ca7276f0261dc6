"""Grading lab 08 in real kernels: the solution gets full marks (the lab as handed out, 0, is graded
with the other labs in test_grading.py), and a submission that calls fa_lab's own solve_tril loses
exactly that exercise."""
from __future__ import annotations

import nbformat
import pytest
from labkit import ROOT, assert_full_marks, grade_unchanged

from fa_lab.grading.registry import get_lab

LAB = get_lab("lab08")
SOLUTION = ROOT / "solutions" / LAB.notebook

pytestmark = pytest.mark.slow


def test_the_solution_gets_full_marks(tmp_path):
    assert_full_marks(LAB, grade_unchanged(SOLUTION, tmp_path))


CALLS_FA_LAB = '''
import fa_lab.linear


def solve_tril(a):
    return fa_lab.linear.solve_tril(a)
'''


def test_calling_fa_labs_solve_tril_costs_that_exercise_only(tmp_path):
    nb = nbformat.read(SOLUTION, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith("def solve_tril("):
            cell.source = CALLS_FA_LAB
    path = tmp_path / "calls_fa_lab.ipynb"
    nbformat.write(nb, path)
    exercises = {e["name"]: e for e in grade_unchanged(path, tmp_path)["exercises"]}
    assert exercises["solve_tril"]["points"] == 0
    assert sum(e["points"] for e in exercises.values()) == 10 - 4
