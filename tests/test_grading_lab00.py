"""Grading lab 00 in real kernels: the solution gets full marks (the lab as handed out, 0, is graded
with the other labs in test_grading.py)."""
from __future__ import annotations

import pytest
from labkit import ROOT, assert_full_marks, grade_unchanged

from fa_lab.grading.registry import get_lab

LAB = get_lab("lab00")
SOLUTION = ROOT / "solutions" / LAB.notebook

pytestmark = pytest.mark.slow


def test_the_solution_gets_full_marks(tmp_path):
    assert_full_marks(LAB, grade_unchanged(SOLUTION, tmp_path))
