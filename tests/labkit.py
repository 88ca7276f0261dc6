"""Helpers the lab tests share: run a solution notebook's code (with edits, for mutants), run an
exercise's cases in-process, judge a mutant's diagnoses, and grade a notebook through the CLI."""
from __future__ import annotations

import hashlib
import itertools
import json
import linecache
from pathlib import Path

import nbformat

from fa_lab import cli
from fa_lab.grading.check import run_exercise, summary_hint

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
        cases += [c for c in exercise.cases(seed) if c.hidden]
    return run_exercise(exercise, namespace[exercise.function], cases)


def assert_no_failures(results) -> None:
    failures = [f"{case.name}: {verdict.message}" for case, verdict in results if not verdict.passed]
    assert not failures, "\n".join(failures)


def assert_diagnosed(exercise, results, mistake: str, words: str, hint_speaks_for_each_case=False):
    """A mutant fails some case, and the diagnosis names ``words`` for most of its failing cases.

    With ``hint_speaks_for_each_case`` a summary hint that names the mistake counts for every
    failing case (it is only given when they all share its cause); otherwise it counts once.
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
    return failing


def grade_json(path: Path, tmp_path: Path, *extra) -> tuple[int, dict]:
    """``fa-lab grade PATH --seed 7 --json FILE``: (exit status, report)."""
    out = tmp_path / f"{path.stem}.json"
    status = cli.main(["grade", str(path), "--seed", "7", "--json", str(out), *extra])
    return status, json.loads(out.read_text())
