"""Lab 03: the FlashAttention forward as a Triton kernel (goes with notebook 03).

==============  ==========================================================================
exercise        the learner's function, as the harness calls it
==============  ==========================================================================
forward_kernel  flash_forward_triton(q, k, v, False, scale, block_m, block_n) -> (out, lse)
causal_kernel   flash_forward_triton(q, k, v, True, scale, block_m, block_n) -> (out, lse)
backward_kernel flash_backward_triton(q, k, v, out, lse, dout, causal, scale, block_m, block_n)
                -> (dq, dk, dv): the dK/dV and dQ kernels
==============  ==========================================================================

q, k, v are float16 or bfloat16 CPU tensors, so the learner's kernel runs in Triton's
interpreter, one program after another. The interpreter makes thousands of Python calls
per tile step, and the call guard (a ``sys.setprofile`` hook, see
:mod:`fa_lab.grading.harness`) sees every one of them, which makes a guarded tile step
several times slower. In the grading sandbox the guard is off for this lab: the view of
fa_lab hides every name that lab03's exercises forbid (:mod:`fa_lab.grading.view`), so there
is nothing left to guard. ``check()`` cells run in the learner's own kernel, with everything
visible, so there every case runs guarded (a launcher could call something forbidden for
some shapes only). So the cases stay small: lengths up to 64 (about 100 in the skipping
cases), head_dim up to 64, one or two (batch, head) pairs, 16- and 32-row tiles.

How block skipping is checked: on ordinary inputs a kernel that visits the key tiles past
the diagonal and masks them computes the same numbers as one that skips them. So one
causal case (public, and one hidden case per seed) fills V with NaN from the start of the
last key tile on. The programs of the first query tiles never need that tile; one that
loads it anyway multiplies the NaN by P = 0 in tl.dot(p, v), and 0 x NaN = NaN. The case
is judged on those first rows only (:func:`.lab03_judges.judge_skipping`).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..registry import Case, Exercise, Lab
from . import attention_cases as cases
from .attention_cases import Shape, draw_choice, draw_int
from .lab03_judges import judge_backward_kernel, judge_kernel, poisoned_rows, summarize

FP16, BF16 = torch.float16, torch.bfloat16
TILES = (16, 32)
ODD_HEAD_DIMS = (24, 40, 48)  # padded to HEAD_DIM = 32 or 64, with masked columns

FORWARD_SHAPES = (
    Shape(1, 1, 16, 16, 16, False, 16, 16, dtype=FP16, note="a single tile"),
    Shape(1, 2, 40, 40, 32, False, 16, 16, dtype=FP16, note="the last query tile and key tile hold 8 rows"),
    Shape(2, 1, 24, 56, 64, False, 16, 32, dtype=BF16, note="Nq != Nk, the last key tile holds 24 keys"),
    Shape(1, 2, 50, 20, 24, False, 32, 16, dtype=FP16, note="head_dim 24: HEAD_DIM 32 with 8 masked columns"),
    Shape(1, 1, 32, 48, 16, False, 16, 16, dtype=BF16, gain=60.0, note="scores far above 88"),
    Shape(1, 2, 33, 33, 32, False, 32, 32, dtype=FP16, strided=True),
)
CAUSAL_SHAPES = (
    Shape(1, 2, 40, 40, 32, True, 16, 16, dtype=FP16, note="tiles on the diagonal masked, above it skipped"),
    Shape(1, 2, 20, 50, 16, True, 16, 16, dtype=BF16, scale=0.2, note="query i sees keys j <= i + 30"),
    Shape(1, 1, 45, 20, 16, True, 16, 16, dtype=FP16, note="the first 25 queries see no key"),
    Shape(1, 2, 32, 32, 32, True, 32, 16, dtype=BF16, note="the diagonal crosses two key tiles"),
)
SKIPPING_SHAPE = Shape(1, 2, 48, 64, 16, True, 16, 16, dtype=FP16)


def poisoned_case(shape: Shape, generator) -> Case:
    """A forward case whose V is NaN from the start of the last key tile on; its name says which
    queries' programs must skip that tile (see :func:`.lab03_judges.judge_skipping`)."""
    case = cases.forward_case(shape, generator)
    q, k, v, *options = case.args
    first = (shape.seqlen_k - 1) // shape.block_k * shape.block_k
    v = v.clone()
    v[..., first:, :] = float("nan")
    case = replace(case, args=(q, k, v, *options))
    rows, _ = poisoned_rows(case)
    return replace(case, name=f"{case.name}: V is NaN from key {first} on, a tile that the programs "
                              f"of queries 0-{rows - 1} must skip")


def public_forward_cases() -> list[Case]:
    return [cases.forward_case(shape, torch.Generator().manual_seed(3000 + i))
            for i, shape in enumerate(FORWARD_SHAPES)]


def public_causal_cases() -> list[Case]:
    drawn = [cases.forward_case(shape, torch.Generator().manual_seed(3100 + i))
             for i, shape in enumerate(CAUSAL_SHAPES)]
    return drawn + [poisoned_case(SKIPPING_SHAPE, torch.Generator().manual_seed(3199))]


def draw_shape(generator, causal: bool, relation: str, **options) -> Shape:
    """A random small shape. relation: "square", "fewer queries", "more queries" or "any" (Nq vs Nk)."""
    seqlen_q, seqlen_k = cases.draw_seqlens(generator, relation, longest=64, step=32)
    # Two heads when strided: a (B, N, 1, d) tensor viewed as (B, 1, N, d) is contiguous after all.
    batch, heads = (1, 2) if options.get("strided") else draw_choice(generator, ((1, 1), (1, 2), (2, 1)))
    head_dim = draw_choice(generator, (16, 32, 64))
    scale = cases.draw_scale(generator, head_dim)
    return Shape(batch, heads, seqlen_q, seqlen_k, head_dim, causal, draw_choice(generator, TILES),
                 draw_choice(generator, TILES), scale, **options)


def draw_skipping_shape(generator) -> Shape:
    """A causal shape with Nk >= Nq whose last key tile is never needed by the first query tile(s)."""
    block_m, block_n = draw_choice(generator, TILES), draw_choice(generator, TILES)
    seqlen_q = block_m + block_n + draw_int(generator, 1, 32)
    return Shape(1, draw_int(generator, 1, 2), seqlen_q, seqlen_q + draw_int(generator, 0, 16),
                 draw_choice(generator, (16, 32)), True, block_m, block_n,
                 dtype=draw_choice(generator, (FP16, BF16)))


def hidden_forward_cases(generator) -> list[Case]:
    """Full attention in float16 and bfloat16, an odd head_dim, non-contiguous inputs, large scores."""
    shapes = [
        draw_shape(generator, False, "any", dtype=FP16),
        draw_shape(generator, False, "any", dtype=BF16),
        replace(draw_shape(generator, False, "any", dtype=FP16),
                head_dim=draw_choice(generator, ODD_HEAD_DIMS)),
        draw_shape(generator, False, "any", dtype=BF16, strided=True),
        replace(draw_shape(generator, False, "any", dtype=FP16, gain=60.0), scale=None),
    ]
    return [cases.forward_case(shape, generator) for shape in shapes]


def hidden_causal_cases(generator) -> list[Case]:
    """Causal with Nq > Nk, Nq < Nk and Nq = Nk (non-contiguous), any lengths, and a skipping case."""
    shapes = [
        draw_shape(generator, True, "more queries", dtype=FP16),
        draw_shape(generator, True, "fewer queries", dtype=BF16),
        draw_shape(generator, True, "square", dtype=FP16, strided=True),
        draw_shape(generator, True, "any", dtype=BF16),
    ]
    return [cases.forward_case(shape, generator) for shape in shapes] + [
        poisoned_case(draw_skipping_shape(generator), generator)]


BACKWARD_SHAPES = (
    Shape(1, 2, 40, 40, 32, False, 16, 16, dtype=FP16, note="ragged last tiles"),
    Shape(1, 2, 40, 56, 32, True, 16, 16, dtype=FP16, note="causal, Nq < Nk"),
    Shape(1, 1, 45, 20, 16, True, 16, 16, dtype=BF16, note="causal: the first 25 queries see no key"),
    Shape(2, 1, 33, 33, 24, True, 32, 16, dtype=FP16, scale=0.2, note="head_dim 24, BLOCK_M > BLOCK_N"),
)


def public_backward_cases() -> list[Case]:
    return [cases.backward_case(shape, torch.Generator().manual_seed(3300 + i))
            for i, shape in enumerate(BACKWARD_SHAPES)]


def hidden_backward_cases(generator) -> list[Case]:
    shapes = [draw_shape(generator, True, "more queries", dtype=FP16),
              draw_shape(generator, True, "fewer queries", dtype=BF16),
              draw_shape(generator, False, "any", dtype=FP16),
              draw_shape(generator, True, "square", dtype=BF16)]
    return [cases.backward_case(shape, generator) for shape in shapes]


LAB = Lab(
    id="lab03",
    title="FlashAttention in Triton: the forward (ragged tiles, the causal mask, block skipping) and the backward",
    notebook="lab03_triton_forward.ipynb",
    exercises=(
        Exercise("forward_kernel", "flash_forward_triton", 4, public_forward_cases, hidden_forward_cases,
                 judge_kernel, summarize=summarize),
        Exercise("causal_kernel", "flash_forward_triton", 3, public_causal_cases, hidden_causal_cases,
                 judge_kernel, summarize=summarize),
        Exercise("backward_kernel", "flash_backward_triton", 3, public_backward_cases, hidden_backward_cases,
                 judge_backward_kernel),
    ),
)
