"""Lab 08's checks accept the solution and reject typical wrong solutions with the right diagnosis.

Every mutant is the solution notebook's own code with one edit a learner might make (the test fails
if the edit no longer applies), run in-process through the same judges the grader uses, on the public
cases and the hidden cases of two seeds.
"""
from __future__ import annotations

import pytest
from labkit import LabChecks, Mutant, mutant_params

LAB = LabChecks("lab08", prelude="import math\n\nimport torch\nimport torch.nn.functional as F\n\n")


@pytest.mark.parametrize("exercise", LAB.exercise_names)
def test_solution_passes_public_and_hidden_cases(exercise):
    LAB.assert_solution_passes(exercise, seeds=(3, 4, 5))


STATE = "h = h * torch.exp2(last)[..., None] + (kc * torch.exp2(last - cum)[..., None]).transpose(-2, -1) @ vc"
DIFF = "diff = (cum[..., :, None] - cum[..., None, :]).masked_fill(cols > rows, float(\"-inf\"))"
CUM = "cum = g[:, :, start:end].float().cumsum(dim=-1) * RCP_LN2"
INTER = "inter = (qc @ h) * torch.exp2(cum)[..., None]"
INTRA = "intra = (qc @ kc.transpose(-2, -1) * torch.exp2(diff)) @ vc"
OUT = "o[:, :, start:end] = scale * (inter + intra)"
FILL = "x[..., rs, :r * 16] = -inv @ (lower[..., rs, :r * 16] @ x[..., :r * 16, :r * 16])"
ROW = "inv[..., i, :] = eye[i] - (block[..., i:i + 1, :i] @ inv[..., :i, :])[..., 0, :]"
EXP = [("chunk_linear_attention", old, old.replace("torch.exp2", "torch.exp")) for old in (STATE, INTER, INTRA)]
# (exercise, what the learner got wrong, edits of the solution, words the diagnosis must contain)
CASES = [
    ("chunk_linear_attention", "state not decayed across the chunk boundary",
     [("chunk_linear_attention", STATE, STATE.replace("h * torch.exp2(last)[..., None]", "h"))],
     "not decayed across the chunk boundary"),
    ("chunk_linear_attention", "keys not decayed to the chunk's end",
     [("chunk_linear_attention", STATE, STATE.replace("(kc * torch.exp2(last - cum)[..., None])", "kc"))],
     "keys are not decayed"),
    ("chunk_linear_attention", "inter-chunk term not decayed",
     [("chunk_linear_attention", INTER, "inter = qc @ h")], "inter-chunk term is not decayed"),
    ("chunk_linear_attention", "intra-chunk mask excludes the diagonal",
     [("chunk_linear_attention", DIFF, DIFF.replace("cols > rows", "cols >= rows"))], "excludes the diagonal"),
    ("chunk_linear_attention", "no causal mask inside the chunk",
     [("chunk_linear_attention", DIFF, DIFF.replace(".masked_fill(cols > rows, float(\"-inf\"))", ""))],
     "no causal mask"),
    ("chunk_linear_attention", "intra-chunk mask transposed",
     [("chunk_linear_attention", DIFF, DIFF.replace("cols > rows", "cols < rows"))], "transposed"),
    ("chunk_linear_attention", "exp instead of exp2 after the log2 fold", EXP, "used exp instead of exp2"),
    ("chunk_linear_attention", "exp2 without the log2 fold",
     [("chunk_linear_attention", CUM, CUM.replace(" * RCP_LN2", ""))], "without folding"),
    ("chunk_linear_attention", "gate cumulated over the whole sequence",
     [("chunk_linear_attention", CUM, "cum = g[:, :, :end].float().cumsum(dim=-1)[..., start:] * RCP_LN2")],
     "whole sequence"),
    ("chunk_linear_attention", "exclusive cumulative sum",
     [("chunk_linear_attention", CUM,
       "cum = (g[:, :, start:end].float().cumsum(dim=-1) - g[:, :, start:end]) * RCP_LN2")],
     "exclusive"),
    ("chunk_linear_attention", "scale not applied",
     [("chunk_linear_attention", OUT, "o[:, :, start:end] = inter + intra")], "scale is not applied"),
    ("chunk_linear_attention", "an (N, N) mask",
     [("chunk_linear_attention", DIFF, "full = torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1)\n        " +
       DIFF.replace("cols > rows", "full[start:end, start:end]"))], "created a tensor of"),
    ("solve_tril", "the inverse transposed",
     [("solve_tril", "return x[..., :n, :n]", "return x[..., :n, :n].transpose(-2, -1)")], "transposed"),
    ("solve_tril", "I - L inverted",
     [("solve_tril", ROW, ROW.replace("eye[i] -", "eye[i] +")), ("solve_tril", FILL, FILL.replace("= -inv", "= inv"))],
     "inverted I - L"),
    ("solve_tril", "block rows below the diagonal left zero",
     [("solve_tril", "        if r:\n", "        if False:\n")], "blocks below the diagonal are zero"),
    ("solve_tril", "fill without the diagonal block's inverse",
     [("solve_tril", FILL, FILL.replace("-inv @ (", "-("))], "misses the inverse of its diagonal block"),
    ("solve_tril", "fill without the inverse of the blocks above",
     [("solve_tril", FILL, "x[..., rs, :r * 16] = -inv @ lower[..., rs, :r * 16]")],
     "misses the inverse of the blocks above"),
    ("solve_tril", "the first-order approximation",
     [("solve_tril", "    lower = F.pad(", "    return torch.eye(n, dtype=a.dtype) - torch.tril(a, diagonal=-1)\n"
       "    lower = F.pad(")], "first-order"),
]
MUTANTS = [Mutant(exercise, mistake, edits, words, seeds=(11, 12)) for exercise, mistake, edits, words in CASES]


@pytest.mark.parametrize("mutant", mutant_params(MUTANTS))
def test_mutant_fails_with_its_diagnosis(mutant):
    LAB.assert_mutant_diagnosed(mutant)
