"""Judges of lab 07's MoBA exercises: the mean-pooled key blocks, the gate and the two passes.

The pool and the gate are judged exactly (the gate up to blocks whose scores tie in float32 rounding)
against the float64 mean keys and the gate's definition, with checks that name what a selection breaks
(the own block, the future, the -1 slots, the count); MoBA's two passes are simulated whole
(:func:`moba_passes`), then merged right or wrong, and compared under the tolerance rule.
"""
from __future__ import annotations

import torch

from ...block_info import BlockInfo, cdiv
from ...inputs import resolve_scale
from ...sparse import moba_mask
from ..judge import PASS, exact_verdict, judge_outputs, outcome_problem, tensor_problem
from ..registry import Verdict
from . import attention_judges as judges
from . import attention_mistakes as mistakes
from .lab07_judges import NEG_INF, expected_under_mask, masked_attention

# ----------------------------------------------------------------------------- mean-pooled key blocks

def pooled(k, block: int) -> torch.Tensor:
    """(B, H, ceil(N / block), d) float64: the mean key of each block, the last over its own tokens."""
    return torch.stack([k[:, :, a:a + block].double().mean(dim=2) for a in range(0, k.shape[2], block)], dim=2)


def strided_pool(k, block: int, mean: bool = False) -> torch.Tensor:
    """The pooling of a (B, H, block, blocks, d) view instead of (B, H, blocks, block, d): "block" b of it is
    the tokens b, b + blocks, b + 2 * blocks, ... (in k's dtype, as the learner's code computes it)."""
    batch, heads, seqlen, head_dim = k.shape
    blocks = cdiv(seqlen, block)
    padded = torch.nn.functional.pad(k, (0, 0, 0, blocks * block - seqlen))
    view = padded.view(batch, heads, block, blocks, head_dim)
    if mean:
        return view.mean(dim=2)
    counts = torch.clamp(seqlen - torch.arange(blocks) * block, max=block).to(k.dtype)
    return view.sum(dim=2) / counts[:, None]


def judge_pool(case, outcome) -> Verdict:
    """mean_pool_blocks(k, block) -> (B, H, ceil(N / block), d)."""
    k, block = case.args
    batch, heads, seqlen, head_dim = k.shape
    blocks = cdiv(seqlen, block)
    problem = outcome_problem(outcome)
    value = outcome["outputs"]
    if not problem and isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        if seqlen % block and shape == (batch, heads, seqlen // block, head_dim):
            return Verdict(False, f"you returned {seqlen // block} blocks; {seqlen} tokens make ceil({seqlen} / "
                                  f"{block}) = {blocks} blocks: the last, partial block of {seqlen % block} tokens "
                                  "is missing (MoBA's gate must be able to pick every block, the last one too).")
        if shape == (batch, heads, blocks, block) and block != head_dim:
            return Verdict(False, "you averaged over head_dim (the last dim of the (B, H, blocks, block, d) view): "
                                  "a block's mean key averages its tokens, dim 3, and keeps the d features.")
        if shape == (batch, heads, block, head_dim) and block != blocks:
            return Verdict(False, "you averaged over the blocks axis (dim 2 of the (B, H, blocks, block, d) view): "
                                  "a block's mean key averages the tokens of that block, dim 3.")
    expected = pooled(k, block).to(k.dtype)
    view = torch.nn.functional.pad(k, (0, 0, 0, blocks * block - seqlen)).view(batch, heads, blocks, block, head_dim)
    counts = torch.clamp(seqlen - torch.arange(blocks) * block, max=block).to(k.dtype)  # tokens per block
    wrong = []
    if blocks > 1 and block > 1:
        message = ("pooled over the wrong tokens: viewing the keys as (B, H, block, blocks, d) and reducing dim 2 "
                   "averages the tokens b, b + blocks, b + 2 * blocks, ...; block b is the tokens b * block .. "
                   "b * block + block - 1, so view (B, H, blocks, block, d) and reduce dim 3.")
        wrong.append((message, strided_pool(k, block)))
        if seqlen % block:  # (with whole blocks the two are the same)
            wrong.append((message, strided_pool(k, block, mean=True)))
    if block == head_dim:  # the shape cannot tell a mean over the wrong dim apart
        message = ("you averaged over head_dim (the last dim of the (B, H, blocks, block, d) view): a block's mean "
                   "key averages its tokens, dim 3, and keeps the d features.")
        wrong += [(message, view.sum(dim=-1) / counts[:, None]), (message, view.mean(dim=-1))]
    if seqlen % block:
        wrong.append((f"the last block holds only {seqlen % block} tokens, but you divided its sum by block = "
                      f"{block}, counting the padding's zeros: divide each block's sum by its own number of tokens.",
                      view.sum(dim=3) / block))
    wrong.append(("you returned each block's sum; the gate scores a block by its mean key: divide the sum by the "
                  "block's number of tokens.", view.sum(dim=3)))
    return exact_verdict(outcome, expected, "the tensor of mean keys", wrong, close=True,
                         where=lambda i: f"batch {i[0]}, head {i[1]}, block {i[2]}, dim {i[3]}")


# ----------------------------------------------------------------------------- MoBA's gate

def _own_blocks(seqlen: int, block: int) -> torch.Tensor:
    return torch.arange(seqlen) // block


def _ranked(q, pooled_keys, block: int, top_k: int, largest: bool = True, future: bool = False) -> torch.Tensor:
    """(B, H, N, top_k - 1): the past blocks a gate keeps, best first (-1 where there are fewer), in float64;
    ``future``: every block but the own one competes (the mistake)."""
    seqlen, block_count = q.shape[2], pooled_keys.shape[2]
    blocks, own = torch.arange(block_count)[None, :], _own_blocks(seqlen, block)[:, None]
    past = blocks != own if future else blocks < own
    scores = torch.matmul(q.double(), pooled_keys.double().transpose(-2, -1))
    scores = torch.where(past, scores if largest else -scores, torch.full_like(scores, NEG_INF))
    best = scores.topk(top_k - 1, dim=-1)
    return torch.where(torch.isinf(best.values), -1, best.indices)


def _as_sets(past: torch.Tensor) -> torch.Tensor:
    """The past columns sorted high to low: one canonical order for "the same blocks"."""
    return past.sort(dim=-1, descending=True).values


def _row(index) -> str:
    b, h, i = index
    return f"(batch {b}, head {h}) query {i}"


def judge_gate(case, outcome) -> Verdict:
    """moba_gate(q, k, block, top_k) -> int64 (B, H, N, top_k): own block first, then the best past blocks."""
    q, k, block, top_k = case.args
    batch, heads, seqlen, _ = q.shape
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    value = outcome["outputs"]
    shape = (batch, heads, seqlen, top_k)
    if isinstance(value, torch.Tensor) and tuple(value.shape) == (batch, heads, seqlen, top_k + 1):
        return Verdict(False, f"you returned {top_k + 1} blocks per query: top_k = {top_k} counts the own block, so "
                              f"a query keeps its own block and top_k - 1 = {top_k - 1} past blocks.")
    if top_k > 1 and isinstance(value, torch.Tensor) and tuple(value.shape) == (batch, heads, seqlen, top_k - 1):
        return Verdict(False, f"you returned {top_k - 1} blocks per query: column 0 must hold the query's own block, "
                              f"followed by its top_k - 1 = {top_k - 1} best past blocks.")
    problem = tensor_problem(value, shape, None, "the selection")
    if problem:
        return Verdict(False, problem)
    if value.is_floating_point() or value.dtype == torch.bool or value.is_complex():
        return Verdict(False, f"the selection has dtype {value.dtype}; expected block indices, int64 (-1 for an "
                              "unused slot).")
    chosen = value.long()
    own = _own_blocks(seqlen, block)
    available = own.expand(batch, heads, seqlen)  # a query in block c has c past blocks
    not_own = chosen[..., 0] != own
    if bool(not_own.any()):
        index = tuple(int(i) for i in torch.nonzero(not_own)[0])
        row = chosen[index].tolist()
        competes = own[index[2]].item() in row
        return Verdict(False, f"{_row(index)} selects {row}: column 0 must be its own block {index[2]} // {block} = "
                              f"{own[index[2]].item()}. MoBA always keeps a query's own block (attended causally); "
                              "the gate only ranks the blocks before it"
                              + (", but your ranking lets the own block compete with them." if competes else "."))
    past = chosen[..., 1:]
    short = (available < top_k - 1)[..., None]  # rows with fewer past blocks than slots
    masked = (past >= own[:, None]) & (past >= 0)  # the own block or a later one, whose score must be -inf
    firm = masked & ~short  # in a row with enough past blocks: no padding slip explains it
    if bool(firm.any()):
        b, h, i, _ = (int(x) for x in torch.nonzero(firm)[0])
        picked, mine = int(past[b, h, i][firm[b, h, i]][0]), int(own[i])
        if picked > mine:
            return Verdict(False, f"{_row((b, h, i))} selects block {picked}, after its own block {mine}: MoBA is "
                                  "causal, a query may only pick blocks that lie wholly before its own. Give the own "
                                  "block and every later block a score of -inf before the top-k.")
        return Verdict(False, f"{_row((b, h, i))} lists its own block {mine} again among its past blocks: it is "
                              "already column 0; rank only the blocks b < i // block.")
    if bool(masked.any()):
        b, h, i, slot = (int(x) for x in torch.nonzero(masked)[0])
        mine = int(own[i])
        if torch.equal(_as_sets(past), _as_sets(_ranked(q, pooled(k, block), block, top_k, future=True))):
            return Verdict(False, f"{_row((b, h, i))} selects block {int(past[b, h, i, slot])}, after its own block "
                                  f"{mine}: MoBA is causal, a query may only pick blocks that lie wholly before its "
                                  "own. Give the own block and every later block a score of -inf before the top-k.")
        return Verdict(False, f"{_row((b, h, i))} has only {mine} past block{'s' if mine != 1 else ''} but "
                              f"{top_k - 1} slots, and slot {slot + 1} holds block {int(past[b, h, i, slot])}: topk "
                              "returns as many indices as asked, the extra ones pointing at blocks whose score is "
                              "-inf (the own block, the future). Put -1 in the slots whose score is -inf.")
    if bool((past < -1).any()):
        return Verdict(False, "a slot holds an index below -1: slots hold block indices, or -1 when unused.")
    ordered = _as_sets(past)
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if bool(repeated.any()):
        index = tuple(int(i) for i in torch.nonzero(repeated)[0][:3])
        return Verdict(False, f"{_row(index)} lists a block twice: {chosen[index].tolist()}.")
    kept, want = (past >= 0).sum(dim=-1), torch.clamp(available, max=top_k - 1)
    if bool((kept != want).any()):
        index = tuple(int(i) for i in torch.nonzero(kept != want)[0])
        return Verdict(False, f"{_row(index)} has {available[index].item()} past blocks, so it keeps "
                              f"min(top_k - 1, {available[index].item()}) = {want[index].item()} of them; yours keeps "
                              f"{kept[index].item()} ({chosen[index].tolist()}). Only the -inf slots are -1.")
    right = _ranked(q, pooled(k, block), block, top_k)
    if torch.equal(ordered, _as_sets(right)) or _ties_only(q, pooled(k, block), ordered, _as_sets(right)):
        return PASS
    wrong = [("you kept the lowest-scoring past blocks: MoBA keeps those whose mean key scores highest against "
              "the query (topk with largest=True, or argsort descending).", _ranked(q, pooled(k, block), block,
                                                                                   top_k, largest=False))]
    if block > 1 and cdiv(seqlen, block) > 1:
        wrong.append(("your scores use mean keys pooled over the wrong tokens (check mean_pool_blocks): block b is "
                      "the tokens b * block .. b * block + block - 1.",
                      _ranked(q, strided_pool(k, block), block, top_k)))
    found = [message for message, blocks in wrong if torch.equal(ordered, _as_sets(blocks))]
    differ = (ordered != _as_sets(right)).any(dim=-1)
    index = tuple(int(i) for i in torch.nonzero(differ)[0])
    detail = (f" {_row(index)} keeps the past blocks {sorted(x for x in ordered[index].tolist() if x >= 0)}, "
              f"expected {sorted(x for x in _as_sets(right)[index].tolist() if x >= 0)}.")
    if found:
        return Verdict(False, found[0] + detail)
    return Verdict(False, "the past blocks are not the best ones: score block b by q_i . mean(K_b) (your "
                          "mean_pool_blocks), one score per block, and keep the top_k - 1 highest among the blocks "
                          "before the query's own." + detail, explained=False)


def _ties_only(q, pooled_keys, got: torch.Tensor, want: torch.Tensor) -> bool:
    """True when the two selections differ only between blocks whose scores tie up to float32 rounding."""
    scores = torch.matmul(q.double(), pooled_keys.double().transpose(-2, -1))

    def score_of(sel):
        values = torch.gather(scores, -1, sel.clamp(min=0))
        return torch.where(sel >= 0, values, torch.full_like(values, NEG_INF)).sort(dim=-1, descending=True).values
    a, b = score_of(got), score_of(want)
    both = torch.isinf(a) & torch.isinf(b)
    return bool(torch.where(both, True, (a - b).abs() <= 1e-5 * (1 + b.abs())).all())


# ----------------------------------------------------------------------------- MoBA's two passes

def moba_passes(q, k, v, selected, block: int, scale: float, own_causal: bool = True, past_from: int = 1,
                past_causal: bool = False):
    """MoBA's two passes in float64: ((out_own, lse_own), (out_past, lse_past)). Pass 1: each query over its own
    block (causally unless ``own_causal`` is False); pass 2: over the blocks in selected[..., past_from:]
    (1: the past blocks; 0 puts the own block in again, causally with ``past_causal``)."""
    seqlen = q.shape[2]
    rows, cols = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None, :]
    causal = BlockInfo(seqlen, seqlen, causal=True).mask()
    own = (rows // block) == (cols // block)
    if own_causal:
        own = own & causal
    picked = (selected[..., past_from:, None] == (cols[0] // block)).any(dim=-2)  # (B, H, N, N)
    if past_causal:
        picked = picked & causal
    return masked_attention(q, k, v, own, scale), masked_attention(q, k, v, picked, scale)


def _merge(passes, how: str = "right"):
    """The merge of the two passes' (out, lse): right, or one of the mistakes ("unshifted": exp(lse) / sum in
    float32, "unnormalized": weights exp(lse_s - max), "max": lse = max and those weights, "equal": weights 1/2)."""
    (o1, l1), (o2, l2) = passes
    lse = torch.logaddexp(l1, l2)
    if how == "unshifted":
        e1, e2 = torch.exp(l1.float()), torch.exp(l2.float())
        total = e1 + e2
        return {"out": (e1 / total)[..., None] * o1.float() + (e2 / total)[..., None] * o2.float(),
                "lse": torch.log(total)}
    if how in ("unnormalized", "max"):
        top = torch.maximum(l1, l2)
        out = torch.exp(l1 - top)[..., None] * o1 + torch.exp(l2 - top)[..., None] * o2
        return {"out": out, "lse": top if how == "max" else lse}
    if how == "equal":
        return {"out": (o1 + o2) / 2, "lse": lse}
    return {"out": torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2, "lse": lse}


def _moba_candidates(q, k, v, selected, block, scale):
    used = resolve_scale(scale, q.shape[-1])
    passes = moba_passes(q, k, v, selected, block, used)
    yield ("the merge's weights are exp(lse_s) / (exp(lse_own) + exp(lse_past)) without subtracting the larger "
           "LSE first: exp overflows float32 once an LSE passes 88.7 (inf / inf = NaN). Use lse = logaddexp("
           "lse_own, lse_past) and the weights exp(lse_s - lse).", lambda: _merge(passes, "unshifted"))
    yield ("the merge's weights exp(lse_s - max(lse_own, lse_past)) are not normalized: divide by their sum, or "
           "use exp(lse_s - lse) with lse = logaddexp(lse_own, lse_past).", lambda: _merge(passes, "unnormalized"))
    yield ("the merged lse is the larger of the two passes' LSEs; it is log(exp(lse_own) + exp(lse_past)) "
           "(torch.logaddexp), and the weights exp(lse_s - lse) measured from it sum to 1.",
           lambda: _merge(passes, "max"))
    yield ("both passes weigh the same: each pass's output is normalized over its own keys only, so it must be "
           "weighted by its share of the softmax mass, exp(lse_s - lse).", lambda: _merge(passes, "equal"))
    yield ("pass 1 is not causal: a query sees the keys of its own block only up to itself (key j <= query i); "
           "the later keys of its block are its future.",
           lambda: _merge(moba_passes(q, k, v, selected, block, used, own_causal=False)))
    own_twice = ("the own block is counted twice: pass 2 must visit the past blocks, selected[..., 1:], only; "
                 "column 0, the own block, is pass 1's.")
    yield own_twice, lambda: _merge(moba_passes(q, k, v, selected, block, used, past_from=0, past_causal=True))
    yield own_twice, lambda: _merge(moba_passes(q, k, v, selected, block, used, past_from=0))
    yield from judges.scale_candidates(
        q, scale, lambda score_scale, _: _merge(moba_passes(q, k, v, selected, block, score_scale)))


def judge_moba(case, outcome) -> Verdict:
    """moba_attention(q, k, v, selected, block, scale) -> (out, lse)."""
    q, k, v, selected, block, scale = case.args
    used = resolve_scale(scale, q.shape[-1])
    mask = moba_mask(selected, q.shape[2], block)
    row_max = mistakes.scores(q, k, used, None).masked_fill(~mask, NEG_INF).amax(dim=-1)
    no_past = ~(selected[..., 1:] >= 0).any(dim=-1)

    def nan_without_past(actual, expected, comparisons):
        bad = torch.isnan(actual["out"]).any(dim=-1) | torch.isnan(actual["lse"])
        if bool(bad.any()) and bool((bad <= no_past).all()):
            return ("NaN only in queries that have no past block (the first block's, or top_k = 1): their pass 2 "
                    "sees no key, so it must give out = 0 and lse = -inf, which the merge weighs exp(-inf) = 0. "
                    "exp(s - lse) with s = lse = -inf is NaN: guard it.")
        return None
    detectors = (nan_without_past, judges.overflow_detector(row_max, (("out", -2), ("lse", -1))),
                 judges.nan_detector)
    return judge_outputs(case, outcome, ("out", "lse"), lambda: expected_under_mask(q, k, v, mask, used),
                         candidates=lambda: _moba_candidates(q, k, v, selected, block, scale), detectors=detectors)
