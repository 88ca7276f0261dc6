"""Lab 04's checks accept the solution and reject typical wrong solutions with the right diagnosis.

Every mutant is the solution notebook's own code with one edit a learner might
make (the test fails if the edit no longer applies), run in-process through the
same judges the grader uses, on the public cases and the hidden cases of two seeds
(the error table's mutants on its public case only: a case takes about a second).
"""
from __future__ import annotations

import pytest
import torch
from labkit import LabChecks, Mutant, code_cells, mutant_params

from fa_lab.grading import harness
from fa_lab.grading.check import run_exercise
from fa_lab.grading.labs.lab04_table import TABLE_SHAPE


def _definition_cells(notebook) -> list[str]:
    """The imports and every cell that starts by defining something (functions, TABLE_SHAPE), without
    the demonstrations and checks."""
    return [s for s in code_cells(notebook) if s.startswith(("import", "def ", "TABLE_SHAPE"))
            and "print(" not in s and "check(" not in s]


LAB = LabChecks("lab04", cells=_definition_cells)
EXERCISES = {name: LAB.exercise(name) for name in LAB.exercise_names}


def solution_namespace(edits=(), function=None):
    return LAB.namespace(edits, function)


@pytest.mark.parametrize("exercise", LAB.exercise_names)
def test_solution_passes_public_and_hidden_cases(exercise):
    LAB.assert_solution_passes(exercise, seeds=(3,) if exercise == "fp8_error_table" else (3, 4, 5))


def test_the_notebook_uses_the_graders_table_shape():
    assert solution_namespace()["TABLE_SHAPE"] == TABLE_SHAPE


FORBIDDEN = "This exercise asks you to write the computation yourself"
HADAMARD_BY_MATRIX = """    head_dim = x.shape[-1]
    h = torch.ones(1, 1, dtype=x.dtype)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return x @ h / math.sqrt(head_dim)
"""

HADAMARD_ROUNDS = "while h < head_dim:"
HADAMARD_END = "return (y / math.sqrt(head_dim)).reshape(x.shape)"
ROTATE = "return hadamard(q * signs), hadamard(k * signs)"
FLASH_FP8 = '"flash_fp8": fp8_attention(q, k, v, signs, block=128)'
NO_INCOHERENT = '"flash_fp8_no_incoherent": fp8_attention(q, k, v, None, block=128)'
# (exercise, what the learner got wrong, edits of the solution, words the diagnosis must contain)
CASES = [
    ("quantize_blocks", "one scale for all blocks",
     [("amax = padded.abs().reshape(batch, heads, num_blocks, block * head_dim).amax(dim=-1)",
       "amax = padded.abs().amax().expand(batch, heads, num_blocks)")], "one scale for all blocks"),
    ("quantize_blocks", "scale = amax, not amax / 448",
     [("amax / E4M3_MAX, torch.ones_like(amax)", "amax, torch.ones_like(amax)")], "448 times too large"),
    ("quantize_blocks", "scale applied the wrong way",
     [("(x / scale_per_row(scales, block, seqlen))", "(x * scale_per_row(scales, block, seqlen))")],
     "data = x * scale"),
    ("quantize_blocks", "blocks along the wrong dimension",
     [("padded.abs().reshape(batch, heads, num_blocks, block * head_dim).amax(dim=-1)",
       "padded.abs().reshape(batch, heads, block, num_blocks, head_dim).amax(dim=(2, 4))")],
     "not runs of consecutive rows"),
    ("quantize_blocks", "an all-zero block gets scale 0",
     [("torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))", "amax / E4M3_MAX")],
     "all-zero block"),
    ("quantize_blocks", "the last, shorter block is dropped",
     [("num_blocks = -(-seqlen // block)", "num_blocks = seqlen // block")], "block does not divide N"),
    ("quantize_blocks", "scales computed in the input's dtype",
     [("    x = x.float()\n", ""), ("return data, scales", "return data, scales.float()")], "computed in"),
    ("quantize_blocks", "calls fa_lab.fp8",
     [("    batch, heads, seqlen, head_dim = x.shape\n",
       "    from fa_lab.fp8 import quantize_e4m3\n    fp8 = quantize_e4m3(x, block)\n"
       "    return fp8.data, fp8.scales\n")], "fa_lab.fp8.quantize_e4m3"),
    ("hadamard", "not normalized",
     [("return (y / math.sqrt(head_dim)).reshape(x.shape)", "return y.reshape(x.shape)")], "not normalized"),
    ("hadamard", "divided by d",
     [("y / math.sqrt(head_dim)", "y / head_dim")], "instead of sqrt(d)"),
    ("hadamard", "every round pairs the same neighbours",
     [("pairs = y.reshape(-1, head_dim // (2 * h), 2, h)", "pairs = y.reshape(-1, head_dim // 2, 2, 1)")],
     "same neighbours"),
    ("hadamard", "sums and differences interleaved",
     [("torch.stack((a + b, a - b), dim=2)", "torch.stack((a + b, a - b), dim=-1)")], "next to each other"),
    ("hadamard", "view on a non-contiguous input",
     [("y = x.reshape(-1, head_dim)", "y = x.view(-1, head_dim)")], "non-contiguous"),
    ("hadamard", "a d x d matrix product",
     [("    head_dim = x.shape[-1]\n", HADAMARD_BY_MATRIX)], "no d x d matrix"),
    ("hadamard", "calls fa_lab.fp8",
     [("    head_dim = x.shape[-1]\n", "    from fa_lab.fp8 import hadamard_transform\n"
       "    return hadamard_transform(x)\n")], "fa_lab.fp8.hadamard_transform"),
    ("rotate_qk", "the rotation applied to V instead of K (K returned as is)",
     [("return hadamard(q * signs), hadamard(k * signs)", "return hadamard(q * signs), k")],
     "k is returned unrotated"),
    ("rotate_qk", "signs after the transform on one side",
     [("return hadamard(q * signs), hadamard(k * signs)", "return hadamard(q * signs), hadamard(k) * signs")],
     "signs of k are applied after the transform"),
    ("rotate_qk", "different signs for q and k",
     [("return hadamard(q * signs), hadamard(k * signs)",
       "return hadamard(q * signs), hadamard(k * signs.flip(0))")], "differ from the signs argument"),
    ("rotate_qk", "signs ignored",
     [("return hadamard(q * signs), hadamard(k * signs)", "return hadamard(q), hadamard(k)")],
     "signs are ignored"),
    ("rotate_qk", "signs left in float32",
     [("    signs = signs.to(q.dtype)\n", "")], "has dtype torch.float32, expected torch.bfloat16"),
    ("rotate_qk", "calls fa_lab.fp8",
     [("    signs = signs.to(q.dtype)\n", "    from fa_lab.fp8 import incoherent_rotation\n"
       "    return incoherent_rotation(q, k, signs)\n")], "fa_lab.fp8.incoherent_rotation"),
    ("fp8_error_table", "flash_fp8 without the rotation",
     [('"flash_fp8": fp8_attention(q, k, v, signs, block=128)',
       '"flash_fp8": fp8_attention(q, k, v, None, block=128)')],
     "equals your flash_fp8_no_incoherent"),
    ("fp8_error_table", "V rotated too",
     [("fp8_attention", "q, k = rotate_qk(q, k, signs)",
       "q, k = rotate_qk(q, k, signs)\n        v = hadamard(v * signs)")],
     "V is never rotated"),
    ("fp8_error_table", "reference from the fp16 inputs",
     [("reference = reference_attention(q64, k64, v64)[0]",
       "reference = reference_attention(q64.half(), k64.half(), v64.half())[0]")], "fp16 rows are too small"),
    ("fp8_error_table", "softmax scale missing",
     [("fp8_attention", "s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])",
       "s = q @ k.transpose(-2, -1)")],
     "all three FP8 flash rows are off"),
    ("fp8_error_table", "mean absolute error instead of RMSE",
     [("rmse(out, reference)", "(out.double() - reference).abs().mean().item()")],
     "all in the same direction"),
    ("fp8_error_table", "FP8 rows from fa_lab.fp8",
     [('"flash_fp8": fp8_attention(q, k, v, signs, block=128)',
       '"flash_fp8": __import__("fa_lab.fp8").fp8.fp8_attention_forward(q, k, v)')],
     "fa_lab.fp8.fp8_attention_forward"),
    ("quantize_blocks", "amax of x, not of |x|", [("amax = padded.abs().reshape", "amax = padded.reshape")],
     "largest value, not the largest magnitude"),
    ("hadamard", "one round short", [(HADAMARD_ROUNDS, "while 2 * h < head_dim:")], "one round of butterflies"),
    ("hadamard", "one round short and not normalized",
     [(HADAMARD_ROUNDS, "while 2 * h < head_dim:"), (HADAMARD_END, "return y.reshape(x.shape)")],
     "Count your rounds and your divisions"),
    ("hadamard", "b - a where a - b belongs",
     [("torch.stack((a + b, a - b), dim=2)", "torch.stack((a + b, b - a), dim=2)")], "b - a where a - b belongs"),
    ("hadamard", "a - b and a + b in each other's places",
     [("torch.stack((a + b, a - b), dim=2)", "torch.stack((a - b, a + b), dim=2)")],
     "right values in the wrong positions"),
    ("hadamard", "sqrt(2) in every round, rounded each time",
     [("        h *= 2\n    " + HADAMARD_END,
       "        y = y / math.sqrt(2)\n        h *= 2\n    return y.reshape(x.shape)")], "does not match the reference"),
    ("rotate_qk", "k rotated without the signs", [(ROTATE, "return hadamard(q * signs), hadamard(k)")],
     "k is rotated without the signs"),
    ("rotate_qk", "q rotated without the signs", [(ROTATE, "return hadamard(q), hadamard(k * signs)")],
     "q is rotated without the signs"),
    ("fp8_error_table", "the seed ignored", [("table_inputs(seed)", "table_inputs(0)")], "the one of seed 0"),
    ("fp8_error_table", "two rows swapped",
     [(FLASH_FP8, FLASH_FP8.replace("signs", "None")), (NO_INCOHERENT, NO_INCOHERENT.replace("None", "signs"))],
     "rows are swapped"),
    ("fp8_error_table", "flash_fp16 through naive attention",
     [('"flash_fp16": flash_forward(q, k, v)[0]', '"flash_fp16": naive_attention(q, k, v)[0]')],
     "your flash_fp16 equals your baseline_fp16"),
    # Part 5: the consumer's two-stage loop.
    ("consumer_steps", "P V issued first",
     [("consumer_steps", '["issue S[j]", "issue PV[j-1]", "wait S[j]"', '["issue PV[j-1]", "issue S[j]", "wait S[j]"')],
     "issued before S_j"),
    ("consumer_steps", "waiting on the wrong WGMMA before the softmax",
     [("consumer_steps", '"wait S[j]", "softmax[j]", "wait PV[j-1]"', '"wait S[j]", "wait PV[j-1]", "softmax[j]"')],
     "before the softmax"),
    ("consumer_steps", "softmax before its GEMM completes",
     [("consumer_steps", '"wait S[j]", "softmax[j]"', '"softmax[j]", "wait S[j]"')], "softmax reads S_j"),
]
# What a mistake must never be told: a rounding matter is no wrong pairing or length.
NEVER = {"sqrt(2) in every round, rounded each time": ("keeps lengths", "times as long")}
# The error table's mutants run its public case only (a case takes about a second), except the one
# that only a hidden seed can show.
SEEDS = {"fp8_error_table": (), "the seed ignored": (11,)}
MUTANTS = [Mutant(exercise, mistake, edits, words, seeds=SEEDS.get(mistake, SEEDS.get(exercise)),
                  public=mistake != "the seed ignored", never=NEVER.get(mistake, ()))
           for exercise, mistake, edits, words in CASES]


@pytest.mark.parametrize("mutant", mutant_params(MUTANTS))
def test_mutant_fails_with_its_diagnosis(mutant):
    # A summary hint speaks for every failing case (it is only given when they all share its cause).
    failing = LAB.assert_mutant_diagnosed(mutant, hint_speaks_for_each_case=True)
    if mutant.words.startswith("fa_lab.fp8."):
        assert all(FORBIDDEN in v.message for _, v in failing)


# ---- what the exercise may and may not call -------------------------------------------------

def test_the_table_may_call_the_attention_references_but_the_other_exercises_may_not():
    from fa_lab.reference import naive_attention
    table = EXERCISES["fp8_error_table"]
    assert "fa_lab.reference.naive_attention" in table.allowed
    rotate = EXERCISES["rotate_qk"]

    def rotate_through_naive_attention(q, k, signs):
        naive_attention(q.float(), k.float(), k.float())
        return solution_namespace()["rotate_qk"](q, k, signs)

    verdicts = [v for _, v in run_exercise(rotate, rotate_through_naive_attention, rotate.cases()[:2])]
    assert all(not v.passed and "fa_lab.reference.naive_attention" in v.message for v in verdicts)


def test_allowed_helpers_are_let_through_with_what_they_call():
    from fa_lab.fp8 import outlier_qkv
    from fa_lab.reference import naive_attention

    def uses_helpers():
        q, k, v = outlier_qkv(1, 1, 4, 4, 8)
        return naive_attention(q, k, v)[0]

    allowed = ("fa_lab.fp8.outlier_qkv", "fa_lab.reference.naive_attention")
    [result] = harness.run_cases(uses_helpers, "call", [((), False)], ("fa_lab.fp8",), allowed)
    assert result["error"] is None and result["forbidden"] == []
    [result] = harness.run_cases(uses_helpers, "call", [((), False)], ("fa_lab.fp8",), ())
    assert result["forbidden"] == ["fa_lab.fp8.outlier_qkv", "fa_lab.reference.naive_attention"]


def test_a_dict_of_rows_reaches_the_judge():
    encoded = harness.encode({"flash_fp8": torch.tensor(0.5), "rows": [1.0, 2], 3: "three"})
    assert set(encoded) == {"flash_fp8", "rows", "<int key>"}
    assert isinstance(encoded["flash_fp8"], torch.Tensor) and encoded["rows"] == [1.0, 2]


@pytest.mark.parametrize("returned, said", [
    (lambda: [1.0] * 6, "expected a dict"),
    (lambda: {"flash_fp8": 1.0}, "missing rows: baseline_fp16"),
    (lambda: {**TABLE_ROWS, "fp4": 0.1}, "unknown rows: fp4"),
    (lambda: {**TABLE_ROWS, "flash_fp8": "small"}, "row flash_fp8 is str"),
    (lambda: {**TABLE_ROWS, "flash_fp8": float("nan")}, "positive, finite"),
])
def test_wrong_tables_are_explained(returned, said):
    table = EXERCISES["fp8_error_table"]
    [(_, verdict)] = run_exercise(table, lambda seed: returned(), table.cases())
    assert not verdict.passed and said in verdict.message, verdict.message


TABLE_ROWS = {"baseline_fp16": 3e-4, "flash_fp16": 2e-4, "baseline_fp8": 2e-2, "flash_fp8": 9e-3,
              "flash_fp8_no_block_quant": 9e-3, "flash_fp8_no_incoherent": 2e-2}


@pytest.mark.parametrize("exercise, returned, said", [
    ("quantize_blocks", lambda x, block: x.clone(), "expected a tuple (data, scales)"),
    ("quantize_blocks", lambda x, block: (x.float(), torch.ones(x.shape[:2] + (-(-x.shape[2] // block),))),
     "data has dtype torch.float32, expected torch.float8_e4m3fn"),
    ("quantize_blocks", lambda x, block: (x.to(torch.float8_e4m3fn), x.abs().amax(dim=-1)),
     "one scale per row"),
    ("hadamard", lambda x: (x, x), "expected a tuple (y)"),
    ("rotate_qk", lambda q, k, signs: q, "expected a tuple (qm, km)"),
])
def test_wrong_return_values_are_explained(exercise, returned, said):
    results = run_exercise(EXERCISES[exercise], returned, EXERCISES[exercise].cases()[:3])
    assert all(not v.passed and said in v.message for _, v in results), [v.message for _, v in results]


def test_a_non_contiguous_input_whose_blocks_divide_it_is_judged():
    """The judge quantizes a contiguous copy: fa_lab.fp8.quantize_e4m3 views its input as blocks."""
    from fa_lab.grading.labs.lab04 import quantize_case
    case = quantize_case("non-contiguous, 128 rows in blocks of 64", (1, 2, 128, 16), 64,
                         torch.Generator().manual_seed(0), strided=True)
    assert not case.args[0].is_contiguous()
    [(_, verdict)] = run_exercise(EXERCISES["quantize_blocks"], solution_namespace()["quantize_blocks"], [case])
    assert verdict.passed, verdict.message
