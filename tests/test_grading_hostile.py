"""Hostile submissions, graded in the sandbox in one folder run (about 2 minutes on 2 cores).

The folder (built by hostile_notebooks.py) holds one notebook per class of attack: the answers
reached through an alias package, a renamed module or their source executed, with the call guard
switched off (labs 01, 03 and 04); torch's SDPA through a builtin under another name, a thread
started earlier and an emptied record; the seed and the labs' code looked for everywhere; the
install, a .pth file and the other submissions written to; a setsid child left to rewrite the
reports, and the grader's processes stopped and killed; a notebook that spends more than its
time budget in sleeps, a hang and re-runs; memory, processes, file size and a 320 MB reply; forged
replies (pickle gadgets, a malformed reply, an always-equal tensor). After them come the lab as
handed out and the solution. The run goes through the CLI in a child process, as an instructor
runs it, so that the grader's own peak memory can be measured.

Every attack scores 0, the solution 10; the install, the submissions and the CSV stay as they
were; nothing outlives the run; each notebook's row is appended when it is done.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from fa_lab.grading import sandbox

pytest.importorskip("nbformat")  # the GPU machine has no Jupyter stack: nothing to grade there
from hostile_notebooks import MARKER, ORPHAN, SEED, write_folder  # noqa: E402
from labkit import ROOT, digest  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.serial,
              pytest.mark.skipif(sys.platform != "linux", reason="the grading sandbox runs on Linux only")]

BUDGET, TIMEOUT, MEMORY_GIB = 45, 20, 4
DRIVER = r"""
import json, resource, sys, threading, time
from fa_lab import cli

table, finished, stop, start = sys.argv[1], {}, threading.Event(), time.monotonic()


def watch():  # when each notebook's row appears in the CSV
    while not stop.is_set():
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            rows = []
        for row in rows:
            finished.setdefault(row.split(",")[0], time.monotonic() - start)
        time.sleep(0.1)


watcher = threading.Thread(target=watch)
watcher.start()
status = cli.main(sys.argv[2:])
time.sleep(0.3)
stop.set()
watcher.join()
print(json.dumps({"status": status, "finished": finished,
                  "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def install_digest() -> str:
    """What the environment's site-packages holds (names, and the .pth files' contents)."""
    hashed = hashlib.sha256()
    site = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(site.iterdir()):
        hashed.update(path.name.encode() + (path.read_bytes() if path.suffix == ".pth" else b""))
    hashed.update(Path(sys.prefix, "pyvenv.cfg").read_bytes())
    return hashed.hexdigest()


def tampered() -> list[str]:
    """The package's files that hold what the tampering notebook writes (it truncates or appends)."""
    package = ROOT / "fa_lab"
    return [str(path) for path in (package / "grading" / "check.py", package / "__init__.py")
            if path.read_text().startswith("FULL_MARKS") or path.read_text().endswith("# changed\n")]


def _processes_named(marker: str) -> list[str]:
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    if sandbox.unavailable_reason():  # on Linux, CI must test the sandbox: fail rather than skip
        pytest.fail(f"no sandbox: {sandbox.unavailable_reason()}")
    base = tmp_path_factory.mktemp("hostile")
    folder, scratch, out = base / "submissions", base / "tmp", base / MARKER
    for path in (folder, scratch, out):
        path.mkdir()
    pwned = Path("/tmp") / f"fa-lab-hostile-pwned-{os.getpid()}"
    notebooks = write_folder(folder, pwned, TIMEOUT)
    table = out / "grades.csv"
    before = {"install": install_digest(), "notebooks": {p: digest(p) for p in notebooks.values()},
              "stages": set(Path("/tmp").glob("fa-lab-stage-*"))}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", DRIVER, str(table), "grade", str(folder), "--seed", str(SEED),
                           "--csv", str(table), "--timeout", str(TIMEOUT), "--budget", str(BUDGET),
                           "--memory", str(MEMORY_GIB)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "TMPDIR": str(scratch)})
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    table_digest = digest(table)
    time.sleep(2)  # anything left behind would rewrite the reports now
    rows = {Path(row["file"]).stem: row for row in csv.DictReader(table.open())}
    return {"rows": rows, "summary": summary, "took": took, "before": before, "notebooks": notebooks,
            "table": table, "table_digest": table_digest, "pwned": pwned, "scratch": scratch}


def test_every_attack_scores_zero_and_the_solution_full_marks(graded):
    rows = graded["rows"]
    assert graded["summary"]["status"] == 0, rows
    assert set(rows) == set(graded["notebooks"])
    assert {name: float(row["score"]) for name, row in rows.items() if row["score"] != "0.0"} == {"zz_solution": 10.0}
    print(f"folder of {len(rows)} notebooks graded in {graded['took']:.0f} s")


def _diagnosis(row: dict) -> dict[str, str]:
    """The first message of each exercise short of full marks, by exercise."""
    return dict(clause.split(": ", 1) for clause in row["diagnosis"].split(" | "))


@pytest.mark.parametrize("name, exercises, said", [
    ("answers_lab01", ("online_softmax", "flash_forward", "flash_backward", "autograd_function"),
     "your function called fa_lab."),
    ("sdpa_lab01", ("online_softmax", "flash_forward", "flash_backward", "autograd_function"),
     "your function called torch: "),
    ("answers_lab03", ("forward_kernel", "causal_kernel"), "your function called fa_lab."),
    ("answers_lab04", ("hadamard", "rotate_qk"), "your function called fa_lab.fp8."),
])
def test_the_answers_and_torch_attention_are_not_there(graded, name, exercises, said):
    diagnosis = _diagnosis(graded["rows"][name])
    for exercise in exercises:
        assert said in diagnosis[exercise], diagnosis[exercise]


def test_the_seed_the_grader_and_the_labs_code_are_not_visible_and_recursion_is_named(graded):
    diagnosis = _diagnosis(graded["rows"]["answers_lab04"])
    assert "seed probe found: []" in diagnosis["fp8_error_table"], diagnosis["fp8_error_table"]
    assert "RecursionError" in diagnosis["quantize_blocks"] and "call monitor" not in diagnosis["quantize_blocks"]
    assert "RecursionError" in _diagnosis(graded["rows"]["resources_lab01"])["online_softmax"]


def test_the_install_and_the_other_submissions_stay_as_they_were(graded):
    before = graded["before"]
    assert install_digest() == before["install"] and not tampered()
    assert not list(Path(sys.prefix).rglob("zz_hostile.pth"))
    assert {p: digest(p) for p in graded["notebooks"].values()} == before["notebooks"]
    assert float(graded["rows"]["zz_handed_out"]["score"]) == 0  # graded after the tampering


def test_nothing_outlives_grading_nor_stops_it(graded):
    assert not _processes_named(ORPHAN)
    assert digest(graded["table"]) == graded["table_digest"]
    assert not graded["pwned"].exists()
    assert not list(graded["scratch"].iterdir())  # every temporary folder removed
    assert set(Path("/tmp").glob("fa-lab-stage-*")) <= graded["before"]["stages"]
    killer = graded["rows"]["killer_lab01"]
    assert "processes ended before grading finished" in killer["error"], killer


def test_one_budget_bounds_each_notebook_and_rows_come_as_notebooks_finish(graded):
    finished = sorted(graded["summary"]["finished"].items(), key=lambda item: item[1])
    assert [Path(name).stem for name, _ in finished] == sorted(graded["notebooks"])
    times = dict(finished)
    names = [name for name, _ in finished]
    bomb = names.index("timebomb_lab01.ipynb")
    spent = times[names[bomb]] - times[names[bomb - 1]]
    assert BUDGET - 5 < spent < BUDGET + 20, spent
    assert f"time budget ({BUDGET} s, restarts included) ran out" in graded["rows"]["timebomb_lab01"]["error"]


def test_limits_hold_and_a_huge_reply_costs_the_grader_nothing(graded):
    row = graded["rows"]["resources_lab01"]
    assert "limits: {" in row["error"] and "not limited" not in row["error"], row["error"]
    assert "returned more than the grader accepts" in _diagnosis(row)["flash_forward"]
    assert graded["summary"]["maxrss_kb"] < 1_200_000  # the grader's own peak: no 320 MB reply in it


def test_forged_replies_are_refused_and_never_unpickled(graded):
    diagnosis = _diagnosis(graded["rows"]["forged_lab01"])
    assert "could not read what online_softmax_stats returned" in diagnosis["online_softmax"]
    assert "could not read what flash_forward returned" in diagnosis["flash_forward"]
    assert "expected form" in diagnosis["flash_backward"]
    assert float(graded["rows"]["forged_lab01"]["autograd_function"]) == 0
    assert not graded["pwned"].exists()
