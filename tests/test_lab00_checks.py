"""Lab 00's checks accept the solution and reject typical wrong counts with the right diagnosis.

Every mutant is the solution notebook's own code with one edit a learner might make (the test fails
if the edit no longer applies), run in-process through the same judges the grader uses, on the public
cases and the hidden cases of two seeds.
"""
from __future__ import annotations

import pytest
from labkit import LabChecks, Mutant, mutant_params

LAB = LabChecks("lab00")


@pytest.mark.parametrize("exercise", LAB.exercise_names)
def test_solution_passes_public_and_hidden_cases(exercise):
    LAB.assert_solution_passes(exercise, seeds=(3, 4, 5))


FLOPS = "flops = 4 * batch * heads * seqlen_q * seqlen_k * head_dim"
NAIVE = "per_head = 4 * scores + 2 * (seqlen_q + seqlen_k) * head_dim"
FLASH = "elements = seqlen_q * head_dim + tiles * 2 * seqlen_k * head_dim + seqlen_q * head_dim"
LSE = "return (elements * dtype_bytes + 4 * seqlen_q) * batch * heads"
PEAK = "return (2 * seqlen_q * seqlen_k + seqlen_q * head_dim) * dtype_bytes * batch * heads"
# (exercise, what the learner got wrong, edits of the solution, words the diagnosis must contain)
CASES = [
    ("attention_flops", "one matmul", [("attention_flops", FLOPS, FLOPS.replace("4 *", "2 *"))], "two"),
    ("attention_flops", "causal not halved",
     [("attention_flops", "return flops // 2 if causal else flops", "return flops")], "causal is not halved"),
    ("naive_hbm_bytes", "elements, not bytes",
     [("naive_hbm_bytes", "return per_head * dtype_bytes * batch * heads", "return per_head * batch * heads")],
     "elements, not bytes"),
    ("naive_hbm_bytes", "the write of P forgotten",
     [("naive_hbm_bytes", NAIVE, NAIVE.replace("4 * scores", "3 * scores"))], "write of P"),
    ("naive_hbm_bytes", "float32 sizes",
     [("naive_hbm_bytes", "return per_head * dtype_bytes * batch * heads", "return per_head * 4 * batch * heads")],
     "float32"),
    ("flash_hbm_bytes", "K and V read once",
     [("flash_hbm_bytes", "tiles = -(-seqlen_q // block_q)", "tiles = 1")], "read once per head"),
    ("flash_hbm_bytes", "the LSE forgotten", [("flash_hbm_bytes", LSE, LSE.replace(" + 4 * seqlen_q", ""))],
     "log-sum-exp is missing"),
    ("flash_hbm_bytes", "the LSE in the input dtype",
     [("flash_hbm_bytes", LSE, LSE.replace("4 * seqlen_q", "dtype_bytes * seqlen_q"))], "float32 (4 bytes)"),
    ("flash_hbm_bytes", "tiles rounded down",
     [("flash_hbm_bytes", "tiles = -(-seqlen_q // block_q)", "tiles = seqlen_q // block_q")], "rounded down"),
    ("attainable_tflops", "max instead of min",
     [("attainable_tflops", "return min(peak_tflops, hbm_tb_s * intensity)",
       "return max(peak_tflops, hbm_tb_s * intensity)")], "smaller of the two"),
    ("attainable_tflops", "no compute ceiling",
     [("attainable_tflops", "return min(peak_tflops, hbm_tb_s * intensity)", "return hbm_tb_s * intensity")],
     "compute ceiling is missing"),
    ("naive_peak_bytes", "one matrix", [("naive_peak_bytes", PEAK, PEAK.replace("2 * seqlen_q", "seqlen_q"))],
     "holds two"),
    ("naive_peak_bytes", "O forgotten", [("naive_peak_bytes", PEAK, PEAK.replace(" + seqlen_q * head_dim", ""))],
     "output O"),
]
MUTANTS = [Mutant(exercise, mistake, edits, words, seeds=(11, 12)) for exercise, mistake, edits, words in CASES]


@pytest.mark.parametrize("mutant", mutant_params(MUTANTS))
def test_mutant_fails_with_its_diagnosis(mutant):
    LAB.assert_mutant_diagnosed(mutant)
