"""Grading lab 03: the Triton kernel's calls under the grader's guard, and whole gradings in real kernels.

The kernel tests (marked slow) grade the solution (full marks) and the solution with Part 2 left
undone (Part 1's points only); the lab as handed out is graded with the other labs in
test_grading.py. Each checks that the submission is left unchanged.
"""

import nbformat
import pytest
import torch
from labkit import ROOT, digest, grade_json

import fa_lab
from fa_lab.grading.assign import strip_solutions
from fa_lab.grading.check import run_exercise
from fa_lab.grading.registry import get_lab
from fa_lab.kernels import load_triton

SOLUTION = ROOT / "solutions" / "lab03_triton_forward.ipynb"
LAB = get_lab("lab03")
EXERCISES = {e.name: e for e in LAB.exercises}


# ---- in-process: the course's kernels are forbidden, the interpreter's fixes are not -------------

def _fa_lab_triton(q, k, v, causal, scale, block_m, block_n):
    return fa_lab.attention(q, k, v, causal, scale, impl="triton", return_lse=True)


def _course_launcher(q, k, v, causal, scale, block_m, block_n):
    from fa_lab.kernels.portable.attention import triton_attention
    return triton_attention(q, k, v, causal, scale)


def _course_kernel(q, k, v, causal, scale, block_m, block_n):
    """Launches the course's kernel itself, without fa_lab's launchers."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fa_lab.kernels.portable.forward import attention_fwd_kernel

    def describe(t, rows):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]])

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, lse = torch.empty_like(q), torch.empty(q.shape[:-1])
    grid = (-(-q.shape[2] // 16), q.shape[0] * q.shape[1])
    qk_scale = (scale or q.shape[-1] ** -0.5) * 1.4427
    unused = (1, 0, 0, 0.0, 0.0, lse, lse, lse, lse, out, 0)  # GQA group, options and varlen arguments, all off
    attention_fwd_kernel[grid](describe(q, 16), describe(k, 16), describe(v, 16), describe(out, 16), lse,
                               q.shape[1], q.shape[2], k.shape[2], qk_scale, *unused, BLOCK_M=16, BLOCK_N=16,
                               HEAD_DIM=q.shape[-1], CAUSAL=causal, REVERSE_GRID=False, WINDOW=False,
                               SOFTCAP=False, ALIBI=False, GQA=False, VARLEN=False)
    return out, lse


@pytest.mark.parametrize("fn, named", [
    (_fa_lab_triton, "fa_lab.attention"),
    (_course_launcher, "fa_lab.kernels.portable.attention.triton_attention"),
    (_course_kernel, "fa_lab.kernels.portable.forward.attention_fwd_kernel"),
])
def test_calling_the_course_kernels_is_forbidden(fn, named):
    exercise = EXERCISES["forward_kernel"]
    [(_, verdict)] = run_exercise(exercise, fn, exercise.cases()[:1])
    assert not verdict.passed and named in verdict.message, verdict.message
    assert "interpreter_fixes" not in verdict.message


triton = load_triton()


@triton.jit
def _round_trip_kernel(src_ptr, dst_ptr, n, BLOCK: triton.language.constexpr):
    # Through float32 and back: a bfloat16 round trip goes through fa_lab's interpreter fixes.
    offs = triton.language.arange(0, BLOCK)
    x = triton.language.load(src_ptr + offs, mask=offs < n, other=0.0).to(triton.language.float32)
    triton.language.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty), mask=offs < n)


def test_interpreter_fixes_are_not_forbidden():
    """A kernel of the learner's own is not flagged for the interpreter fixes it goes through
    (this one returns q as out: wrong, but it calls nothing forbidden)."""
    def not_attention(q, k, v, causal, scale, block_m, block_n):
        out = torch.empty_like(q)
        _round_trip_kernel[(1,)](q, out, q.numel(), BLOCK=triton.next_power_of_2(q.numel()))
        return out, torch.zeros(q.shape[:-1])

    exercise = EXERCISES["forward_kernel"]
    bfloat16 = [c for c in exercise.cases() if c.args[0].dtype == torch.bfloat16][:1]
    [(_, verdict)] = run_exercise(exercise, not_attention, bfloat16)
    assert not verdict.passed and "your function called" not in verdict.message, verdict.message


# ---- whole gradings in real kernels ----------------------------------------------------------

@pytest.mark.slow
def test_the_solution_gets_full_marks(tmp_path):
    before = digest(SOLUTION)
    status, report = grade_json(SOLUTION, tmp_path)
    assert status == 0 and report["lab"] == "lab03"
    assert report["score"] == report["max_score"] == 10
    assert [e["name"] for e in report["exercises"]] == list(EXERCISES)
    for exercise in report["exercises"]:
        assert exercise["points"] == exercise["max_points"] and exercise["messages"] == []
        assert exercise["passed"] == exercise["cases"] > len(EXERCISES[exercise["name"]].cases())
    assert digest(SOLUTION) == before


@pytest.mark.slow
def test_part_1_alone_earns_part_1s_points(tmp_path):
    """The solution with Part 2's helpers and Part 3's backward as handed out: they raise NotImplementedError."""
    nb = nbformat.read(SOLUTION, as_version=4)
    for cell in nb.cells:
        if any(f"def {name}(" in cell.source for name in ("causal_key_end", "causal_query_start",
                                                           "flash_backward_triton")):
            cell.source = strip_solutions(cell.source)
    path = tmp_path / "part1.ipynb"
    nbformat.write(nb, path)
    before = digest(path)
    status, report = grade_json(path, tmp_path)
    exercises = {e["name"]: e for e in report["exercises"]}
    assert status == 0 and report["score"] == exercises["forward_kernel"]["max_points"]
    causal = exercises["causal_kernel"]
    assert causal["points"] == 0 and len(causal["messages"]) == 1
    assert "causal_key_end" in causal["messages"][0] and "NotImplementedError" in causal["messages"][0]
    assert digest(path) == before
