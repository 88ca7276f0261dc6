"""Judging lab 03's Triton forward: the attention judges plus what belongs to a kernel.

A case calls ``flash_forward_triton(q, k, v, causal, scale, block_m, block_n) -> (out, lse)``.
:func:`judge_kernel` applies the tolerance rule and, on a failure, tries the shared forward
mistakes (:func:`.attention_judges.forward_candidates`: masks, scales, rescaling, the LSE) and
the mistakes of a kernel that tiles with ``block_m`` x ``block_n``: padding keys of a ragged
last key tile that keep a score of 0, a causal mask applied only in a program's last key tile;
then detectors for a last, partial query tile that is wrong in every row (a grid too small) and
for pointers that are not moved to each (batch, head) pair.

Block skipping is judged on cases whose V holds NaN from some key tile on
(:func:`poisoned_rows`): see :func:`judge_skipping`.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from ...block_info import BlockInfo
from ...inputs import resolve_scale
from ...kernels.common import LOG2E
from ...reference import softmax_with_lse
from ..judge import (
    Verdict,
    checked_outputs,
    compare_all,
    judge_outputs,
    largest_error,
    only_some_fail,
    wrong_positions,
)
from . import attention_gradients as gradients
from . import attention_judges as judges
from . import attention_mistakes as mistakes

NAMES = ("out", "lse")
GRID_FIX = ("launch triton.cdiv(seqlen_q, BLOCK_M) programs along the grid's first axis (seqlen_q // BLOCK_M "
            "drops a partial last query tile, and launches none when Nq < BLOCK_M), and mask that tile's "
            "loads and stores with offs_m < seqlen_q.")
ROWS = (("out", -2), ("lse", -1))
NOT_IMPLEMENTED = ("not implemented yet: your kernel, or a @triton.jit function it calls (causal_key_end, "
                   "causal_visible), still raises NotImplementedError.")
ERROR_HINTS = (
    ("power of 2",
     "Triton blocks have power-of-two sizes: launch with HEAD_DIM = triton.next_power_of_2(head_dim) "
     "(at least 16) and mask the columns past head_dim."),
    ("cannot be accessed from Triton",
     "This machine has CUDA, so Triton compiles the kernel for the GPU, but the checks pass CPU "
     "tensors. Run the lab's first cell, which sets TRITON_INTERPRET=1 before fa_lab imports triton, "
     "after restarting the kernel."),
)


def _padding_keys(q, k, v, scale: float, count: int) -> dict:
    """Attention with ``count`` extra keys of score 0 and value 0: what a kernel computes when it
    loads a ragged last key tile with other=0 and leaves the padding's scores unmasked."""
    s = mistakes.scores(q, k, scale, None)
    p, lse = softmax_with_lse(torch.cat([s, s.new_zeros(*s.shape[:-1], count)], dim=-1))
    return {"out": torch.matmul(p[..., :k.shape[-2]], v.double()), "lse": lse}


def _mask_in_last_tile_only(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int) -> torch.Tensor:
    """(Nq, Nk) bool: the keys a skipping kernel uses when it masks only the last key tile of each
    program (every key of the earlier tiles counts, the last tile is masked right)."""
    info = BlockInfo(seqlen_q, seqlen_k, causal=True)
    rows = torch.arange(seqlen_q)[:, None]
    tile_start = rows // block_m * block_m
    key_end = info.key_end(torch.clamp(tile_start + block_m, max=seqlen_q) - 1)
    last_tile = (key_end - 1) // block_n * block_n
    return (torch.arange(seqlen_k)[None, :] < last_tile) | info.mask()


def kernel_candidates(q, k, v, causal, scale, block_m, block_n):
    """The mistakes of a tiled kernel, as (message, thunk) pairs; thunks return {out, lse} in float64."""
    used = resolve_scale(scale, q.shape[-1])
    seqlen_q, seqlen_k = q.shape[-2], k.shape[-2]
    padding = -seqlen_k % block_n
    if not causal and padding:  # with causal=True the diagonal hides the padding keys anyway
        yield (f"the last key tile is ragged (Nk = {seqlen_k} is not a multiple of BLOCK_N = {block_n}), and "
               f"its {padding} padding keys count, with a score of 0: loading them with other=0 gives "
               "q . k = 0, not -inf. Set the scores of keys past seqlen_k to -inf "
               "(tl.where(offs_n < seqlen_k, s, float('-inf'))).",
               lambda: _padding_keys(q, k, v, used, padding))
        if padding > 1:
            yield (f"key {seqlen_k}, one past the last, counts with a score of 0: the real keys are "
                   "offs_n < seqlen_k, not offs_n <= seqlen_k.", lambda: _padding_keys(q, k, v, used, 1))
    def exp_of_base2_scores():
        s = mistakes.scores(q, k, used * LOG2E, judges.causal_mask_for(q, k, causal))  # the scores in base-2 units
        p, lse = softmax_with_lse(s)  # tl.exp of them: a softmax at a temperature log2(e) too high
        row_max = s.amax(dim=-1)
        stored = torch.where(torch.isinf(row_max), lse, lse - row_max * (1 - math.log(2)))  # ln 2 (m + log2 l)
        return {"out": torch.matmul(p, v.double()), "lse": stored}
    yield ("your scores are in base-2 units (the scale times log2(e)), but you take tl.exp of them: with "
           "log2(e) folded into the scale every exponential must be tl.math.exp2 (alpha and p alike); or "
           "keep the plain scale and use tl.exp, with lse = m + log(l).", exp_of_base2_scores)
    if causal:
        mask = _mask_in_last_tile_only(seqlen_q, seqlen_k, block_m, block_n)
        yield ("the causal mask is applied only in the last key tile of each program, but the diagonal "
               "can run through more than one tile (when BLOCK_M > BLOCK_N, or when Nk - Nq is not a "
               "multiple of BLOCK_N): mask every tile a program visits, or at least every tile that "
               "holds a key past some row's diagonal.",
               lambda: dict(zip(NAMES, mistakes.attention(q, k, v, used, mask), strict=True)))


def partial_tile_detector(seqlen_q: int, block_m: int):
    """Wrong rows only in the last, partial query tile, in out or lse, and every full tile right: that
    tile's programs ran wrong or not at all (a grid too small, or loads and stores masked wrong).

    A program that never runs leaves whatever the allocator handed out, which may by chance be
    right in some rows, so the test is "no wrong row outside the tile", not "every row of it".
    """
    first = seqlen_q // block_m * block_m

    def only_partial_tile(actual, expected, comparisons):
        if first in (0, seqlen_q):  # no partial tile, or no full tile to compare it with
            return None
        wrong = judges.wrong_rows(actual, expected, comparisons, ROWS)
        if not wrong or min(wrong) < first:
            return None
        return (f"only queries of the last query tile are wrong ({_row_span(sorted(wrong))}), which is partial "
                f"(Nq = {seqlen_q} is not a multiple of BLOCK_M = {block_m}), while the full tiles are right: "
                + GRID_FIX)
    return only_partial_tile


def _row_span(rows: list[int]) -> str:
    """'query 7', 'queries 16 to 24' or 'queries 16, 18 and 20' for sorted row indices."""
    if len(rows) == 1:
        return f"query {rows[0]}"
    if rows[-1] - rows[0] + 1 == len(rows):
        return f"queries {rows[0]} to {rows[-1]}"
    shown = ", ".join(map(str, rows[:-1][:8])) + (", ..." if len(rows) > 9 else "")
    return f"queries {shown} and {rows[-1]}"


def pair_offset_detector(actual, expected, comparisons):
    """(batch 0, head 0) right and every other pair wrong: the per-pair pointer offsets are wrong."""
    pairs = None
    for name, _ in ROWS:
        wrong = wrong_positions(actual[name], expected[name].reference, comparisons[name].bound)
        wrong = wrong.flatten(2).any(dim=-1)  # (batch, head)
        pairs = wrong if pairs is None else pairs | wrong
    pairs = pairs.flatten()
    if pairs.numel() < 2 or pairs[0] or not pairs[1:].all():
        return None
    return ("(batch 0, head 0) is right and every other (batch, head) pair is wrong: each program must move "
            "its pointers to its own pair bh = tl.program_id(1), q_ptr and out_ptr by bh * seqlen_q * head_dim, "
            "k_ptr and v_ptr by bh * seqlen_k * head_dim, lse_ptr by bh * seqlen_q.")


def first_nan_key(v) -> int | None:
    """The first key whose value vector holds NaN in any batch or head (v: (B, H, Nk, d)), or None."""
    nan_keys = torch.nonzero(torch.isnan(v).flatten(0, 1).any(dim=0).any(dim=-1)).flatten()
    return int(nan_keys[0]) if nan_keys.numel() else None


def poisoned_rows(case) -> tuple[int, int] | None:
    """For a case whose V holds NaN from some key on: (rows, keys), the first ``rows`` queries, whose
    programs never need a key tile with NaN, and the ``keys`` keys those rows see. None without NaN."""
    q, k, v, causal, scale, block_m, block_n = case.args
    first = first_nan_key(v)
    if first is None:
        return None
    info = BlockInfo(q.shape[-2], k.shape[-2], causal=True)
    begin = info.query_blocks(first // block_n * block_n, block_n, block_m).begin
    rows = min(begin, info.seqlen_q)  # the query tiles before the first that meets the NaN tile
    return rows, rows + info.offset


def judge_skipping(case, outcome) -> Verdict:
    """A causal case whose V holds NaN in the key tiles that the first ``rows`` queries' programs skip.

    A program that loads such a tile anyway multiplies the NaN by P = 0 (0 x NaN = NaN), so those
    rows come out NaN although their lse (which does not involve V) is right: that is the sign of
    missing block skipping. Otherwise the rows are judged as the same problem cut down to them
    (q[:rows], k[:keys], v[:keys] keeps Nk - Nq, so the causal mask is unchanged); the later
    rows see NaN values and are not judged.
    """
    q, k, v, causal, scale, block_m, block_n = case.args
    rows, keys = poisoned_rows(case)
    checked = checked_outputs(outcome, NAMES, lambda: judges.forward_expected(q, k, v.nan_to_num(), causal, scale),
                              ERROR_HINTS)
    if isinstance(checked, Verdict):
        return checked
    actual, _ = checked
    cut = (q[..., :rows, :], k[..., :keys, :], v[..., :keys, :])
    seen = {"out": actual["out"][..., :rows, :], "lse": actual["lse"][..., :rows]}
    cut_case = replace(case, args=(*cut, causal, scale, block_m, block_n))
    cut_outcome = {**outcome, "outputs": [seen["out"], seen["lse"]]}
    verdict = _judge(cut_case, cut_outcome)
    expected = judges.forward_expected(*cut, causal, scale)
    comparisons = compare_all(seen, expected)
    if verdict.passed or not torch.isnan(seen["out"]).any():
        return verdict
    if not comparisons["lse"].ok:  # NaN from keys these rows should not see: the lse names the mistake
        message = _judge(cut_case, cut_outcome, lse_only=True).message
        return Verdict(False, f"{message} (This case's V holds NaN from key {first_nan_key(v)} on, on "
                              f"purpose: NaN in queries 0 to {rows - 1} means their programs read it.)")
    return Verdict(False, (
        f"queries 0 to {rows - 1} get NaN in out, though their lse is right and none of them sees a key "
        f"from {first_nan_key(v)} on, where this case's V holds NaN. Their programs loaded V tiles past the "
        "diagonal and multiplied the NaN by P = 0 (0 x NaN = NaN): a program must skip the key tiles "
        "from causal_key_end on (no row of its tile sees them), not load them and mask them. "
        + largest_error(seen, expected, comparisons)))


def _judge(case, outcome, lse_only: bool = False) -> Verdict:
    """The tolerance rule and the diagnosis; lse_only: compare and diagnose the lse alone."""
    q, k, v, causal, scale, block_m, block_n = case.args

    def candidates():
        yield from judges.forward_candidates(q, k, v, causal, scale, (block_m, block_n), GRID_FIX)
        yield from kernel_candidates(q, k, v, causal, scale, block_m, block_n)

    detectors = () if lse_only else (partial_tile_detector(q.shape[-2], block_m), pair_offset_detector,
                                     *judges.forward_detectors(q, k, causal, scale))
    return judge_outputs(case, outcome, NAMES, lambda: judges.forward_expected(q, k, v, causal, scale),
                         view=(lambda outputs: {"lse": outputs["lse"]}) if lse_only else None,
                         candidates=candidates, detectors=detectors, error_hints=ERROR_HINTS)


def judge_kernel(case, outcome) -> Verdict:
    """flash_forward_triton(q, k, v, causal, scale, block_m, block_n) -> (out, lse)."""
    error = outcome["error"] or ""
    if not outcome["forbidden"] and "InterpreterError" in error and "NotImplementedError" in error:
        return Verdict(False, NOT_IMPLEMENTED)  # raised in a @triton.jit function, wrapped by the interpreter
    return judge_skipping(case, outcome) if poisoned_rows(case) else _judge(case, outcome)


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def summarize(results) -> str | None:
    """A hint when only the non-contiguous cases, only those with an odd head_dim, or only those with a
    partial last query tile fail."""
    return (only_some_fail(
                results, lambda c: not all(t.is_contiguous() for t in c.args[:3]),
                "Only the non-contiguous cases fail: pointer arithmetic with seqlen * head_dim assumes "
                "contiguous tensors, so call .contiguous() on q, k and v in the launcher (or pass their "
                "strides to the kernel).", unexplained_only=True)
            or only_some_fail(
                results, lambda c: not _power_of_two(c.args[0].shape[-1]),
                "Only the cases whose head_dim is not a power of two fail: HEAD_DIM must be the next power "
                "of two, and every load and store must mask the columns offs_d >= head_dim.",
                unexplained_only=True)
            or only_some_fail(
                results, lambda c: c.args[0].shape[-2] % c.args[5] != 0,
                "Only the cases whose Nq is not a multiple of BLOCK_M fail: the last query tile is partial "
                "(with Nq < BLOCK_M it is the only one): " + GRID_FIX))


# ----------------------------------------------------------------------------- the backward kernels

def _backward_with_p(q, k, v, out, dout, p, used, rows_kept=None):
    """(dq, dk, dv) in float64 from probabilities ``p`` (B, H, Nq, Nk); rows_kept (Nq, Nk) bool: the
    (query, key) pairs the dK/dV kernel's loop reaches (None: all), for dk and dv only."""
    q, k, v, out, dout = (t.double() for t in (q, k, v, out, dout))
    delta = (dout * out).sum(dim=-1, keepdim=True)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - delta)
    dq = used * torch.matmul(ds, k)
    if rows_kept is not None:
        p, ds = p * rows_kept, ds * rows_kept
    return {"dq": dq, "dk": used * torch.matmul(ds.transpose(-2, -1), q), "dv": torch.matmul(p.transpose(-2, -1), dout)}


def backward_kernel_candidates(q, k, v, out, lse, dout, causal, scale, block_m, block_n):
    """The mistakes of the two backward kernels beyond the shared ones: exp of base-2 scores, and a
    dK/dV loop that starts one Q tile late under causal masking."""
    used = resolve_scale(scale, q.shape[-1])
    mask = judges.causal_mask_for(q, k, causal)
    s = mistakes.scores(q, k, used, mask)
    lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse).double()
    yield ("P is recomputed with tl.exp of base-2 scores: with log2(e) folded into the scale the exponent is "
           "in base 2, so it needs tl.math.exp2 (P = 2^(s log2 e - lse log2 e)), or the plain scale with tl.exp.",
           lambda: _backward_with_p(q, k, v, out, dout, torch.exp(LOG2E * (s - lse_safe[..., None])), used))
    if causal:
        info = BlockInfo(q.shape[-2], k.shape[-2], causal=True)
        rows = torch.arange(info.seqlen_q)[:, None]
        first = torch.tensor([info.query_blocks(j // block_n * block_n, block_n, block_m).begin
                              for j in range(info.seqlen_k)])[None, :]
        late = rows >= first + block_m
        yield ("the dK/dV kernel starts one Q tile late: causal_query_start must round the first row that "
               "sees the tile's first key down to the start of its Q tile (start_n - (Nk - Nq), at least 0, "
               "// BLOCK_M * BLOCK_M); the tile above it holds rows that see these keys.",
               lambda: _backward_with_p(q, k, v, out, dout, torch.exp(s - lse_safe[..., None]), used, late))


def judge_backward_kernel(case, outcome) -> Verdict:
    """flash_backward_triton(q, k, v, out, lse, dout, causal, scale, block_m, block_n) -> (dq, dk, dv)."""
    q, k, v, out, lse, dout, causal, scale, block_m, block_n = case.args
    error = outcome["error"] or ""
    if not outcome["forbidden"] and "InterpreterError" in error and "NotImplementedError" in error:
        return Verdict(False, NOT_IMPLEMENTED)

    def expected():
        specs = gradients.gradient_expected(q, k, v, causal, scale, dout)
        return {name: specs[name] for name in gradients.GRADIENTS}

    def candidates():
        yield from backward_kernel_candidates(q, k, v, out, lse, dout, causal, scale, block_m, block_n)
        yield from gradients.backward_candidates(q, k, v, out, lse, dout, causal, scale, (block_m, block_n))

    return judge_outputs(case, outcome, gradients.GRADIENTS, expected, candidates=candidates,
                         detectors=(gradients.gradients_detector, judges.nan_detector), error_hints=ERROR_HINTS)
