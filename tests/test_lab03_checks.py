"""Lab 03's checks accept the solution's Triton kernel and reject typical wrong kernels with the right
diagnosis.

Every mutant is the solution notebook's own code with one edit a learner might make (the test fails
if the edit no longer applies), run in-process, in Triton's interpreter, through the same judges the
grader uses, on the public cases and (marked slow) on the hidden cases of one seed.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from labkit import LabChecks, Mutant, mutant_params

PRELUDE = ("import torch\nfrom fa_lab.kernels import load_triton\n"
           "triton = load_triton()\nimport triton.language as tl\n")
LAB = LabChecks("lab03", prelude=PRELUDE, seeds=(11,))


@pytest.mark.parametrize("exercise", LAB.exercise_names)
def test_solution_passes_public_and_hidden_cases(exercise):
    LAB.assert_solution_passes(exercise, seeds=(3, 4))


KERNEL, LAUNCHER = "flash_forward_kernel", "flash_forward_triton"
DKDV, DQ, BACKWARD = "flash_backward_dkdv_kernel", "flash_backward_dq_kernel", "flash_backward_triton"
CAUSAL_KEY_END = "start_m + BLOCK_M + seqlen_k - seqlen_q"
# (exercise, what the learner got wrong, edits of the solution, words the diagnosis must contain)
CASES = [
    ("forward_kernel", "padding keys keep a score of 0",
     [(KERNEL, 's = tl.where(visible, s, float("-inf"))', "")], "padding keys count"),
    ("forward_kernel", "key seqlen_k counts",
     [(KERNEL, "visible = offs_n[None, :] < seqlen_k", "visible = offs_n[None, :] <= seqlen_k")],
     "one past the last"),
    ("forward_kernel", "grid misses the partial query tile",
     [(LAUNCHER, "grid = (triton.cdiv(seqlen_q, block_m), batch * heads)",
       "grid = (seqlen_q // block_m, batch * heads)")], "triton.cdiv(seqlen_q, BLOCK_M)"),
    # The rows no program writes hold what the allocator gave: pin that down both ways (NaN, zeros).
    *[("forward_kernel", f"grid misses the partial query tile, outputs start as {fill}",
       [(LAUNCHER, "grid = (triton.cdiv(seqlen_q, block_m), batch * heads)",
         "grid = (seqlen_q // block_m, batch * heads)"),
        (LAUNCHER, "out = torch.empty_like(q)", f"out = torch.full_like(q, {fill})"),
        (LAUNCHER, "lse = torch.empty((batch, heads, seqlen_q),",
         f"lse = torch.full((batch, heads, seqlen_q), {fill},")], "triton.cdiv(seqlen_q, BLOCK_M)")
      for fill in ("float('nan')", "0.0")],
    ("forward_kernel", "q, k, v not made contiguous",
     [(LAUNCHER, "q, k, v = q.contiguous(), k.contiguous(), v.contiguous()", "")], "non-contiguous"),
    ("forward_kernel", "lse in log2",
     [(KERNEL, "(m_i + tl.math.log2(l_safe)) * 0.6931471805599453", "(m_i + tl.math.log2(l_safe))")],
     "log base 2"),
    ("forward_kernel", "lse without the max",
     [(KERNEL, "(m_i + tl.math.log2(l_safe)) * 0.6931471805599453",
       "tl.math.log2(l_safe) * 0.6931471805599453")], "missing the running max"),
    ("forward_kernel", "accumulator not rescaled",
     [(KERNEL, "acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot(")],
     "accumulator is not rescaled"),
    ("forward_kernel", "l not rescaled",
     [(KERNEL, "l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)")], "l is not rescaled"),
    ("forward_kernel", "scale applied twice",
     [(KERNEL, "s = tl.dot(q, tl.trans(k)) * qk_scale", "s = tl.dot(q, tl.trans(k)) * qk_scale * scale")],
     "scale is applied twice"),
    ("forward_kernel", "a typo inside the kernel",
     [(KERNEL, "l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_j * alpha + tl.sum(p, 1)")],
     "NameError(\"name 'l_j' is not defined\") (in flash_forward_kernel, at: l_i = l_j * alpha"),
    ("causal_kernel", "causal mask misses the diagonal",
     [("causal_visible", "offs_n[None, :] <= offs_m[:, None]", "offs_n[None, :] < offs_m[:, None]")],
     "off by one"),
    ("causal_kernel", "causal mask one key too far",
     [("causal_visible", "offs_m[:, None] + (seqlen_k - seqlen_q)",
       "offs_m[:, None] + (seqlen_k - seqlen_q) + 1"),
      ("causal_key_end", "start_m + BLOCK_M + seqlen_k - seqlen_q",
       "start_m + BLOCK_M + seqlen_k - seqlen_q + 1")],
     "off by one"),
    ("causal_kernel", "causal mask aligned top-left",
     [("causal_visible", "offs_m[:, None] + (seqlen_k - seqlen_q)", "offs_m[:, None]"),
      ("causal_key_end", "start_m + BLOCK_M + seqlen_k - seqlen_q", "start_m + BLOCK_M")], "top-left"),
    ("causal_kernel", "causal mask only in the last tile of a program",
     [(KERNEL, "if CAUSAL:  # Part 2: nor do",
       "if CAUSAL and start_n + BLOCK_N >= key_end:  # Part 2: nor do")],
     "only in the last key tile"),
    ("causal_kernel", "no block skipping",
     [("causal_key_end", "return tl.minimum(seqlen_k, start_m + BLOCK_M + seqlen_k - seqlen_q)",
       "return seqlen_k")], "must skip the key tiles"),
    ("causal_kernel", "no guard for a running max of -inf",
     [(KERNEL, 'm_safe = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_safe = m_new")], "see no key"),
    ("causal_kernel", "no guard for l = 0",
     [(KERNEL, "out = acc / l_safe[:, None]", "out = acc / l_i[:, None]")], "see no key"),
    ("causal_kernel", "Part 2 not written yet",
     [("causal_visible", "return offs_n[None, :] <= offs_m[:, None] + (seqlen_k - seqlen_q)",
       "raise NotImplementedError")], "still raises NotImplementedError"),
    ("causal_kernel", "causal_key_end from the tile's first row",
     [("causal_key_end", CAUSAL_KEY_END, "start_m + seqlen_k - seqlen_q")], "first row's keys"),
    ("causal_kernel", "causal mask inverted",
     [("causal_visible", "offs_n[None, :] <= offs_m[:, None]", "offs_n[None, :] >= offs_m[:, None]")], "inverted"),
    ("forward_kernel", "q pointer not moved to its (batch, head)",
     [(KERNEL, "    q_ptr += bh * seqlen_q * head_dim\n", "")], "(batch 0, head 0) is right"),
    ("forward_kernel", "running max never updated", [(KERNEL, "        m_i = m_new\n", "")], "never updated"),
    ("forward_kernel", "tl.exp of base-2 scores",
     [(KERNEL, "alpha = tl.math.exp2(m_i - m_safe)", "alpha = tl.exp(m_i - m_safe)"),
      (KERNEL, "p = tl.math.exp2(s - m_safe[:, None])", "p = tl.exp(s - m_safe[:, None])")], "base-2 units"),
    # The backward kernels (Part 3).
    ("backward_kernel", "dq and dk without the scale",
     [(DKDV, "(dk * scale).to(dk_ptr.dtype.element_ty)", "dk.to(dk_ptr.dtype.element_ty)"),
      (DQ, "(dq * scale).to(dq_ptr.dtype.element_ty)", "dq.to(dq_ptr.dtype.element_ty)")], "miss the softmax scale"),
    ("backward_kernel", "D without the row sum",
     [(BACKWARD, "delta = (dout.float() * out.float()).sum(dim=-1).contiguous()",
       "delta = (dout.float() * out.float()).contiguous()")], "D = rowsum(dO * O)"),
    ("backward_kernel", "exp of base-2 scores",
     [(DKDV, "p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None] * 1.4426950408889634)\n"
             "        visible = offs_n[None, :] < seqlen_k\n        if CAUSAL:\n"
             "            visible = visible & causal_visible(offs_m, offs_n, seqlen_q, seqlen_k)\n"
             "        p = tl.where(visible, p, 0.0)  # also",
       "p = tl.exp(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None] * 1.4426950408889634)\n"
       "        visible = offs_n[None, :] < seqlen_k\n        if CAUSAL:\n"
       "            visible = visible & causal_visible(offs_m, offs_n, seqlen_q, seqlen_k)\n"
       "        p = tl.where(visible, p, 0.0)  # also"),
      (DQ, "p = tl.math.exp2(", "p = tl.exp(")], "tl.exp of base-2"),
    ("backward_kernel", "the dK/dV loop starts a tile late",
     [("causal_query_start", "// BLOCK_M * BLOCK_M", "// BLOCK_M * BLOCK_M + BLOCK_M")], "one Q tile late"),
]
# What a mistake must never be told (a cause it is not).
NEVER = {"causal_key_end from the tile's first row": ("last query tile, which is partial",)}
MUTANTS = [Mutant(exercise, mistake, edits, words, never=NEVER.get(mistake, ()))
           for exercise, mistake, edits, words in CASES]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's, in the interpreter, for NaN and 0 / 0
@pytest.mark.parametrize("cases", ["public", pytest.param("hidden", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mutant", mutant_params(MUTANTS))
def test_mutant_fails_with_its_diagnosis(mutant, cases):
    """On the public cases, and (slow) on the hidden cases of one seed."""
    hidden = cases == "hidden"
    LAB.assert_mutant_diagnosed(replace(mutant, seeds=LAB.seeds if hidden else (), public=not hidden))
