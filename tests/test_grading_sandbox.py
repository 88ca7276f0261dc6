"""The pieces of sandboxed grading, each on its own: the reply format, the frames on the pipe, the
package a graded notebook sees, torch's attention blocked in the kernel, the call guard's
RecursionError, the report's cells and CSV, and the sandbox itself (limits, teardown, what it
shows). The sandbox tests need bubblewrap on Linux (`make setup` installs it as root; without it
they fail, elsewhere they are skipped); a whole hostile folder run is in test_grading_hostile.py.
"""
from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fa_lab import cli
from fa_lab.grading import grade, sandbox, wire
from fa_lab.grading.channel import ChannelBroken, FrameReader, write_frame
from fa_lab.grading.check import run_exercise
from fa_lab.grading.registry import get_lab, lab_ids
from fa_lab.grading.report import IN_KERNEL_CHECKS, ExerciseReport, GradeReport, cell_label, write_csv
from fa_lab.grading.view import plan_view, write_view

# Sandboxed runs with wall-clock budgets of a few seconds: make test runs them alone (pyproject: serial).
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fa_lab"


# ---- the reply format ------------------------------------------------------------------------

def test_replies_round_trip_as_plain_tensors():
    value = {"status": "ran", "results": [{"outputs": [torch.randn(2, 3).bfloat16(), torch.zeros(0, 4),
                                                      torch.randn(4, 6).t(), torch.ones(3).to(torch.float8_e4m3fn)],
                                           "error": None, "forbidden": [], "largest": 7},
                                          {"outputs": {"rmse": float("nan")}, "error": "x" * 30_000,
                                           "forbidden": ["a"], "largest": None}]}
    back = wire.loads(wire.dumps(value), 1 << 20)
    first, second = back["results"]
    assert [t.dtype for t in first["outputs"]] == [t.dtype for t in value["results"][0]["outputs"]]
    assert all(type(t) is torch.Tensor and torch.equal(t.float(), s.float())
               for t, s in zip(first["outputs"], value["results"][0]["outputs"], strict=True))
    assert second["outputs"]["rmse"] != second["outputs"]["rmse"] and len(second["error"]) == wire.MAX_STRING


def _header_with(**tensor) -> bytes:
    header = json.dumps({"value": {"__tensor__": 0}, "tensors": [
        {"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8, **tensor}]}).encode()
    return len(header).to_bytes(8, "little") + header + bytes(8)


@pytest.mark.parametrize("data, said", [
    (b"", "truncated"),
    (b"\xff" * 16, "truncated"),
    (b"\x05\0\0\0\0\0\0\0{oops", "not JSON"),
    (_header_with(dtype="object"), "unsupported dtype"),
    (_header_with(shape=[3]), "do not match"),
    (_header_with(offset=4), "do not match"),
    (_header_with(shape=[-2, -1]), "not a list of sizes"),
    (_header_with(shape=[0, 1 << 62], nbytes=0), "not a list of sizes"),
    (_header_with()[:-8] + bytes(12), "belong to no tensor"),
])
def test_replies_that_break_the_format_are_refused(data, said):
    with pytest.raises(wire.BadReply, match=said):
        wire.loads(data, 1 << 20)


def test_tensors_may_not_share_bytes():
    """Many tensors pointing at the same bytes would multiply the reply's size in the grader's memory."""
    spec = {"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
    header = json.dumps({"value": [{"__tensor__": i} for i in range(1000)], "tensors": [spec] * 1000}).encode()
    with pytest.raises(wire.BadReply, match="do not follow"):
        wire.loads(len(header).to_bytes(8, "little") + header + bytes(8), 1 << 20)


def test_a_pickle_or_an_oversized_reply_is_never_loaded():
    buffer = io.BytesIO()
    torch.save({"status": "ran", "results": []}, buffer)
    with pytest.raises(wire.BadReply):
        wire.loads(buffer.getvalue(), 1 << 20)
    with pytest.raises(wire.BadReply, match="more than"):
        wire.loads(wire.dumps([torch.zeros(1000)]), 100)
    nested = "[" * 100 + "]" * 100
    header = json.dumps({"value": 0, "tensors": []}).replace("0", nested, 1).encode()
    with pytest.raises(wire.BadReply, match="nested"):
        wire.loads(len(header).to_bytes(8, "little") + header, 1 << 20)


# ---- frames on the pipe ----------------------------------------------------------------------

def test_frames_arrive_whole_and_oversized_payloads_are_dropped():
    read, write = os.pipe()
    write_frame(write, {"type": "cell", "index": 3, "problem": "x"})
    write_frame(write, {"type": "exercise", "number": 0}, b"a" * 100)
    write_frame(write, {"type": "exercise", "number": 1}, b"b" * 10)
    os.close(write)
    data = os.read(read, 1 << 16)
    os.close(read)
    reader = FrameReader(lambda h: 50 if h.get("number") == 0 else 1000, 1 << 20)
    frames = [frame for start in range(0, len(data), 7) for frame in reader.feed(data[start:start + 7])]
    assert [(f.header.get("index", f.header.get("number")), f.size, f.payload) for f in frames] == [
        (3, 0, b""), (0, 100, None), (1, 10, b"b" * 10)]


@pytest.mark.parametrize("data", [b"x" * 70_000, b"not json\n", b'{"size": -1}\n', b'[1]\n'])
def test_what_is_not_a_frame_breaks_the_channel(data):
    with pytest.raises(ChannelBroken):
        FrameReader(lambda header: 0, 1 << 20).feed(data)


def test_more_than_the_total_breaks_the_channel():
    reader = FrameReader(lambda header: 1 << 20, 100)
    with pytest.raises(ChannelBroken, match="in all"):
        reader.feed(b'{"size": 60}\n' + b"x" * 60 + b'{"size": 60}\n')
    with pytest.raises(ChannelBroken, match="in all"):  # headers count too: no endless stream of frames
        FrameReader(lambda header: 0, 1000).feed(b'{"size": 0, "type": "cell"}\n' * 100)


# ---- the package a graded notebook sees ------------------------------------------------------

ANSWERS = {  # what each lab asks for, and so must hide
    "lab00": ("fa_lab.iomodel.attention_flops", "fa_lab.iomodel.naive_hbm_bytes", "fa_lab.iomodel.flash_hbm_bytes",
              "fa_lab.iomodel.attainable_tflops", "fa_lab.iomodel.naive_extra_bytes"),
    "lab02": ("fa_lab.parallelism.grid", "fa_lab.parallelism.waves", "fa_lab.parallelism.kv_tiles_per_cta",
              "fa_lab.parallelism.list_schedule", "fa_lab.parallelism.launch_order"),
    "lab01": ("fa_lab.attention", "fa_lab.flash_torch.flash_forward", "fa_lab.flash_torch.flash_backward",
              "fa_lab.flash_torch.FlashAttentionFunction", "fa_lab.online_softmax.online_softmax_update",
              "fa_lab.reference.naive_attention", "fa_lab.reference.reference_attention",
              "fa_lab.reference.causal_mask", "fa_lab.block_info.BlockInfo"),
    "lab03": ("fa_lab.attention", "fa_lab.kernels.triton_attention", "fa_lab.reference.reference_attention",
              "fa_lab.flash_torch.flash_forward"),
    "lab04": ("fa_lab.fp8.quantize_e4m3", "fa_lab.fp8.hadamard_transform", "fa_lab.fp8.incoherent_rotation",
              "fa_lab.fp8.reproduce_error_table", "fa_lab.fp8.fp8_attention_forward", "fa_lab.attention"),
    "lab05": ("fa_lab.attention", "fa_lab.varlen.attention_varlen", "fa_lab.reference.expand_kv",
              "fa_lab.reference.reference_attention", "fa_lab.block_info.BlockInfo",
              "fa_lab.score_mods.alibi_bias", "fa_lab.score_mods.modify_scores", "fa_lab.impls.run"),
    "lab06": ("fa_lab.kvcache.attention_with_kvcache", "fa_lab.kvcache.gather_kv", "fa_lab.kvcache.choose_num_splits",
              "fa_lab.online_softmax.merge_splits", "fa_lab.reference.reference_attention"),
    "lab07": ("fa_lab.sparse.block_sparse_attention", "fa_lab.sparse.moba_gate", "fa_lab.sparse.moba_attention",
              "fa_lab.sparse.selection_mask", "fa_lab.online_softmax.merge_splits",
              "fa_lab.kernels.triton_block_select_attention", "fa_lab.reference.reference_attention"),
    "lab08": ("fa_lab.linear.linear_attention", "fa_lab.linear.delta_rule", "fa_lab.linear.tril.solve_tril",
              "fa_lab.linear.chunk.chunk_fwd_h", "fa_lab.linear.chunk.chunk_fwd_o", "fa_lab.linear.chunk.chunk_gla",
              "fa_lab.kernels.triton_chunk_linear_attention"),
    "lab09": ("fa_lab.context_parallel.shard", "fa_lab.context_parallel.chunk_cases",
              "fa_lab.context_parallel.ring_schedule", "fa_lab.context_parallel.ring_attention",
              "fa_lab.online_softmax.merge_splits", "fa_lab.online_softmax.merge_partials"),
}
# What the lab notebooks import and use outside the graded functions (their first cell and helpers).
KEPT = {"lab00": (), "lab02": (),
        "lab01": ("fa_lab.testing.make_qkv", "fa_lab.reference.softmax_with_lse"),
        "lab03": ("fa_lab.kernels.load_triton", "fa_lab.reference.causal_mask", "fa_lab.testing.make_qkv"),
        "lab04": ("fa_lab.flash_torch.flash_forward", "fa_lab.fp8.outlier_qkv", "fa_lab.fp8.random_signs",
                  "fa_lab.fp8.rmse", "fa_lab.reference.reference_attention"),
        "lab05": ("fa_lab.testing.make_qkv",),
        "lab06": ("fa_lab.testing.make_qkv",),
        "lab07": (), "lab08": (), "lab09": ()}


@pytest.mark.parametrize("lab", sorted(ANSWERS))
def test_the_view_hides_the_answers_and_keeps_what_the_notebook_uses(lab):
    view = plan_view(get_lab(lab), PACKAGE)
    assert set(ANSWERS[lab]) <= set(view.hidden)
    assert not set(KEPT[lab]) & set(view.hidden)
    kernel_modules = {name.rpartition(".")[0] for name in view.hidden if name.startswith("fa_lab.kernels.")}
    assert "fa_lab.kernels.interpreter_fixes" not in kernel_modules


def test_the_guard_stays_on_only_where_a_forbidden_name_must_stay_visible():
    for lab_id in lab_ids():
        lab = get_lab(lab_id)
        view = plan_view(lab, PACKAGE)
        for exercise in lab.exercises:  # each such name is one that another exercise may call
            for name in view.unguarded[exercise.name]:
                assert name not in view.hidden
                assert any(other is not exercise for other in lab.exercises)
    lab01 = plan_view(get_lab("lab01"), PACKAGE).unguarded
    assert lab01["flash_forward"] == lab01["flash_backward"] == lab01["online_softmax"] == ()
    lab04 = plan_view(get_lab("lab04"), PACKAGE).unguarded
    assert "fa_lab.flash_torch.flash_forward" in lab04["quantize_blocks"]
    assert "fa_lab.flash_torch.flash_forward" not in lab04["fp8_error_table"]


def test_the_report_names_the_checks_that_ran_in_the_kernel():
    def checks(lab_id, options):
        lab = get_lab(lab_id)
        cases = [(e, e.cases(0)) for e in lab.exercises]
        guards = grade._guards(lab, cases, options)
        return {e.name: grade._in_kernel_checks(e, c, g) for (e, c), g in zip(cases, guards, strict=True)}

    lab01 = checks("lab01", grade.Options())
    assert "tensor sizes" in lab01["flash_forward"] and "tensor sizes" in lab01["online_softmax"]
    assert not any("call guard" in found for found in lab01.values())
    lab04 = checks("lab04", grade.Options())
    assert "call guard" in lab04["quantize_blocks"] and "tensor sizes" in lab04["hadamard"]
    unsandboxed = checks("lab01", grade.Options(sandboxed=False))
    assert all("call guard" in found for found in unsandboxed.values())
    for found in [*lab01.values(), *lab04.values()]:
        assert set(found) <= set(IN_KERNEL_CHECKS) and "torch attention" in found


def test_the_view_is_importable_and_holds_no_answer(tmp_path):
    write_view(get_lab("lab01"), PACKAGE, tmp_path / "fa_lab")
    assert sorted(p.name for p in (tmp_path / "fa_lab" / "grading").iterdir()) == ["__init__.py"]
    assert not list(tmp_path.rglob("__pycache__"))
    text = "\n".join(p.read_text() for p in tmp_path.rglob("*.py"))
    assert "def flash_forward" not in text and "def online_softmax_update" not in text
    assert "def reference_attention" not in text and "hidden_cases" not in text
    code = """
import fa_lab, fa_lab.memory
from fa_lab.grading import check
from fa_lab.reference import causal_mask, naive_attention, reference_attention
from fa_lab.testing import make_qkv
assert fa_lab.__file__.startswith(%r), fa_lab.__file__
check("flash_forward", None)
for answer in (lambda: naive_attention(*make_qkv()), lambda: causal_mask(2, 2)):
    try:
        answer()
    except RuntimeError as exc:
        print(type(exc).__name__, exc.hidden_name)
""" % str(tmp_path)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["check('flash_forward') skipped: the grader runs its own cases.",
                                        "HiddenWhileGrading fa_lab.reference.naive_attention",
                                        "HiddenWhileGrading fa_lab.reference.causal_mask"]


# ---- torch's attention in the grading kernel, the guard's RecursionError -----------------------

def test_torch_attention_raises_by_every_route_once_blocked():
    code = """
import threading, torch
import fa_lab.grading.prelude as prelude
prelude.block_torch_attention()
q = torch.randn(1, 2, 8, 16)
sdpa = getattr(torch._C._nn, "scaled_dot_product_" + "attention")
routes = {
    "functional": lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q),
    "nameless builtin": lambda: sdpa(q, q, q, is_causal=True),
    "aten op": lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q),
    "math": lambda: torch.ops.aten._scaled_dot_product_attention_math(q, q, q),
    "flex": lambda: torch.nn.attention.flex_attention.flex_attention(q, q, q),
}
said = {}
def attempt(name, route):
    try:
        route()
        said[name] = "ran"
    except RuntimeError as exc:
        said[name] = getattr(exc, "hidden_name", repr(exc))
for name, route in routes.items():
    attempt(name, route)
thread = threading.Thread(target=attempt, args=("thread", routes["functional"]))
thread.start(); thread.join()
said["matmul"] = tuple((q @ q.transpose(-1, -2)).shape)
print(said)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    said = eval(done.stdout)
    assert said.pop("matmul") == (1, 2, 8, 8)
    assert all(name.startswith("torch: ") for name in said.values()), said


def test_an_endless_recursion_is_a_recursion_error_not_a_forbidden_call():
    forward = {e.name: e for e in get_lab("lab01").exercises}["flash_forward"]

    def recurse(q, k, v, causal=False, scale=None, block_q=64, block_k=64):
        return recurse(q, k, v, causal, scale, block_q, block_k)

    for _, verdict in run_exercise(forward, recurse, forward.cases()[:2]):
        assert "RecursionError" in verdict.message and "call monitor" not in verdict.message, verdict.message
        assert "write the computation yourself" not in verdict.message


# ---- the report ------------------------------------------------------------------------------

def test_cells_are_named_as_the_learner_sees_them_and_the_csv_says_why():
    nbformat = pytest.importorskip("nbformat")
    cells = [nbformat.v4.new_markdown_cell("# Lab"), nbformat.v4.new_code_cell("\n  1 / 0  # oops\n")]
    assert cell_label(cells, 1) == 'cell 2 of 2 (it starts "1 / 0  # oops")'
    exercise = ExerciseReport("flash_forward", "flash_forward", 1.5, 3.0, "graded", 1, 2, ["case 2: wrong lse."])
    report = GradeReport("a.ipynb", "lab01", 7, 1.5, 10.0, [exercise], [f"{cell_label(cells, 1)}: ZeroDivisionError"])
    stream = io.StringIO()
    write_csv([("a.ipynb", report), ("b.ipynb", "cannot read b.ipynb")], stream)
    header, first, second = stream.getvalue().splitlines()
    assert header == "file,lab,score,max_score,flash_forward,diagnosis,error"
    assert "flash_forward: case 2: wrong lse." in first and "ZeroDivisionError" in first
    assert second.endswith(",cannot read b.ipynb")


# ---- the sandbox itself ----------------------------------------------------------------------

def needs_sandbox(test):
    """Linux only; there, a missing sandbox fails the test (CI must test the sandboxed path)."""
    @pytest.mark.skipif(sys.platform != "linux", reason="the grading sandbox (bubblewrap) runs on Linux only")
    @functools.wraps(test)
    def run(*args, **kwargs):
        if sandbox.unavailable_reason():
            pytest.fail(f"no sandbox: {sandbox.unavailable_reason()}")
        return test(*args, **kwargs)
    return run

PROBE = r"""
import json, os, socket, subprocess, sys
def frame(header):
    os.write(1, (json.dumps({**header, "size": 0}) + "\n").encode())
writable = []
for path in (sys.prefix, os.path.dirname(os.__file__), "/usr", "/etc", "/grading/in"):
    try:
        open(os.path.join(path, "x"), "w")
        writable.append(path)
    except OSError:
        pass
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2)
    network = True
except OSError:
    network = False
frame({"type": "probe", "uid": os.getuid(), "env": sorted(os.environ), "writable": writable,
       "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), "network": network,
       "course": [p for p in %r if os.path.exists(p)]})
subprocess.Popen(["setsid", "sh", "-c", "exec sleep 300 # fa-lab-sandbox-orphan"], start_new_session=True)
""" + "%s"


def _probe(tmp_path, tail="", **limits):
    (tmp_path / "in").mkdir()
    reader = FrameReader(lambda header: 0, 1 << 20)
    binds = [(tree, tree) for tree in sandbox.python_trees()] + [(str(tmp_path / "in"), "/grading/in")]
    start = time.monotonic()
    course = [str(ROOT / name) for name in ("solutions", "tests", "fa_lab", "labs")]
    outcome = sandbox.run([sys.executable, "-c", PROBE % (course, tail)], binds, sandbox.sandbox_env({}),
                          "/tmp", sandbox.Limits(**limits), reader)
    return outcome, time.monotonic() - start


def _orphans() -> list[str]:
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if b"fa-lab-sandbox-orphan" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


@needs_sandbox
def test_the_sandbox_shows_little_and_leaves_nothing_behind(tmp_path):
    outcome, _ = _probe(tmp_path, budget=60)
    [probe] = [f.header for f in outcome.frames]
    assert probe["uid"] == sandbox.SANDBOX_UID and probe["writable"] == [] and probe["network"] is False
    assert set(probe["env"]) - {"PWD"} == set(sandbox.sandbox_env({})) and probe["course"] == []  # bwrap sets PWD
    assert probe["pids"] == [1, 2]  # bwrap's init and this python: nothing of the grader
    assert not _orphans()


@needs_sandbox
def test_the_budget_stops_a_sandbox_that_never_ends(tmp_path):
    outcome, took = _probe(tmp_path, "\nimport signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                     "os.kill(1, signal.SIGSTOP)\ntime.sleep(300)\n", budget=4)
    assert outcome.budget_exceeded and took < 4 + 10
    assert not _orphans()


@needs_sandbox
def test_limits_hold_in_the_sandbox(tmp_path):
    tail = """
import torch
def attempt(what, action):
    try:
        action()
        frame({"type": what, "held": False})
    except Exception as exc:
        frame({"type": what, "held": True, "error": type(exc).__name__})
attempt("memory", lambda: torch.ones(3 << 30, dtype=torch.uint8))
attempt("file", lambda: open("/tmp/big", "wb").write(bytes(96 << 20)))
attempt("processes", lambda: [subprocess.Popen(["sleep", "60"]) for _ in range(200)])
"""
    outcome, _ = _probe(tmp_path, tail, budget=60, memory=2 << 30, file_size=64 << 20, processes=64)
    held = {f.header["type"]: f.header["held"] for f in outcome.frames if f.header["type"] != "probe"}
    assert held == {"memory": True, "file": True, "processes": True}
    assert not _orphans()


def test_without_a_sandbox_grading_refuses_and_says_what_to_do(monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: "bubblewrap (bwrap) is not installed: ...")
    notebook = ROOT / "labs" / get_lab("lab01").notebook
    assert cli.main(["grade", str(notebook)]) == cli.GRADING_FAILED
    assert "no sandbox on this machine: bubblewrap" in capsys.readouterr().err
    assert "--no-sandbox" in sandbox.INSTALL_HINT


@pytest.mark.slow
def test_no_sandbox_grades_and_warns(tmp_path, capsys):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(ROOT / "labs" / get_lab("lab01").notebook, as_version=4)
    nb.cells = nb.cells[:2]
    path = tmp_path / "short.ipynb"
    nbformat.write(nb, path)
    out = tmp_path / "report.json"
    assert cli.main(["grade", str(path), "--no-sandbox", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sandboxed"] is False and report["score"] == 0
    assert {e["status"] for e in report["exercises"]} == {"missing"}
    assert "can read the answers" in capsys.readouterr().err


def test_a_judge_that_raises_costs_its_exercise_only(monkeypatch):
    """A reply no judge foresaw (say a division by zero in a judge) fails that exercise, with the reason."""
    from fa_lab.grading import grade
    from fa_lab.grading.registry import get_lab

    exercise = get_lab("lab04").exercises[-1]

    def broken(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(grade, "_score", broken)
    report = grade._judged(exercise, [], None, "", False)
    assert report.status == "failed" and report.points == 0
    assert "ZeroDivisionError" in report.messages[0] and exercise.function in report.messages[0]


def test_a_kernel_whose_prelude_fails_grades_nothing(tmp_path):
    """Without its prelude (torch's attention blocked) the kernel must not grade: the session refuses."""
    import asyncio

    nbformat = pytest.importorskip("nbformat")
    from fa_lab.grading.kernel import KernelSession

    async def start():
        async with KernelSession(nbformat.v4.new_notebook(), str(tmp_path), 60.0, prelude="1 / 0"):
            pass

    with pytest.raises(RuntimeError, match="prelude failed: ZeroDivisionError"):
        asyncio.run(start())
