"""``fa-lab grade``: grade a submitted lab notebook, or a folder of them.

For one notebook: read the lab id from its metadata, copy it into a temporary
folder (the submission is never opened for writing), run the copy in a fresh
kernel (:class:`~fa_lab.grading.kernel.KernelSession`, a time limit per cell),
then for each exercise ship the grader's cases (public, plus hidden ones drawn
from ``seed``) to the kernel, call the learner's function there through
:mod:`~fa_lab.grading.harness`, and judge what comes back in this process.
Nothing the kernel computes about correctness is trusted: it only returns the
learner's outputs, which are loaded with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import asyncio
import csv
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat
import torch

from . import harness
from .check import GRADING_ENV, harness_cases, judge_cases, points, summary_hint
from .judge import forbidden_message
from .kernel import KernelSession
from .registry import Exercise, Lab, UnknownLab, get_lab

DEFAULT_TIMEOUT = 60.0

# Loads the harness by path, so that a submission that patched fa_lab cannot replace it.
_SNIPPET = """\
def _fa_lab_grade():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_fa_lab_grading_harness", {harness!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.serve(globals(), {request!r}, {result!r})
_fa_lab_grade()
del _fa_lab_grade
"""
_OUTCOME_KEYS = {"outputs", "error", "forbidden", "largest"}


class GradingError(Exception):
    """The notebook could not be graded (unreadable, no lab id, unknown lab)."""


@dataclass
class ExerciseReport:
    """Points of one exercise. status: graded, forbidden, missing, not callable, timed out or failed."""

    name: str
    function: str
    points: float
    max_points: float
    status: str
    passed: int = 0
    cases: int = 0
    messages: list[str] = field(default_factory=list)


@dataclass
class GradeReport:
    notebook: str
    lab: str
    seed: int
    score: float
    max_score: float
    exercises: list[ExerciseReport]
    notebook_errors: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def read_lab_id(nb) -> str:
    """The lab id in the notebook's metadata (``{"fa_lab": {"lab": "lab01"}}``)."""
    meta = nb.metadata.get("fa_lab")
    lab_id = meta.get("lab") if isinstance(meta, dict) else None
    if not isinstance(lab_id, str):
        raise GradingError('no lab id in the notebook metadata (expected {"fa_lab": {"lab": "labNN"}}); '
                           "was the notebook started from fa-lab start or labs/?")
    return lab_id


def _valid_reply(reply, count: int) -> bool:
    if not isinstance(reply, dict) or reply.get("status") not in ("ran", "missing", "not callable"):
        return False
    results = reply.get("results")
    if reply["status"] != "ran":
        return True
    return (isinstance(results, list) and len(results) == count
            and all(isinstance(r, dict) and set(r) == _OUTCOME_KEYS
                    and (r["error"] is None or isinstance(r["error"], str))
                    and isinstance(r["forbidden"], list) and all(isinstance(f, str) for f in r["forbidden"])
                    and (r["largest"] is None or isinstance(r["largest"], int))
                    for r in results))


def _load_reply(path: Path, count: int):
    try:
        reply = torch.load(path, weights_only=True)
    except Exception:  # missing, truncated, or not a plain-data file: the call did not complete
        return None
    return reply if _valid_reply(reply, count) else None


def _score(exercise: Exercise, cases, reply, run) -> ExerciseReport:
    report = ExerciseReport(exercise.name, exercise.function, 0.0, float(exercise.points), "graded",
                            cases=len(cases))
    if reply is None:
        if run.timed_out:
            report.status = "timed out"
            report.messages = [f"{exercise.function} did not finish on the grader's cases: the call "
                               f"{run.error} (an endless loop?)."]
        else:
            report.status = "failed"
            report.messages = [f"the grader could not run {exercise.function}: {run.error or 'no result'}."]
        return report
    if reply["status"] != "ran":
        report.status = reply["status"]
        what = "not defined" if reply["status"] == "missing" else "not callable"
        report.messages = [f"{exercise.function} is {what} after the notebook ran (was it renamed or "
                           "deleted, or did its cell fail?)."]
        return report
    forbidden = sorted({call for outcome in reply["results"] for call in outcome["forbidden"]})
    if forbidden:
        report.status = "forbidden"
        report.messages = [forbidden_message(forbidden)]
        return report
    results = judge_cases(exercise, cases, reply["results"])
    report.points = points(exercise, results)
    report.passed = sum(v.passed for _, v in results)
    hint = summary_hint(exercise, results) if report.passed < len(results) else None
    report.messages = ([hint] if hint else []) + _grouped_diagnoses(results)
    return report


def _grouped_diagnoses(results) -> list[str]:
    """One line per distinct diagnosis, naming the first case that got it and how many others did."""
    cases_by_message: dict[str, list] = {}
    for case, verdict in results:
        if not verdict.passed:
            cases_by_message.setdefault(verdict.message, []).append(case)
    lines = []
    for message, cases in cases_by_message.items():
        first = f"{'hidden' if cases[0].hidden else 'public'} case {cases[0].name}"
        more = f" (and {len(cases) - 1} more cases)" if len(cases) > 1 else ""
        lines.append(f"{first}{more}: {message}")
    return lines


async def _grade_exercise(session: KernelSession, exercise: Exercise, seed: int, folder: Path,
                          number: int) -> ExerciseReport:
    cases = exercise.cases(seed)
    request_path, result_path = folder / f"request_{number}.pt", folder / f"result_{number}.pt"
    torch.save({"function": exercise.function, "calling": exercise.calling, "cases": harness_cases(cases),
                "forbidden": list(exercise.forbidden), "allowed": list(exercise.allowed)}, request_path)
    run = await session.run_snippet(_SNIPPET.format(harness=harness.__file__, request=str(request_path),
                                                    result=str(result_path)))
    return _score(exercise, cases, _load_reply(result_path, len(cases)), run)


async def _grade_copy(nb, lab: Lab, seed: int, timeout: float, folder: Path):
    async with KernelSession(nb, str(folder), timeout, env={GRADING_ENV: "1"}) as session:
        await session.run_notebook()
        reports = [await _grade_exercise(session, exercise, seed, folder, number)
                   for number, exercise in enumerate(lab.exercises)]
    errors = [f"cell {index + 1}: {problem}" for index, problem in sorted(session.problems.items())]
    return reports, errors


def grade_notebook(path, seed: int = 0, timeout: float = DEFAULT_TIMEOUT) -> GradeReport:
    """Grade one submission; raises :class:`GradingError` when it cannot be graded at all."""
    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="fa-lab-grade-") as tmp:
        folder = Path(tmp)
        copy = folder / "submission.ipynb"
        try:
            shutil.copyfile(path, copy)
            nb = nbformat.read(copy, as_version=4)
        except Exception as exc:
            raise GradingError(f"cannot read {path}: {exc}") from exc
        try:
            lab = get_lab(read_lab_id(nb))
        except UnknownLab as exc:
            raise GradingError(str(exc)) from exc
        try:
            reports, errors = asyncio.run(_grade_copy(nb, lab, seed, timeout, folder))
        except Exception as exc:  # no kernel could be started or kept: the notebook is not graded
            raise GradingError(f"grading {path} failed: {type(exc).__name__}: {exc}") from exc
    score = round(sum(r.points for r in reports), 2)
    return GradeReport(str(path), lab.id, seed, score, lab.max_score, reports, errors)


def find_notebooks(folder) -> list[Path]:
    """Every .ipynb under ``folder`` (checkpoints excluded), sorted."""
    return sorted(p for p in Path(folder).rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def grade_folder(folder, seed: int = 0, timeout: float = DEFAULT_TIMEOUT, progress: bool = True):
    """Grade every notebook under ``folder``: a list of (path, GradeReport or error message)."""
    from tqdm import tqdm

    results = []
    for path in tqdm(find_notebooks(folder), desc="grading", unit="notebook", disable=not progress):
        try:
            results.append((path, grade_notebook(path, seed, timeout)))
        except GradingError as exc:
            results.append((path, str(exc)))
    return results


def write_csv(results, stream, base=None) -> None:
    """One row per submission: file, lab, score, max_score, the points of each exercise, error."""
    exercise_names = []
    for _, report in results:
        if isinstance(report, GradeReport):
            exercise_names += [e.name for e in report.exercises if e.name not in exercise_names]
    writer = csv.writer(stream)
    writer.writerow(["file", "lab", "score", "max_score", *exercise_names, "error"])
    for path, report in results:
        name = str(Path(path).relative_to(base)) if base else str(path)
        if isinstance(report, GradeReport):
            earned = {e.name: e.points for e in report.exercises}
            writer.writerow([name, report.lab, report.score, report.max_score,
                             *(earned.get(n, "") for n in exercise_names), ""])
        else:
            writer.writerow([name, "", "", "", *([""] * len(exercise_names)), report])
