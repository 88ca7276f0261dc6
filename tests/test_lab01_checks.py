"""Lab 01's checks accept the solution and reject typical wrong solutions with the right diagnosis.

Every mutant is the solution notebook's own code with one edit a learner might
make (the test fails if the edit no longer applies), run in-process through the
same judges the grader uses, on the public cases and the hidden cases of two seeds.
"""
from __future__ import annotations

import pytest
from labkit import ROOT, assert_diagnosed, assert_no_failures, exercise_results, run_sources, solution_cells

from fa_lab.grading.registry import get_lab

SOLUTION = ROOT / "solutions" / "lab01_flash_attention_cpu.ipynb"
LAB = get_lab("lab01")
EXERCISES = {e.name: e for e in LAB.exercises}
SEEDS = (11, 12)


def solution_namespace(edits=(), function=None):
    """Run the solution's exercise cells (edited, for a mutant) and return the namespace."""
    return run_sources(solution_cells(SOLUTION), edits, function, prelude="import torch\n")


def results_for(exercise_name, namespace, seeds=SEEDS):
    return exercise_results(EXERCISES[exercise_name], namespace, seeds)


@pytest.mark.parametrize("exercise", [e.name for e in LAB.exercises])
def test_solution_passes_public_and_hidden_cases(exercise):
    assert_no_failures(results_for(exercise, solution_namespace(), seeds=(3, 4, 5)))


# (exercise, what the learner got wrong, edits of the solution, words the diagnosis must contain)
MUTANTS = [
    ("online_softmax", "l not rescaled",
     [("l = torch.exp(m - m_safe) * l + ", "l = l + ")], "l is not rescaled"),
    ("online_softmax", "rescale with the wrong sign",
     [("torch.exp(m - m_safe) * l", "torch.exp(m_safe - m) * l")], "exp(m_new - m_old)"),
    ("online_softmax", "no max subtraction",
     [("l = torch.exp(m - m_safe) * l + torch.exp(block - m_safe[..., None]).sum(dim=-1)",
       "l = l + torch.exp(block).sum(dim=-1)")], "subtract"),
    ("online_softmax", "m is the block max",
     [("m_new = torch.maximum(m, block.amax(dim=-1))", "m_new = block.amax(dim=-1)")], "running max"),
    ("online_softmax", "no guard for a max of -inf",
     [("m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)", "m_safe = m_new")],
     "-inf"),
    ("flash_forward", "accumulator not rescaled",
     [("acc = alpha[..., None] * acc + ", "acc = acc + ")], "accumulator is not rescaled"),
    ("flash_forward", "l not rescaled",
     [("l = alpha * l + p.sum(dim=-1)", "l = l + p.sum(dim=-1)")], "l is not rescaled"),
    ("flash_forward", "rescale with the wrong sign",
     [("alpha = torch.exp(m - m_safe)", "alpha = torch.exp(m_safe - m)")], "wrong sign"),
    ("flash_forward", "no max subtraction, so large scores overflow",
     [("p = torch.exp(s - m_safe[..., None])", "p = torch.exp(s)"),
      ("alpha = torch.exp(m - m_safe)", "alpha = torch.ones_like(m)"),
      ("lse[..., i0:i1] = m + torch.log(l)", "lse[..., i0:i1] = torch.log(l)")], "overflow"),
    ("flash_forward", "lse in log2",
     [("lse[..., i0:i1] = m + torch.log(l)", "lse[..., i0:i1] = (m + torch.log(l)) / math.log(2)"),
      ("def flash_forward(", "import math\n\n\ndef flash_forward(")], "log base 2"),
    ("flash_forward", "causal mask off by one",
     [("causal_tile_mask", "return cols <= rows + (seqlen_k - seqlen_q)",
       "return cols <= rows + (seqlen_k - seqlen_q) + 1"),
      ("key_end", "return max(0, min(seqlen_k, i1 + seqlen_k - seqlen_q))",
       "return max(0, min(seqlen_k, i1 + seqlen_k - seqlen_q + 1))")], "off by one"),
    ("flash_forward", "causal mask misses the diagonal",
     [("causal_tile_mask", "return cols <= rows + (seqlen_k - seqlen_q)",
       "return cols < rows + (seqlen_k - seqlen_q)")],
     "off by one"),
    ("flash_forward", "causal mask aligned top-left",
     [("causal_tile_mask", "return cols <= rows + (seqlen_k - seqlen_q)", "return cols <= rows"),
      ("key_end", "return max(0, min(seqlen_k, i1 + seqlen_k - seqlen_q))", "return min(seqlen_k, i1)")],
     "top-left"),
    ("flash_forward", "scale applied twice",
     [("s = q_tile @ k[..., j0:j1, :].float().transpose(-2, -1)",
       "s = q_tile @ k[..., j0:j1, :].float().transpose(-2, -1) * scale")], "scale is applied twice"),
    ("flash_forward", "no guard for queries that see no key",
     [("(acc / torch.where(l == 0, 1.0, l)[..., None])", "(acc / l[..., None])")], "see no key"),
    ("flash_forward", "out not normalized",
     [("(acc / torch.where(l == 0, 1.0, l)[..., None])", "acc")], "not normalized"),
    ("flash_forward", "the whole score matrix at once",
     [("for i0 in range(0, seqlen_q, block_q):", "block_q = block_k = max(seqlen_q, seqlen_k)\n"
       "    for i0 in range(0, seqlen_q, block_q):")], "tile"),
    ("flash_backward", "D term missing",
     [("ds = p * (do_tile @ v_tile.transpose(-2, -1) - delta[..., i0:i1, None])",
       "ds = p * (do_tile @ v_tile.transpose(-2, -1))")], "D term is missing"),
    ("flash_backward", "scale missing in dq and dk",
     [("dq[..., i0:i1, :] += ds @ k_tile * scale", "dq[..., i0:i1, :] += ds @ k_tile"),
      ("dk[..., j0:j1, :] += ds.transpose(-2, -1) @ q_tile * scale",
       "dk[..., j0:j1, :] += ds.transpose(-2, -1) @ q_tile")], "miss the softmax scale"),
    ("flash_backward", "scale applied twice when recomputing S",
     [("s = (q_tile @ k_tile.transpose(-2, -1)) * scale",
       "s = (q_tile * scale @ k_tile.transpose(-2, -1)) * scale")],
     "scale is applied twice"),
    ("flash_backward", "causal mask forgotten in the backward",
     [("            if causal:\n                s = s.masked_fill("
       "~causal_tile_mask(i0, i1, j0, j1, seqlen_q, seqlen_k), float(\"-inf\"))\n"
       "            p = torch.exp(s - lse",
       "            p = torch.exp(s - lse")], "causal"),
    ("flash_backward", "no guard for an lse of -inf",
     [("lse = torch.where(torch.isinf(lse), float(\"inf\"), lse)", "")], "see no key"),
    ("autograd_function", "gradients in the wrong order",
     [("return dq, dk, dv, None, None", "return dk, dq, dv, None, None")], "order"),
    ("autograd_function", "too few gradients",
     [("return dq, dk, dv, None, None", "return dq, dk, dv")], "None for each non-tensor input"),
    ("autograd_function", "causal not passed to the backward",
     [("flash_backward(q, k, v, out, lse, dout, ctx.causal, ctx.scale)",
       "flash_backward(q, k, v, out, lse, dout, False, ctx.scale)")], "causal"),
    ("autograd_function", "scale not passed to the backward",
     [("flash_backward(q, k, v, out, lse, dout, ctx.causal, ctx.scale)",
       "flash_backward(q, k, v, out, lse, dout, ctx.causal)")], "scale"),
    ("autograd_function", "grad_out ignored",
     [("flash_backward(q, k, v, out, lse, dout, ctx.causal, ctx.scale)",
       "flash_backward(q, k, v, out, lse, torch.ones_like(dout), ctx.causal, ctx.scale)")], "grad_out"),
]


@pytest.mark.parametrize("exercise, mistake, edits, words", MUTANTS, ids=[m[1] for m in MUTANTS])
def test_mutant_fails_with_its_diagnosis(exercise, mistake, edits, words):
    results = results_for(exercise, solution_namespace(edits, EXERCISES[exercise].function))
    assert_diagnosed(EXERCISES[exercise], results, mistake, words)
