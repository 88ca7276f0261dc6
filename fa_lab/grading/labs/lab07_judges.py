"""Judges of lab 07's block-sparse forward, and what the MoBA judges (:mod:`.lab07_moba`) share with them.

The judge compares the learner's outputs with attention restricted to the selection, in float64, in the
grader's process, and when a case fails names the mistake whose simulation reproduces them. The forward is
simulated the way the lab's loop computes it (:func:`stream_tiles`: every query tile folds its listed key
tiles, in the list's order, into the online softmax of :func:`.attention_mistakes.stream_softmax`), so a
wrong mask, a wrong head or key offset and every online-softmax slip come out exactly.
"""
from __future__ import annotations

import math

import torch

from ...inputs import resolve_scale
from ...reference import expand_kv, softmax_with_lse
from ...sparse import selection_mask
from ...testing import LSE_FLOOR
from ..judge import Expected, judge_outputs, wrong_positions
from ..registry import Verdict
from . import attention_judges as judges
from . import attention_mistakes as mistakes

NEG_INF = float("-inf")
OUT_DIMS, LSE_DIMS = judges.OUT_DIMS, judges.LSE_DIMS
TILES_ONLY = ("Fold one key tile at a time into the running (m, l, acc) of the query tile: a (group x block_q, "
              "block_k) tile of scores is all the online softmax needs. Neither gather every listed tile of a "
              "query tile into one softmax nor build an (Nq, Nk) score matrix or mask.")


def masked_attention(q, k, v, mask, scale: float, dtype=torch.float64):
    """(out, lse) of q (B, H, Nq, d) over k, v (B, H_kv, Nk, d) restricted to ``mask`` (broadcastable to
    (B, H, Nq, Nk)), computed in ``dtype``; rows that see no key give 0 and -inf."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-2, -1)) * scale
    p, lse = softmax_with_lse(s.masked_fill(~mask, NEG_INF))
    return torch.matmul(p, v.to(dtype)), lse


def expected_under_mask(q, k, v, mask, scale) -> dict:
    """out and lse: float64 attention under ``mask``, and as the rule's baseline the same in q's dtype."""
    ref_out, ref_lse = masked_attention(q, k, v, mask, scale)
    base_out, base_lse = masked_attention(q, k, v, mask, scale, dtype=q.dtype)
    return {"out": Expected(ref_out, base_out.to(q.dtype), q.dtype, OUT_DIMS),
            "lse": Expected(ref_lse, base_lse.float(), torch.float32, LSE_DIMS, LSE_FLOOR)}


LSE_LOG2 = "lse is in log base 2, but the course's lse is a natural log: lse = m + ln(l)."
LSE_MAX = "lse is only the running max m: it must be m + log(l)."
LSE_NO_MAX = "lse is missing the running max: it must be m + log(l), not log(l)."


def _lse_forms(out, m, l) -> dict:
    """The three wrong LSEs of an otherwise right result: {message: outputs}."""
    lse = m + torch.log(l)
    return {LSE_LOG2: {"out": out, "lse": lse / math.log(2)}, LSE_MAX: {"out": out, "lse": m},
            LSE_NO_MAX: {"out": out, "lse": torch.log(l)}}


def _empty_rows_detector(empty: torch.Tensor, message: str):
    """``message`` when the only wrong (batch, head, query) rows are rows that see no key (``empty``)."""
    def only_empty_rows(actual, expected, comparisons):
        wrong = (wrong_positions(actual["out"], expected["out"].reference, comparisons["out"].bound).any(-1)
                 | wrong_positions(actual["lse"], expected["lse"].reference, comparisons["lse"].bound))
        return message if bool(wrong.any()) and bool((wrong <= empty).all()) else None
    return only_empty_rows


# ----------------------------------------------------------------------------- block-sparse forward

def sparse_mask(q, k, key_tiles, block_q: int, block_k: int, causal: bool) -> torch.Tensor:
    """(B, H, Nq, Nk) bool: the keys each query sees, its query tile's listed key tiles under the causal mask."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    mask = expand_kv(selection_mask(key_tiles, seqlen_q, seqlen_k, block_q, block_k), q.shape[1])
    if causal:
        mask = mask & judges.causal_mask_for(q, k, True)
    return mask


def stream_tiles(q, k, v, key_tiles, block_q: int, block_k: int, causal: bool, scale: float, *, kv_head=None,
                 keys_of=None, positions_of=None, visible=None, slots=None, dtype=torch.float32, **mistake):
    """The lab's loop, right or with one mistake: (out, m, l) with out (B, H, Nq, d) normalized by l, m and l
    (B, H, Nq) the running max and sum after the last tile.

    For each batch, query head and query tile the listed key tiles are visited in the list's order:
    ``slots(list) -> list`` the tiles the loop takes (right: all), ``keys_of(tile)`` the keys one tile reads
    (None: it is skipped; right: a -1 slot is skipped, tile t reads [t * block_k, min(t * block_k + block_k, Nk))),
    ``kv_head(h)`` the K/V head and the list query head h reads (right: h // group), ``visible(rows, keys)``
    the mask inside a tile ((rows, keys) bool, or None for none; right: the bottom-right causal rule), applied
    to the positions ``positions_of(tile)`` the loop believes it reads (default: the keys it reads).
    mistake: the options of :func:`.attention_mistakes.stream_softmax` (dtype: the stream's precision).
    """
    batch, heads, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    group, offset = heads // heads_kv, seqlen_k - seqlen_q
    kv_head = kv_head or (lambda h: h // group)
    slots = slots or (lambda tiles: tiles)
    if keys_of is None:
        def keys_of(tile):
            return torch.arange(tile * block_k, min(tile * block_k + block_k, seqlen_k)) if tile >= 0 else None
    if visible is None:
        def visible(rows, keys):
            return keys[None, :] <= rows[:, None] + offset if causal else None
    out = torch.zeros(batch, heads, seqlen_q, head_dim, dtype=dtype)
    m_all = torch.full((batch, heads, seqlen_q), NEG_INF, dtype=dtype)
    l_all = torch.zeros(batch, heads, seqlen_q, dtype=dtype)
    for b in range(batch):
        for h in range(heads):
            hk = kv_head(h)
            for t in range(key_tiles.shape[2]):
                i0, i1 = t * block_q, min(t * block_q + block_q, seqlen_q)
                rows = torch.arange(i0, i1)
                score_blocks, value_blocks = [], []
                for tile in slots(key_tiles[b, hk, t].tolist()):
                    keys = keys_of(tile)
                    if keys is None:
                        continue
                    s = torch.matmul(q[b, h, i0:i1].double(), k[b, hk, keys].double().T) * scale
                    mask = visible(rows, keys if positions_of is None else positions_of(tile))
                    score_blocks.append(s if mask is None else s.masked_fill(~mask, NEG_INF))
                    value_blocks.append(v[b, hk, keys].double())
                if not score_blocks:
                    continue
                m, l, acc = mistakes.stream_softmax(score_blocks, value_blocks, dtype=dtype, **mistake)
                out[b, h, i0:i1], m_all[b, h, i0:i1], l_all[b, h, i0:i1] = acc, m, l
    return out / torch.where(l_all == 0, torch.ones_like(l_all), l_all)[..., None], m_all, l_all


def _sparse_candidates(q, k, v, key_tiles, block_q, block_k, causal, scale):
    """The known mistakes of a block-sparse forward, as (message, thunk) pairs."""
    used = resolve_scale(scale, q.shape[-1])
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    heads, heads_kv = q.shape[1], k.shape[1]
    group, offset = heads // heads_kv, seqlen_k - seqlen_q
    rule = mistakes.causal_rule(seqlen_q, seqlen_k)

    def run(score_scale=used, normalize=True, nan_lse=True, **options):
        out, m, l = stream_tiles(q, k, v, key_tiles, block_q, block_k, causal, score_scale, **options)
        lse = m + torch.log(l)
        if not nan_lse:  # lse computed where l > 0 only, -inf elsewhere: a NaN l gives -inf
            lse = torch.where(l > 0, lse, torch.full_like(lse, NEG_INF))
        return {"out": out if normalize else out * l[..., None], "lse": lse}

    def exact(**options):  # a mask or an index mistake: the stream in float64, so only the mistake differs
        return lambda: run(dtype=torch.float64, **options)

    if causal:
        yield (f"the causal mask is not applied inside the listed tiles: a tile may cross the diagonal, and there "
               f"query i sees key j only when {rule}.", exact(visible=lambda rows, keys: None))
        if seqlen_q != seqlen_k:
            yield (f"the causal mask is aligned top-left (query i sees keys j <= i); the course aligns it "
                   f"bottom-right: {rule}.", exact(visible=lambda rows, keys: keys[None, :] <= rows[:, None]))
        yield (f"your causal mask compares positions inside the tile (counted from 0 in each tile), not positions "
               f"in the sequence: in the tile of queries [i0, i1) and keys [j0, j1), query i0 + a sees key j0 + b "
               f"when j0 + b <= i0 + a + Nk - Nq ({rule}).",
               exact(visible=lambda rows, keys: (keys - keys[0])[None, :] <= (rows - rows[0])[:, None] + offset))
        for shift, what in ((1, "also sees the key just past its diagonal"), (-1, "misses the key on its diagonal")):
            yield (f"causal mask off by one: each query {what} ({rule}).",
                   exact(visible=lambda rows, keys, s=shift: keys[None, :] <= rows[:, None] + offset + s))
    if group > 1 and heads_kv > 1:
        yield (f"query head h reads the wrong KV head: with {heads} query heads over {heads_kv} KV heads the group "
               f"of {group} consecutive heads h = g * {group} .. g * {group} + {group - 1} shares KV head g = "
               f"h // {group} and its tile list key_tiles[:, g] (not h % {heads_kv}).",
               exact(kv_head=lambda h: h % heads_kv))
    if block_k > 1:
        yield (f"a listed tile t is read as keys t .. t + block_k - 1; tile t holds the keys [t * block_k, "
               f"min(t * block_k + block_k, Nk)), here block_k = {block_k}.",
               exact(keys_of=lambda t: torch.arange(t, min(t + block_k, seqlen_k)) if t >= 0 else None))
    if bool((key_tiles < 0).any()):
        def wrapped(tile):  # keys tile * block_k + arange(block_k): negative ones index from the end
            return torch.arange(tile * block_k, min(tile * block_k + block_k, seqlen_k))
        yield ("a -1 slot is read as a tile: -1 * block_k + arange(block_k) indexes from the end, so your loop "
               "attends to the last block_k keys there. -1 marks an unused slot; skip it.",
               exact(keys_of=lambda t: wrapped(t) % seqlen_k, positions_of=wrapped))

        def until_unused(tiles):
            return tiles[:tiles.index(-1)] if -1 in tiles else tiles
        yield ("your loop stops at the first -1 slot, but unused slots may sit anywhere in a list: skip a -1 "
               "(continue) and go on with the slots after it.", exact(slots=until_unused))
    yield from judges.scale_candidates(q, scale, lambda score_scale, _: exact(score_scale=score_scale)())
    yield ("the output accumulator is not rescaled: when a tile raises the running max from m_old to m_new, acc "
           "must be multiplied by exp(m_old - m_new) before P V is added.", lambda: run(rescale_acc=False))
    yield ("l is not rescaled: when a tile raises the running max from m_old to m_new, l must be multiplied by "
           "exp(m_old - m_new) before the tile's row sums are added.", lambda: run(rescale_l=False))
    yield ("neither l nor the accumulator is rescaled: when the running max grows from m_old to m_new, both "
           "must be multiplied by exp(m_old - m_new).", lambda: run(rescale_l=False, rescale_acc=False))
    flipped = ("the rescale factor has the wrong sign: you used exp(m_new - m_old) instead of exp(m_old - m_new). "
               "It must be <= 1; at the first tile m_old = -inf, so the wrong factor is inf, and inf * 0 = NaN.")
    yield flipped, lambda: run(flip=True)
    yield flipped, lambda: run(flip=True, nan_lse=False)
    yield ("the running max m is never updated (m = m_new is missing): alpha = exp(m - m_new) is then 0 at every "
           "tile, each tile throws away l and acc, and only the last listed tile counts.",
           lambda: run(update_max=False))
    yield ("the tile's probabilities are exp(s - m_old), with the max from before this tile: compute m_new "
           "first, then p = exp(s - m_new).", lambda: run(terms_old_max=True))
    yield "out is not normalized: divide the accumulator by l once, after the last listed tile.", \
        lambda: run(normalize=False)

    right = {}

    def lse_form(message):
        if not right:
            right.update(_lse_forms(*stream_tiles(q, k, v, key_tiles, block_q, block_k, causal, used,
                                                   dtype=torch.float64)))
        return right[message]
    for message in (LSE_LOG2, LSE_MAX, LSE_NO_MAX):
        yield message, lambda message=message: lse_form(message)


def judge_block_sparse(case, outcome) -> Verdict:
    """block_sparse_forward(q, k, v, key_tiles, block_q, block_k, causal, scale) -> (out, lse)."""
    q, k, v, key_tiles, block_q, block_k, causal, scale = case.args
    used = resolve_scale(scale, q.shape[-1])
    mask = sparse_mask(q, k, key_tiles, block_q, block_k, causal)
    row_max = mistakes.scores(q, expand_kv(k, q.shape[1]), used, None).masked_fill(~mask, NEG_INF).amax(dim=-1)
    empty = ~mask.any(dim=-1)
    detectors = (judges.overflow_detector(row_max, (("out", -2), ("lse", -1))),
                 _empty_rows_detector(empty, "only the rows that see no key are wrong: a query tile that lists no "
                                             "tile (every slot -1), or whose listed keys the causal mask hides, must "
                                             "give out = 0 and lse = -inf, never NaN. Guard the division by l = 0, "
                                             "and use 0 in place of a running max of -inf."),
                 judges.nan_detector)
    return judge_outputs(case, outcome, ("out", "lse"), lambda: expected_under_mask(q, k, v, mask, used),
                         candidates=lambda: _sparse_candidates(q, k, v, key_tiles, block_q, block_k, causal, scale),
                         detectors=detectors, limit_message=TILES_ONLY)


def summarize_block_sparse(results):
    return judges.summarize(results, causal_index=6)
