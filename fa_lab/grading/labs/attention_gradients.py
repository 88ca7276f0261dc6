"""Judges for attention backwards and autograd.Functions.

:func:`judge_backward` judges fn(q, k, v, out, lse, dout, causal, scale[, block_q, block_k]) ->
(dq, dk, dv) given the exact out and lse; :func:`judge_autograd` judges Function.apply(q, k, v,
causal, scale) and its backward. Both compare with the float64 reference under the tolerance rule
and name a mistake when a simulation of it (:func:`.attention_mistakes.recompute_backward`)
reproduces the learner's gradients: D left out, summed per tile or taken from dO alone, dS with the
wrong sign, masks, key loops, scales, an lse of -inf used as it is, gradients overwritten instead
of accumulated, arguments that do not reach forward or backward. Detectors then say which of dq,
dk, dv are wrong and what that rules out.
"""
from __future__ import annotations

import math
from functools import partial

import torch

from ...inputs import resolve_scale
from ...reference import naive_attention, reference_attention
from ..judge import Expected, judge_outputs
from . import attention_mistakes as mistakes
from .attention_judges import (
    KEY_DIMS,
    OUT_DIMS,
    TILES_ONLY,
    causal_mask_for,
    key_loop_candidates,
    last_query_block,
    mask_candidates,
    nan_detector,
    scale_candidates,
    visited,
)

GRADIENTS = ("dq", "dk", "dv")


def gradient_expected(q, k, v, causal, scale, dout) -> dict:
    """out and (dq, dk, dv) for the upstream gradient dout: float64 reference, dtype baseline."""
    def run(attention, tensors, grad):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out, _ = attention(*leaves, causal, scale)
        return (out.detach(), *torch.autograd.grad(out, leaves, grad))
    # float64 leaves: gradients of bfloat16 leaves would come back rounded to bfloat16
    reference = run(reference_attention, (q.double(), k.double(), v.double()), dout.double())
    baseline = run(naive_attention, (q, k, v), dout)
    dims = (OUT_DIMS, OUT_DIMS, KEY_DIMS, KEY_DIMS)
    return {name: Expected(r, b, q.dtype, d)
            for name, r, b, d in zip(("out", *GRADIENTS), reference, baseline, dims, strict=True)}


def gradients_detector(actual, expected, comparisons):
    """What the pattern of wrong gradients rules out (dv = P^T dO needs only P; dq and dk need dS)."""
    if "out" in comparisons and not comparisons["out"].ok:
        return None  # a wrong forward: the gradients say nothing on their own
    wrong = {name for name in GRADIENTS if not comparisons[name].ok}
    if wrong == {"dq", "dk"}:
        return ("dv is right, so your P is right (dv = P^T dO), but dq and dk are wrong: look at dS = "
                "P * (dP - D), with dP = dO V^T and D = rowsum(dO * O) (one number per query row), and at "
                "dq = scale * dS K and dk = scale * dS^T Q.")
    if wrong == {"dq"}:
        return ("dk and dv are right, so P and dS are right: look at dq = scale * dS K, summed over every "
                "key block that a query block visits.")
    if wrong == {"dk"}:
        return ("dq and dv are right, so P and dS are right: look at dk = scale * dS^T Q, summed over every "
                "query block that visits the key block.")
    if wrong == {"dv"}:
        return ("dq and dk are right but dv is wrong: look at dv = P^T dO, summed over every query block "
                "that visits the key block, and at P = exp(S - lse) itself.")
    return None


def backward_candidates(q, k, v, out, lse, dout, causal, scale, blocks=()):
    """The known mistakes of a backward, as (message, thunk) pairs; blocks: (block_q, block_k) when
    the function tiles with them."""
    used = resolve_scale(scale, q.shape[-1])
    correct = causal_mask_for(q, k, causal)
    loop = visited(q, k, causal, blocks) if blocks else None
    qk, dp = mistakes.product(q, k), mistakes.product(dout, v)

    def grads(mask=correct, score_scale=used, grad_scale=used, **mistake):
        dq, dk, dv = mistakes.recompute_backward(q, k, v, out, lse, dout, mask, score_scale, grad_scale,
                                                 blocks=blocks or None, qk=qk, dp=dp, **mistake)
        return {"dq": dq, "dk": dk, "dv": dv}

    yield ("the D term is missing: dS = P * (dP - D), where D = rowsum(dO * O) holds one number per "
           "query row (it comes from the softmax's normalization).", lambda: grads(delta="none"))
    yield ("D is rowsum(dO), without O: D = rowsum(dO * O), the dot product of each row of dO with the "
           "same row of O (one number per query row).", lambda: grads(delta="dout"))
    if blocks:
        yield ("D is summed over each key tile only: D_i = sum_j P_ij dP_ij runs over the whole row of "
               "keys, so compute it once before the loop, as rowsum(dO * O) (one number per query row); a "
               "tile's partial sum is not D.", lambda: grads(delta="tile"))
    yield "dS has the wrong sign: dS = P * (dP - D), not P * (D - dP).", lambda: grads(flip_ds=True)
    yield from mask_candidates(q, k, causal, lambda mask: grads(mask=mask), blocks)
    if blocks:
        yield from key_loop_candidates(
            q, k, causal, blocks, lambda keys: grads(mask=keys if correct is None else correct & keys))
    yield ("dq and dk miss the softmax scale: S = scale * q k^T, so dq = scale * dS K and "
           "dk = scale * dS^T Q.", lambda: grads(grad_scale=1.0))
    yield ("the scale is applied twice in dq and dk: multiply dS K and dS^T Q by the scale once.",
           lambda: grads(grad_scale=used * used))
    yield from scale_candidates(q, scale, lambda score_scale, grad_scale: grads(
        score_scale=score_scale, grad_scale=grad_scale))
    unguarded = ("the queries that see no key give NaN: their lse is -inf, so P = exp(S - lse) computes "
                 "exp(-inf - (-inf)) = NaN, which spreads from dq to dk and dv. Use +inf in place of an lse "
                 "of -inf: exp(S - inf) = 0, so those queries get P = 0 and gradients 0.")
    yield unguarded, lambda: grads(guard=False)
    if blocks:
        yield unguarded, lambda: grads(guard=False, visited=loop)
        yield ("dq is overwritten instead of accumulated: a query block's dq is the sum of dS K over "
               "every key block it visits, so add each block's term (+=), do not assign it (=).",
               lambda: grads(overwrite="dq", visited=loop))
        for name, term in (("dk", "dS^T Q"), ("dv", "P^T dO")):
            yield (f"{name} is overwritten instead of accumulated: a key block's {name} is the sum of {term} "
                   "over every query block that visits it, so add each block's term (+=), do not assign "
                   "it (=).", partial(grads, overwrite=name, visited=loop))
        first = last_query_block(q.shape[-2], blocks[0])
        if first is not None:
            rows = torch.arange(q.shape[-2])[:, None] < first
            yield (f"the last query block (queries {first} to {q.shape[-2] - 1}) is never computed: its dq rows "
                   "stay 0 and its terms are missing from dk and dv. When Nq is not a multiple of block_q the "
                   "last block is shorter, but it still needs its turn: loop with range(0, Nq, block_q) and "
                   "take the queries [i0, min(i0 + block_q, Nq)).",
                   lambda: grads(mask=rows if correct is None else correct & rows))


def judge_backward(case, outcome):
    """fn(q, k, v, out, lse, dout, causal, scale[, block_q, block_k]) -> (dq, dk, dv)."""
    q, k, v, out, lse, dout, causal, scale, *blocks = case.args

    def expected():
        specs = gradient_expected(q, k, v, causal, scale, dout)
        return {name: specs[name] for name in GRADIENTS}

    detectors = (gradients_detector, nan_detector)
    return judge_outputs(case, outcome, GRADIENTS, expected,
                         candidates=lambda: backward_candidates(q, k, v, out, lse, dout, causal, scale, blocks),
                         detectors=detectors, limit_message=TILES_ONLY)


_AUTOGRAD_HINTS = (
    ("incorrect number of gradients",
     "backward must return one value per input of forward: dq, dk, dv, and None for each "
     "non-tensor input (causal, scale)."),
    ("returned an invalid gradient at index",
     "backward returns the gradients in a different order from forward's inputs, or of other "
     "shapes: return (dq, dk, dv, ...) in the order of forward(ctx, q, k, v, ...)."),
)


def autograd_candidates(q, k, v, causal, scale, dout):
    """The known mistakes of an autograd.Function, as (message, thunk) pairs of {out, dq, dk, dv}."""
    used, default = resolve_scale(scale, q.shape[-1]), resolve_scale(None, q.shape[-1])
    correct = causal_mask_for(q, k, causal)

    def run(mask=correct, fwd_scale=used, bwd_mask=correct, bwd_scale=used, grad=dout):
        out, lse = mistakes.attention(q, k, v, fwd_scale, mask)
        grads = mistakes.recompute_backward(q, k, v, out, lse, grad, bwd_mask, bwd_scale, bwd_scale)
        return {"out": out, **dict(zip(GRADIENTS, grads, strict=True))}

    def reordered(order):
        grads = run()
        if any(grads[a].shape != grads[b].shape for a, b in zip(GRADIENTS, order, strict=True)):
            return None
        return {"out": grads["out"], **{a: grads[b] for a, b in zip(GRADIENTS, order, strict=True)}}

    for order in (("dk", "dq", "dv"), ("dq", "dv", "dk"), ("dv", "dk", "dq"), ("dk", "dv", "dq"),
                  ("dv", "dq", "dk")):
        yield ("backward returns the gradients in a different order from forward's inputs: return "
               "them as (dq, dk, dv, ...) to match forward(ctx, q, k, v, ...).", partial(reordered, order))
    yield ("backward ignores its grad_out argument (your gradients are those of out.sum()): pass "
           "the incoming gradient to flash_backward as dout.", lambda: run(grad=torch.ones_like(dout)))
    if causal:
        yield ("backward does not get causal=True: save causal on ctx in forward and pass it to "
               "flash_backward.", lambda: run(bwd_mask=None))
        yield ("forward does not pass causal=True to flash_forward (out is full attention), while backward "
               "gets it: pass causal to flash_forward too.", lambda: run(mask=None))
        yield ("causal is ignored: pass it to flash_forward, save it on ctx and pass it to flash_backward.",
               lambda: run(mask=None, bwd_mask=None))
    if scale is not None and not math.isclose(scale, default):
        yield ("backward does not get the scale: save it on ctx in forward and pass it to "
               "flash_backward.", lambda: run(bwd_scale=default))
        yield ("forward does not pass the scale to flash_forward (out uses head_dim ** -0.5), while "
               "backward gets it: pass scale to flash_forward too.", lambda: run(fwd_scale=default))
        yield ("the scale is ignored: pass it to flash_forward, save it on ctx and pass it to flash_backward.",
               lambda: run(fwd_scale=default, bwd_scale=default))


def judge_autograd(case, outcome):
    """Function.apply(q, k, v, causal, scale), then out.backward(dout): (out, dq, dk, dv)."""
    q, k, v, causal, scale, dout = case.args
    return judge_outputs(case, outcome, ("out", *GRADIENTS),
                         lambda: gradient_expected(q, k, v, causal, scale, dout),
                         candidates=lambda: autograd_candidates(q, k, v, causal, scale, dout),
                         detectors=(gradients_detector, nan_detector), error_hints=_AUTOGRAD_HINTS)
