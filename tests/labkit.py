"""Helpers the lab tests share: run a solution notebook's code (with edits, for mutants), run an
exercise's cases in-process, judge a mutant's diagnoses, and grade a notebook through the CLI.

:class:`LabChecks` holds what every ``tests/test_labNN_checks.py`` repeats: the lab, its solution
notebook, how to run the solution's cells, and the two checks (the solution passes; a mutant fails
with its diagnosis).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import linecache
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import nbformat
import pytest

from fa_lab import cli
from fa_lab.grading.check import run_exercise, summary_hint
from fa_lab.grading.registry import Lab, get_lab

ROOT = Path(__file__).resolve().parents[1]
_sources = itertools.count()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def code_cells(notebook: Path) -> list[str]:
    """The sources of a notebook's code cells."""
    return [c.source for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code"]


def solution_cells(notebook: Path) -> list[str]:
    """The code cells that hold a solution region."""
    return [source for source in code_cells(notebook) if "# BEGIN SOLUTION" in source]


def run_sources(sources, edits=(), function=None, prelude="") -> dict:
    """Execute ``sources`` (after ``prelude``) in a fresh namespace and return it.

    edits: (old, new) pairs applied to the cell that defines ``function``, or
    (name, old, new) triples applied to the cell that defines ``name``; each must apply once.
    The code is registered with linecache, since @triton.jit reads a function's source.
    """
    sources = list(sources)
    for edit in edits:
        name, old, new = edit if len(edit) == 3 else (function, *edit)
        [index] = [i for i, source in enumerate(sources)
                   if f"def {name}(" in source or f"class {name}(" in source]
        assert sources[index].count(old) == 1, f"edit does not apply once: {old!r}"
        sources[index] = sources[index].replace(old, new)
    source = prelude + "\n\n".join(sources)
    filename = f"<solution {next(_sources)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def exercise_results(exercise, namespace, seeds=(), public=True):
    """(case, verdict) pairs of the exercise's public cases and the hidden cases of ``seeds``."""
    cases = exercise.cases() if public else []
    for seed in seeds:
        cases += exercise.hidden(seed)
    return run_exercise(exercise, namespace[exercise.function], cases)


def assert_no_failures(results) -> None:
    failures = [f"{case.name}: {verdict.message}" for case, verdict in results if not verdict.passed]
    assert not failures, "\n".join(failures)


def assert_diagnosed(exercise, results, mistake: str, words: str, hint_speaks_for_each_case=False,
                     never: tuple[str, ...] = ()):
    """A mutant fails some case, and the diagnosis names ``words`` for most of its failing cases.

    With ``hint_speaks_for_each_case`` a summary hint that names the mistake counts for every
    failing case (it is only given when they all share its cause); otherwise it counts once.
    never: words that no diagnosis and no hint may say (a cause this mistake is not).
    Returns the failing (case, verdict) pairs.
    """
    failing = [(case, verdict) for case, verdict in results if not verdict.passed]
    assert failing, f"every case passes with the mistake: {mistake}"
    hint = summary_hint(exercise, results)
    hint_names = bool(hint) and words in hint
    if hint_speaks_for_each_case:
        named = [v.message for _, v in failing if words in v.message or hint_names]
    else:
        named = [v.message for _, v in failing if words in v.message] + ([hint] if hint_names else [])
    report = "\n".join(f"{c.name}: {v.message}" for c, v in failing) + f"\nhint: {hint}"
    assert named, f"no diagnosis says {words!r}:\n{report}"
    # The diagnosis names this mistake for most of the failing cases, not by luck on one.
    assert len(named) >= len(failing) / 2, report
    for wrong in never:
        assert all(wrong not in text for text in [v.message for _, v in failing] + [hint or ""]), report
    return failing


@dataclass(frozen=True)
class Mutant:
    """A typical wrong solution: the solution's code with ``edits`` (see :func:`run_sources`), which the
    checks of ``exercise`` must reject with a diagnosis that says ``words`` (and none that says a word
    of ``never``). seeds: the hidden cases' seeds (None: the lab's default); public: run the public
    cases too."""

    exercise: str
    mistake: str
    edits: list
    words: str
    seeds: tuple[int, ...] | None = None
    public: bool = True
    never: tuple[str, ...] = ()


def mutant_params(mutants: list[Mutant]) -> list:
    """The mutants as pytest parameters, named by their mistake."""
    return [pytest.param(m, id=m.mistake) for m in mutants]


@dataclass(frozen=True)
class LabChecks:
    """One lab's checks as the tests run them: its solution's cells (``cells`` picks them from the
    notebook, after ``prelude``), run fresh for each namespace, and its exercises' cases."""

    lab_id: str
    prelude: str = ""
    cells: Callable[[Path], list[str]] = solution_cells
    seeds: tuple[int, ...] = (11, 12)  # the hidden cases a mutant runs by default

    @property
    def lab(self) -> Lab:
        return get_lab(self.lab_id)

    @property
    def solution(self) -> Path:
        return ROOT / "solutions" / self.lab.notebook

    @property
    def exercise_names(self) -> list[str]:
        return [e.name for e in self.lab.exercises]

    def exercise(self, name: str):
        [exercise] = [e for e in self.lab.exercises if e.name == name]
        return exercise

    def namespace(self, edits=(), function=None) -> dict:
        """Run the solution's cells (edited, for a mutant) and return the namespace."""
        return run_sources(self.cells(self.solution), edits, function, prelude=self.prelude)

    def results(self, name: str, namespace: dict, seeds=(), public=True):
        return exercise_results(self.exercise(name), namespace, seeds, public)

    def assert_solution_passes(self, name: str, seeds=(3, 4, 5)) -> None:
        assert_no_failures(self.results(name, self.namespace(), seeds))

    def assert_mutant_diagnosed(self, mutant: Mutant, hint_speaks_for_each_case=False):
        """The mutant fails with its diagnosis; returns the failing (case, verdict) pairs."""
        exercise = self.exercise(mutant.exercise)
        namespace = self.namespace(mutant.edits, exercise.function)
        seeds = self.seeds if mutant.seeds is None else mutant.seeds
        results = self.results(mutant.exercise, namespace, seeds, mutant.public)
        return assert_diagnosed(exercise, results, mutant.mistake, mutant.words, hint_speaks_for_each_case,
                                mutant.never)


def grade_json(path: Path, tmp_path: Path, *extra) -> tuple[int, dict]:
    """``fa-lab grade PATH --seed 7 --json FILE``: (exit status, report)."""
    out = tmp_path / f"{path.stem}.json"
    status = cli.main(["grade", str(path), "--seed", "7", "--json", str(out), *extra])
    return status, json.loads(out.read_text())


def grade_unchanged(path: Path, tmp_path: Path) -> dict:
    """Grade ``path`` (``grade_json``), asserting that grading worked and left the submission as it was."""
    before = digest(path)
    status, report = grade_json(path, tmp_path)
    assert status == 0
    assert digest(path) == before, "grading changed the submission"
    return report


def assert_full_marks(lab, report: dict) -> None:
    """The report of ``lab``'s solution: every exercise, every case passed, nothing else said."""
    assert report["lab"] == lab.id and report["score"] == report["max_score"] == 10
    assert [e["name"] for e in report["exercises"]] == [e.name for e in lab.exercises]
    for exercise in report["exercises"]:
        assert exercise["points"] == exercise["max_points"] and exercise["messages"] == []
        assert exercise["passed"] == exercise["cases"] > 1
    assert report["notebook_errors"] == []

