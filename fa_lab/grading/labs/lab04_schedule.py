"""Lab 04's scheduling exercise: a consumer warpgroup's loop as steps, judged by the pipeline simulator.

``consumer_steps()`` returns the steps of one iteration (:mod:`fa_lab.pipeline_steps`). An order
passes when it is valid and the simulator predicts at least FlashAttention-3's two-stage throughput
for it (with FA3's producer, two consumers and ping-pong) on the case's shape. A slower order is told
which overlap it loses: P V issued before S (the tensor cores complete WGMMAs in issue order, so S_j
waits behind P_{j-1} V_{j-1}), or a wait for P V before the softmax (which then no longer overlaps it).
"""
from __future__ import annotations

from ...iomodel import AttentionShape
from ...pipeline_sim import FA3, predict_tflops
from ...pipeline_steps import check_steps, steps_tflops
from ..judge import PASS, outcome_problem
from ..registry import Case, Verdict
from .attention_cases import draw_choice

_SHAPES: dict[str, AttentionShape] = {}  # case name -> the shape it is judged on


def _case(shape: AttentionShape) -> Case:
    name = (f"B={shape.batch} H={shape.heads} N={shape.seqlen_q} d={shape.head_dim}, fp16, FA3's producer and "
            "ping-pong")
    _SHAPES[name] = shape
    return Case(name, ())


def public_schedule_cases() -> list[Case]:
    return [_case(AttentionShape(4, 16, 8448, 128, dtype="fp16")),
            _case(AttentionShape(8, 32, 4096, 64, dtype="fp16"))]


def hidden_schedule_cases(generator) -> list[Case]:
    return [_case(AttentionShape(draw_choice(generator, (1, 2, 4)), draw_choice(generator, (16, 32)),
                                 draw_choice(generator, (2048, 8192, 16384)), draw_choice(generator, (64, 128)),
                                 dtype="fp16")) for _ in range(2)]


def judge_schedule(case, outcome) -> Verdict:
    """consumer_steps() -> the steps of one iteration, in order."""
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    steps = outcome["outputs"]
    try:
        steps = check_steps(steps)
    except ValueError as exc:
        return Verdict(False, f"this order cannot run: {exc}")
    shape = _SHAPES[case.name]
    got, want = steps_tflops(steps, shape=shape), predict_tflops(FA3, shape=shape)
    if got >= want * (1 - 1e-9):
        return PASS
    if steps.index("issue PV[j-1]") < steps.index("issue S[j]"):
        why = ("P_{j-1} V_{j-1} is issued before S_j: WGMMAs complete in the order they are issued, so S_j, and the "
               "softmax that needs it, wait behind the product; issue S_j first, then P_{j-1} V_{j-1}.")
    elif steps.index("wait PV[j-1]") < steps.index("softmax[j]"):
        why = ("you wait for P_{j-1} V_{j-1} before the softmax of tile j: the softmax then runs after the product "
               "instead of under it; wait for S_j only, run the softmax, and wait for the product after it.")
    else:
        why = "some of the softmax's work no longer overlaps a WGMMA."
    return Verdict(False, f"the simulator predicts {got:.0f} TFLOP/s for your order against FA3's two-stage "
                          f"{want:.0f}: {why}")
