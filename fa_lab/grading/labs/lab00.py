"""Lab 00: the IO count of attention and its roofline (goes with notebook 00).

=================  =================================================================================
exercise           the learner's function, as the harness calls it
=================  =================================================================================
attention_flops    attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal) -> int
naive_hbm_bytes    naive_hbm_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, dtype_bytes) -> int
flash_hbm_bytes    flash_hbm_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, dtype_bytes, block_q) -> int
attainable_tflops  attainable_tflops(intensity, peak_tflops, hbm_tb_s) -> float
naive_peak_bytes   naive_peak_bytes(batch, heads, seqlen_q, seqlen_k, head_dim, dtype_bytes) -> int
=================  =================================================================================

Each is judged against :mod:`fa_lab.iomodel` (forward, not causal for the byte counts; the GPUs of
``GPU_SPECS`` for the roofline), and a wrong count is matched against the typical wrong ones:
elements instead of bytes, the write of P forgotten, S counted once, K and V read once per head,
the LSE forgotten or stored in the input dtype, one matmul instead of two, causal not halved.
fa_lab.iomodel is forbidden in every exercise, so it is absent while grading.
"""
from __future__ import annotations

import math

from ...iomodel import GPU_SPECS, AttentionShape, attention_flops, flash_hbm_bytes, naive_extra_bytes, naive_hbm_bytes
from ..judge import PASS, mistakes_message, outcome_problem
from ..registry import Case, Exercise, Lab, Verdict
from .attention_cases import draw_choice, draw_int

FORBIDDEN = ("fa_lab.iomodel", "fa_lab.memory", "fa_lab.parallelism")
DTYPES = {1: "fp8", 2: "bf16", 4: "fp32"}


def _shape(batch, heads, seqlen_q, seqlen_k, head_dim, dtype_bytes=2, causal=False) -> AttentionShape:
    return AttentionShape(batch, heads, seqlen_q, head_dim, seqlen_k=seqlen_k, causal=causal,
                          dtype=DTYPES[dtype_bytes])


def _int_verdict(outcome, want: int, mistakes, what: str) -> Verdict:
    """An exact int: named when it equals one of the (message, wrong value) mistakes."""
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    value = outcome["outputs"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and
                                                                          not value.is_integer()):
        return Verdict(False, f"expected {what} as an int, got {value!r}.")
    if int(value) == want:
        return PASS
    found = list(dict.fromkeys(message for message, wrong in mistakes if wrong != want and int(value) == wrong))
    ratio = f" ({int(value) / want:.3g} times the right count)" if want else ""
    return Verdict(False, (mistakes_message(found) if found else f"{what} is wrong.") +
                   f" Got {int(value)}, expected {want}{ratio}.", explained=bool(found))


def _draw_shape(generator):
    n_q = draw_choice(generator, (512, 1024, 2048, 4096, 8192, 16384))
    n_k = draw_choice(generator, (n_q, n_q, 2 * n_q))
    return (draw_int(generator, 1, 8), draw_choice(generator, (8, 16, 32, 64)), n_q, n_k,
            draw_choice(generator, (64, 128, 256)))


# ----------------------------------------------------------------------------- FLOPs

PUBLIC_FLOPS = ((2, 32, 8192, 8192, 128, False), (2, 32, 8192, 8192, 128, True), (1, 8, 1024, 4096, 64, False),
                (4, 16, 2048, 2048, 64, True))


def public_flops_cases() -> list[Case]:
    return [Case(f"B={b} H={h} Nq={nq} Nk={nk} d={d}{' causal' if c else ''}", (b, h, nq, nk, d, c))
            for b, h, nq, nk, d, c in PUBLIC_FLOPS]


def hidden_flops_cases(generator) -> list[Case]:
    cases = []
    for causal in (False, True, False, True):
        b, h, nq, _, d = _draw_shape(generator)
        cases.append(Case(f"B={b} H={h} N={nq} d={d}{' causal' if causal else ''}", (b, h, nq, nq, d, causal)))
    return cases


def judge_flops(case, outcome) -> Verdict:
    b, h, nq, nk, d, causal = case.args
    want = attention_flops(_shape(b, h, nq, nk, d, causal=causal))
    full = 4 * b * h * nq * nk * d
    mistakes = [("one matmul counted: attention has two, S = QK^T and O = PV, each 2 * Nq * Nk * d FLOPs per "
                 "head (a multiply and an add per term).", want // 2),
                ("causal is not halved: by the FA3 paper's convention a causal forward counts half the FLOPs.",
                 full if causal else want),
                ("batch and heads are missing: the count is per head times batch * heads.", want // (b * h)),
                ("a matmul of (Nq, d) by (d, Nk) is 2 * Nq * Nk * d FLOPs, not Nq * Nk * d.", want // 2)]
    return _int_verdict(outcome, want, mistakes, "the FLOP count")


# ----------------------------------------------------------------------------- naive bytes

PUBLIC_BYTES = ((2, 32, 8192, 8192, 128, 2), (1, 8, 1024, 4096, 64, 2), (4, 16, 2048, 2048, 64, 4),
                (1, 1, 512, 512, 128, 1))


def public_bytes_cases() -> list[Case]:
    return [Case(f"B={b} H={h} Nq={nq} Nk={nk} d={d}, {DTYPES[e]}", (b, h, nq, nk, d, e))
            for b, h, nq, nk, d, e in PUBLIC_BYTES]


def hidden_bytes_cases(generator) -> list[Case]:
    return [Case(f"B={b} H={h} Nq={nq} Nk={nk} d={d}, {DTYPES[e]}", (b, h, nq, nk, d, e))
            for (b, h, nq, nk, d), e in ((_draw_shape(generator), draw_choice(generator, (2, 2, 4, 1)))
                                         for _ in range(4))]


def judge_naive_bytes(case, outcome) -> Verdict:
    b, h, nq, nk, d, e = case.args
    want = naive_hbm_bytes(_shape(b, h, nq, nk, d, e))
    scores, sides = nq * nk, 2 * (nq + nk) * d

    def total(scores_count, element=e):
        return (scores_count * scores + sides) * element * b * h
    mistakes = [(f"you counted elements, not bytes: multiply by the bytes per element ({e} for {DTYPES[e]}).",
                 want // e),
                ("the write of P is missing: softmax reads S and writes P, and O = PV reads P back; S and P "
                 "each make a round trip (4 * Nq * Nk elements in all).", total(3)),
                ("S is counted once: QK^T writes S and softmax reads it back, two passes over Nq * Nk elements "
                 "(and P makes the same round trip).", total(3)),
                ("the matrices S and P are counted but not Q, K, V and O: each of the three kernels reads its "
                 "inputs and writes its output in HBM.", 4 * scores * e * b * h),
                ("the sizes are float32's (4 bytes): use the input dtype's bytes per element.", total(4, 4))]
    return _int_verdict(outcome, want, mistakes, "the byte count")


# ----------------------------------------------------------------------------- flash bytes

PUBLIC_FLASH = ((2, 32, 8192, 8192, 128, 2, 128), (1, 8, 1024, 4096, 64, 2, 64), (4, 16, 2000, 2000, 64, 2, 128),
                (1, 4, 4096, 4096, 128, 4, 64))


def public_flash_cases() -> list[Case]:
    return [Case(f"B={b} H={h} Nq={nq} Nk={nk} d={d}, {DTYPES[e]}, block_q={bq}", (b, h, nq, nk, d, e, bq))
            for b, h, nq, nk, d, e, bq in PUBLIC_FLASH]


def hidden_flash_cases(generator) -> list[Case]:
    cases = []
    for _ in range(4):
        b, h, nq, nk, d = _draw_shape(generator)
        nq += draw_choice(generator, (0, 0, 37))
        e, bq = draw_choice(generator, (2, 2, 4)), draw_choice(generator, (64, 128))
        cases.append(Case(f"B={b} H={h} Nq={nq} Nk={nk} d={d}, {DTYPES[e]}, block_q={bq}", (b, h, nq, nk, d, e, bq)))
    return cases


def judge_flash_bytes(case, outcome) -> Verdict:
    b, h, nq, nk, d, e, bq = case.args
    want = flash_hbm_bytes(_shape(b, h, nq, nk, d, e), block_q=bq)
    passes = math.ceil(nq / bq)

    def total(passes_=passes, lse_bytes=4, o_written=True):
        return (e * (nq * d + passes_ * 2 * nk * d + (nq * d if o_written else 0)) + lse_bytes * nq) * b * h
    mistakes = [(f"K and V are read once per head, but each of the ceil(Nq / block_q) = {passes} Q tiles streams "
                 "all of K and V (no L2 in this model).", total(1)),
                ("the log-sum-exp is missing: the forward writes one float32 per query row for the backward.",
                 total(lse_bytes=0)),
                (f"the LSE is stored in the input dtype ({e} bytes); it is float32 (4 bytes) whatever the input.",
                 total(lse_bytes=e)),
                ("the write of O is missing.", total(o_written=False)),
                (f"the Q tiles are Nq // block_q = {nq // bq}, rounded down; the last partial tile streams K and V "
                 f"too: ceil(Nq / block_q) = {passes}.", total(nq // bq))]
    return _int_verdict(outcome, want, mistakes, "the byte count")


# ----------------------------------------------------------------------------- roofline

def _roofline_case(name, intensity, gpu) -> Case:
    spec = GPU_SPECS[gpu]
    return Case(f"{name} on the {spec.name}", (intensity, spec.bf16_tflops, spec.hbm_tb_s))


def public_roof_cases() -> list[Case]:
    return [_roofline_case("intensity 10 (memory-bound)", 10.0, "H100"),
            _roofline_case("intensity 1000 (compute-bound)", 1000.0, "H200"),
            _roofline_case("intensity 153", 153.0, "A100"),
            _roofline_case("intensity 0.5", 0.5, "H200")]


def hidden_roof_cases(generator) -> list[Case]:
    return [_roofline_case(f"intensity {x:g}", x, draw_choice(generator, ("A100", "H100", "H200")))
            for x in (float(draw_choice(generator, (1, 4, 30, 80, 150, 300, 2000))) for _ in range(5))]


def judge_roof(case, outcome) -> Verdict:
    intensity, peak, bandwidth = case.args
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    value = outcome["outputs"]
    want = min(peak, bandwidth * intensity)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return Verdict(False, f"expected a number of TFLOP/s, got {value!r}.")
    if math.isclose(value, want, rel_tol=1e-6):
        return PASS
    mistakes = [("the roofline is the smaller of the two ceilings, min(peak, bandwidth x intensity): a kernel can "
                 "go no faster than its FLOPs allow, nor than its bytes allow.", max(peak, bandwidth * intensity)),
                ("units: TB/s times FLOP/byte gives TFLOP/s directly (no factor 1000).",
                 min(peak, 1000 * bandwidth * intensity)),
                ("the memory ceiling is bandwidth x intensity (FLOPs per byte times bytes per second), not "
                 "intensity / bandwidth.", min(peak, intensity / bandwidth)),
                ("the compute ceiling is missing: past the ridge point the peak caps the kernel.",
                 bandwidth * intensity)]
    found = [m for m, wrong in mistakes if not math.isclose(wrong, want) and math.isclose(value, wrong, rel_tol=1e-6)]
    return Verdict(False, (mistakes_message(found) if found else "the attainable TFLOP/s is wrong.") +
                   f" Got {value:.4g}, expected {want:.4g}.", explained=bool(found))


# ----------------------------------------------------------------------------- naive peak memory

def public_peak_cases() -> list[Case]:
    return [Case(f"B={b} H={h} Nq={nq} Nk={nk} d={d}, {DTYPES[e]}", (b, h, nq, nk, d, e))
            for b, h, nq, nk, d, e in PUBLIC_BYTES]


def judge_peak(case, outcome) -> Verdict:
    b, h, nq, nk, d, e = case.args
    shape = _shape(b, h, nq, nk, d, e)
    want = naive_extra_bytes(shape)
    matrix, output = nq * nk * e * b * h, nq * d * e * b * h
    mistakes = [("one (Nq, Nk) matrix is counted; at its peak naive attention holds two, S and P (P = softmax(S) "
                 "is a new tensor while S is still alive).", matrix + output),
                ("the output O (B, H, Nq, d) is missing: it is allocated while S and P are alive.", 2 * matrix),
                (f"the matrices are counted in float32; they are in the input dtype ({e} bytes).",
                 2 * nq * nk * 4 * b * h + output),
                ("you counted elements, not bytes.", want // e)]
    return _int_verdict(outcome, want, mistakes, "the peak extra memory")


LAB = Lab(
    id="lab00",
    title="Attention is memory-bound: FLOPs, HBM bytes, the roofline and naive attention's peak memory",
    notebook="lab00_io_roofline.ipynb",
    exercises=(
        Exercise("attention_flops", "attention_flops", 1.5, public_flops_cases, hidden_flops_cases, judge_flops,
                 forbidden=FORBIDDEN),
        Exercise("naive_hbm_bytes", "naive_hbm_bytes", 2.5, public_bytes_cases, hidden_bytes_cases,
                 judge_naive_bytes, forbidden=FORBIDDEN),
        Exercise("flash_hbm_bytes", "flash_hbm_bytes", 2.5, public_flash_cases, hidden_flash_cases,
                 judge_flash_bytes, forbidden=FORBIDDEN),
        Exercise("attainable_tflops", "attainable_tflops", 1.5, public_roof_cases, hidden_roof_cases, judge_roof,
                 forbidden=FORBIDDEN),
        Exercise("naive_peak_bytes", "naive_peak_bytes", 2, public_peak_cases, hidden_bytes_cases, judge_peak,
                 forbidden=FORBIDDEN),
    ),
)
