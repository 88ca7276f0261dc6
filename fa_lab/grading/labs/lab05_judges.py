"""Judging lab 05: grouped heads, packed batches, and the window and ALiBi of one tile.

Every judge compares with fa_lab's own answer (:func:`fa_lab.reference.expand_kv`,
:func:`fa_lab.reference.reference_attention`, :class:`fa_lab.block_info.BlockInfo`,
:func:`fa_lab.score_mods.alibi_bias`), computed here in the grader's process, and names a
wrong answer by matching it against the typical wrong ones: the head mapping ``h % g``
instead of ``h // g``, a mean instead of a sum over the group, cu_seqlens without its
leading 0, sequences that see each other in a packed batch, masks aligned top-left, a
window edge off by one, ALiBi's sign.
"""
from __future__ import annotations

import torch

from ...block_info import BlockInfo, band_visible, causal_visible
from ...reference import expand_kv, naive_attention, reference_attention
from ...score_mods import alibi_bias
from ...testing import LSE_FLOOR
from ..judge import Expected, exact_verdict, judge_outputs, outcome_problem
from ..registry import Verdict
from . import attention_judges as judges

GROUP_RULE = "query head h reads key/value head h // (heads // heads_kv)"


# ----------------------------------------------------------------------------- GQA

def judge_expand(case, outcome) -> Verdict:
    """expand_kv(k, heads) -> (B, heads, N, d)."""
    k, heads = case.args
    group = heads // k.shape[1]
    mistakes = [(f"your copies follow h % heads_kv (k.repeat(...)), but {GROUP_RULE}: each key/value head "
                 "must appear `group` times in a row (repeat_interleave).", k.repeat(1, group, 1, 1))]
    return exact_verdict(outcome, expand_kv(k, heads), "the expanded tensor", mistakes,
                  where=lambda i: f"[batch {i[0]}, head {i[1]}, position {i[2]}, dim {i[3]}]")


def judge_group_sum(case, outcome) -> Verdict:
    """group_sum(grad, heads_kv) -> (B, heads_kv, N, d): the gradient of each K/V head."""
    grad, heads_kv = case.args
    batch, heads, n, d = grad.shape
    group = heads // heads_kv
    grouped = grad.view(batch, heads_kv, group, n, d)
    mistakes = [
        ("you averaged over the group; the gradient of a key/value head is the sum of the gradients of "
         "every query head that read it (each use adds its contribution).", grouped.mean(dim=2)),
        (f"your groups follow h % heads_kv, but {GROUP_RULE}: the heads of group g are the consecutive "
         "heads g * group ... (g + 1) * group - 1 (view(B, heads_kv, group, N, d).sum(2)).",
         grad.view(batch, group, heads_kv, n, d).sum(dim=1)),
        ("you kept one query head of each group instead of summing the group's gradients.", grouped[:, :, 0]),
    ]
    return exact_verdict(outcome, grouped.sum(dim=2), "the grouped gradient", mistakes, close=True,
                  where=lambda i: f"[batch {i[0]}, kv head {i[1]}, position {i[2]}, dim {i[3]}]")


def judge_gqa_attention(case, outcome) -> Verdict:
    """gqa_attention(q, k, v, causal, scale) -> (out, lse), with k, v of heads_kv heads."""
    q, k, v, causal, scale = case.args
    heads, group = q.shape[1], q.shape[1] // k.shape[1]

    def candidates():
        if group > 1 and k.shape[1] > 1:
            wrong = [t.repeat(1, group, 1, 1) for t in (k, v)]
            out, lse = reference_attention(q, *wrong, causal, scale)
            yield (f"your heads follow h % heads_kv (repeat), but {GROUP_RULE} (repeat_interleave).",
                   lambda: {"out": out, "lse": lse})
        yield from judges.forward_candidates(q, expand_kv(k, heads), expand_kv(v, heads), causal, scale)

    return judge_outputs(case, outcome, ("out", "lse"), lambda: judges.forward_expected(q, k, v, causal, scale),
                         candidates=candidates, detectors=judges.forward_detectors(q, expand_kv(k, heads), causal,
                                                                                   scale))


# ----------------------------------------------------------------------------- varlen

def judge_cu_seqlens(case, outcome) -> Verdict:
    """cu_seqlens(lengths) -> int32 (batch + 1,)."""
    (lengths,) = case.args
    expected = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    value = outcome["outputs"]
    if isinstance(value, torch.Tensor) and tuple(value.shape) == (len(lengths),) and len(lengths):
        if torch.equal(value.long(), expected[1:].long()):
            return Verdict(False, "the leading 0 is missing: cu_seqlens has batch + 1 entries, starting at 0, so "
                                  "that sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1].")
        if torch.equal(value.long(), expected[:-1].long()):
            return Verdict(False, "the last offset (the total) is missing: cu_seqlens has batch + 1 entries and "
                                  "ends at the total number of tokens.")
    if isinstance(value, torch.Tensor) and value.dtype != torch.int32 and tuple(value.shape) == tuple(expected.shape):
        if torch.equal(value.long(), expected.long()):
            return Verdict(False, f"the offsets are right but their dtype is {value.dtype}: flash-attn's "
                                  "kernels take cu_seqlens as int32.")
    return exact_verdict(outcome, expected, "cu_seqlens", [], where=lambda i: f"cu_seqlens[{i[0]}]")


VARLEN_OUT_DIMS, VARLEN_LSE_DIMS = ("token", "head", "dim"), ("head", "token")


def _bounds(cu) -> list[tuple[int, int]]:
    values = cu.tolist()
    return list(zip(values, values[1:]))


def varlen_reference(q, k, v, cu_q, cu_k, causal, scale, upcast=True, key_ranges=None, top_left=False):
    """(out (total_q, H, d), lse (H, total_q)) sequence by sequence; float64 with ``upcast``, else naive
    attention in q's dtype. key_ranges: the keys each sequence sees instead of its own (for mistakes);
    top_left: causal aligned top-left inside each sequence (a mistake)."""
    dtype = torch.float64 if upcast else q.dtype
    out = torch.zeros(q.shape, dtype=dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64 if upcast else torch.float32)
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(_bounds(cu_q), _bounds(cu_k), strict=True)):
        k0, k1 = key_ranges[b] if key_ranges else (k0, k1)
        if q1 == q0 or k1 == k0:
            continue
        dense = [t[a:e].transpose(0, 1)[None] for t, (a, e) in ((q, (q0, q1)), (k, (k0, k1)), (v, (k0, k1)))]
        if top_left and causal:  # query i sees keys j <= i of its own sequence: the causal rule at offset 0
            mask = causal_visible(torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None, :], 0)
            kh, vh = (expand_kv(t, q.shape[1]) for t in dense[1:])
            s = torch.matmul(dense[0].double(), kh.double().transpose(-2, -1)) * scale
            s = s.masked_fill(~mask, float("-inf"))
            p, l = torch.softmax(s, -1).nan_to_num(0.0), torch.logsumexp(s, -1)
            o = torch.matmul(p, vh.double())
        elif upcast:
            o, l = reference_attention(*dense, causal, scale)
        else:
            o, l = naive_attention(*dense, causal, scale)
        out[q0:q1], lse[:, q0:q1] = o[0].transpose(0, 1).to(dtype), l[0].to(lse.dtype)
    return out, lse


def judge_varlen(case, outcome) -> Verdict:
    """varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale) -> (out, lse)."""
    q, k, v, cu_q, cu_k, causal, scale = case.args
    used = q.shape[-1] ** -0.5 if scale is None else scale
    outputs = outcome.get("outputs")
    heads, total = q.shape[1], q.shape[0]
    if (not outcome["error"] and isinstance(outputs, list) and len(outputs) == 2
            and isinstance(outputs[1], torch.Tensor) and tuple(outputs[1].shape) == (total, heads) != (heads, total)):
        return Verdict(False, f"lse has shape ({total}, {heads}), (total_q, heads); flash-attn's varlen functions "
                              f"return it as (heads, total_q) = ({heads}, {total}): transpose it.")

    def expected():
        ref_out, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, causal, used)
        base_out, base_lse = varlen_reference(q, k, v, cu_q, cu_k, causal, used, upcast=False)
        return {"out": Expected(ref_out, base_out, q.dtype, VARLEN_OUT_DIMS),
                "lse": Expected(ref_lse, base_lse, torch.float32, VARLEN_LSE_DIMS, LSE_FLOOR)}

    def candidates():
        total_k = k.shape[0]
        everything = [(0, total_k)] * (cu_q.numel() - 1)
        yield ("every query attends to the whole packed batch: sequence b must see only its own keys, rows "
               "cu_seqlens_k[b]:cu_seqlens_k[b + 1] (attention over a packed batch is block-diagonal).",
               lambda: _as_dict(varlen_reference(q, k, v, cu_q, cu_k, False, used, key_ranges=everything)))
        wider = [(k0, min(k1 + 1, total_k)) for k0, k1 in _bounds(cu_k)]
        yield ("off by one: each sequence also sees the first key of the next one; sequence b's keys are "
               "cu_seqlens_k[b] to cu_seqlens_k[b + 1] - 1 (the slice [cu[b]:cu[b + 1]] excludes its end).",
               lambda: _as_dict(varlen_reference(q, k, v, cu_q, cu_k, causal, used, key_ranges=wider)))
        if causal:
            yield ("the causal mask is aligned top-left inside each sequence (query i sees keys j <= i). Like "
                   "dense attention it is bottom-right aligned per sequence: query i of a sequence with nq "
                   "queries and nk keys sees keys j <= i + nk - nq.",
                   lambda: _as_dict(varlen_reference(q, k, v, cu_q, cu_k, causal, used, top_left=True)))
            yield ("causal is ignored: pass it to the attention of each sequence.",
                   lambda: _as_dict(varlen_reference(q, k, v, cu_q, cu_k, False, used)))

    empty = [(q0, q1) for (q0, q1), (k0, k1) in zip(_bounds(cu_q), _bounds(cu_k), strict=True)
             if k1 == k0 and q1 > q0]

    def sequences_without_keys(actual, expected, comparisons):
        rows = judges.wrong_rows(actual, expected, comparisons, (("out", 0), ("lse", -1)))
        seen = {row for q0, q1 in empty for row in range(q0, q1)}
        if empty and rows and rows <= seen:
            return ("only the queries of sequences with no keys are wrong: a sequence whose cu_seqlens_k range "
                    "is empty sees no key, so its queries get out = 0 and lse = -inf (never NaN, never an "
                    "error); skip its attention and leave those rows at 0 and -inf.")
        return None

    return judge_outputs(case, outcome, ("out", "lse"), expected, candidates=candidates,
                         detectors=(sequences_without_keys, judges.nan_detector))


def _as_dict(pair) -> dict:
    return {"out": pair[0], "lse": pair[1]}


# ----------------------------------------------------------------------------- tile masks

def _window_text(window) -> str:
    return (f"with o = Nk - Nq, query i sees key j when i + o - left <= j <= i + o + right, window = "
            f"(left, right) = {tuple(window)}, and -1 leaves that side unbounded")


def _band(rows, cols, offset, left, right):
    """The window (left, right) at this offset, -1 unbounded as in flash-attn (block_info's rule)."""
    return band_visible(rows, cols, offset, left if left >= 0 else None, right if right >= 0 else None)


def judge_window_mask(case, outcome) -> Verdict:
    """window_tile_mask(i0, i1, j0, j1, seqlen_q, seqlen_k, window) -> (i1 - i0, j1 - j0) bool."""
    i0, i1, j0, j1, seqlen_q, seqlen_k, window = case.args
    left, right = window
    expected = BlockInfo(seqlen_q, seqlen_k, False, tuple(window)).mask(i0, i1, j0, j1)
    rows, cols = torch.arange(i0, i1)[:, None], torch.arange(j0, j1)[None, :]
    offset, rule = seqlen_k - seqlen_q, _window_text(window)
    mistakes = [(f"your mask is True where the key is hidden; it must be True where the query sees it ({rule}).",
                 ~expected)]
    if left >= 0:  # (a left side of -1 taken literally hides the diagonal itself)
        mistakes.append((f"off by one at the left edge: the key at j = i + o - left is visible ({rule}).",
                         band_visible(rows, cols, offset, left - 1, right if right >= 0 else None)))
        mistakes.append((f"off by one at the left edge: your mask lets each query see one key too many on the "
                         f"left ({rule}).", _band(rows, cols, offset, left + 1, right)))
    if right >= 0:
        mistakes.append((f"off by one at the right edge: the key at j = i + o + right is visible ({rule}).",
                         band_visible(rows, cols, offset, left if left >= 0 else None, right - 1)))
        mistakes.append((f"off by one at the right edge: your mask lets each query see one key too many on the "
                         f"right ({rule}).", _band(rows, cols, offset, left, right + 1)))
    if offset:
        mistakes.append((f"your window is aligned top-left (o = 0). flash-attn aligns it bottom-right: {rule}.",
                         _band(rows, cols, 0, left, right)))
    if left != right:
        mistakes.append((f"left and right are swapped: left bounds the keys before the diagonal ({rule}).",
                         _band(rows, cols, offset, right, left)))
    if -1 in window:  # -1 taken as a size
        literal = band_visible(rows, cols, offset, left, right)
        mistakes.append((f"-1 is not a window size: it means that side is unbounded ({rule}).", literal))
    mistakes.append((f"your mask compares positions inside the tile, not in the sequence: row a is query i0 + a and "
                     f"column b is key j0 + b ({rule}).",
                     _band(torch.arange(i1 - i0)[:, None], torch.arange(j1 - j0)[None, :], offset, left, right)))
    return exact_verdict(outcome, expected, "the mask", mistakes,
                  where=lambda i: f"query {i0 + i[0]}, key {j0 + i[1]} (row {i[0]}, column {i[1]})")


def judge_alibi(case, outcome) -> Verdict:
    """alibi_tile_bias(i0, i1, j0, j1, seqlen_q, seqlen_k, slope) -> float32 (i1 - i0, j1 - j0)."""
    i0, i1, j0, j1, seqlen_q, seqlen_k, slope = case.args
    rows, cols = torch.arange(i0, i1)[:, None], torch.arange(j0, j1)[None, :]
    offset = seqlen_k - seqlen_q
    slopes = torch.tensor(slope, dtype=torch.float32)
    expected = alibi_bias(slopes, rows, cols, offset)
    rule = "bias = -slope * |i + o - j| with o = Nk - Nq"
    distance = (rows + offset - cols).float()
    mistakes = [
        (f"the sign is flipped: ALiBi is a penalty, so far keys get a more negative score ({rule}).", -expected),
        (f"the distance needs its absolute value: a key after the diagonal is as far as one before it ({rule}).",
         -slopes * distance),
        (f"your bias is aligned top-left (o = 0); the course aligns it bottom-right like the masks ({rule}).",
         alibi_bias(slopes, rows, cols, 0)),
        (f"the slope is missing: {rule}.", alibi_bias(torch.tensor(1.0), rows, cols, offset)),
        (f"your bias uses positions inside the tile, not in the sequence ({rule}, i and j positions in the "
         "sequence).", alibi_bias(slopes, torch.arange(i1 - i0)[:, None], torch.arange(j1 - j0)[None, :],
                                  offset)),
    ]
    return exact_verdict(outcome, expected, "the bias", mistakes, close=True,
                  where=lambda i: f"query {i0 + i[0]}, key {j0 + i[1]} (row {i[0]}, column {i[1]})")
