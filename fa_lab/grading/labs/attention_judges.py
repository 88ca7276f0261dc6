"""Judges for attention forwards, and what the gradient judges share with them.

A forward judge takes a case whose arguments follow :mod:`.attention_cases` (block sizes at the
end are optional: a kernel with its own tiling is judged without the tiling-dependent mistakes)
and the harness's outcome, compares with the float64 reference under the tolerance rule, and names
the mistake when a simulation of it reproduces the learner's outputs: wrong causal masks (whole,
inside the tiles, in tile coordinates), key loops that end too early, a last query block that is
never computed, wrong scales, missing rescales, a running max never updated, a log2 LSE, ...
Detectors then look at invariants (errors only in the rows that see no key, exp overflowing in
exactly the rows whose scores pass 88.7, NaN). The backward's and the autograd.Function's judges
are in :mod:`.attention_gradients`.
"""
from __future__ import annotations

import math

import torch

from ...block_info import BlockInfo
from ...inputs import resolve_scale
from ...reference import naive_attention, reference_attention
from ...testing import LSE_FLOOR, compare
from ..judge import Expected, judge_outputs, only_some_fail, wrong_positions
from . import attention_mistakes as mistakes
from .attention_cases import FLOAT32_EXP_LIMIT

OUT_DIMS = ("batch", "head", "query", "dim")
KEY_DIMS = ("batch", "head", "key", "dim")
LSE_DIMS = ("batch", "head", "query")
TILES_ONLY = ("FlashAttention never holds more than a (block_q, block_k) tile of scores or "
              "probabilities (or of the mask); build S, P and the causal mask tile by tile, never "
              "for the whole (Nq, Nk) matrix.")


def block_info(q, k, causal) -> BlockInfo:
    return BlockInfo(q.shape[-2], k.shape[-2], causal=bool(causal))


def causal_mask_for(q, k, causal, offset_shift=0, top_left=False):
    """The causal mask (None without causal); offset_shift / top_left give the wrong ones."""
    if not causal:
        return None
    info = block_info(q, k, True)
    if not (offset_shift or top_left):
        return info.mask()
    offset = 0 if top_left else info.offset
    return mistakes.causal_mask_with_offset(info.seqlen_q, info.seqlen_k, offset + offset_shift)


def visited(q, k, causal, blocks, end=None) -> torch.Tensor:
    """(Nq, Nk) bool: the keys whose blocks a tiled loop visits. Right: each query block's key loop
    runs up to one past the last key its last row sees; ``end(info, i0, i1)`` gives another end."""
    info = block_info(q, k, causal)
    end = end or (lambda info, i0, i1: info.key_end(i1 - 1))
    return mistakes.visited_keys(info.seqlen_q, info.seqlen_k, *blocks, lambda i0, i1: end(info, i0, i1))


def mask_candidates(q, k, causal, make, blocks=None):
    """The wrong causal masks, as (message, thunk) with make(mask) -> outputs.

    blocks: (block_q, block_k) when the function tiles with them; then each wrong mask is also
    tried as a tile mask under a right key loop (the tiles past the diagonal skipped)."""
    if not causal:
        return
    info = block_info(q, k, True)
    offset, rule = info.offset, mistakes.causal_rule(info.seqlen_q, info.seqlen_k)
    first = info.first_query(0)  # the first query that sees a key
    right_loop = visited(q, k, True, blocks) if blocks else None

    def wrong(mask):
        yield lambda: make(mask)
        if right_loop is not None and mask is not None:
            yield lambda: make(mask & right_loop)

    masks = [(f"the causal mask is not applied: with causal=True, {rule}.", None)]
    if info.seqlen_q != info.seqlen_k:
        masks.append(("the causal mask is aligned top-left (query i sees keys j <= i). The course aligns it "
                      f"bottom-right: {rule}, so the last query sees every key.",
                      causal_mask_for(q, k, True, top_left=True)))
    inverted = (f"your causal mask is inverted: it hides the keys a query sees and shows the ones past its "
                f"diagonal. True must mark the keys a query sees: {rule}.")
    masks += [(inverted, ~info.mask()), (inverted, ~causal_mask_for(q, k, True, -1))]
    masks += [
        (f"causal mask off by one: query {first} sees key {first + offset + 1}, but it may see keys up to "
         f"{first + offset} only ({rule}).", causal_mask_for(q, k, True, 1)),
        (f"causal mask off by one: each query misses the key on its diagonal (query {first} must see key "
         f"{first + offset}; {rule}).", causal_mask_for(q, k, True, -1)),
    ]
    for message, mask in masks:
        for thunk in wrong(mask):
            yield message, thunk
    if blocks:
        yield ("the causal mask is not applied inside the tiles: skipping the key blocks past the "
               "diagonal is not enough, the tiles that cross it must mask the keys a query may not see.",
               lambda: make(right_loop))
        local = mistakes.tile_local_mask(info.seqlen_q, info.seqlen_k, *blocks, offset)
        yield ("your tile mask compares positions inside the tile (counted from 0 in each tile), not "
               "positions in the sequence: in the tile of queries [i0, i1) and keys [j0, j1), query "
               f"i0 + a sees key j0 + b when j0 + b <= i0 + a + Nk - Nq ({rule}).",
               lambda: make(local & right_loop))


def key_loop_candidates(q, k, causal, blocks, make):
    """Key loops that end too early, as (message, thunk) with make(visited) -> outputs, where visited
    is the (Nq, Nk) bool of the keys whose blocks the wrong loop visits (the masks stay right)."""
    block_k = blocks[1]
    right = "one past the last key that the block's last row, i1 - 1, sees"
    end = f"({'i1 + Nk - Nq, clamped to [0, Nk]' if causal else 'Nk'})"

    def loop(wrong_end):
        return lambda: make(visited(q, k, causal, blocks, wrong_end))

    whole = ("your key loop never visits a last key block that is shorter than block_k: when the loop's end "
             "is not a multiple of block_k its last block holds fewer keys, but they count. Loop with "
             "range(0, end, block_k) and take the keys [j0, min(j0 + block_k, Nk)).")
    yield whole, loop(lambda info, i0, i1: info.key_end(i1 - 1) // block_k * block_k)
    yield whole, loop(lambda info, i0, i1: min(info.key_end(i1 - 1), info.seqlen_k // block_k * block_k))
    yield (f"the key loop of a query block [i0, i1) ends one key too early: it must end {right} {end}; one "
           "less drops that key whenever it is the first of a key block.",
           loop(lambda info, i0, i1: info.key_end(i1 - 1) - 1))
    if causal:
        message = (f"the key loop of a query block [i0, i1) ends where its first row's keys end, but the "
                   f"block's last row sees the most keys: the loop must end {right} {end}.")
        yield message, loop(lambda info, i0, i1: info.key_end(i0))
        yield message, loop(lambda info, i0, i1: info.key_end(i0 - 1))


def last_query_block(seqlen_q: int, block_q: int) -> int | None:
    """The first query of a last query block that is shorter than block_q (None when there is none)."""
    first = seqlen_q - seqlen_q % block_q
    return first if first < seqlen_q else None


def scale_candidates(q, scale, make):
    """The wrong scales, as (message, thunk) with make(score_scale, grad_scale) -> outputs."""
    used = resolve_scale(scale, q.shape[-1])
    default = resolve_scale(None, q.shape[-1])
    yield ("the scale is applied twice (scale^2 * q k^T): scale q or S, not both.",
           lambda: make(used * used, used))
    yield "the softmax scale is missing: S = scale * q k^T.", lambda: make(1.0, used)
    if scale is not None and not math.isclose(scale, default):
        yield ("the scale argument is ignored: you used head_dim ** -0.5, but the case passes "
               f"scale={scale}.", lambda: make(default, default))


def row_max_scores(q, k, scale, causal) -> torch.Tensor:
    """(B, H, Nq) float64: the largest score each query sees (-inf for one that sees no key)."""
    return mistakes.scores(q, k, resolve_scale(scale, q.shape[-1]), causal_mask_for(q, k, causal)).amax(dim=-1)


def overflow_detector(row_max: torch.Tensor, names_and_dims):
    """exp overflowing in float32, tested: the outputs are non-finite (where the reference is finite)
    in every row whose largest score passes 89, and only in rows whose largest score passes 88.

    row_max: the largest score of each row, shaped as the outputs' dims up to their row dim;
    names_and_dims: (output name, its row dim) pairs.
    """
    def overflow(actual, expected, comparisons):
        blown = torch.zeros(row_max.shape, dtype=torch.bool)
        for name, row_dim in names_and_dims:
            bad = ~torch.isfinite(actual[name]) & torch.isfinite(expected[name].reference)
            trailing = tuple(range(row_dim % bad.ndim + 1, bad.ndim))
            blown |= bad.any(dim=trailing) if trailing else bad
        must, may = row_max > FLOAT32_EXP_LIMIT + 0.3, row_max > FLOAT32_EXP_LIMIT - 0.7
        if not blown.any() or not bool((blown <= may).all()) or not bool((must <= blown).all()):
            return None
        return (f"exp overflowed: your outputs are inf or NaN in exactly the rows whose scores pass 88.7 (up to "
                f"{float(row_max[torch.isfinite(row_max)].max()):.0f} here), and exp(x) is inf in float32 "
                "above 88.7. Subtract the running max m before exp, so that every exponent is <= 0.")
    return overflow


def nan_detector(actual, expected, comparisons):
    """NaN where the reference is finite (after the more specific detectors had their say)."""
    if any((torch.isnan(actual[n]) & ~torch.isnan(expected[n].reference)).any() for n in actual):
        return ("NaN where the reference has a number. A NaN is born from inf - inf, 0 * inf or 0 / 0 "
                "(exp(-inf - (-inf)) is one), and spreads to everything computed from it: find the first "
                "place where one of your values becomes inf, -inf or NaN.")
    return None


def wrong_rows(actual, expected, comparisons, names_and_dims) -> set[int]:
    """The query rows where any output misses its bound; names_and_dims: (output name, its query dim)."""
    rows = set()
    for name, row_dim in names_and_dims:
        wrong = wrong_positions(actual[name], expected[name].reference, comparisons[name].bound)
        others = [d for d in range(wrong.ndim) if d != row_dim % wrong.ndim]
        rows |= set(torch.nonzero(wrong.any(dim=others)).flatten().tolist())
    return rows


def empty_rows(q, k, causal) -> set[int]:
    """The queries that see no key (the first Nq - Nk when causal and Nq > Nk)."""
    info = block_info(q, k, causal)
    return set(range(info.first_query(0))) if causal and info.seqlen_k else set()


def only_empty_rows_detector(q, k, causal, names_and_dims, message):
    """``message(rows)`` when the only wrong rows are queries that see no key."""
    empty = empty_rows(q, k, causal)

    def only_empty_rows(actual, expected, comparisons):
        rows = wrong_rows(actual, expected, comparisons, names_and_dims)
        return message(max(empty)) if empty and rows and rows <= empty else None
    return only_empty_rows


def _forward_empty_rows(last: int) -> str:
    return (f"only the queries that see no key are wrong (queries 0 to {last} here, since Nq > Nk). Such a "
            "row has no visible score: it must give out = 0 and lse = -inf, never NaN. Guard the division "
            "by l = 0, and use 0 in place of a running max of -inf.")


def forward_expected(q, k, v, causal, scale) -> dict:
    """out and lse: the float64 reference, and as the baseline plain attention in q's dtype, with the
    scale applied to S (naive attention) or to q first (as kernels do, ``reorder_ops``), whichever
    errs more: with large scores the rounding of S alone differs between the two orders, and either
    order is a right answer."""
    ref_out, ref_lse = reference_attention(q, k, v, causal, scale)
    orders = (naive_attention(q, k, v, causal, scale),
              reference_attention(q, k, v, causal, scale, upcast=False, reorder_ops=True))

    def worse(i, reference):
        return max((order[i] for order in orders), key=lambda b: compare("", b, reference, b).error)
    return {"out": Expected(ref_out, worse(0, ref_out), q.dtype, OUT_DIMS),
            "lse": Expected(ref_lse, worse(1, ref_lse), torch.float32, LSE_DIMS, LSE_FLOOR)}


def summarize(results, causal_index: int):
    """A hint when only the causal cases, or only the float16 / bfloat16 ones, fail, and no failing
    case's diagnosis found a cause."""
    return (only_some_fail(results, lambda c: c.args[causal_index],
                           "Every failing case is causal and the non-causal ones pass: look at your "
                           "causal mask (which keys each query sees, which blocks you skip).",
                           unexplained_only=True)
            or only_some_fail(results, lambda c: c.args[0].dtype != torch.float32,
                              "Only the float16 / bfloat16 cases fail: compute each tile in float32 "
                              "and cast the result back to the input dtype at the end.",
                              unexplained_only=True))


LAST_BLOCK_LOOP_FIX = "loop with range(0, Nq, block_q) and take the queries [i0, min(i0 + block_q, Nq))."


def forward_candidates(q, k, v, causal, scale, blocks=(), last_block_fix=LAST_BLOCK_LOOP_FIX):
    """The known mistakes of a forward fn(q, k, v, causal, scale[, block_q, block_k]) -> (out, lse),
    as (message, thunk) pairs; blocks: (block_q, block_k) when the function tiles with them.
    last_block_fix: how to give a short last query block its turn (a loop's bounds by default)."""
    used = resolve_scale(scale, q.shape[-1])
    correct = causal_mask_for(q, k, causal)
    qk = mistakes.product(q, k)
    loop = visited(q, k, causal, blocks) if blocks else None

    def exact(mask, score_scale=used):
        out, lse = mistakes.attention(q, k, v, score_scale, mask, qk)
        return {"out": out, "lse": lse}

    def tiled(**mistake):
        out, lse = mistakes.tiled_forward(q, k, v, used, correct, blocks[1], visited=loop, qk=qk, **mistake)
        return {"out": out, "lse": lse}

    yield from mask_candidates(q, k, causal, exact, blocks)
    if blocks:
        yield from key_loop_candidates(q, k, causal, blocks,
                                       lambda keys: exact(keys if correct is None else correct & keys))
    yield from scale_candidates(q, scale, lambda score_scale, _: exact(correct, score_scale))
    if blocks:
        yield from _tiling_candidates(tiled)
    reference = exact(correct)
    row_max = mistakes.scores(q, k, used, correct, qk).amax(dim=-1)
    yield ("lse is in log base 2, but the course's lse is a natural log: lse = m + ln(l). If you "
           "worked with exp2, multiply by ln 2 at the end.",
           lambda: {**reference, "lse": reference["lse"] / math.log(2)})
    yield "lse is only the running max m: it must be m + log(l).", lambda: {**reference, "lse": row_max}
    yield ("lse is missing the running max: it must be m + log(l), not log(l).",
           lambda: {**reference, "lse": torch.where(torch.isinf(row_max), reference["lse"],
                                                    reference["lse"] - row_max)})
    first = last_query_block(q.shape[-2], blocks[0]) if blocks else None
    if first is not None:
        def unwritten():
            out, lse = reference["out"].clone(), reference["lse"].clone()
            out[..., first:, :], lse[..., first:] = 0.0, 0.0
            return {"out": out, "lse": lse}
        yield (f"the last query block (queries {first} to {q.shape[-2] - 1}) is never computed: its rows "
               f"keep the zeros out and lse start with. When Nq is not a multiple of the query block size "
               f"({blocks[0]}) the last block is shorter, but it still needs its turn: {last_block_fix}",
               unwritten)


def forward_detectors(q, k, causal, scale):
    """The detectors for a forward's (out, lse): overflow, rows that see no key, NaN."""
    rows = (("out", -2), ("lse", -1))
    return (overflow_detector(row_max_scores(q, k, scale, causal), rows),
            only_empty_rows_detector(q, k, causal, rows, _forward_empty_rows), nan_detector)


def judge_forward(case, outcome):
    """fn(q, k, v, causal, scale[, block_q, block_k]) -> (out, lse)."""
    q, k, v, causal, scale, *blocks = case.args
    return judge_outputs(case, outcome, ("out", "lse"), lambda: forward_expected(q, k, v, causal, scale),
                         candidates=lambda: forward_candidates(q, k, v, causal, scale, blocks),
                         detectors=forward_detectors(q, k, causal, scale), limit_message=TILES_ONLY)


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
    yield ("the running max m is never updated (m = m_new is missing): m stays -inf, so "
           "alpha = exp(m - m_new) is 0 at every key block, each block throws away l and acc, only the "
           "last block counts, and lse = m + log(l) is -inf.", lambda: tiled(update_max=False))
    yield ("out is not normalized: divide the accumulator by l once, after the last key block.",
           lambda: tiled(normalize=False))
