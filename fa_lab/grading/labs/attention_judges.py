"""Judges for attention functions: a forward, a backward, an autograd.Function.

Each judge takes a case whose arguments follow :mod:`.attention_cases` (block
sizes at the end are optional: a kernel with its own tiling is judged without the
tiling-dependent mistakes) and the harness's outcome, compares with the float64
reference under the tolerance rule, and names the mistake when it recognizes one:
wrong causal masks, wrong scales, missing rescales, a log2 LSE, a missing D term,
gradients in the wrong order, NaN in rows that see no key, overflow, ...
"""
from __future__ import annotations

import math
from functools import partial

import torch

from ...block_info import BlockInfo
from ...reference import naive_attention, reference_attention
from ...testing import LSE_FLOOR
from ..judge import Expected, judge_outputs, only_some_fail, wrong_positions
from . import attention_mistakes as mistakes
from .attention_cases import FLOAT32_EXP_LIMIT

OUT_DIMS = ("batch", "head", "query", "dim")
KEY_DIMS = ("batch", "head", "key", "dim")
LSE_DIMS = ("batch", "head", "query")
TILES_ONLY = ("FlashAttention never holds more than a (block_q, block_k) tile of scores or "
              "probabilities; build S and P tile by tile, never the whole (Nq, Nk) matrix.")


def resolve_scale(q, scale) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _mask(q, k, causal, offset_shift=0, top_left=False):
    """The causal mask (None without causal); offset_shift / top_left give the wrong ones."""
    if not causal:
        return None
    info = BlockInfo(q.shape[-2], k.shape[-2], causal=True)
    if not (offset_shift or top_left):
        return info.mask()
    offset = 0 if top_left else info.offset
    return mistakes.causal_mask_with_offset(info.seqlen_q, info.seqlen_k, offset + offset_shift)


def _visited_keys_mask(seqlen_q, seqlen_k, block_q, block_k) -> torch.Tensor:
    """(Nq, Nk) bool: every key of the key blocks that a causal loop visits for each query's block
    (up to the last visible key), that is the causal mask without masking inside the tiles."""
    info = BlockInfo(seqlen_q, seqlen_k, causal=True)
    block_start = torch.arange(seqlen_q) // block_q * block_q
    key_end = info.key_end(torch.clamp(block_start + block_q, max=seqlen_q) - 1)  # the block's last row's
    visited_end = torch.clamp((key_end + block_k - 1) // block_k * block_k, max=seqlen_k)
    return torch.arange(seqlen_k)[None, :] < visited_end[:, None]


def mask_candidates(q, k, causal, make, blocks=None):
    """The wrong causal masks, as (message, thunk) with make(mask) -> outputs.
    blocks: (block_q, block_k) when the function tiles with them."""
    if not causal:
        return
    seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
    offset = seqlen_k - seqlen_q
    shift = f" {'+' if offset > 0 else '-'} {abs(offset)}" if offset else ""
    rule = f"query i sees keys j <= i + Nk - Nq, here j <= i{shift}" if offset else "query i sees keys j <= i"
    first = max(0, -offset)  # the first query that sees a key
    yield f"the causal mask is not applied: with causal=True, {rule}.", lambda: make(None)
    if blocks:
        yield ("the causal mask is not applied inside the tiles: skipping the key blocks past the "
               "diagonal is not enough, the tiles that cross it must mask the keys a query may not see.",
               lambda: make(_visited_keys_mask(seqlen_q, seqlen_k, *blocks)))
    if seqlen_q != seqlen_k:
        yield ("the causal mask is aligned top-left (query i sees keys j <= i). The course aligns it "
               f"bottom-right: {rule}, so the last query sees every key.",
               lambda: make(_mask(q, k, True, top_left=True)))
    yield (f"causal mask off by one: query {first} sees key {first + offset + 1}, but it may see keys "
           f"up to {first + offset} only ({rule}).", lambda: make(_mask(q, k, True, 1)))
    yield (f"causal mask off by one: each query misses the key on its diagonal (query {first} must "
           f"see key {first + offset}; {rule}).", lambda: make(_mask(q, k, True, -1)))


def scale_candidates(q, scale, make):
    """The wrong scales, as (message, thunk) with make(score_scale, grad_scale) -> outputs."""
    used = resolve_scale(q, scale)
    default = q.shape[-1] ** -0.5
    yield ("the scale is applied twice (scale^2 * q k^T): scale q or S, not both.",
           lambda: make(used * used, used))
    yield "the softmax scale is missing: S = scale * q k^T.", lambda: make(1.0, used)
    if scale is not None and not math.isclose(scale, default):
        yield ("the scale argument is ignored: you used head_dim ** -0.5, but the case passes "
               f"scale={scale}.", lambda: make(default, default))


def overflow_detector(largest_score: float):
    """Non-finite outputs on a case whose scores overflow exp in float32."""
    def overflow(actual, expected, comparisons):
        blown = any((~torch.isfinite(actual[n]) & torch.isfinite(expected[n].reference)).any()
                    for n in actual)
        if blown and largest_score > FLOAT32_EXP_LIMIT:
            return (f"exp overflowed: scores in this case reach {largest_score:.0f}, and exp(x) is inf in "
                    "float32 above 88.7. Subtract the running max m before exp, so that every "
                    "exponent is <= 0.")
        return None
    return overflow


def nan_detector(actual, expected, comparisons):
    """NaN where the reference is finite (after the more specific detectors had their say)."""
    if any((torch.isnan(actual[n]) & ~torch.isnan(expected[n].reference)).any() for n in actual):
        return ("NaN where the reference has a number. Usual causes: a rescale factor with the wrong "
                "sign, exp(m_new - m_old), which is inf while m_old = -inf (and inf * 0 = NaN); or "
                "exp(-inf - (-inf)) for a row whose running max is still -inf.")
    return None


def wrong_rows(actual, expected, comparisons, names_and_dims) -> set[int]:
    """The query rows where any output misses its bound; names_and_dims: (output name, its query dim)."""
    rows = set()
    for name, row_dim in names_and_dims:
        wrong = wrong_positions(actual[name], expected[name].reference, comparisons[name].bound)
        others = [d for d in range(wrong.ndim) if d != row_dim % wrong.ndim]
        rows |= set(torch.nonzero(wrong.any(dim=others)).flatten().tolist())
    return rows


def row_detectors(q, k, causal, block_q, names_and_dims):
    """Detectors for errors only in the rows that see no key, NaN, or errors only in the last
    (shorter) query block. names_and_dims: (output name, its query dim) pairs."""
    mask = _mask(q, k, causal)
    empty = set() if mask is None else set(torch.nonzero(~mask.any(dim=-1)).flatten().tolist())
    seqlen_q = q.shape[-2]
    partial_rows = seqlen_q % block_q if block_q else 0
    has_last_block = partial_rows and seqlen_q > block_q
    last_block = set(range(seqlen_q - partial_rows, seqlen_q)) if has_last_block else set()

    def only_empty_rows(actual, expected, comparisons):
        rows = wrong_rows(actual, expected, comparisons, names_and_dims)
        if empty and rows and rows <= empty:
            return (f"only the queries that see no key are wrong (queries 0 to {max(empty)} here, "
                    "since Nq > Nk). Such a row has no visible score: it must give out = 0 and "
                    "lse = -inf, and gradients 0, never NaN. Guard the division by l = 0, and use 0 "
                    "in place of a running max (or lse) of -inf.")
        return None

    def only_last_block(actual, expected, comparisons):
        rows = wrong_rows(actual, expected, comparisons, names_and_dims)
        if last_block and rows and rows <= last_block:
            return (f"only the last query block is wrong (queries {min(last_block)} to "
                    f"{max(last_block)}): when Nq is not a multiple of block_q, the last block is "
                    "shorter. Loop with range(0, Nq, block_q) and slice up to min(start + block_q, Nq).")
        return None

    return (only_empty_rows, nan_detector, only_last_block)


def _largest_score(q, k, scale, causal) -> float:
    s = mistakes.scores(q, k, resolve_scale(q, scale), _mask(q, k, causal))
    finite = s[torch.isfinite(s)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def forward_expected(q, k, v, causal, scale) -> dict:
    """out and lse: the float64 reference, naive attention in q's dtype as the baseline."""
    ref_out, ref_lse = reference_attention(q, k, v, causal, scale)
    base_out, base_lse = naive_attention(q, k, v, causal, scale)
    return {"out": Expected(ref_out, base_out, q.dtype, OUT_DIMS),
            "lse": Expected(ref_lse, base_lse, torch.float32, LSE_DIMS, LSE_FLOOR)}


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
            for name, r, b, d in zip(("out", "dq", "dk", "dv"), reference, baseline, dims, strict=True)}


def summarize(results, causal_index: int):
    """A hint when only the causal cases, or only the float16 / bfloat16 ones, fail."""
    return (only_some_fail(results, lambda c: c.args[causal_index],
                           "Every failing case is causal and the non-causal ones pass: look at your "
                           "causal mask (which keys each query sees, which blocks you skip).")
            or only_some_fail(results, lambda c: c.args[0].dtype != torch.float32,
                              "Only the float16 / bfloat16 cases fail: compute each tile in float32 "
                              "and cast the result back to the input dtype at the end."))


def forward_candidates(q, k, v, causal, scale, blocks=()):
    """The known mistakes of a forward fn(q, k, v, causal, scale[, block_q, block_k]) -> (out, lse),
    as (message, thunk) pairs; blocks: (block_q, block_k) when the function tiles with them."""
    used = resolve_scale(q, scale)
    correct = _mask(q, k, causal)

    def exact(mask, score_scale=used):
        out, lse = mistakes.attention(q, k, v, score_scale, mask)
        return {"out": out, "lse": lse}

    def tiled(**mistake):
        out, lse = mistakes.tiled_forward(q, k, v, used, correct, blocks[1], **mistake)
        return {"out": out, "lse": lse}

    yield from mask_candidates(q, k, causal, exact, blocks)
    yield from scale_candidates(q, scale, lambda score_scale, _: exact(correct, score_scale))
    if blocks:
        yield from _tiling_candidates(tiled)
    reference = exact(correct)
    row_max = mistakes.scores(q, k, used, correct).amax(dim=-1)
    yield ("lse is in log base 2, but the course's lse is a natural log: lse = m + ln(l). If you "
           "worked with exp2, multiply by ln 2 at the end.",
           lambda: {**reference, "lse": reference["lse"] / math.log(2)})
    yield "lse is only the running max m: it must be m + log(l).", lambda: {**reference, "lse": row_max}
    yield ("lse is missing the running max: it must be m + log(l), not log(l).",
           lambda: {**reference, "lse": torch.where(torch.isinf(row_max), reference["lse"],
                                                    reference["lse"] - row_max)})
    seqlen_k = k.shape[-2]
    if blocks and seqlen_k % blocks[1] and seqlen_k > blocks[1]:
        full = seqlen_k - seqlen_k % blocks[1]
        kept = torch.arange(seqlen_k)[None, :] < full
        yield (f"the last key block is ignored (keys {full} to {seqlen_k - 1}): when Nk is not a "
               "multiple of block_k the last block is shorter, but it still counts.",
               lambda: exact(kept if correct is None else correct & kept))


def forward_detectors(q, k, causal, scale, block_q=None):
    """The detectors for a forward's (out, lse): overflow, rows that see no key, NaN, and (with
    block_q) errors only in the last, shorter query block."""
    return (overflow_detector(_largest_score(q, k, scale, causal)),
            *row_detectors(q, k, causal, block_q, (("out", -2), ("lse", -1))))


def judge_forward(case, outcome):
    """fn(q, k, v, causal, scale[, block_q, block_k]) -> (out, lse)."""
    q, k, v, causal, scale, *blocks = case.args
    return judge_outputs(case, outcome, ("out", "lse"), lambda: forward_expected(q, k, v, causal, scale),
                         candidates=lambda: forward_candidates(q, k, v, causal, scale, blocks),
                         detectors=forward_detectors(q, k, causal, scale, blocks[0] if blocks else None),
                         limit_message=TILES_ONLY)


def _tiling_candidates(tiled):
    yield ("the output accumulator is not rescaled: when a block raises the running max from m_old "
           "to m_new, acc must be multiplied by exp(m_old - m_new) before P V is added.",
           lambda: tiled(rescale_acc=False))
    yield ("l is not rescaled: when a block raises the running max from m_old to m_new, l must be "
           "multiplied by exp(m_old - m_new) before the block's row sums are added.",
           lambda: tiled(rescale_l=False))
    yield ("neither l nor the accumulator is rescaled: when the running max grows from m_old to "
           "m_new, both must be multiplied by exp(m_old - m_new).",
           lambda: tiled(rescale_l=False, rescale_acc=False))
    yield ("the rescale factor has the wrong sign: you used exp(m_new - m_old) instead of "
           "exp(m_old - m_new). It must be <= 1; at the start m_old = -inf, so the wrong factor is "
           "inf, and inf * 0 = NaN.", lambda: tiled(flip=True))
    yield ("out is not normalized: divide the accumulator by l once, after the last key block.",
           lambda: tiled(normalize=False))


def judge_backward(case, outcome):
    """fn(q, k, v, out, lse, dout, causal, scale[, block_q, block_k]) -> (dq, dk, dv)."""
    q, k, v, out, lse, dout, causal, scale, *blocks = case.args
    used = resolve_scale(q, scale)
    correct = _mask(q, k, causal)

    def expected():
        specs = gradient_expected(q, k, v, causal, scale, dout)
        return {name: specs[name] for name in ("dq", "dk", "dv")}

    def grads(mask=correct, score_scale=used, grad_scale=used, **mistake):
        dq, dk, dv = mistakes.recompute_backward(q, k, v, out, lse, dout, mask, score_scale, grad_scale,
                                                 **mistake)
        return {"dq": dq, "dk": dk, "dv": dv}

    def candidates():
        yield ("the D term is missing: dS = P * (dP - D), where D = rowsum(dO * O) holds one number "
               "per query row (it comes from the softmax's normalization).",
               lambda: grads(use_delta=False))
        yield from mask_candidates(q, k, causal, lambda mask: grads(mask=mask), blocks)
        yield ("dq and dk miss the softmax scale: S = scale * q k^T, so dq = scale * dS K and "
               "dk = scale * dS^T Q.", lambda: grads(grad_scale=1.0))
        yield ("the scale is applied twice in dq and dk: multiply dS K and dS^T Q by the scale once.",
               lambda: grads(grad_scale=used * used))
        yield from scale_candidates(q, scale, lambda score_scale, grad_scale: grads(
            score_scale=score_scale, grad_scale=grad_scale))
        yield ("rows that see no key give NaN: their lse is -inf, so exp(S - lse) computes "
               "exp(-inf - (-inf)) = NaN. Give those rows P = 0 (for example, use +inf in place of "
               "their lse).", lambda: grads(guard=False))

    detectors = row_detectors(q, k, causal, blocks[0] if blocks else None, (("dq", -2),))
    return judge_outputs(case, outcome, ("dq", "dk", "dv"), expected, candidates=candidates,
                         detectors=detectors, limit_message=TILES_ONLY)


_GRADIENTS = ("dq", "dk", "dv")
_AUTOGRAD_HINTS = (
    ("incorrect number of gradients",
     "backward must return one value per input of forward: dq, dk, dv, and None for each "
     "non-tensor input (causal, scale)."),
    ("returned an invalid gradient at index",
     "backward returns the gradients in a different order from forward's inputs, or of other "
     "shapes: return (dq, dk, dv, ...) in the order of forward(ctx, q, k, v, ...)."),
)


def judge_autograd(case, outcome):
    """Function.apply(q, k, v, causal, scale), then out.backward(dout): (out, dq, dk, dv)."""
    q, k, v, causal, scale, dout = case.args
    used = resolve_scale(q, scale)
    correct = _mask(q, k, causal)

    def candidates():
        ref_out, ref_lse = mistakes.attention(q, k, v, used, correct)

        def backward(mask=correct, bwd_scale=used, grad=dout):
            grads = mistakes.recompute_backward(q, k, v, ref_out, ref_lse, grad, mask, bwd_scale, bwd_scale)
            return {"out": ref_out, **dict(zip(_GRADIENTS, grads, strict=True))}

        def reordered(order):
            grads = backward()
            if any(grads[a].shape != grads[b].shape for a, b in zip(_GRADIENTS, order, strict=True)):
                return None
            return {"out": ref_out, **{a: grads[b] for a, b in zip(_GRADIENTS, order, strict=True)}}

        for order in (("dk", "dq", "dv"), ("dq", "dv", "dk"), ("dv", "dk", "dq"), ("dk", "dv", "dq"),
                      ("dv", "dq", "dk")):
            yield ("backward returns the gradients in a different order from forward's inputs: return "
                   "them as (dq, dk, dv, ...) to match forward(ctx, q, k, v, ...).",
                   partial(reordered, order))
        yield ("backward ignores its grad_out argument (your gradients are those of out.sum()): pass "
               "the incoming gradient to flash_backward as dout.",
               lambda: backward(grad=torch.ones_like(dout)))
        if causal:
            yield ("backward does not get causal=True: save causal on ctx in forward and pass it to "
                   "flash_backward.", lambda: backward(mask=None))
        if scale is not None and not math.isclose(scale, q.shape[-1] ** -0.5):
            yield ("backward does not get the scale: save it on ctx in forward and pass it to "
                   "flash_backward.", lambda: backward(bwd_scale=q.shape[-1] ** -0.5))

    return judge_outputs(case, outcome, ("out", *_GRADIENTS),
                         lambda: gradient_expected(q, k, v, causal, scale, dout),
                         candidates=candidates, error_hints=_AUTOGRAD_HINTS)
