"""What grading reports: points per exercise, the notebook's problems, and the CSV of a folder.

Cells are named the way a learner can find them: ``cell 14 of 31`` counts every cell
from the top of the notebook, starting at 1, markdown cells included, and the label
quotes the cell's first line.

The CSV has one row per notebook: file, lab, score, max_score, the points of each
exercise, ``diagnosis`` (the first message of each exercise short of full marks)
and ``error`` (why the notebook could not be graded, or the cells that raised).
"""
from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The checks that can only run in the learner's process, because they ask how an answer is computed,
# not what it is (docs/design.md, section 7, says why no outside measurement can take their place).
IN_KERNEL_CHECKS = {
    "tensor sizes": "the largest tensor the function creates (the tiles-only and online cases)",
    "call guard": "calls of course functions that the exercise forbids but the sandbox must show",
    "torch attention": "torch's own attention operators, made to raise in the kernel",
}
CELL_NUMBERING = "cells are counted from 1 at the top of the notebook, markdown cells included"
CSV_FIXED = ("file", "lab", "score", "max_score")
CSV_TRAILING = ("diagnosis", "error")


@dataclass
class ExerciseReport:
    """Points of one exercise. status: graded, forbidden, missing, not callable, timed out or failed.
    in_kernel_checks: the checks behind its points that ran in the notebook's own kernel
    (:data:`IN_KERNEL_CHECKS`), which a notebook written to fool them can."""

    name: str
    function: str
    points: float
    max_points: float
    status: str
    passed: int = 0
    cases: int = 0
    messages: list[str] = field(default_factory=list)
    in_kernel_checks: list[str] = field(default_factory=list)


@dataclass
class GradeReport:
    """One notebook's grade. notebook_errors: the cells that raised, timed out or killed the kernel,
    and how the run ended when it ended early. hidden_calls: cells stopped by something grading hides
    (an exercise's answer; expected in a demonstration cell). sandboxed: graded in the sandbox."""

    notebook: str
    lab: str
    seed: int
    score: float
    max_score: float
    exercises: list[ExerciseReport]
    notebook_errors: list[str]
    hidden_calls: list[str] = field(default_factory=list)
    sandboxed: bool = True
    cell_numbering: str = CELL_NUMBERING

    def to_dict(self) -> dict:
        return asdict(self)


def cell_label(cells, index: int) -> str:
    """``cell 14 of 31 (it starts "q, k, v = make_qkv(...")``; cells: the notebook's cells."""
    lines = [line.strip() for line in cells[index].source.splitlines() if line.strip()] \
        if 0 <= index < len(cells) else []
    start = lines[0] if lines else ""
    start = start if len(start) <= 50 else start[:47] + "..."
    return f"cell {index + 1} of {len(cells)}" + (f' (it starts "{start}")' if start else "")


def diagnosis(report: GradeReport) -> str:
    """The first message of each exercise short of full marks, one clause each."""
    return " | ".join(f"{e.name}: {e.messages[0]}" for e in report.exercises
                      if e.points < e.max_points and e.messages)


def csv_header(exercise_names) -> list[str]:
    return [*CSV_FIXED, *exercise_names, *CSV_TRAILING]


def csv_row(path, report, exercise_names, base=None) -> list:
    """The row of one notebook: ``report`` is its GradeReport or the message saying why it was not graded."""
    name = str(Path(path).relative_to(base)) if base else str(path)
    if not isinstance(report, GradeReport):
        return [name, "", "", "", *([""] * len(exercise_names)), "", report]
    earned = {e.name: e.points for e in report.exercises}
    return [name, report.lab, report.score, report.max_score, *(earned.get(n, "") for n in exercise_names),
            diagnosis(report), "; ".join(report.notebook_errors)]


def write_csv(results, stream, base=None) -> None:
    """The CSV of ``results``, a list of (path, GradeReport or error message)."""
    exercise_names = []
    for _, report in results:
        if isinstance(report, GradeReport):
            exercise_names += [e.name for e in report.exercises if e.name not in exercise_names]
    writer = csv.writer(stream)
    writer.writerow(csv_header(exercise_names))
    for path, report in results:
        writer.writerow(csv_row(path, report, exercise_names, base))
