"""A consumer warpgroup's loop written as steps, run by the pipeline simulator (lab 04's schedule).

FlashAttention-3's consumer loop is a short program per K/V tile ``j``: issue WGMMAs, wait for some of
them, run the softmax, rescale. In FA3's two-stage order the softmax of tile ``j`` runs while the
tensor cores compute the product of tile ``j - 1`` (lab 04 has you write that order).
:func:`check_steps` refuses an order that cannot be right (a wait for a WGMMA that was not issued, a
softmax before its scores are done, a rescale while the tensor cores still write O); :func:`steps_tflops`
runs a valid order through :mod:`fa_lab.pipeline_sim` with FA3's producer, two consumers and ping-pong,
so that its speed can be compared with FA3's.

The steps, for iteration ``j`` (those about tile ``j - 1`` do nothing in iteration 0):

=================  ===========================================================================
``issue S[j]``     issue S_j = Q K_j^T (asynchronous; WGMMAs complete in the order they are issued)
``issue PV[j-1]``  issue O += P_{j-1} V_{j-1}
``wait S[j]``      wait until S_j is done
``wait PV[j-1]``   wait until P_{j-1} V_{j-1} is done
``softmax[j]``     the online softmax of tile j (needs S_j)
``rescale[j]``     O *= exp(m_{j-1} - m_j) (O must not be in use by the tensor cores)
=================  ===========================================================================
"""
from __future__ import annotations

from .iomodel import AttentionShape, attention_flops
from .pipeline_sim import ABLATION_SHAPE, FA3, H100, H100_FIT, CostParams, Schedule, SMRates, _Program, _run_cta

STEPS = ("issue S[j]", "issue PV[j-1]", "wait S[j]", "wait PV[j-1]", "softmax[j]", "rescale[j]")
# (a step, the step it must come after, why)
_ORDER = (("wait S[j]", "issue S[j]", "a wait for S_j must come after S_j is issued, or it waits forever"),
          ("wait PV[j-1]", "issue PV[j-1]", "a wait for P_{j-1} V_{j-1} must come after it is issued"),
          ("softmax[j]", "wait S[j]", "the softmax reads S_j: it must wait until the WGMMA computing S_j is done"),
          ("rescale[j]", "wait PV[j-1]", "the rescale writes O, which O += P_{j-1} V_{j-1} is still writing: "
                                         "wait for that WGMMA first"))


def check_steps(steps) -> tuple[str, ...]:
    """``steps`` as a tuple, or ValueError saying which rule the order breaks."""
    if isinstance(steps, str) or not hasattr(steps, "__iter__"):
        raise ValueError(f"the steps must be a list of strings, got {type(steps).__name__}")
    steps = tuple(steps)
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise ValueError(f"unknown steps {unknown}; the steps are {list(STEPS)}")
    counts = {s: steps.count(s) for s in STEPS}
    wrong = {s: n for s, n in counts.items() if n != 1}
    if wrong:
        raise ValueError(f"each step appears exactly once per iteration; these do not: {wrong}")
    for step, before, why in _ORDER:
        if steps.index(step) < steps.index(before):
            raise ValueError(f"'{step}' comes before '{before}': {why}.")
    return steps


class _StepProgram(_Program):
    """:class:`_Program` whose consumers run ``steps`` in each iteration before the last."""

    def __init__(self, schedule: Schedule, n_kv: int, steps: tuple[str, ...]):
        self.steps = steps
        super().__init__(schedule, n_kv)

    def iteration(self, w, j):
        if j == self.n:  # draining P_{n-1} V_{n-1} and the epilogue are the same for every order
            return super().iteration(w, j)
        pending = []
        for step in self.steps:
            if step.startswith("issue"):
                if step == "issue S[j]":
                    pending.append(self.gemm0_of(w, j))
                elif j > 0:
                    pending.append(self.gemm1_of(w, j - 1))
                continue
            self.issue(w, pending)
            pending = []
            if step == "wait S[j]":
                self.wait(w, j, self.gemm0[w][j])
            elif step == "softmax[j]":
                self.on_lane(w, "softmax", j, "softmax")
            elif j > 0 and step == "wait PV[j-1]":
                self.wait(w, j, self.gemm1[w][j - 1])
            elif j > 0 and step == "rescale[j]":
                self.on_lane(w, "rescale", j, "rescale", (self.gemm1[w][j - 1],))
        self.issue(w, pending)


def steps_tflops(steps, schedule: Schedule = FA3, params: CostParams = H100_FIT,
                 shape: AttentionShape = ABLATION_SHAPE, rates: SMRates = H100) -> float:
    """The TFLOP/s the simulator predicts when each consumer of ``schedule`` runs ``steps``."""
    steps = check_steps(steps)
    *_, ends, _, waves = _run_cta(schedule, params, shape, rates,
                                  compile=lambda s, n_kv: _StepProgram(s, n_kv, steps))
    return attention_flops(shape) / (waves * max(ends)) / 1e12
