"""The grader: what it detects in-process, its command line, and whole gradings in real kernels.

The kernel tests (marked slow) grade the solution (full marks), every lab as handed out
(0), a folder of renamed and broken submissions (one CSV), and one hostile notebook
that loops forever ignoring interrupts, calls SDPA, monkeypatches the checks and
deletes a function. Every one of them checks that the submission is left unchanged.
"""
from __future__ import annotations

import csv
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest
import torch
from labkit import ROOT, digest, grade_json

import fa_lab
from fa_lab import cli
from fa_lab.grading.check import run_exercise
from fa_lab.grading.registry import get_lab, lab_ids

SOLUTION = ROOT / "solutions" / "lab01_flash_attention_cpu.ipynb"
LAB_NOTEBOOK = ROOT / "labs" / "lab01_flash_attention_cpu.ipynb"
FORWARD = {e.name: e for e in get_lab("lab01").exercises}["flash_forward"]


def forward_results(fn):
    """The first three public cases of flash_forward, run in-process."""
    return run_exercise(FORWARD, fn, FORWARD.cases()[:3])


# ---- in-process: forbidden calls, wrong return values ----------------------------------------

def _sdpa(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return out, torch.zeros(q.shape[:-1])


def _sdpa_through_ops(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
    out = torch.ops.aten.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return out, torch.zeros(q.shape[:-1])


def _fa_lab_attention(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
    return fa_lab.attention(q, k, v, causal, scale, impl="naive", return_lse=True)


def _flash_torch(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
    from fa_lab.flash_torch import flash_forward
    return flash_forward(q, k, v, causal, scale, block_q, block_k)


def _grading_solution(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
    from fa_lab.grading.labs import attention_mistakes
    return attention_mistakes.attention(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale, None)


def _profiler_switched_off(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
    hook = sys.getprofile()
    sys.setprofile(None)
    try:
        return _flash_torch(q, k, v, causal, scale, block_q, block_k)
    finally:
        sys.setprofile(hook)


@pytest.mark.parametrize("fn, named", [
    (_sdpa, "scaled_dot_product_attention"),
    (_sdpa_through_ops, "scaled_dot_product_attention"),
    (_fa_lab_attention, "fa_lab.attention"),
    (_flash_torch, "fa_lab.flash_torch.flash_forward"),
    (_grading_solution, "fa_lab.grading.labs.attention_mistakes"),
    (_profiler_switched_off, "sys.setprofile"),
])
def test_calling_what_the_exercise_asks_for_fails_and_says_so(fn, named):
    for _, verdict in forward_results(fn):
        assert not verdict.passed
        assert named in verdict.message and "write the computation yourself" in verdict.message


def test_a_function_that_writes_into_its_inputs_is_judged_on_the_original_inputs():
    def attention_then_scribble(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
        s = (q.float() @ k.float().transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if causal:  # the learner's own mask (fa_lab's is forbidden in lab01)
            visible = torch.ones(s.shape[-2:], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2])
            s = s.masked_fill(~visible, float("-inf"))
        out = (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)
        lse = torch.logsumexp(s, dim=-1)
        q.mul_(-3.0)
        k.zero_()
        return out, lse

    cases = FORWARD.cases()[:3]
    inputs = [[t.clone() for t in case.args[:3]] for case in cases]
    assert all(v.passed for _, v in run_exercise(FORWARD, attention_then_scribble, cases))
    assert all(torch.equal(a, b) for case, saved in zip(cases, inputs, strict=True)
               for a, b in zip(case.args, saved, strict=False))


@pytest.mark.parametrize("returned, said", [
    (lambda q: q.clone(), "expected a tuple (out, lse)"),
    (lambda q: (q.clone(), q.shape[:-1]), "lse is a tuple of 3 values, expected a tensor"),
    (lambda q: (q.clone(), torch.zeros(q.shape[:-1] + (1,))), "lse has shape"),
    (lambda q: (q.double(), torch.zeros(q.shape[:-1])), "out has dtype torch.float64"),
    (lambda q: (q.numpy(), torch.zeros(q.shape[:-1])), "numpy.ndarray"),
])
def test_wrong_return_values_are_explained(returned, said):
    results = forward_results(lambda q, k, v, causal, scale, block_q, block_k: returned(q))
    assert all(not v.passed and said in v.message for _, v in results), [v.message for _, v in results]


def test_an_exception_names_the_learners_line():
    def broken(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
        tiles = list(range(block_q))
        return tiles[block_q]
    results = forward_results(broken)
    assert all("IndexError" in v.message and "tiles[block_q]" in v.message for _, v in results)


def test_hidden_cases_depend_on_the_seed_only():
    first, again, other = (FORWARD.cases(seed) for seed in (7, 7, 8))
    assert [c.name for c in first] == [c.name for c in again]
    assert all(torch.equal(a.args[0], b.args[0]) for a, b in zip(first, again, strict=True))
    assert [c.name for c in first if c.hidden] != [c.name for c in other if c.hidden]
    assert len([c for c in first if c.hidden]) > 0 and len([c for c in first if not c.hidden]) > 0


# ---- imports and the command line ------------------------------------------------------------

def test_imports_stay_light():
    code = ("import sys, fa_lab; assert 'fa_lab.grading' not in sys.modules; "
            "import fa_lab.grading; bad = {'nbclient', 'nbformat', 'jupyter_client'} & set(sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_grade_exit_status_says_when_a_notebook_cannot_be_graded(tmp_path, capsys):
    garbage = tmp_path / "garbage.ipynb"
    garbage.write_text("this is not a notebook")
    no_lab = tmp_path / "no_lab.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), no_lab)
    unknown = tmp_path / "unknown.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.metadata["fa_lab"] = {"lab": "lab99"}
    nbformat.write(nb, unknown)
    for path, said in ((garbage, "cannot read"), (no_lab, "no lab id"), (unknown, "unknown lab 'lab99'"),
                       (tmp_path / "missing.ipynb", "cannot read")):
        assert cli.main(["grade", str(path)]) == cli.GRADING_FAILED
        assert said in capsys.readouterr().err
    assert cli.main(["grade", str(tmp_path), "--json", str(tmp_path / "x.json")]) == cli.GRADING_FAILED


def test_doctor_reports_the_machine(capsys):
    assert cli.main(["doctor"]) == 0
    report = capsys.readouterr().out
    assert torch.__version__ in report and "chapters" in report and "kernels" in report and "grading" in report


def test_bench_forwards_its_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("fa_lab.bench")
    fake.main = lambda argv: seen.append(argv) or 5
    monkeypatch.setitem(sys.modules, "fa_lab.bench", fake)
    assert cli.main(["bench", "--device", "cpu", "--help"]) == 5
    assert seen == [["--device", "cpu", "--help"]]


# ---- whole gradings in real kernels ----------------------------------------------------------

@pytest.mark.slow
def test_the_solution_gets_full_marks(tmp_path):
    before = digest(SOLUTION)
    status, report = grade_json(SOLUTION, tmp_path)
    assert status == 0
    assert report["lab"] == "lab01" and report["seed"] == 7
    assert report["score"] == report["max_score"] == 10
    assert [e["name"] for e in report["exercises"]] == [e.name for e in get_lab("lab01").exercises]
    for exercise in report["exercises"]:
        assert exercise["points"] == exercise["max_points"] and exercise["messages"] == []
        assert exercise["passed"] == exercise["cases"] > 3
    assert digest(SOLUTION) == before


@pytest.mark.slow
def test_a_folder_gives_one_csv_row_per_submission(tmp_path):
    """The lab under another name (the lab id comes from its metadata) and a broken file."""
    folder = tmp_path / "submissions"
    (folder / "group_b").mkdir(parents=True)
    (folder / "alice.ipynb").write_bytes(LAB_NOTEBOOK.read_bytes())
    (folder / "group_b" / "bob.ipynb").write_bytes(b'{"cells": [')
    hashes = {p: digest(p) for p in folder.rglob("*.ipynb")}
    table = tmp_path / "grades.csv"
    assert cli.main(["grade", str(folder), "--seed", "7", "--csv", str(table)]) == cli.GRADING_FAILED
    rows = list(csv.DictReader(table.open()))
    assert [r["file"] for r in rows] == ["alice.ipynb", str(Path("group_b") / "bob.ipynb")]
    alice, bob = rows
    assert alice["lab"] == "lab01" and float(alice["score"]) == 0 and float(alice["max_score"]) == 10
    assert all(float(alice[e.name]) == 0 for e in get_lab("lab01").exercises)
    assert "not implemented yet" in alice["diagnosis"] and "NotImplementedError" in alice["error"]
    assert bob["score"] == "" and "cannot read" in bob["error"]
    assert {p: digest(p) for p in folder.rglob("*.ipynb")} == hashes


@pytest.mark.slow
@pytest.mark.parametrize("lab", lab_ids())
def test_the_lab_as_handed_out_scores_zero(lab, tmp_path):
    status, report = grade_json(ROOT / "labs" / get_lab(lab).notebook, tmp_path)
    assert status == 0 and report["score"] == 0 and report["max_score"] == 10
    for exercise in report["exercises"]:
        assert exercise["status"] == "graded" and exercise["passed"] == 0
        assert len(exercise["messages"]) == 1 and "not implemented yet" in exercise["messages"][0]


HOSTILE_CELLS = {
    "def online_softmax_stats(": '''
def online_softmax_stats(score_blocks):
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the grader's interrupt cannot stop this
    while True:
        pass
''',
    "def flash_forward(": '''
def flash_forward(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    scores = (q.float() @ k.float().transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)
    return out, torch.logsumexp(scores, dim=-1)
''',
    "def flash_backward(": '''
import fa_lab.grading, fa_lab.reference, fa_lab.testing

torch.allclose = lambda *args, **kwargs: True
torch.testing.assert_close = lambda *args, **kwargs: None
fa_lab.testing.compare = lambda name, *args, **kwargs: fa_lab.testing.Comparison(name, 0.0, 0.0, 1.0)
fa_lab.testing.assert_attention_close = fa_lab.testing.compare
fa_lab.reference.reference_attention = lambda q, k, v, *args, **kwargs: (torch.zeros_like(q), None)
try:  # the sandbox's fa_lab.grading has neither module
    import fa_lab.grading.check, fa_lab.grading.harness
    fa_lab.grading.check = fa_lab.grading.check.check = lambda *args, **kwargs: print("all pass")
    fa_lab.grading.check.judge_cases = lambda exercise, cases, outcomes: []
    fa_lab.grading.harness.run_cases = lambda *args, **kwargs: []
except ImportError:
    pass


def flash_backward(q, k, v, out, lse, dout, causal=False, scale=None, block_q=64, block_k=64):
    return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)
''',
}


def hostile_notebook(path: Path) -> None:
    """The solution with: an endless loop that ignores interrupts, SDPA, monkeypatched checks and
    references, a top-level endless loop, a cell that raises, and deleted functions (the mask helpers,
    whose right answers would otherwise score)."""
    nb = nbformat.read(SOLUTION, as_version=4)
    last_check = max(i for i, c in enumerate(nb.cells) if 'check("autograd_function"' in c.source)
    nb.cells = nb.cells[:last_check + 1]
    for cell in nb.cells:
        for marker, source in HOSTILE_CELLS.items():
            if marker in cell.source:
                cell.source = source
    nb.cells += [nbformat.v4.new_code_cell("while True:\n    pass"),
                 nbformat.v4.new_code_cell("1 / 0"),
                 nbformat.v4.new_code_cell("del FlashAttentionFunction, causal_tile_mask, key_end")]
    nbformat.write(nb, path)


@pytest.mark.slow
@pytest.mark.serial
def test_a_hostile_submission_is_graded_without_hanging(tmp_path):
    path = tmp_path / "hostile.ipynb"
    hostile_notebook(path)
    before = digest(path)
    status, report = grade_json(path, tmp_path, "--timeout", "15")
    assert status == 0
    exercises = {e["name"]: e for e in report["exercises"]}
    assert report["score"] == 0
    assert exercises["online_softmax"]["status"] == "timed out"
    assert exercises["flash_forward"]["status"] == "forbidden"
    assert "scaled_dot_product_attention" in exercises["flash_forward"]["messages"][0]
    assert exercises["flash_backward"]["status"] == "graded" and exercises["flash_backward"]["passed"] == 0
    assert all(exercises[name]["status"] == "missing" for name in ("autograd_function", "causal_tile_mask", "key_end"))
    errors = "\n".join(report["notebook_errors"])
    assert "timed out" in errors and "ZeroDivisionError" in errors
    assert digest(path) == before
