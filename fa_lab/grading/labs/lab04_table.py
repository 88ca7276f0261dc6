"""Lab 04's last exercise, the FA3 paper's FP8 error table: the shape it runs at, and its judge.

The learner's table is measured on the data :func:`fa_lab.fp8.reproduce_error_table`
draws (the lab's ``table_inputs(seed)`` draws it the same way), at ``TABLE_SHAPE``:
256 queries attending to 8192 keys (notebook 04 runs 2048 queries), so that
a case takes about a second. With so few queries a row lands anywhere from 0.5 to 2.7
times the paper's value, depending on the seed, so rows are compared with fa_lab's own
table at the same shape and seed, not with the paper's numbers. The learner's FP8
attention need not be tiled: without tiles it lands within 3% of fa_lab's tiled
emulation (8% without scaling P by 2^8).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from ...fp8 import PAPER_ERROR_TABLE, reproduce_error_table
from ..judge import PASS, describe, outcome_problem
from ..registry import Verdict

TABLE_SHAPE = {"batch": 1, "heads": 1, "seqlen_q": 256, "seqlen_k": 8192, "head_dim": 128}
ROW_TOLERANCE = 1.15  # each row within 15% of fa_lab's
# The paper's big gaps: pairs of rows more than 10% apart in the paper (which leaves out flash_fp8 vs
# flash_fp8_no_block_quant, 2% apart: seed noise here), checked where fa_lab's own table at this seed
# separates them by 20% too (on a few seeds baseline_fp16 and flash_fp16 come within 11%).
PAPER_GAP, SEED_GAP = 1.1, 1.2
ROTATED = ("flash_fp8", "flash_fp8_no_block_quant")
FP8_FLASH = (*ROTATED, "flash_fp8_no_incoherent")
BASELINES = ("baseline_fp16", "flash_fp16", "baseline_fp8")


@lru_cache(maxsize=16)
def fa_lab_table(seed: int) -> dict:
    """fa_lab.fp8.reproduce_error_table at TABLE_SHAPE (about half a second; cached per seed)."""
    return reproduce_error_table(seed, **TABLE_SHAPE)


def paper_gaps() -> list[tuple[str, str]]:
    """(larger, smaller) pairs of rows that the paper separates by more than PAPER_GAP."""
    rows = list(PAPER_ERROR_TABLE)
    return [(a, b) for a in rows for b in rows if PAPER_ERROR_TABLE[a] > PAPER_GAP * PAPER_ERROR_TABLE[b]]


def _row_values(outputs) -> dict | str:
    """{row: float} from the learner's dict, or what is wrong with it."""
    rows = ", ".join(PAPER_ERROR_TABLE)
    if not isinstance(outputs, dict):
        return f"expected a dict {{row name: RMSE}} with the rows {rows}; got {describe(outputs)}."
    missing = [row for row in PAPER_ERROR_TABLE if row not in outputs]
    unknown = [str(row) for row in outputs if row not in PAPER_ERROR_TABLE]
    if missing or unknown:
        parts = ([f"missing rows: {', '.join(missing)}"] if missing else []) + \
                ([f"unknown rows: {', '.join(unknown)}"] if unknown else [])
        return f"{'; '.join(parts)}. The table has the paper's six rows: {rows}."
    values = {}
    for row in PAPER_ERROR_TABLE:
        value = outputs[row]
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"row {row} is {describe(value)}, expected a number (an RMSE)."
        if not math.isfinite(value) or value <= 0:
            return f"row {row} is {value}: an RMSE is a positive, finite number."
        values[row] = float(value)
    return values


def _close(a: float, b: float, tolerance: float = 0.05) -> bool:
    return abs(a / b - 1) < tolerance


def _all_close(values: dict, table: dict) -> bool:
    return all(1 / ROW_TOLERANCE <= values[row] / table[row] <= ROW_TOLERANCE for row in table)


def _swapped(values: dict, reference: dict, off: list[str]) -> tuple[str, str] | None:
    """Two rows off whose values are each other's (within 5%)."""
    for i, a in enumerate(off):
        for b in off[i + 1:]:
            if _close(values[a], reference[b]) and _close(values[b], reference[a]):
                return a, b
    return None


def _named_mistake(values: dict, ratios: dict, off: list[str], seed: int) -> str | None:
    """The mistake that the pattern of rows off (and how far off) points to, if any."""
    reference = {row: values[row] / ratios[row] for row in values}
    if seed != 0 and _all_close(values, fa_lab_table(0)):
        return ("your table is the one of seed 0, whatever the seed: draw the data with "
                "table_inputs(seed), from the seed argument.")
    pair = _swapped(values, reference, off)
    if pair:
        return (f"your {pair[0]} and {pair[1]} rows are swapped: each holds the other's RMSE (check which "
                "output goes under which name).")
    if len(off) == len(values) and (max(ratios.values()) < 1 or min(ratios.values()) > 1):
        return (f"every row is off, all in the same direction (x{min(ratios.values()):.2f} to "
                f"x{max(ratios.values()):.2f} of fa_lab's): look at how you measure. Each RMSE is the square "
                "root of the mean of the squared errors over all elements of O (fa_lab.fp8.rmse), against "
                "the float64 reference.")
    if "flash_fp16" in off and ratios["flash_fp16"] < 1 and not set(off) & set(FP8_FLASH):
        return ("your fp16 rows are too small: compute the float64 reference from the float64 inputs, "
                "before they are rounded to fp16. The rounding of the inputs is part of what the paper "
                "measures, and most of the fp16 rows' error.")
    if all(ratios[row] > 3 for row in ROTATED) and "flash_fp8_no_incoherent" not in off:
        return ("the rows that use the rotation are far off, and the one without it is right: rotate Q "
                "and K only. V is never rotated: P (V M) = O M is a different output.")
    if set(FP8_FLASH) <= set(off) and not set(off) & set(BASELINES):
        return ("all three FP8 flash rows are off, with and without the tricks, while the baselines are "
                "right: look at your fp8_attention itself (the softmax scale d^-1/2, subtracting the row "
                "max, dividing by the row sum, dequantizing each operand with its own scales).")
    if "flash_fp8" in off and _close(values["flash_fp8"], values["flash_fp8_no_incoherent"]):
        return ("your flash_fp8 row equals your flash_fp8_no_incoherent row: flash_fp8 rotates Q and K "
                "(pass the signs) before quantizing them.")
    if "flash_fp8_no_block_quant" in off and _close(values["flash_fp8_no_block_quant"],
                                                   values["flash_fp8_no_incoherent"]):
        return ("your flash_fp8_no_block_quant row equals your flash_fp8_no_incoherent row: the row "
                "without block quantization still rotates Q and K.")
    if "baseline_fp16" in off and _close(values["baseline_fp16"], values["flash_fp16"]):
        return ("your baseline_fp16 equals your flash_fp16: the baseline is standard attention with S and "
                "P in fp16 (naive_attention on the fp16 inputs).")
    if "flash_fp16" in off and _close(values["flash_fp16"], values["baseline_fp16"]):
        return ("your flash_fp16 equals your baseline_fp16: flash_fp16 is FlashAttention in fp16 "
                "(flash_forward: a float32 softmax, O rounded to fp16 once), while the baseline rounds S "
                "and P to fp16 too.")
    return None


def judge_table(case, outcome) -> Verdict:
    """fp8_error_table(seed) -> {row: RMSE}, compared row by row with fa_lab's table at TABLE_SHAPE."""
    (seed,) = case.args
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    values = _row_values(outcome["outputs"])
    if isinstance(values, str):
        return Verdict(False, values)
    reference = fa_lab_table(seed)
    ratios = {row: values[row] / reference[row] for row in values}
    off = [row for row, ratio in ratios.items() if not 1 / ROW_TOLERANCE <= ratio <= ROW_TOLERANCE]
    if off:
        mistake = _named_mistake(values, ratios, off, seed)
        listing = "; ".join(f"{row}: yours {values[row]:.2e}, fa_lab's {reference[row]:.2e} "
                            f"(x{ratios[row]:.2f})" for row in off)
        return Verdict(False, f"{mistake + ' ' if mistake else ''}Rows more than "
                              f"{ROW_TOLERANCE - 1:.0%} away from fa_lab.fp8.reproduce_error_table at "
                              f"TABLE_SHAPE, seed {seed}: {listing}.")
    broken = [(a, b) for a, b in paper_gaps()
              if reference[a] > SEED_GAP * reference[b] and not values[a] > values[b]]
    if broken:
        listing = "; ".join(f"{a} ({values[a]:.2e}) should be above {b} ({values[b]:.2e})" for a, b in broken)
        return Verdict(False, f"every row is close to fa_lab's, but the paper's order is broken: {listing}.")
    return PASS
