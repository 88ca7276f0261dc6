"""Grading lab 04 in real kernels: the solution gets full marks (the lab as handed out, 0, is
graded with the other labs in test_grading.py), and a submission that calls fa_lab.fp8's answers
loses exactly those exercises (what each exercise may call travels to the grading kernel with its
cases). Each grading runs the notebook (about 10 s)."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from labkit import ROOT, digest, grade_json

from fa_lab.grading.registry import get_lab

LAB = get_lab("lab04")
SOLUTION = ROOT / "solutions" / LAB.notebook

pytestmark = pytest.mark.slow


def grade(path: Path, tmp_path: Path) -> dict:
    before = digest(path)
    status, report = grade_json(path, tmp_path)
    assert status == 0
    assert digest(path) == before, "grading changed the submission"
    return report


def test_the_solution_gets_full_marks(tmp_path):
    report = grade(SOLUTION, tmp_path)
    assert report["lab"] == "lab04" and report["score"] == report["max_score"] == 10
    assert [e["name"] for e in report["exercises"]] == [e.name for e in LAB.exercises]
    for exercise in report["exercises"]:
        assert exercise["points"] == exercise["max_points"] and exercise["messages"] == []
        assert exercise["passed"] == exercise["cases"] > 1
    assert report["notebook_errors"] == []


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
    exercises = {e["name"]: e for e in grade(path, tmp_path)["exercises"]}
    for name in ("hadamard", "fp8_error_table"):
        assert exercises[name]["status"] == "forbidden" and exercises[name]["points"] == 0
        assert "fa_lab.fp8." in exercises[name]["messages"][0]
    # quantize_blocks is the solution's; rotate_qk goes through fa_lab's transform, so it is caught too.
    assert exercises["quantize_blocks"]["points"] == 2.5
    assert exercises["rotate_qk"]["status"] == "forbidden"
