"""Lab 01's two helpers of the tiled loops: the causal mask of one tile, and where a key loop ends.

``causal_tile_mask(i0, i1, j0, j1, seqlen_q, seqlen_k)`` returns the (i1 - i0, j1 - j0) bool mask
of queries [i0, i1) and keys [j0, j1); ``key_end(i1, seqlen_q, seqlen_k, causal)`` the end of the
key loop of a query block [i0, i1): one past the last key that query i1 - 1 sees, at least 0 (it
never passes seqlen_k, since i1 <= seqlen_q). Both are judged against
:class:`fa_lab.block_info.BlockInfo`, and a wrong answer is matched against the typical wrong
ones: off by one, aligned top-left, the offset's sign flipped, tile coordinates instead of
sequence positions, rows and columns swapped, no clamp at 0, causal ignored.
"""
from __future__ import annotations

import torch

from ...block_info import BlockInfo
from ..judge import PASS, describe, mistakes_message, outcome_problem
from ..registry import Case, Verdict
from .attention_cases import draw_choice, draw_int, draw_seqlens
from .attention_mistakes import causal_rule, offset_mask

# fa_lab's own answers to both helpers (the mask and the loop bounds of BlockInfo): forbidden in every
# exercise of the lab, since the loops use the helpers, and so absent while grading.
FORBIDDEN = ("fa_lab.block_info", "fa_lab.reference.causal_mask")


# ----------------------------------------------------------------------------- causal_tile_mask

PUBLIC_TILES = (
    ("Nq = Nk = 16, queries 8-15 x keys 8-15: the diagonal crosses the tile", 8, 16, 8, 16, 16, 16),
    ("Nq = Nk = 16, queries 8-15 x keys 0-7: below the diagonal, every key visible", 8, 16, 0, 8, 16, 16),
    ("Nq = Nk = 16, queries 0-7 x keys 8-15: above the diagonal, no key visible", 0, 8, 8, 16, 16, 16),
    ("Nq = 4, Nk = 10, queries 0-3 x keys 4-9: the diagonal shifted right by 6", 0, 4, 4, 10, 4, 10),
    ("Nq = 10, Nk = 4, queries 0-7 x keys 0-3: queries 0-5 see no key", 0, 8, 0, 4, 10, 4),
    ("Nq = Nk = 21, queries 16-20 x keys 16-20: a ragged last tile", 16, 21, 16, 21, 21, 21),
    ("Nq = 7, Nk = 12, queries 4-6 x keys 5-11: 3 x 7, the diagonal crosses it", 4, 7, 5, 12, 7, 12),
)


def public_mask_cases() -> list[Case]:
    return [Case(name, args) for name, *args in PUBLIC_TILES]


def _draw_tile(generator, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int, int]:
    block_q, block_k = draw_choice(generator, (4, 5, 8, 16)), draw_choice(generator, (4, 6, 8, 16))
    i0 = draw_int(generator, 0, (seqlen_q - 1) // block_q) * block_q
    j0 = draw_int(generator, 0, (seqlen_k - 1) // block_k) * block_k
    return i0, min(i0 + block_q, seqlen_q), j0, min(j0 + block_k, seqlen_k)


def hidden_mask_cases(generator) -> list[Case]:
    cases = []
    for relation in ("square", "fewer queries", "more queries", "any", "fewer queries", "more queries"):
        seqlen_q, seqlen_k = draw_seqlens(generator, relation, longest=48, step=24)
        i0, i1, j0, j1 = _draw_tile(generator, seqlen_q, seqlen_k)
        cases.append(Case(f"Nq = {seqlen_q}, Nk = {seqlen_k}, queries {i0}-{i1 - 1} x keys {j0}-{j1 - 1}",
                          (i0, i1, j0, j1, seqlen_q, seqlen_k)))
    return cases


def _mask_mistakes(i0, i1, j0, j1, seqlen_q, seqlen_k):
    """(message, wrong mask) for the typical wrong tile masks."""
    offset, rule = seqlen_k - seqlen_q, causal_rule(seqlen_q, seqlen_k, formula=True)
    rows, cols = torch.arange(i0, i1), torch.arange(j0, j1)
    yield (f"your mask is True where the key is hidden: it must be True where the query sees the key "
           f"({rule}), the keys it may attend to.", ~offset_mask(rows, cols, offset))
    yield (f"off by one: your mask lets each query see one key past its diagonal ({rule}).",
           offset_mask(rows, cols, offset + 1))
    yield (f"off by one: your mask hides the key on each query's diagonal ({rule}: j = i + Nk - Nq is "
           "visible).", offset_mask(rows, cols, offset - 1))
    if offset:
        yield ("your mask is aligned top-left (query i sees keys j <= i). The course aligns it bottom-right: "
               f"{rule}, so the last query sees every key.", offset_mask(rows, cols, 0))
        yield (f"the offset has the wrong sign: you used j <= i + Nq - Nk, but {rule}.",
               offset_mask(rows, cols, -offset))
    yield ("your mask compares positions inside the tile (torch.arange(i1 - i0) and torch.arange(j1 - j0)), "
           f"not positions in the sequence: row a is query i0 + a and column b is key j0 + b ({rule}).",
           offset_mask(torch.arange(i1 - i0), torch.arange(j1 - j0), offset))
    if i1 - i0 == j1 - j0:
        yield ("rows and columns are swapped (your mask is the right one transposed): rows are the queries "
               f"[i0, i1), columns the keys [j0, j1) ({rule}).", offset_mask(rows, cols, offset).T)


def judge_mask(case, outcome) -> Verdict:
    """causal_tile_mask(i0, i1, j0, j1, seqlen_q, seqlen_k) -> (i1 - i0, j1 - j0) bool."""
    i0, i1, j0, j1, seqlen_q, seqlen_k = case.args
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    mask, shape = outcome["outputs"], (i1 - i0, j1 - j0)
    expected = BlockInfo(seqlen_q, seqlen_k, causal=True).mask(i0, i1, j0, j1)
    if not isinstance(mask, torch.Tensor):
        return Verdict(False, f"expected a bool tensor of shape (i1 - i0, j1 - j0) = {shape}, got {describe(mask)}.")
    if tuple(mask.shape) != shape:
        swapped = " (keys, queries): rows are the queries [i0, i1), columns the keys [j0, j1)" \
            if tuple(mask.shape) == shape[::-1] else ""
        return Verdict(False, f"the mask has shape {tuple(mask.shape)}{swapped}; expected (i1 - i0, j1 - j0) "
                              f"= {shape}.")
    if mask.dtype != torch.bool:
        return Verdict(False, f"the mask has dtype {mask.dtype}, expected torch.bool (True where the query sees "
                              "the key), as masked_fill and ~ need.")
    if torch.equal(mask, expected):
        return PASS
    found = [message for message, wrong in _mask_mistakes(i0, i1, j0, j1, seqlen_q, seqlen_k)
             if not torch.equal(wrong, expected) and torch.equal(mask, wrong)]
    a, b = (int(x) for x in torch.nonzero(mask != expected)[0])
    where = (f"First wrong entry: query {i0 + a}, key {j0 + b} (row {a}, column {b}) is "
             f"{bool(mask[a, b])}, expected {bool(expected[a, b])}.")
    rule = causal_rule(seqlen_q, seqlen_k, formula=True)
    message = mistakes_message(found) if found else f"the mask is wrong ({rule})."
    return Verdict(False, f"{message} {where}", explained=bool(found))


# ----------------------------------------------------------------------------- key_end

PUBLIC_ENDS = (
    ("causal=False: every query sees the 16 keys", 8, 16, 16, False),
    ("Nq = Nk = 16, the query block 0-7", 8, 16, 16, True),
    ("Nq = Nk = 16, the query block 8-15: the last query sees every key", 16, 16, 16, True),
    ("Nq = 4, Nk = 10, the query block 0-3", 4, 4, 10, True),
    ("Nq = 12, Nk = 30, the query block 0-4", 5, 12, 30, True),
    ("Nq = 20, Nk = 7, the query block 0-7: no query sees a key", 8, 20, 7, True),
    ("Nq = 20, Nk = 7, the query block 8-15: queries 13-15 see keys", 16, 20, 7, True),
    ("Nq = 20, Nk = 7, the query block 16-19", 20, 20, 7, True),
)


def public_end_cases() -> list[Case]:
    return [Case(name, args) for name, *args in PUBLIC_ENDS]


def hidden_end_cases(generator) -> list[Case]:
    cases = []
    for relation, causal in (("square", True), ("fewer queries", True), ("more queries", True),
                             ("more queries", True), ("any", False), ("any", True)):
        seqlen_q, seqlen_k = draw_seqlens(generator, relation, longest=64, step=32)
        block_q = draw_choice(generator, (4, 8, 16))
        i1 = min(draw_int(generator, 0, (seqlen_q - 1) // block_q) * block_q + block_q, seqlen_q)
        cases.append(Case(f"Nq = {seqlen_q}, Nk = {seqlen_k}, causal={causal}, the query block "
                          f"{i1 - min(block_q, i1)}-{i1 - 1}", (i1, seqlen_q, seqlen_k, causal)))
    return cases


def _clamp(end: int, seqlen_k: int) -> int:
    return min(max(end, 0), seqlen_k)


def _end_mistakes(i1, seqlen_q, seqlen_k, causal):
    """(message, wrong end) for the typical wrong key_end values."""
    if not causal:
        yield ("with causal=False every query sees every key: the loop runs over all of them, up to seqlen_k.",
               _clamp(i1 + seqlen_k - seqlen_q, seqlen_k))
        return
    offset, rule = seqlen_k - seqlen_q, causal_rule(seqlen_q, seqlen_k, formula=True)
    end = i1 + offset
    last = f"the block's last query, i1 - 1, sees keys up to i1 - 1 + Nk - Nq ({rule})"
    yield f"one too far: {last}, so one past it is i1 + Nk - Nq, not one more.", _clamp(end + 1, seqlen_k)
    yield (f"one short: {last}, so the end, one past that key, is i1 + Nk - Nq. One less drops the key on "
           "its diagonal.", _clamp(end - 1, seqlen_k))
    if offset:
        yield ("aligned top-left (the end i1, for query i seeing keys j <= i). The course aligns the mask "
               f"bottom-right: {rule}, so the end is i1 + Nk - Nq.", _clamp(i1, seqlen_k))
        yield f"the offset has the wrong sign: the end is i1 + Nk - Nq, not i1 + Nq - Nk ({rule}).", \
            _clamp(i1 - offset, seqlen_k)
    if end < 0:
        yield (f"not clamped to 0: i1 + Nk - Nq = {end}. No query before i1 sees a key (the first Nq - Nk "
               "queries see none), so the end is 0 and the loop visits no key block.", end)
    yield ("with causal=True the loop may stop at i1 + Nk - Nq: no query of the block sees a key past it, so "
           f"the key blocks from there on are skipped ({rule}).", seqlen_k)


def judge_key_end(case, outcome) -> Verdict:
    """key_end(i1, seqlen_q, seqlen_k, causal) -> int: one past the last key that query i1 - 1 sees."""
    i1, seqlen_q, seqlen_k, causal = case.args
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    value = outcome["outputs"]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return Verdict(False, f"key_end returned {describe(value)}, expected an int (range() needs one).")
    expected = BlockInfo(seqlen_q, seqlen_k, causal=causal).key_end(i1 - 1)
    if value == expected:
        return PASS
    found = [message for message, wrong in _end_mistakes(i1, seqlen_q, seqlen_k, causal)
             if wrong != expected and wrong == value]
    call = f"key_end({i1}, {seqlen_q}, {seqlen_k}, {causal}) returned {value}, expected {expected}"
    if found:
        return Verdict(False, f"{call}: {mistakes_message(found)}")
    rule = causal_rule(seqlen_q, seqlen_k, formula=True) if causal else "every key, without causal"
    return Verdict(False, f"{call}: the end is one past the last key that query i1 - 1 sees, clamped to "
                          f"[0, seqlen_k] ({rule}).", explained=False)
