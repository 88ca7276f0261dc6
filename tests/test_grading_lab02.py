"""Grading lab 05 in real kernels: the solution gets full marks (the lab as handed out, 0, is graded
with the other labs in test_grading.py), and a submission that calls fa_lab's own varlen attention
loses exactly that exercise."""
from __future__ import annotations

from pathlib import Path

import pytest
from labkit import ROOT, digest, grade_json

from fa_lab.grading.registry import get_lab

LAB = get_lab("lab02")
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
    assert report["lab"] == "lab02" and report["score"] == report["max_score"] == 10
    assert [e["name"] for e in report["exercises"]] == [e.name for e in LAB.exercises]
    for exercise in report["exercises"]:
        assert exercise["points"] == exercise["max_points"] and exercise["messages"] == []
        assert exercise["passed"] == exercise["cases"] > 1
    assert report["notebook_errors"] == []
