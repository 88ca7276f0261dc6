"""Lab 01: FlashAttention on the CPU in plain PyTorch (goes with notebook 01).

=================  =========================================================================
exercise           the learner's function, as the harness calls it
=================  =========================================================================
online_softmax     online_softmax_stats(score_blocks) -> (m, l)
flash_forward      flash_forward(q, k, v, causal, scale, block_q, block_k) -> (out, lse)
flash_backward     flash_backward(q, k, v, out, lse, dout, causal, scale, block_q, block_k)
                   -> (dq, dk, dv)
autograd_function  FlashAttentionFunction.apply(q, k, v, causal, scale), then backward
=================  =========================================================================

The attention exercises use the shared cases and judges of :mod:`.attention_cases`
and :mod:`.attention_judges`; the online softmax's are here.
"""
from __future__ import annotations

from functools import partial

import torch

from ...reference import softmax_with_lse
from ...testing import LSE_FLOOR
from ..judge import Expected, judge_outputs
from ..registry import Case, Exercise, Lab
from . import attention_cases as cases
from . import attention_judges as judges
from . import attention_mistakes as mistakes


def score_blocks_case(generator, rows: int, widths, gain: float, drift: float, masked: float,
                      name: str, empty_rows=()) -> Case:
    """online_softmax_stats(score_blocks): float32 blocks (rows, width) of N(0, gain) scores.

    drift shifts block j by drift * j (a max that grows block by block); masked is
    the share of scores set to -inf; rows in empty_rows are -inf everywhere.
    """
    blocks = []
    for j, width in enumerate(widths):
        block = torch.randn(rows, width, generator=generator) * gain + drift * j
        hide = torch.rand(rows, width, generator=generator) < masked
        if empty_rows:
            hide[list(empty_rows)] = True
        blocks.append(block.masked_fill(hide, float("-inf")))
    return Case(name, (blocks,))


def public_stats_cases() -> list[Case]:
    specs = [
        dict(rows=4, widths=(8,), gain=1.0, drift=0.0, masked=0.0, name="one block of 8 scores per row"),
        dict(rows=4, widths=(6, 6, 6, 6), gain=1.0, drift=3.0, masked=0.0,
             name="4 blocks, the max grows block by block"),
        dict(rows=5, widths=(5, 1, 12, 3), gain=2.0, drift=-1.0, masked=0.3, empty_rows=(3,),
             name="ragged blocks of 5, 1, 12, 3 with masked (-inf) scores; row 3 sees nothing"),
        dict(rows=3, widths=(16, 16), gain=300.0, drift=0.0, masked=0.0,
             name="large scores (up to about 1000)"),
    ]
    return [score_blocks_case(torch.Generator().manual_seed(2000 + i), **s) for i, s in enumerate(specs)]


def hidden_stats_cases(generator) -> list[Case]:
    drawn = []
    for i, gain in enumerate((1.0, 3.0, 1.0, 10.0, 300.0, 1.0)):
        widths = [cases.draw_int(generator, 1, 16) for _ in range(cases.draw_int(generator, 1, 7))]
        rows = cases.draw_int(generator, 1, 6)
        drift = cases.draw_choice(generator, (0.0, 2.0, -2.0, 5.0))
        masked = cases.draw_choice(generator, (0.0, 0.2, 0.6))
        empty = (rows - 1,) if i == 2 else ()
        drawn.append(score_blocks_case(generator, rows, widths, gain, drift, masked,
                                       f"{rows} rows, blocks of {', '.join(map(str, widths))}", empty))
    return drawn


def _stats_view(outputs: dict) -> dict:
    """Compared: m itself, and l through the log-sum-exp m + log(l) (l spans many orders of magnitude)."""
    m, l = outputs["m"], outputs["l"]
    return {"m": m, "m + log(l)": m.double() + torch.log(l.double())}


def _judge_stats(case, outcome):
    (blocks,) = case.args
    s = torch.cat(blocks, dim=-1)
    dims = ("row",) if s.ndim == 2 else ("batch", "row")
    finite = s[torch.isfinite(s)]

    def expected():
        m = Expected(s.double().amax(dim=-1), s.amax(dim=-1), torch.float32, dims)
        lse = Expected(softmax_with_lse(s.double())[1], softmax_with_lse(s)[1], None, dims, LSE_FLOOR)
        return {"m": m, "l": m, "m + log(l)": lse}  # l: shape and dtype as m's

    def candidates():
        def make(**mistake):
            m, l, _ = mistakes.stream_softmax(blocks, **mistake)
            return _stats_view({"m": m, "l": l})
        yield ("l is not rescaled: when a block raises the running max from m_old to m_new, the old "
               "sum must be multiplied by exp(m_old - m_new) before the block's terms are added.",
               lambda: make(rescale_l=False))
        yield ("the rescale factor has the wrong sign: you used exp(m_new - m_old) instead of "
               "exp(m_old - m_new). It must be <= 1 (old terms shrink when the max grows); at the "
               "start m_old = -inf, so the wrong factor is inf, and inf * 0 = NaN.",
               lambda: make(flip=True))
        yield ("you summed exp(s) without subtracting the running max: l is the sum of exp(s - m). "
               "Besides, exp(s) overflows float32 as soon as a score passes 88.7.",
               lambda: make(subtract_max=False))
        yield ("m is the max of the latest block only: it must be the running max over every "
               "block seen so far.", lambda: make(running_max=False))
        yield ("rows whose first blocks are fully masked (-inf) give NaN: while m is still -inf, "
               "exp(m_old - m_new) is exp(-inf - (-inf)) = NaN. Use 0 in place of an m_new of -inf "
               "(nothing has been seen yet, so nothing needs rescaling).", lambda: make(guard=False))

    largest = float(finite.abs().max()) if finite.numel() else 0.0
    return judge_outputs(case, outcome, ("m", "l"), expected, view=_stats_view, candidates=candidates,
                         detectors=[judges.overflow_detector(largest)])


LAB = Lab(
    id="lab01",
    title="FlashAttention on the CPU: online softmax, tiled forward, recomputation backward",
    notebook="lab01_flash_attention_cpu.ipynb",
    exercises=(
        Exercise("online_softmax", "online_softmax_stats", 2, public_stats_cases, hidden_stats_cases,
                 _judge_stats),
        Exercise("flash_forward", "flash_forward", 3,
                 partial(cases.public_attention_cases, cases.forward_case),
                 partial(cases.hidden_attention_cases, cases.forward_case),
                 judges.judge_forward, summarize=partial(judges.summarize, causal_index=3)),
        Exercise("flash_backward", "flash_backward", 3,
                 partial(cases.public_attention_cases, cases.backward_case, cases.BACKWARD_PUBLIC),
                 partial(cases.hidden_attention_cases, cases.backward_case, large_scores=False),
                 judges.judge_backward, summarize=partial(judges.summarize, causal_index=6)),
        Exercise("autograd_function", "FlashAttentionFunction", 2,
                 partial(cases.public_attention_cases, cases.autograd_case, cases.AUTOGRAD_PUBLIC),
                 partial(cases.hidden_attention_cases, cases.autograd_case, large_scores=False,
                         count=5),
                 judges.judge_autograd, calling="autograd",
                 summarize=partial(judges.summarize, causal_index=3)),
    ),
)
