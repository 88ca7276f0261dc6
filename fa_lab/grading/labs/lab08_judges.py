"""Judges of lab 08: the chunkwise forward of scalar-gated linear attention, and solve_tril.

Both are judged in the grader's process against float64 references computed independently of the
exercise's algorithm (the token-by-token recurrence for the forward, ``torch.linalg.solve_triangular`` for
the inverse), with the package's own chunkwise code in the input dtype as the rule's baseline. A failing
case is diagnosed by simulating the exercise's algorithm with one mistake at a time
(:func:`simulate_chunks`, :func:`blocked_inverse`) and naming the ones whose outputs the learner's match.
"""
from __future__ import annotations

import math

import torch

from ...linear import linear_attention
from ...linear import solve_tril as package_solve_tril
from ..judge import Expected, judge_outputs
from ..registry import Verdict

RCP_LN2 = 1 / math.log(2)  # log2(e)
O_DIMS = ("batch", "head", "token", "value dim")
STATE_DIMS = ("batch", "head", "key dim", "value dim")
CHUNKS_ONLY = ("Work one chunk at a time (or all chunks at once as (chunks, C, C) blocks): the intra-chunk term "
               "needs a (C, C) score block per chunk, never an (N, N) score matrix or mask.")


# ----------------------------------------------------------------------------- the chunkwise forward

def simulate_chunks(q, k, v, g, chunk_size: int, scale: float, initial_state=None, *, decay_state=True,
                    decay_keys=True, decay_inter=True, mask="causal", power="right", cumulate="chunk",
                    final="after"):
    """The lab's chunk loop in float64, right or with one mistake. Returns {"o", "state"}.

    decay_state: the start state is decayed by exp(G_last) when the chunk is folded in; decay_keys: each
    key by exp(G_last - G_j); decay_inter: the inter-chunk term by exp(G_i). mask: the intra-chunk block
    keeps j <= i ("causal"), j < i ("strict"), j >= i ("transposed") or every pair ("none"). power: how a
    decay is computed from the cumulated gate: "right" (e^G), "exp_folded" (exp of G * log2 e, the fold
    without exp2), "exp2_unfolded" (2^G, exp2 on the natural-log gate). cumulate: G within the chunk
    ("chunk"), over the whole sequence ("sequence") or exclusive of the token itself ("exclusive").
    final: return the state after the last chunk ("after") or the last chunk's start state ("last_start").
    """
    q, k, v, g = (t.double() for t in (q, k, v, g))
    batch, heads, seqlen, d_k = q.shape
    state = (torch.zeros(batch, heads, d_k, v.shape[-1], dtype=torch.float64) if initial_state is None
             else initial_state.double().clone())
    total = g.cumsum(dim=-1)
    outs, start_state = [], state
    for start in range(0, seqlen, chunk_size):
        end = min(start + chunk_size, seqlen)
        qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        if cumulate == "sequence":
            cum = total[:, :, start:end]
        elif cumulate == "exclusive":
            cum = g[:, :, start:end].cumsum(dim=-1) - g[:, :, start:end]
        else:
            cum = g[:, :, start:end].cumsum(dim=-1)

        def decay(x):
            if power == "exp_folded":
                return torch.exp(x * RCP_LN2)
            if power == "exp2_unfolded":
                return torch.exp2(x)
            return torch.exp(x)
        n = end - start
        rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
        drop = {"causal": cols > rows, "strict": cols >= rows, "transposed": cols < rows,
                "none": torch.zeros(n, n, dtype=torch.bool)}[mask]
        diff = cum[..., :, None] - cum[..., None, :]
        weights = torch.where(drop, torch.zeros_like(diff), decay(diff.masked_fill(drop, 0.0)))
        inter = qc @ state
        if decay_inter:
            inter = inter * decay(cum)[..., None]
        intra = (qc @ kc.transpose(-2, -1) * weights) @ vc
        outs.append(scale * (inter + intra))
        last = cum[..., -1:]
        keys = kc * decay(last - cum)[..., None] if decay_keys else kc
        start_state = state
        state = (state * decay(last)[..., None] if decay_state else state) + keys.transpose(-2, -1) @ vc
    return {"o": torch.cat(outs, dim=2), "state": start_state if final == "last_start" else state}


def _chunk_candidates(q, k, v, g, chunk_size, scale, initial_state):
    def run(**mistake):
        return lambda: simulate_chunks(q, k, v, g, chunk_size, scale, initial_state, **mistake)

    several = q.shape[2] > chunk_size
    if several:
        yield ("the state is not decayed across the chunk boundary: when a chunk is folded in, the start state "
               "must be multiplied by exp(G_last), the decay over the whole chunk (h_next = exp(G_last) h + ...), "
               "not carried over as it is.", run(decay_state=False))
    elif initial_state is not None:
        yield ("the initial state is not decayed over the chunk: the state after the chunk is exp(G_last) h + "
               "sum_j (k_j exp(G_last - G_j))^T v_j, with the start state decayed too.", run(decay_state=False))
    yield ("the keys are not decayed to the chunk's end in the state update: token j's contribution to the next "
           "start state is (k_j exp(G_last - G_j))^T v_j, since it decays over the rest of the chunk.",
           run(decay_keys=False))
    if several or initial_state is not None:
        yield ("the inter-chunk term is not decayed: token i reads the chunk's start state through exp(G_i) "
               "q_i h, the decay from the chunk's start to token i.", run(decay_inter=False))
    yield ("the intra-chunk mask excludes the diagonal: token i sees itself (j <= i), since its own k_i^T v_i "
           "is in the state it reads.", run(mask="strict"))
    yield ("the intra-chunk block has no causal mask: inside a chunk token i may only see tokens j <= i.",
           run(mask="none"))
    yield ("the intra-chunk mask is transposed: you kept j >= i (the future and the token itself); causal "
           "keeps j <= i, the lower triangle.", run(mask="transposed"))
    yield ("you folded RCP_LN2 = log2(e) into the gate but then used exp instead of exp2: after the fold, "
           "exp(x) = exp2(x * RCP_LN2), so every decay must be torch.exp2 of the folded values.",
           run(power="exp_folded"))
    yield ("you used exp2 on the natural-log gate without folding RCP_LN2 = log2(e) in: exp(x) = exp2(x * "
           "RCP_LN2), so multiply the cumulated gate by RCP_LN2 once before the exp2s.", run(power="exp2_unfolded"))
    if several:
        yield ("the gate is cumulated over the whole sequence instead of within each chunk: the start state "
               "already holds the decay before the chunk, so G must restart at every chunk (G_i = sum of g over "
               "the chunk's tokens up to i).", run(cumulate="sequence"))
    yield ("the gate's cumulative sum is exclusive (it leaves out token i's own g_i): the decay from the chunk's "
           "start to token i includes g_i, G_i = g_start + ... + g_i (torch.cumsum).", run(cumulate="exclusive"))
    if scale != 1.0:
        yield ("scale is not applied: o_i = scale * (inter + intra), with scale = d_k ** -0.5 unless given.",
               lambda: simulate_chunks(q, k, v, g, chunk_size, 1.0, initial_state))
    if several:
        yield ("the final state is the last chunk's start state: return the state after the last chunk has been "
               "folded in.", run(final="last_start"))


def _expected_chunk(q, k, v, g, scale, initial_state, chunk_size) -> dict:
    args = (q.double(), k.double(), v.double(), g.double())
    h0 = None if initial_state is None else initial_state.double()
    ref_o, ref_state = linear_attention(*args, scale=scale, initial_state=h0, output_final_state=True,
                                        form="recurrent")
    base_o, base_state = linear_attention(q, k, v, g.float(), scale=scale, initial_state=initial_state,
                                          output_final_state=True, form="chunk", chunk_size=chunk_size)
    return {"o": Expected(ref_o, base_o, q.dtype, O_DIMS),
            "state": Expected(ref_state, base_state.float(), torch.float32, STATE_DIMS)}


def judge_chunk(case, outcome) -> Verdict:
    """chunk_linear_attention(q, k, v, g, chunk_size, scale, initial_state) -> (o, state)."""
    q, k, v, g, chunk_size, scale, initial_state = case.args
    used = q.shape[-1] ** -0.5 if scale is None else scale
    return judge_outputs(case, outcome, ("o", "state"),
                         lambda: _expected_chunk(q, k, v, g, used, initial_state, chunk_size),
                         candidates=lambda: _chunk_candidates(q, k, v, g, chunk_size, used, initial_state),
                         limit_message=CHUNKS_ONLY)


# ----------------------------------------------------------------------------- solve_tril

BLOCK = 16
FLOAT64_FLOOR = 1e-10


def _unit_lower(a) -> torch.Tensor:
    n = a.shape[-1]
    return torch.tril(a.double(), diagonal=-1) + torch.eye(n, dtype=torch.float64)


def blocked_inverse(a, *, fill="right", sign=1.0, block: int = BLOCK) -> torch.Tensor:
    """(I + sign * strictly_lower(a))^{-1} in float64 by the lab's algorithm, right or with one mistake.

    fill: how a block row below the diagonal is filled: "right" (-X_rr A_r,:r X_:r,:r), "no_diagonal_inverse"
    (-A_r,:r X_:r,:r), "no_earlier_inverse" (-X_rr A_r,:r) or "zero" (left at zero: block diagonal).
    """
    n = a.shape[-1]
    blocks = -(-n // block)
    size = blocks * block
    lower = sign * torch.nn.functional.pad(torch.tril(a.double(), diagonal=-1), (0, size - n, 0, size - n))
    eye = torch.eye(size, dtype=torch.float64)
    x = torch.zeros_like(lower)
    for r in range(blocks):
        rs = slice(r * block, r * block + block)
        x[..., rs, rs] = torch.linalg.solve_triangular(lower[..., rs, rs] + eye[rs, rs], eye[rs, rs], upper=False,
                                                       unitriangular=True)
        if r == 0 or fill == "zero":
            continue
        a_row, earlier, x_rr = lower[..., rs, :r * block], x[..., :r * block, :r * block], x[..., rs, rs]
        if fill == "no_diagonal_inverse":
            x[..., rs, :r * block] = -(a_row @ earlier)
        elif fill == "no_earlier_inverse":
            x[..., rs, :r * block] = -(x_rr @ a_row)
        else:
            x[..., rs, :r * block] = -(x_rr @ a_row @ earlier)
    return x[..., :n, :n]


def _tril_candidates(a):
    n = a.shape[-1]
    yield ("the inverse is transposed: (I + L)^{-1} is lower triangular, like I + L; you returned its transpose "
           "(upper triangular). Row i of X reads rows before it: X_i,: = e_i - L_i,:i X_:i,:.",
           lambda: {"inverse": blocked_inverse(a).transpose(-2, -1)})
    yield ("you inverted I - L instead of I + L: forward substitution gives row i as e_i - L_i,:i X_:i,: (minus), "
           "and a block row below as -X_rr A_r,:r X_:r,:r.", lambda: {"inverse": blocked_inverse(a, sign=-1.0)})
    yield ("you returned I - L, the first-order approximation of (I + L)^{-1}: the inverse has every power of "
           "-L, (I + L)^{-1} = I - L + L^2 - ..., which forward substitution sums exactly.",
           lambda: {"inverse": torch.eye(n, dtype=torch.float64) - torch.tril(a.double(), diagonal=-1)})
    off_diagonal = a.double() - torch.diagonal(a.double(), dim1=-2, dim2=-1).diag_embed()
    yield ("you read the upper triangle of a: only its strictly lower triangle counts (the diagonal is taken as "
           "ones and the upper triangle is ignored, as torch.linalg.solve_triangular(..., unitriangular=True) "
           "does); mask it with torch.tril(a, diagonal=-1).",
           lambda: {"inverse": torch.linalg.inv(off_diagonal + torch.eye(n, dtype=torch.float64))})
    yield ("you read the diagonal of a: it is taken as ones (a unit lower-triangular matrix), whatever a holds "
           "there; use torch.tril(a, diagonal=-1) and add the identity.",
           lambda: {"inverse": torch.linalg.solve_triangular(torch.tril(a.double()) + torch.eye(n, dtype=torch.float64),
                                                             torch.eye(n, dtype=torch.float64), upper=False)})
    if n > BLOCK:
        yield ("the blocks below the diagonal are zero: you inverted only the diagonal 16 x 16 blocks. Block row "
               "r of the inverse is X_r,:r = -X_rr A_r,:r X_:r,:r (from (A X)_r,:r = 0).",
               lambda: {"inverse": blocked_inverse(a, fill="zero")})
        yield ("a block row below the diagonal misses the inverse of its diagonal block: X_r,:r = -X_rr A_r,:r "
               "X_:r,:r, with X_rr on the left, not -A_r,:r X_:r,:r.",
               lambda: {"inverse": blocked_inverse(a, fill="no_diagonal_inverse")})
        yield ("a block row below the diagonal misses the inverse of the blocks above: X_r,:r = -X_rr A_r,:r "
               "X_:r,:r, multiplied on the right by the part of X already computed, not -X_rr A_r,:r.",
               lambda: {"inverse": blocked_inverse(a, fill="no_earlier_inverse")})


def judge_tril(case, outcome) -> Verdict:
    """solve_tril(a) -> (I + strictly_lower(a))^{-1}, (..., n, n) in a's dtype."""
    (a,) = case.args
    n = a.shape[-1]
    dims = tuple(f"batch dim {i}" for i in range(a.ndim - 2)) + ("row", "column")

    def expected():
        eye = torch.eye(n, dtype=torch.float64)
        reference = torch.linalg.solve_triangular(_unit_lower(a), eye.expand(a.shape), upper=False,
                                                  unitriangular=True)
        floor = FLOAT64_FLOOR if a.dtype == torch.float64 else None  # the course's rule has no float64 floor
        return {"inverse": Expected(reference, package_solve_tril(a), a.dtype, dims, floor)}
    # One tensor comes back, not a tuple: judged as the one-output tuple ("inverse",).
    value = outcome["outputs"]
    wrapped = dict(outcome, outputs=[value]) if isinstance(value, torch.Tensor) else outcome
    return judge_outputs(case, wrapped, ("inverse",), expected, candidates=lambda: _tril_candidates(a))
