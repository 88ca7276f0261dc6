"""The ``fa-lab`` command: assign, start, grade, doctor, bench.

Parsing and printing only; the work is done in :mod:`fa_lab.grading` and
:mod:`fa_lab.bench`, imported when a subcommand needs them (the GPU machine has
no nbformat or nbclient, and ``fa-lab doctor`` must run there).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib import metadata
from pathlib import Path

from .argtypes import output_file, positive_float

GRADING_FAILED = 2  # exit status when a submission could not be graded at all
INTERRUPTED = 130  # exit status after Ctrl-C, as a shell reports a process ended by SIGINT


def _assign(args) -> int:
    from .grading.assign import AssignError, assign, orphan_labs

    try:
        stale = assign(check=args.check, prune=args.prune)
        orphans = [] if args.prune else orphan_labs()
    except (AssignError, FileNotFoundError) as exc:
        print(f"fa-lab assign: {exc}", file=sys.stderr)
        return 1
    for path in stale:
        print(f"out of date: {path} (run fa-lab assign{' --prune' if args.prune else ''})" if args.check
              else f"{'wrote' if path.exists() else 'removed'} {path}")
    for path in orphans:
        print(f"no solution for {path}: fa-lab assign --prune removes it", file=sys.stderr)
    if not (args.check or stale or orphans):
        print("labs/ is up to date")
    return 1 if (args.check and stale) or orphans else 0


def _start(args) -> int:
    from .grading.assign import start
    from .grading.registry import UnknownLab

    try:
        path = start(args.lab, force=args.force)
    except (UnknownLab, FileExistsError, FileNotFoundError) as exc:
        print(f"fa-lab start: {exc}", file=sys.stderr)
        return 1
    print(f"copied {args.lab} to {path}\nopen it in JupyterLab (make lab) and run it top to bottom")
    return 0


def _print_report(report) -> None:
    from .grading.report import CELL_NUMBERING, IN_KERNEL_CHECKS

    print(f"{report.notebook}: {report.lab}, seed {report.seed}"
          + ("" if report.sandboxed else " (graded without a sandbox)"))
    if report.notebook_errors or report.hidden_calls:
        print(f"  ({CELL_NUMBERING})")
    for error in report.notebook_errors:
        print(f"  notebook: {error}")
    for call in report.hidden_calls:
        print(f"  note: {call} (fine in a cell that only demonstrates)")
    for exercise in report.exercises:
        graded = exercise.status == "graded"
        outcome = f"{exercise.passed}/{exercise.cases} cases" if graded else exercise.status
        print(f"  {exercise.name:<20} {exercise.points:5.2f} / {exercise.max_points:g}   {outcome}")
        for message in exercise.messages[:3]:
            print(f"      {message}")
        if len(exercise.messages) > 3:
            print(f"      ... and {len(exercise.messages) - 3} more (see --json)")
    checks = [name for name in IN_KERNEL_CHECKS
              if any(name in e.in_kernel_checks and e.points > 0 for e in report.exercises)]
    if checks:
        print("  note: these checks ran in the notebook's own kernel, so a notebook written to fool them "
              "could: " + "; ".join(f"{name} ({IN_KERNEL_CHECKS[name]})" for name in checks))
    print(f"score {report.score:.2f} / {report.max_score:g}")


def _grade_options(args):
    from .grading.grade import Options

    given = {"timeout": args.timeout, "budget": args.budget,
             "memory": None if args.memory is None else int(args.memory * (1 << 30))}
    return Options(sandboxed=not args.no_sandbox, **{k: v for k, v in given.items() if v is not None})


def _grade_folder(path: Path, notebooks: list[Path], args, options) -> int:
    import csv

    from .grading.grade import grade_folder, lab_exercises
    from .grading.report import csv_header, csv_row

    names = lab_exercises(notebooks)
    stream = open(args.csv, "w", newline="", encoding="utf-8") if args.csv else sys.stdout
    try:
        writer = csv.writer(stream)
        writer.writerow(csv_header(names))
        stream.flush()

        def append(notebook, result):  # each row as soon as its notebook is done
            writer.writerow(csv_row(notebook, result, names, base=path))
            stream.flush()

        results = grade_folder(path, args.seed, options, on_result=append)
    finally:
        if stream is not sys.stdout:
            stream.close()
    failed = [p for p, report in results if isinstance(report, str)]
    print(f"graded {len(results) - len(failed)} of {len(results)} notebooks", file=sys.stderr)
    return GRADING_FAILED if failed or not results else 0


def _grade(args) -> int:
    from .grading.grade import GradingError, grade_notebook
    from .grading.report import write_csv
    from .grading.sandbox import NO_SANDBOX_WARNING, unavailable_reason

    path = Path(args.path)
    if path.is_dir() and args.json:
        print("fa-lab grade: --json takes one notebook; use --csv for a folder", file=sys.stderr)
        return GRADING_FAILED
    notebooks = None
    if path.is_dir():
        from .grading.grade import find_notebooks
        notebooks = find_notebooks(path)
        if not notebooks:
            print(f"fa-lab grade: no .ipynb files under {path}", file=sys.stderr)
            return GRADING_FAILED
    options = _grade_options(args)
    if options.sandboxed and unavailable_reason():
        print(f"fa-lab grade: no sandbox on this machine: {unavailable_reason()}", file=sys.stderr)
        return GRADING_FAILED
    if not options.sandboxed:
        print(f"fa-lab grade: warning: {NO_SANDBOX_WARNING}", file=sys.stderr)
    if notebooks is not None:
        return _grade_folder(path, notebooks, args, options)
    try:
        report = grade_notebook(path, args.seed, options)
    except GradingError as exc:
        print(f"fa-lab grade: {exc}", file=sys.stderr)
        return GRADING_FAILED
    _print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    if args.csv:
        with open(args.csv, "w", newline="", encoding="utf-8") as stream:
            write_csv([(path, report)], stream)
    return 0


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _doctor(args) -> int:
    import torch

    from . import __version__
    from .grading.sandbox import unavailable_reason
    from .kernels import interpreting

    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if cuda else None
    capability = torch.cuda.get_device_capability(0) if cuda else None
    triton = _version("triton")
    if triton is None:
        mode, kernels = None, "cannot run: Triton is missing (it publishes Linux wheels only; see README.md)"
    elif cuda and not interpreting():
        mode, kernels = "compiled", f"compiled for {gpu}"
    else:
        mode, kernels = "interpreted", "interpreted (Triton's interpreter on CPU tensors: small shapes, slow)"
    hopper = capability is not None and capability[0] == 9  # sm_90: H100, H200
    no_sandbox = unavailable_reason()
    rows = [
        ("python", f"{platform.python_version()} ({platform.system()} {platform.machine()})"),
        ("fa_lab", __version__),
        ("torch", torch.__version__),
        ("triton", triton or "missing"),
        ("kernels", kernels),
        ("CUDA", f"{torch.version.cuda} (GPU: {gpu}, compute capability "
                 f"{capability[0]}.{capability[1]})" if cuda else "not available"),
        ("chapters", "00-02 and their labs (CPU track): yes"),
        ("", f"03 on (Triton kernels): {f'yes, {mode}' if mode else 'no, Triton is missing'}"),
        ("", "Hopper sections (FlashAttention-3 kernels, live benchmarks): "
             + ("yes" if hopper else "recorded H200 results only (live runs need a Hopper GPU, sm_90)")),
        ("grading", "fa-lab grade runs notebooks in a bubblewrap sandbox" if no_sandbox is None
         else f"no sandbox, so fa-lab grade refuses: {no_sandbox}"),
    ]
    for name, value in rows:
        print(f"{name:<10}{value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .grading.sandbox import Limits  # the standard library only: light enough for every command

    parser = argparse.ArgumentParser(prog="fa-lab", description="FlashAttention Lab: labs, grading, checks.")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("assign", help="write labs/ from solutions/")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if labs/ is out of date")
    p.add_argument("--prune", action="store_true", help="also remove the labs that have no solution (kept, "
                   "and named, without it)")
    p.set_defaults(handler=_assign)

    p = commands.add_parser("start", help="copy a lab into work/ (git-ignored) to work on it")
    p.add_argument("lab", help="the lab id, e.g. lab01")
    p.add_argument("--force", action="store_true", help="replace an existing copy in work/")
    p.set_defaults(handler=_start)

    p = commands.add_parser("grade", help="grade a submitted notebook, or a folder of them",
                            description="Each notebook runs in a bubblewrap sandbox (no network, no "
                                        "access to the course's answers, the seed or other files, limits on "
                                        "time, memory and processes). Exit status 0 when grading worked "
                                        f"(whatever the score), {GRADING_FAILED} when a notebook could not "
                                        "be graded or no sandbox is available.")
    p.add_argument("path", help="a notebook, or a folder of notebooks (one CSV row each)")
    p.add_argument("--seed", type=int, default=0, help="seed of the hidden cases (default 0)")
    p.add_argument("--json", metavar="FILE", type=output_file, help="write the report of one notebook as JSON")
    p.add_argument("--csv", metavar="FILE", type=output_file,
                   help="write one CSV row per notebook (for a folder, default: to stdout)")
    p.add_argument("--timeout", type=positive_float, metavar="SECONDS",
                   help="time limit per cell and per exercise (default 60)")
    p.add_argument("--budget", type=positive_float, metavar="SECONDS",
                   help="time limit for a whole notebook, kernel restarts included "
                        f"(default {Limits.budget:g})")
    p.add_argument("--memory", type=positive_float, metavar="GIB",
                   help=f"address space per process of the sandbox, in GiB (default {Limits.memory >> 30})")
    p.add_argument("--no-sandbox", action="store_true",
                   help="run notebooks as yourself, without bubblewrap: only for notebooks you trust (they "
                        "could then read the answers and the seed, change the course and other submissions)")
    p.set_defaults(handler=_grade)

    p = commands.add_parser("doctor", help="what this machine can run")
    p.set_defaults(handler=_doctor)

    commands.add_parser("bench", help="benchmarks: fa-lab bench cpu|gpu|hopper (try fa-lab bench --help)",
                        add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["bench"]:
            from .bench import main as bench_main
            return bench_main(argv[1:])
        args = build_parser().parse_args(argv)
        return args.handler(args)
    except KeyboardInterrupt:
        print(f"fa-lab {' '.join(argv[:1])}: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
