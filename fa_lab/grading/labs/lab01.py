"""Lab 01: FlashAttention on the CPU in plain PyTorch (goes with notebook 01).

=================  =========================================================================
exercise           the learner's function, as the harness calls it
=================  =========================================================================
online_softmax     online_softmax_stats(score_blocks) -> (m, l)
causal_tile_mask   causal_tile_mask(i0, i1, j0, j1, seqlen_q, seqlen_k) -> (i1 - i0, j1 - j0) bool
key_end            key_end(i1, seqlen_q, seqlen_k, causal) -> int
flash_forward      flash_forward(q, k, v, causal, scale, block_q, block_k) -> (out, lse)
flash_backward     flash_backward(q, k, v, out, lse, dout, causal, scale, block_q, block_k)
                   -> (dq, dk, dv)
autograd_function  FlashAttentionFunction.apply(q, k, v, causal, scale), then backward
=================  =========================================================================

The attention exercises use the shared cases and judges of :mod:`.attention_cases`,
:mod:`.attention_judges` and :mod:`.attention_gradients`; the two helpers' are in
:mod:`.lab01_helpers`, the online softmax's here.

How the online softmax is checked to be online: one case (public, and one hidden per seed)
streams many blocks and lets the call create no tensor larger than a quarter of the whole row
of scores (:class:`fa_lab.grading.harness.TensorProbe`), so ``torch.cat(score_blocks)`` with a
``logsumexp`` fails it however it is written, while folding block by block into (m, l) never
holds more than a block. The probe runs in the learner's kernel: it catches honest shortcuts, and
a notebook that sets out to fool it can (the limit is not a guarantee of the sandbox).
"""
from __future__ import annotations

from functools import partial

import torch

from ...reference import softmax_with_lse
from ...testing import LSE_FLOOR
from ..judge import Expected, judge_outputs
from ..registry import Case, Exercise, Lab
from . import attention_cases as cases
from . import attention_gradients as gradients
from . import attention_judges as judges
from . import attention_mistakes as mistakes
from . import lab01_helpers as helpers

ONLINE = ("online softmax keeps only (m, l) between blocks: fold each block into them as it comes, "
          "never the whole row of scores (torch.cat of the blocks is that row).")


def score_blocks_case(generator, rows: int, widths, gain: float, drift: float, masked: float,
                      name: str, empty_rows=(), online=False) -> Case:
    """online_softmax_stats(score_blocks): float32 blocks (rows, width) of N(0, gain) scores.

    drift shifts block j by drift * j (a max that grows block by block); masked is
    the share of scores set to -inf; rows in empty_rows are -inf everywhere. online: the
    call may create no tensor larger than a quarter of the (rows, sum of widths) row.
    """
    blocks = []
    for j, width in enumerate(widths):
        block = torch.randn(rows, width, generator=generator) * gain + drift * j
        hide = torch.rand(rows, width, generator=generator) < masked
        if empty_rows:
            hide[list(empty_rows)] = True
        blocks.append(block.masked_fill(hide, float("-inf")))
    return Case(name, (blocks,), rows * sum(widths) // 4 if online else None)


def public_stats_cases() -> list[Case]:
    specs = [
        dict(rows=4, widths=(8,), gain=1.0, drift=0.0, masked=0.0, name="one block of 8 scores per row"),
        dict(rows=4, widths=(6, 6, 6, 6), gain=1.0, drift=3.0, masked=0.0,
             name="4 blocks, the max grows block by block"),
        dict(rows=5, widths=(5, 1, 12, 3), gain=2.0, drift=-1.0, masked=0.3, empty_rows=(3,),
             name="ragged blocks of 5, 1, 12, 3 with masked (-inf) scores; row 3 sees nothing"),
        dict(rows=3, widths=(16, 16), gain=300.0, drift=0.0, masked=0.0,
             name="large scores (up to about 1000)"),
        dict(rows=8, widths=(16,) * 16, gain=2.0, drift=0.5, masked=0.1, online=True,
             name="16 blocks of 16: fold them one at a time, never the whole row of 256"),
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
    rows, count = cases.draw_int(generator, 4, 8), cases.draw_int(generator, 12, 20)
    width = cases.draw_int(generator, 8, 16)
    drawn.append(score_blocks_case(generator, rows, (width,) * count, 2.0, 0.5, 0.1,
                                   f"{count} blocks of {width}: never the whole row of {count * width}",
                                   online=True))
    return drawn


def _stats_view(outputs: dict) -> dict:
    """Compared: m itself, and l through the log-sum-exp m + log(l) (l spans many orders of magnitude)."""
    m, l = outputs["m"], outputs["l"]
    return {"m": m, "m + log(l)": m.double() + torch.log(l.double())}


def _judge_stats(case, outcome):
    (blocks,) = case.args
    s = torch.cat(blocks, dim=-1)
    dims = ("row",) if s.ndim == 2 else ("batch", "row")

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
        yield ("the block's terms are measured against the old max: after m_new = max(m, rowmax(block)), "
               "both the rescale and the new terms use m_new: l = exp(m - m_new) * l + sum(exp(s - m_new)).",
               lambda: make(terms_old_max=True))
        yield ("m is the max of the latest block only: it must be the running max over every "
               "block seen so far.", lambda: make(running_max=False))
        yield ("m starts at 0 instead of -inf: a row whose scores are all below 0 (or all -inf) ends with "
               "m = 0, which is not its largest score. Start from m = -inf and l = 0.",
               lambda: make(m_start=0.0))
        yield ("rows whose first blocks are fully masked (-inf) give NaN: while m is still -inf, "
               "exp(m_old - m_new) is exp(-inf - (-inf)) = NaN. Use 0 in place of an m_new of -inf "
               "(nothing has been seen yet, so nothing needs rescaling).", lambda: make(guard=False))

        def lse_as_l():
            m, l, _ = mistakes.stream_softmax(blocks)
            return _stats_view({"m": m, "l": m + torch.log(l)})
        yield ("you returned m + log(l), the log-sum-exp, in place of l: return l itself, the sum of "
               "exp(s - m) (the LSE is m + log(l)).", lse_as_l)

    row_max = s.double().amax(dim=-1)
    rows = (("m", -1), ("m + log(l)", -1))
    return judge_outputs(case, outcome, ("m", "l"), expected, view=_stats_view, candidates=candidates,
                         detectors=[judges.overflow_detector(row_max, rows), judges.nan_detector],
                         limit_message=ONLINE)


LAB = Lab(
    id="lab01",
    title="FlashAttention on the CPU: online softmax, tiled forward, recomputation backward",
    notebook="lab01_flash_attention_cpu.ipynb",
    exercises=(
        Exercise("online_softmax", "online_softmax_stats", 2, public_stats_cases, hidden_stats_cases,
                 _judge_stats, forbidden=helpers.FORBIDDEN),
        Exercise("causal_tile_mask", "causal_tile_mask", 0.5, helpers.public_mask_cases,
                 helpers.hidden_mask_cases, helpers.judge_mask, forbidden=helpers.FORBIDDEN),
        Exercise("key_end", "key_end", 0.5, helpers.public_end_cases, helpers.hidden_end_cases,
                 helpers.judge_key_end, forbidden=helpers.FORBIDDEN),
        Exercise("flash_forward", "flash_forward", 2.5,
                 partial(cases.public_attention_cases, cases.forward_case),
                 partial(cases.hidden_attention_cases, cases.forward_case),
                 judges.judge_forward, summarize=partial(judges.summarize, causal_index=3),
                 forbidden=helpers.FORBIDDEN),
        Exercise("flash_backward", "flash_backward", 2.5,
                 partial(cases.public_attention_cases, cases.backward_case, cases.BACKWARD_PUBLIC),
                 partial(cases.hidden_attention_cases, cases.backward_case, large_scores=False),
                 gradients.judge_backward, summarize=partial(judges.summarize, causal_index=6),
                 forbidden=helpers.FORBIDDEN),
        Exercise("autograd_function", "FlashAttentionFunction", 2,
                 partial(cases.public_attention_cases, cases.autograd_case, cases.AUTOGRAD_PUBLIC),
                 partial(cases.hidden_attention_cases, cases.autograd_case, large_scores=False,
                         count=5),
                 gradients.judge_autograd, calling="autograd",
                 summarize=partial(judges.summarize, causal_index=3), forbidden=helpers.FORBIDDEN),
    ),
)
