"""``fa-lab grade``: grade a submitted lab notebook, or a folder of them.

For one notebook, in this process: read its bytes once (the submission is never
opened for writing) and its lab id, draw the cases (public, plus hidden ones from
``seed``), and write into a fresh private folder the notebook, the cases'
arguments, the runner's tools (:data:`TOOLS`) and the lab's view of the package
(:mod:`~fa_lab.grading.view`: the exercises' answers, the labs' cases, judges and
solutions are not in it). :mod:`~fa_lab.grading.sandbox` runs the runner
(:mod:`~fa_lab.grading.runner`) on them and returns what it sent once every process
of the sandbox is gone. Only then are the replies read: validated and decoded
(:mod:`~fa_lab.grading.wire`, no pickle) and judged here, against references computed
here. Nothing the sandbox says about correctness is trusted; what it says can only
cost the submission points (an error, a forbidden call, a tensor over a case's limit).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat
import torch

from . import sandbox, wire
from .channel import Frame, FrameReader
from .check import GRADING_ENV, harness_cases, judge_cases, points, summary_hint
from .judge import forbidden_message
from .registry import Exercise, Lab, UnknownLab, get_lab
from .report import ExerciseReport, GradeReport, cell_label
from .view import plan_view, write_view

DEFAULT_TIMEOUT = 60.0
MAX_NOTEBOOK_BYTES = 64 << 20
TOOLS = ("runner", "kernel", "harness", "wire", "channel", "prelude")  # what the sandbox runs, as _fa_lab_grader
HIDDEN_ERRORS = ("HiddenWhileGrading:", "TorchAttentionHidden:")
_SANDBOX_ROOT = "/grading"
_OUTCOME_KEYS = {"outputs", "error", "forbidden", "largest"}


class GradingError(Exception):
    """The notebook could not be graded (unreadable, no lab id, unknown lab, no sandbox)."""


@dataclass(frozen=True)
class Options:
    """How to grade: seconds per cell, seconds for the whole notebook (restarts included), the
    sandbox's per-process limits, and whether to use the sandbox at all."""

    timeout: float = DEFAULT_TIMEOUT
    budget: float = sandbox.Limits.budget
    memory: int = sandbox.Limits.memory
    sandboxed: bool = True

    def limits(self) -> sandbox.Limits:
        return sandbox.Limits(budget=self.budget, memory=self.memory)


def read_lab_id(nb) -> str:
    """The lab id in the notebook's metadata (``{"fa_lab": {"lab": "lab01"}}``)."""
    meta = nb.metadata.get("fa_lab")
    lab_id = meta.get("lab") if isinstance(meta, dict) else None
    if not isinstance(lab_id, str):
        raise GradingError('no lab id in the notebook metadata (expected {"fa_lab": {"lab": "labNN"}}); '
                           "was the notebook started from fa-lab start or labs/?")
    return lab_id


def _read(path: Path):
    """(bytes, notebook) of the submission; raises GradingError."""
    try:
        with path.open("rb") as stream:
            data = stream.read(MAX_NOTEBOOK_BYTES + 1)
        if len(data) > MAX_NOTEBOOK_BYTES:
            raise ValueError(f"larger than {MAX_NOTEBOOK_BYTES >> 20} MiB")
        return data, nbformat.reads(data.decode("utf-8"), as_version=4)
    except Exception as exc:  # unreadable, not JSON, not a notebook
        raise GradingError(f"cannot read {path} as a notebook: {exc}") from exc


def _reply_limit(cases) -> int:
    """The most bytes a reply to these cases may take: eight times their tensors, plus 1 MiB."""
    def size(value):
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)):
            return sum(size(item) for item in value)
        return 0
    return (1 << 20) + 8 * sum(size(case.args) for case in cases)


def _package_copies() -> list[str]:
    """Every folder that `import fa_lab` could find: the view is mounted over each of them."""
    found = {str(Path(__file__).resolve().parents[1])}
    for entry in sys.path:
        candidate = Path(entry or ".") / "fa_lab"
        if (candidate / "__init__.py").is_file():
            found.add(str(candidate.resolve()))
    return sorted(found)


def _readable(folder: Path) -> None:
    """Let the sandbox's user read ``folder`` whatever this process's umask."""
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def _prepare(folder: Path, data: bytes, exercise_cases, guards, timeout: float) -> None:
    """Write in/ (the notebook, request.json, cases.pt) and tools/ into ``folder``."""
    inputs, tools = folder / "in", folder / "tools" / "_fa_lab_grader"
    inputs.mkdir()
    (inputs / "submission.ipynb").write_bytes(data)
    torch.save([{"function": e.function, "calling": e.calling, "cases": harness_cases(cases),
                 "forbidden": list(e.forbidden), "allowed": list(e.allowed)} for e, cases in exercise_cases],
               inputs / "cases.pt")
    (inputs / "request.json").write_text(json.dumps({"timeout": timeout, "exercises": [
        {"function": e.function, "guard": guard} for (e, _), guard in zip(exercise_cases, guards, strict=True)]}))
    tools.mkdir(parents=True)
    (tools / "__init__.py").write_text('"""fa_lab.grading\'s runner, as the grading sandbox runs it."""\n')
    for module in TOOLS:
        shutil.copyfile(Path(__file__).with_name(f"{module}.py"), tools / f"{module}.py")


def _binds(folder: Path, package: Path) -> list[tuple[str, str]]:
    """What the sandbox mounts, read-only: the runner's tools, the inputs, this Python, and the
    view in place of every copy of the package. Refuses a Python installation that holds the course."""
    trees = sandbox.python_trees()
    for tree in trees:
        if package.parent == Path(tree) or Path(tree) in package.parent.parents:
            raise GradingError(f"the Python installation {tree} holds the course ({package.parent}), so the "
                               "sandbox would show its solutions and tests: use a virtual environment outside "
                               "the course, or its .venv")
    binds = [(str(folder / "tools"), f"{_SANDBOX_ROOT}/tools"), (str(folder / "in"), f"{_SANDBOX_ROOT}/in")]
    binds += [(tree, tree) for tree in trees]
    return binds + [(str(folder / "view" / "fa_lab"), copy) for copy in _package_copies()]


def _guards(lab: Lab, exercise_cases, options: Options) -> list[bool]:
    """Per exercise: whether the in-process call guard watches it (without a sandbox, always; in one,
    only where the view must show a name the exercise forbids)."""
    if not options.sandboxed:
        return [True] * len(exercise_cases)
    unguarded = plan_view(lab, Path(__file__).resolve().parents[1]).unguarded
    return [bool(unguarded[e.name]) for e, _ in exercise_cases]


def _in_kernel_checks(exercise: Exercise, cases, guard: bool) -> list[str]:
    """The keys of :data:`~.report.IN_KERNEL_CHECKS` that this exercise's points rest on."""
    checks = ["tensor sizes"] if any(case.tensor_limit is not None for case in cases) else []
    return checks + (["call guard"] if guard else []) + ["torch attention"]


def _run(folder: Path, data: bytes, lab: Lab, exercise_cases, guards: list[bool], options: Options):
    """Run the notebook and the exercises (guards: :func:`_guards`); returns the sandbox's Outcome."""
    package = Path(__file__).resolve().parents[1]
    if options.sandboxed:
        write_view(lab, package, folder / "view" / "fa_lab")
    _prepare(folder, data, exercise_cases, guards, options.timeout)
    _readable(folder)
    limits = [_reply_limit(cases) for _, cases in exercise_cases]

    def payload_limit(header: dict) -> int:
        number = header.get("number")
        valid = header.get("type") == "exercise" and type(number) is int and 0 <= number < len(limits)
        return limits[number] if valid else 0

    reader = FrameReader(payload_limit, sum(limits) + (16 << 20))  # 16 MiB of headers: the cells' problems
    if not options.sandboxed:
        (folder / "tmp").mkdir()  # the runner's temporary folders go where the grader removes them
        env = {**os.environ, GRADING_ENV: "1", "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(folder / "tmp")}
        command = [sys.executable, "-m", "_fa_lab_grader.runner", str(folder / "in")]
        return sandbox.run(command, [], env, str(folder / "tools"), options.limits(), reader, sandboxed=False)
    env = sandbox.sandbox_env({"PYTHONPATH": str(package.parent)})
    command = [sys.executable, "-m", "_fa_lab_grader.runner", f"{_SANDBOX_ROOT}/in"]
    return sandbox.run(command, _binds(folder, package), env, f"{_SANDBOX_ROOT}/tools", options.limits(), reader)


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
                    and (r["largest"] is None or type(r["largest"]) is int)
                    for r in results))


def _failed(exercise: Exercise, cases, status: str, message: str) -> ExerciseReport:
    return ExerciseReport(exercise.name, exercise.function, 0.0, float(exercise.points), status,
                          cases=len(cases), messages=[message])


def _judged(exercise: Exercise, cases, frame: Frame | None, ended: str, budget_exceeded: bool) -> ExerciseReport:
    """:func:`_score`, where a reply that breaks the grader's own code costs that exercise only."""
    try:
        return _score(exercise, cases, frame, _reply_limit(cases), ended, budget_exceeded)
    except Exception as exc:  # a reply no judge foresaw: this exercise fails, the others are graded
        return _failed(exercise, cases, "failed", f"the grader could not judge what {exercise.function} "
                                                  f"returned ({type(exc).__name__}: {str(exc)[:200]}).")


def _score(exercise: Exercise, cases, frame: Frame | None, limit: int, ended: str,
           budget_exceeded: bool) -> ExerciseReport:
    """The report of one exercise from its frame (None: the run ended before it; ``ended`` says how)."""
    if frame is None:
        return _failed(exercise, cases, "timed out" if budget_exceeded else "failed",
                       f"{exercise.function} was not graded: {ended}.")
    header = frame.header
    if not header.get("replied"):
        error = str(header.get("error") or "no result")[:2000]
        if header.get("timed_out") is True:
            return _failed(exercise, cases, "timed out", f"{exercise.function} did not finish on the grader's "
                                                         f"cases: the call {error} (an endless loop?).")
        return _failed(exercise, cases, "failed", f"the grader could not run {exercise.function}: {error}.")
    if frame.payload is None:
        return _failed(exercise, cases, "failed", f"{exercise.function} returned more than the grader accepts "
                                                  f"for these cases ({frame.size} bytes; at most {limit}).")
    try:
        reply = wire.loads(frame.payload, limit)
    except wire.BadReply as exc:
        return _failed(exercise, cases, "failed", f"the grader could not read what {exercise.function} "
                                                  f"returned: {exc}.")
    if not _valid_reply(reply, len(cases)):
        return _failed(exercise, cases, "failed", f"the grader could not read what {exercise.function} "
                                                  "returned: the reply does not have the expected form.")
    report = ExerciseReport(exercise.name, exercise.function, 0.0, float(exercise.points), "graded",
                            cases=len(cases))
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


def _how_it_ended(outcome, options: Options) -> str:
    if outcome.budget_exceeded:
        return f"the notebook's time budget ({options.budget:g} s, restarts included) ran out"
    if outcome.broken:
        return f"the sandbox's output broke the grader's rules ({outcome.broken})"
    return f"the notebook's processes ended before grading finished (exit status {outcome.exit_status})"


def grade_notebook(path, seed: int = 0, options: Options = Options()) -> GradeReport:
    """Grade one submission; raises :class:`GradingError` when it cannot be graded at all."""
    path = Path(path)
    data, nb = _read(path)
    try:
        lab = get_lab(read_lab_id(nb))
    except UnknownLab as exc:
        raise GradingError(str(exc)) from exc
    exercise_cases = [(e, e.cases(seed)) for e in lab.exercises]
    guards = _guards(lab, exercise_cases, options)
    with tempfile.TemporaryDirectory(prefix="fa-lab-grade-") as tmp:
        try:
            outcome = _run(Path(tmp), data, lab, exercise_cases, guards, options)
        except sandbox.SandboxUnavailable as exc:
            raise GradingError(f"no sandbox on this machine: {exc}") from None
        except GradingError:
            raise
        except Exception as exc:  # the sandbox could not be started or torn down: not graded
            raise GradingError(f"grading {path} failed: {type(exc).__name__}: {exc}") from exc
    frames = outcome.frames
    if not any(f.header.get("type") == "started" for f in frames) and not outcome.budget_exceeded:
        raise GradingError(f"grading {path} failed: no kernel could be started in the sandbox (each of its "
                           f"processes may map {options.memory / (1 << 30):g} GiB: --memory raises that); the "
                           f"runner's last output was:\n{outcome.stderr.strip()[-2000:]}")
    problems = {f.header["index"]: str(f.header.get("problem"))[:4000] for f in frames
                if f.header.get("type") == "cell" and type(f.header.get("index")) is int}
    replies = {}
    for frame in frames:
        number = frame.header.get("number")
        if frame.header.get("type") == "exercise" and type(number) is int:
            replies.setdefault(number, frame)
    finished = any(f.header.get("type") == "done" for f in frames)
    ended = "" if finished else _how_it_ended(outcome, options)
    reports = [_judged(e, cases, replies.get(n), ended, outcome.budget_exceeded)
               for n, (e, cases) in enumerate(exercise_cases)]
    for report, (exercise, cases), guard in zip(reports, exercise_cases, guards, strict=True):
        report.in_kernel_checks = _in_kernel_checks(exercise, cases, guard)
    errors, hidden = [], []
    for index, problem in sorted(problems.items()):
        line = f"{cell_label(nb.cells, index)}: {problem}"
        (hidden if problem.startswith(HIDDEN_ERRORS) else errors).append(line)
    if ended:
        errors.append(ended)
    score = round(sum(r.points for r in reports), 2)
    return GradeReport(str(path), lab.id, seed, score, lab.max_score, reports, errors, hidden, options.sandboxed)


def find_notebooks(folder) -> list[Path]:
    """Every .ipynb under ``folder`` (checkpoints excluded), sorted."""
    return sorted(p for p in Path(folder).rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def lab_exercises(paths) -> list[str]:
    """The exercise names of every lab that these notebooks name (for a CSV header), in lab order."""
    ids = set()
    for path in paths:
        try:
            ids.add(read_lab_id(_read(Path(path))[1]))
        except GradingError:
            continue
    names = []
    for lab_id in sorted(ids):
        try:
            names += [e.name for e in get_lab(lab_id).exercises if e.name not in names]
        except UnknownLab:
            continue
    return names


def grade_folder(folder, seed: int = 0, options: Options = Options(), progress: bool = True, on_result=None):
    """Grade every notebook under ``folder``, each in its own sandbox, one after another.

    Returns a list of (path, GradeReport or error message); ``on_result(path, result)`` is
    called as each notebook is done (the CLI appends its CSV row then).
    """
    from tqdm import tqdm

    results = []
    for path in tqdm(find_notebooks(folder), desc="grading", unit="notebook", disable=not progress):
        try:
            result = grade_notebook(path, seed, options)
        except GradingError as exc:
            result = str(exc)
        results.append((path, result))
        if on_result:
            on_result(path, result)
    return results

