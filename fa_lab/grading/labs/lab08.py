"""Lab 08: flash linear attention, the chunkwise forward and solve_tril (goes with notebook 08).

======================  =============================================================================
exercise                the learner's function, as the harness calls it
======================  =============================================================================
chunk_linear_attention  chunk_linear_attention(q, k, v, g, chunk_size, scale, initial_state) -> (o, state):
                        scalar-gated linear attention chunk by chunk (the inter-chunk term through the start
                        state, the intra-chunk causal block, the state passed on), gates folded into log2
solve_tril              solve_tril(a) -> (I + strictly_lower(a))^{-1}: blocked forward substitution, 16 x 16
======================  =============================================================================

Judged in the grader's process against the float64 recurrence and ``torch.linalg.solve_triangular``
(:mod:`.lab08_judges`). fa_lab's linear attention (:mod:`fa_lab.linear`, its Triton kernels) is forbidden in
every exercise, so it is absent while grading. The points of ``solve_tril`` rest on its values; the lab
asks for the blocked algorithm but cannot see whether a notebook calls torch's own triangular solvers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import Case, Exercise, Lab
from . import lab08_judges as judges
from .attention_cases import draw_choice, draw_int

FORBIDDEN = ("fa_lab.linear", "fa_lab.kernels.triton_chunk_linear_attention", "fa_lab.kernels.triton_chunk_delta_rule",
             "fa_lab.kernels.triton_fused_recurrent")


# ----------------------------------------------------------------------------- chunk_linear_attention

def _chunk_case(generator, name, batch, heads, seqlen, d_k, d_v, chunk_size, *, scale=None, dtype=torch.float32,
                decay=3.0, initial=False, plain=False, chunks_only=False) -> Case:
    """q, k, v from N(0, 1); g = logsigmoid(N(0, 1) + decay) (0 with ``plain``); initial: a random start state."""
    q, k = (torch.randn(batch, heads, seqlen, d_k, generator=generator) for _ in range(2))
    v = torch.randn(batch, heads, seqlen, d_v, generator=generator)
    g = F.logsigmoid(torch.randn(batch, heads, seqlen, generator=generator) + decay)
    if plain:
        g = torch.zeros_like(g)
    state = torch.randn(batch, heads, d_k, d_v, generator=generator) if initial else None
    # Chunks only: no tensor larger than one (C, C) block per chunk (or the inputs), never (N, N).
    limit = batch * heads * seqlen * max(chunk_size, d_k, d_v) if chunks_only else None
    return Case(name, (q.to(dtype), k.to(dtype), v.to(dtype), g, chunk_size, scale, state), limit)


def public_chunk_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(8100)
    return [
        _chunk_case(gen, "one head, 64 tokens in chunks of 16, d 8", 1, 1, 64, 8, 8, 16),
        _chunk_case(gen, "50 tokens in chunks of 16 (a ragged last chunk of 2), 2 heads", 1, 2, 50, 8, 8, 16),
        _chunk_case(gen, "one chunk: 12 tokens, chunk_size 32", 1, 1, 12, 8, 4, 32),
        _chunk_case(gen, "no gate (g = 0): plain linear attention, 40 tokens in chunks of 8", 1, 2, 40, 8, 8, 8,
                    plain=True),
        _chunk_case(gen, "strong decay (about 0.5 per token), d_k 16, d_v 8, scale 0.5", 2, 2, 48, 16, 8, 16,
                    scale=0.5, decay=0.0),
        _chunk_case(gen, "an initial state (a cache from an earlier call), 33 tokens in chunks of 8", 1, 2, 33, 8,
                    8, 8, initial=True),
        _chunk_case(gen, "bfloat16 q, k, v, 64 tokens in chunks of 16", 1, 2, 64, 16, 16, 16, dtype=torch.bfloat16),
        _chunk_case(gen, "chunks only: 512 tokens in chunks of 32, no tensor of (N, N)", 1, 2, 512, 16, 16, 32,
                    chunks_only=True),
    ]


def hidden_chunk_cases(generator) -> list[Case]:
    cases = []
    for dtype, initial, plain, decay in ((torch.float32, False, False, 3.0), (torch.float32, True, False, 1.0),
                                         (torch.float32, False, True, 3.0), (torch.float16, False, False, 2.0),
                                         (torch.bfloat16, True, False, 3.0), (torch.float32, False, False, 0.0)):
        chunk_size = draw_choice(generator, (4, 8, 16, 32))
        seqlen = draw_int(generator, 1, 90)
        d_k, d_v = draw_choice(generator, (4, 8, 16)), draw_choice(generator, (4, 8, 16))
        name = (f"{seqlen} tokens in chunks of {chunk_size}, d_k {d_k}, d_v {d_v}"
                + (", an initial state" if initial else "") + (", no gate" if plain else "")
                + (f", {dtype}" if dtype != torch.float32 else ""))
        cases.append(_chunk_case(generator, name, draw_int(generator, 1, 2), draw_int(generator, 1, 2), seqlen, d_k,
                                 d_v, chunk_size, dtype=dtype, decay=decay, initial=initial, plain=plain))
    n = draw_int(generator, 400, 520)
    cases.append(_chunk_case(generator, f"chunks only: {n} tokens in chunks of 32", 1, 2, n, 16, 16, 32,
                             chunks_only=True))
    return cases


# ----------------------------------------------------------------------------- solve_tril

def delta_system(generator, shape, n, d_k=16, dtype=torch.float32) -> torch.Tensor:
    """beta_i (k_i . k_j) for every pair, the matrix whose strictly lower triangle is the delta rule's A - I
    (keys L2-normalized, beta in (0, 1)); its diagonal and upper triangle are there too and must be ignored."""
    k = F.normalize(torch.randn(*shape, n, d_k, generator=generator), dim=-1)
    beta = torch.sigmoid(torch.randn(*shape, n, generator=generator))
    return (beta[..., None] * (k @ k.transpose(-2, -1))).to(dtype)


def public_tril_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(8200)
    return [
        Case("one 16 x 16 block (forward substitution only)", (delta_system(gen, (), 16),)),
        Case("64 x 64: four blocks, three block rows to fill", (delta_system(gen, (), 64),)),
        Case("a batch (2, 3) of 32 x 32, float64", (delta_system(gen, (2, 3), 32, dtype=torch.float64),)),
        Case("50 x 50 (not a multiple of 16: pad with an identity block)", (delta_system(gen, (1,), 50),)),
        Case("8 x 8 (smaller than a block)", (delta_system(gen, (), 8),)),
        Case("1 x 1 (the inverse is [[1]])", (delta_system(gen, (2,), 1),)),
        Case("random entries of 0.3 N(0, 1), with a diagonal and an upper triangle to ignore",
             (0.3 * torch.randn(48, 48, generator=gen),)),
    ]


def hidden_tril_cases(generator) -> list[Case]:
    cases = []
    for dtype in (torch.float32, torch.float32, torch.float64, torch.float32):
        n = draw_choice(generator, (16, 32, 48, 64, draw_int(generator, 2, 70)))
        shape = draw_choice(generator, ((), (2,), (1, 2, 3)))
        cases.append(Case(f"{n} x {n}, batch {shape or 'none'}" + (f", {dtype}" if dtype != torch.float32 else ""),
                          (delta_system(generator, shape, n, dtype=dtype),)))
    n = draw_int(generator, 17, 64)
    cases.append(Case(f"random entries, {n} x {n}", (0.3 * torch.randn(n, n, generator=generator),)))
    return cases


LAB = Lab(
    id="lab08",
    title="Flash linear attention: the chunkwise forward with a log2 gate, and solve_tril",
    notebook="lab08_linear.ipynb",
    exercises=(
        Exercise("chunk_linear_attention", "chunk_linear_attention", 6.0, public_chunk_cases, hidden_chunk_cases,
                 judges.judge_chunk, forbidden=FORBIDDEN),
        Exercise("solve_tril", "solve_tril", 4.0, public_tril_cases, hidden_tril_cases, judges.judge_tril,
                 forbidden=FORBIDDEN),
    ),
)
