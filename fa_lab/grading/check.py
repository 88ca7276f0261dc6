"""``check(name, fn)``: run an exercise's public cases in the learner's notebook and explain.

Also the pieces the grader shares: judging a list of harness outcomes and
turning verdicts into points.
"""
from __future__ import annotations

import os
import textwrap

from . import harness
from .registry import Case, Exercise, Verdict, find_exercise

GRADING_ENV = "FA_LAB_GRADING"  # set in the grading kernel: the notebook's own check() calls do nothing


def judge_cases(exercise: Exercise, cases: list[Case], outcomes: list[dict]) -> list[tuple[Case, Verdict]]:
    """Each case with the verdict on its outcome (outcomes from :func:`harness.run_cases`)."""
    return [(case, exercise.judge(case, outcome)) for case, outcome in zip(cases, outcomes, strict=True)]


def harness_cases(cases: list[Case]) -> list[tuple]:
    """The cases as :func:`harness.run_cases` takes them: (args, whether to probe tensor sizes)."""
    return [(c.args, c.tensor_limit is not None) for c in cases]


def run_exercise(exercise: Exercise, fn, cases: list[Case]) -> list[tuple[Case, Verdict]]:
    """Run ``fn`` on ``cases`` in this process (forbidden calls watched) and judge each one."""
    outcomes = harness.run_cases(fn, exercise.calling, harness_cases(cases),
                                 exercise.forbidden, exercise.allowed)
    return judge_cases(exercise, cases, outcomes)


def summary_hint(exercise: Exercise, results: list[tuple[Case, Verdict]]) -> str | None:
    return exercise.summarize(results) if exercise.summarize else None


def points(exercise: Exercise, results: list[tuple[Case, Verdict]]) -> float:
    """The exercise's points times the share of cases that pass, rounded to 0.01."""
    if not results:
        return 0.0
    passed = sum(verdict.passed for _, verdict in results)
    return round(exercise.points * passed / len(results), 2)


def format_results(results: list[tuple[Case, Verdict]], width: int = 100) -> str:
    """One line per case, ``ok`` or ``FAIL`` and its name, with the diagnosis wrapped under a failure."""
    lines = []
    for case, verdict in results:
        lines.append(f"  {'ok  ' if verdict.passed else 'FAIL'}  {case.name}")
        if not verdict.passed:
            lines += textwrap.wrap(verdict.message, width, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return "\n".join(lines)


def check(name: str, fn) -> None:
    """Check your function for exercise ``name`` on the public cases and print what went wrong.

    Prints, per case, ok or FAIL with a diagnosis (which invariant broke, where the
    largest error is). The grader runs the same checks plus hidden cases.
    """
    if os.environ.get(GRADING_ENV):
        print(f"check({name!r}) skipped: the grader runs its own cases.")
        return
    exercise = find_exercise(name)
    results = run_exercise(exercise, fn, exercise.cases())
    passed = sum(verdict.passed for _, verdict in results)
    print(f"{name}: {len(results)} public cases")
    print(format_results(results))
    if passed == len(results):
        print(f"All {passed} cases pass. Grading adds hidden cases (other shapes, dtypes and values).")
    else:
        hint = summary_hint(exercise, results)
        print(f"{passed} of {len(results)} cases pass." + (f" {hint}" if hint else ""))
