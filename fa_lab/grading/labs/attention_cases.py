"""Inputs of the attention exercises: public cases (fixed) and hidden cases (drawn from a seed).

A case is described by a :class:`Shape` and turned into the arguments of each
kind of function (forward, backward, autograd.Function). What the function must
return is computed by the judges (:mod:`.attention_judges`) and never shipped to
the learner's kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...reference import reference_attention
from ...testing import make_qkv
from ..registry import Case

# Scores above this overflow exp() in float32 (e^88.7 is its largest finite value).
FLOAT32_EXP_LIMIT = 88.7
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class Shape:
    """An attention case: sizes, options, and the tile sizes the learner's function gets.

    gain multiplies q (large scores); tiles_only limits the largest tensor the
    call may build to a quarter of the (Nq, Nk) score matrix.
    """

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    block_q: int
    block_k: int
    scale: float | None = None
    dtype: torch.dtype = torch.float32
    gain: float = 1.0
    strided: bool = False
    tiles_only: bool = False
    note: str = ""

    @property
    def name(self) -> str:
        return self.label()

    def label(self, blocks: bool = True) -> str:
        """The case's name; blocks=False leaves out the tile sizes, and a note about tiles, for a
        function that takes no tile sizes."""
        parts = ["causal" if self.causal else "full",
                 f"Nq={self.seqlen_q} Nk={self.seqlen_k} d={self.head_dim}",
                 f"B={self.batch} H={self.heads}", DTYPE_NAMES[self.dtype]]
        if blocks:
            parts.append(f"blocks {self.block_q}x{self.block_k}")
        if self.scale is not None:
            parts.append(f"scale {self.scale}")
        if self.gain != 1.0:
            parts.append(f"q x {self.gain:g}")
        if self.strided:
            parts.append("non-contiguous")
        note = self.note if blocks or not any(word in self.note for word in ("tile", "block")) else ""
        return ", ".join(parts) + (f": {note}" if note else "")

    @property
    def tensor_limit(self) -> int | None:
        return self.seqlen_q * self.seqlen_k // 4 if self.tiles_only else None

    def qkv(self, generator):
        q, k, v = make_qkv(self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim,
                           generator=generator, strided=self.strided, requires_grad=False)
        q = q * self.gain
        return q.to(self.dtype), k.to(self.dtype), v.to(self.dtype)


def forward_case(shape: Shape, generator) -> Case:
    """flash_forward(q, k, v, causal, scale, block_q, block_k)."""
    q, k, v = shape.qkv(generator)
    args = (q, k, v, shape.causal, shape.scale, shape.block_q, shape.block_k)
    return Case(shape.name, args, shape.tensor_limit)


def backward_case(shape: Shape, generator) -> Case:
    """flash_backward(q, k, v, out, lse, dout, causal, scale, block_q, block_k), given the exact
    out and lse."""
    q, k, v = shape.qkv(generator)
    out, lse = reference_attention(q, k, v, shape.causal, shape.scale)
    dout = torch.randn(out.shape, generator=generator).to(shape.dtype)
    args = (q, k, v, out.to(shape.dtype), lse.float(), dout, shape.causal, shape.scale,
            shape.block_q, shape.block_k)
    return Case(shape.name, args, shape.tensor_limit)


def autograd_case(shape: Shape, generator) -> Case:
    """FlashAttentionFunction.apply(q, k, v, causal, scale), then out.backward(dout)."""
    q, k, v = shape.qkv(generator)
    dout = torch.randn((shape.batch, shape.heads, shape.seqlen_q, shape.head_dim),
                       generator=generator).to(shape.dtype)
    return Case(shape.label(blocks=False), (q, k, v, shape.causal, shape.scale, dout))


PUBLIC_SHAPES = (
    Shape(1, 1, 8, 8, 16, False, 8, 8, note="a single tile"),
    Shape(2, 2, 40, 40, 16, False, 16, 8, note="many tiles"),
    Shape(1, 2, 33, 33, 32, True, 16, 16, note="the last blocks are shorter"),
    Shape(1, 2, 12, 30, 16, True, 8, 8, scale=0.2, note="query i sees keys j <= i + 18"),
    Shape(1, 1, 20, 7, 16, True, 8, 4, note="the first 13 queries see no key"),
    Shape(1, 2, 24, 40, 16, False, 8, 8, gain=60.0, note="scores far above 88"),
    Shape(1, 2, 24, 24, 32, True, 8, 8, dtype=torch.bfloat16),
    Shape(1, 1, 512, 512, 16, True, 64, 64, tiles_only=True,
          note="tiles only, no 512 x 512 tensor"),
)
# The backward and the autograd.Function are checked on fewer shapes (one of each kind).
BACKWARD_PUBLIC = (1, 2, 3, 4, 6, 7)
AUTOGRAD_PUBLIC = (1, 3, 4)


def public_attention_cases(make, indices=None) -> list[Case]:
    """``make(shape, generator)`` on the public shapes (all, or those at ``indices``)."""
    chosen = range(len(PUBLIC_SHAPES)) if indices is None else indices
    return [make(PUBLIC_SHAPES[i], torch.Generator().manual_seed(1000 + i)) for i in chosen]


def draw_int(generator, low: int, high: int) -> int:
    """A random int in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=generator))


def draw_choice(generator, options):
    return options[draw_int(generator, 0, len(options) - 1)]


def draw_seqlens(generator, relation: str, longest: int, step: int) -> tuple[int, int]:
    """(seqlen_q, seqlen_k). relation: "square" and "any" draw up to ``longest``; "fewer queries" and
    "more queries" draw the shorter one up to ``step`` and add 1 to ``step`` for the longer."""
    if relation == "square":
        seqlen_q = seqlen_k = draw_int(generator, 1, longest)
    elif relation == "fewer queries":
        seqlen_q = draw_int(generator, 1, step)
        seqlen_k = seqlen_q + draw_int(generator, 1, step)
    elif relation == "more queries":
        seqlen_k = draw_int(generator, 1, step)
        seqlen_q = seqlen_k + draw_int(generator, 1, step)
    else:
        seqlen_q, seqlen_k = draw_int(generator, 1, longest), draw_int(generator, 1, longest)
    return seqlen_q, seqlen_k


def draw_scale(generator, head_dim: int) -> float | None:
    """None (the default scale) or an explicit one within 0.5x to 1.5x of it, as a softmax temperature gives."""
    factor = 0.5 + float(torch.rand(1, generator=generator))
    return draw_choice(generator, (None, round(factor * head_dim ** -0.5, 3)))


def draw_shape(generator, causal: bool, relation: str, **options) -> Shape:
    """A random shape. relation: "square", "fewer queries", "more queries" or "any" (Nq vs Nk)."""
    seqlen_q, seqlen_k = draw_seqlens(generator, relation, longest=70, step=40)
    head_dim = draw_choice(generator, (8, 16, 24, 32, 64))
    scale = draw_scale(generator, head_dim)
    return Shape(draw_int(generator, 1, 2), draw_int(generator, 1, 3), seqlen_q, seqlen_k, head_dim, causal,
                 draw_choice(generator, (5, 8, 16, 32)), draw_choice(generator, (4, 8, 12, 32)), scale,
                 **options)


def draw_tiles_only_shape(generator) -> Shape:
    n = draw_int(generator, 300, 500)
    return Shape(1, 1, n, n, 16, draw_choice(generator, (False, True)), draw_choice(generator, (32, 64)),
                 draw_choice(generator, (32, 64)), tiles_only=True)


def hidden_attention_cases(make, generator, large_scores: bool = True, count: int = 8) -> list[Case]:
    """Random cases: causal with Nq > Nk, Nq < Nk and Nq = Nk (float16), full attention in float32 and
    bfloat16, non-contiguous, causal again, a tiles-only case (the first ``count`` of these), and
    with ``large_scores`` one with scores far above 88. (Recomputing P from a float32 LSE
    loses about |lse| * 6e-8, so large scores are a forward-only case in float32.)"""
    shapes = [
        draw_shape(generator, True, "more queries"),
        draw_shape(generator, True, "fewer queries"),
        draw_shape(generator, True, "square", dtype=torch.float16),
        draw_shape(generator, False, "any"),
        draw_shape(generator, False, "any", dtype=torch.bfloat16),
        draw_shape(generator, True, "any", strided=True),
        draw_shape(generator, True, "square"),
        draw_tiles_only_shape(generator),
    ][:count]
    if large_scores:  # scores of about 60 standard deviations: well past 88, not so far that
        # rounding S (|s| * 6e-8) dominates the error
        shapes.append(replace(draw_shape(generator, False, "any", gain=60.0), scale=None))
    return [make(shape, generator) for shape in shapes]
