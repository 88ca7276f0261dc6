"""Grading lab 04 in real kernels: the solution gets full marks (the lab as handed out, 0, is
graded with the other labs in test_grading.py), and a submission that calls fa_lab.fp8's answers
loses exactly those exercises (what each exercise may call travels to the grading kernel with its
cases). Each grading runs the notebook (about 10 s)."""
from __future__ import annotations

import nbformat
import pytest
from labkit import ROOT, assert_full_marks, grade_unchanged

from fa_lab.grading.registry import get_lab

LAB = get_lab("lab04")
SOLUTION = ROOT / "solutions" / LAB.notebook

pytestmark = pytest.mark.slow


def test_the_solution_gets_full_marks(tmp_path):
    assert_full_marks(LAB, grade_unchanged(SOLUTION, tmp_path))


# The cell that defines each function, replaced by one that calls fa_lab.fp8's answer.
CALLS_FA_LAB = {
    "def hadamard(": '''
from fa_lab.fp8 import hadamard_transform


def hadamard(x):
    return hadamard_transform(x)
''',
    "def fp8_attention(": '''
from fa_lab.fp8 import reproduce_error_table


def fp8_error_table(seed):
    return reproduce_error_table(seed, **TABLE_SHAPE)
''',
}


def test_calling_fa_lab_fp8_costs_those_exercises_only(tmp_path):
    nb = nbformat.read(SOLUTION, as_version=4)
    for cell in nb.cells:
        for marker, source in CALLS_FA_LAB.items():
            if cell.cell_type == "code" and cell.source.startswith(marker):
                cell.source = source
    path = tmp_path / "calls_fa_lab.ipynb"
    nbformat.write(nb, path)
    exercises = {e["name"]: e for e in grade_unchanged(path, tmp_path)["exercises"]}
    for name in ("hadamard", "fp8_error_table"):
        assert exercises[name]["status"] == "forbidden" and exercises[name]["points"] == 0
        assert "fa_lab.fp8." in exercises[name]["messages"][0]
    # quantize_blocks is the solution's; rotate_qk goes through fa_lab's transform, so it is caught too.
    assert exercises["quantize_blocks"]["points"] == 2.5
    assert exercises["rotate_qk"]["status"] == "forbidden"
