"""Judges of lab 04's first three exercises: block quantization, the Hadamard transform, the rotation.

Each judge compares the learner's outputs with :mod:`fa_lab.fp8` (computed here, in
the grader's process) and, when they differ, names the mistake: one scale for all
blocks, a scale of amax instead of amax / 448, a multiply where a divide belongs,
blocks that are not runs of consecutive rows, a transform that is not normalized,
pairs the wrong elements or runs a round short, signs applied after the transform or
left out on one side, K left unrotated...
"""
from __future__ import annotations

import math

import torch

from ...block_info import cdiv
from ...fp8 import E4M3_MAX, hadamard_transform, incoherent_rotation, quantize_e4m3, round_to_e4m3
from ..judge import PASS, Expected, judge_outputs, outcome_problem, structure_problem, unpack
from ..registry import Verdict

X_DIMS = ("batch", "head", "row", "dim")
SCALE_DIMS = ("batch", "head", "block")
Q_DIMS = ("batch", "head", "query", "dim")
K_DIMS = ("batch", "head", "key", "dim")
# scale = amax / 448 in float32: one rounding, so 1e-5 leaves room for amax * (1 / 448).
SCALE_RTOL = 1e-5
# Round to nearest e4m3: off by at most 2^-4 of |x| in the normal range, half a subnormal step below.
E4M3_HALF_STEP, E4M3_HALF_SUBNORMAL_STEP = 2.0**-4, 2.0**-10
FLOAT64_FLOOR = 1e-12  # the tolerance rule's floor for float64 outputs (it has none of its own)
NON_CONTIGUOUS_HINT = ("view size is not compatible",
                       "Your input may be a non-contiguous view (a transposed tensor): use reshape, which "
                       "copies when it must, instead of view.")


def _floor(dtype: torch.dtype) -> float | None:
    return FLOAT64_FLOOR if dtype == torch.float64 else None


def _format_index(index, dims) -> str:
    return ", ".join(f"{dim} {int(i)}" for dim, i in zip(dims, index, strict=True))


def _as_tuple(outcome: dict) -> dict:
    """A function that returns one tensor, judged as a tuple of one."""
    outputs = outcome["outputs"]
    return {**outcome, "outputs": [outputs]} if isinstance(outputs, torch.Tensor) else outcome


# ----------------------------------------------------------------------------- quantize_blocks


def _scale_mistakes(x, block, expected):
    """(message, scales) for the wrong scales learners compute. x: (B, H, N, d), expected: Fp8Tensor."""
    batch, heads, seqlen, head_dim = x.shape
    x32 = x.float()
    num_blocks = expected.scales.shape[-1]
    whole = x32.abs().amax()
    yield ("one scale for all blocks: you took the largest magnitude of the whole tensor. Block "
           "quantization gives each block of rows its own scale, so that a block of small values is not "
           "quantized with the scale of a block of large ones.",
           torch.where(whole > 0, whole / E4M3_MAX, 1.0).expand(batch, heads, num_blocks))
    per_head = x32.abs().amax(dim=(-2, -1), keepdim=True)[..., 0]
    yield ("one scale per (batch, head): you took the largest magnitude over all the rows of a head. Each "
           f"block of {block} rows gets its own scale.",
           torch.where(per_head > 0, per_head / E4M3_MAX, 1.0).expand(batch, heads, num_blocks))
    amax = expected.scales * E4M3_MAX
    yield ("your scales are amax, 448 times too large: scale = amax / 448 maps the block's largest "
           "magnitude to 448, e4m3's largest value. With scale = amax every value lands in [-1, 1] and "
           "uses a small part of e4m3's range (values below 2^-6 lose bits).", amax)
    yield ("your scales are 448 / amax, the inverse of amax / 448: the scale is what data is multiplied "
           "by to get x back (x = data * scale).", E4M3_MAX / amax)
    signed = torch.nn.functional.pad(x32, (0, 0, 0, num_blocks * block - seqlen), value=float("-inf"))
    largest = signed.reshape(batch, heads, num_blocks, block * head_dim).amax(dim=-1)
    yield ("your scales come from the largest value, not the largest magnitude: amax is the max of |x| "
           "over the block, so that its most negative values fit into [-448, 448] too.",
           torch.where(largest != 0, largest / E4M3_MAX, 1.0))
    padded = torch.nn.functional.pad(x32.abs(), (0, 0, 0, num_blocks * block - seqlen))
    strided = padded.reshape(batch, heads, block, num_blocks, head_dim).amax(dim=(2, 4))
    yield (f"your blocks are not runs of consecutive rows: block j must hold rows j * {block} to "
           f"(j + 1) * {block} - 1. Splitting the rows as ({block}, N / {block}) instead of "
           f"(N / {block}, {block}) puts every {num_blocks}th row into one block.",
           torch.where(strided > 0, strided / E4M3_MAX, 1.0))
    if x.dtype != torch.float32:
        rounded = x.abs().amax(dim=-1).float()  # exact: a max of x.dtype values
        padded_rows = torch.nn.functional.pad(rounded, (0, num_blocks * block - seqlen))
        blocks = padded_rows.reshape(batch, heads, num_blocks, block).amax(dim=-1).to(x.dtype)
        yield (f"your scales were computed in {x.dtype} (x's dtype): amax / 448 is rounded to "
               f"{x.dtype}'s few mantissa bits. Compute in float32 (x.float()), as a kernel's "
               "quantization step does.",
               torch.where(blocks > 0, blocks / E4M3_MAX, torch.ones_like(blocks)).float())


def _scales_match(actual, target, rtol=SCALE_RTOL) -> bool:
    return actual.shape == target.shape and bool(((actual.double() - target.double()).abs()
                                                   <= rtol * target.double().abs()).all())


def _scales_diagnosis(x, block, actual, expected) -> str:
    reference = expected.scales
    for message, candidate in _scale_mistakes(x, block, expected):
        if not _scales_match(candidate, reference, 1e-3) and _scales_match(actual, candidate, 1e-3):
            return message
    wrong = ~((actual.double() - reference.double()).abs() <= SCALE_RTOL * reference.double())
    padded = torch.nn.functional.pad(x.float().abs(), (0, 0, 0, reference.shape[-1] * block - x.shape[-2]))
    empty = padded.reshape(*reference.shape, -1).amax(dim=-1) == 0
    if (wrong & empty).any():
        index = tuple(torch.nonzero(wrong & empty)[0].tolist())
        return (f"an all-zero block ([{_format_index(index, SCALE_DIMS)}]) got scale "
                f"{actual[index].item():.4g}: its amax is 0, and 0 / 0 is NaN. Give an all-zero block "
                "scale 1 (any scale quantizes zeros exactly).")
    last = reference.shape[-1] - 1
    if x.shape[-2] % block and wrong[..., last].all() and not wrong[..., :last].any():
        return (f"only the last block, which is shorter ({x.shape[-2] % block} rows, not {block}), has "
                "wrong scales: its amax must be taken over its own rows only.")
    index = tuple(torch.nonzero(wrong)[0].tolist())
    return (f"wrong scale at [{_format_index(index, SCALE_DIMS)}]: got {actual[index].item():.6g}, "
            f"expected amax / 448 = {reference[index].item():.6g}.")


def _data_diagnosis(x, block, data, expected) -> str | None:
    """None when data * scale is x rounded to the nearest e4m3 value; otherwise what went wrong."""
    x64 = x.double()
    row_scales = expected.row_scales().double()
    values = data.double()
    error = (values * row_scales - x64).abs()
    bound = (E4M3_HALF_STEP * x64.abs() + E4M3_HALF_SUBNORMAL_STEP * row_scales) * (1 + 1e-5)
    if torch.isnan(values).any() or (values.abs() > E4M3_MAX).any():
        return "data holds NaN or values beyond 448: clamp x / scale to [-448, 448] before the cast."
    wrong = ~(error <= bound)
    if not wrong.any():
        return None
    multiplied = round_to_e4m3(x.float() * expected.row_scales()).double()
    if not torch.equal(multiplied, expected.values().double()) and \
            ((values - multiplied).abs() <= E4M3_HALF_STEP * 2 * multiplied.abs() + 1e-30).all():
        return ("data = x * scale: quantizing divides by the scale (data = x / scale), so that "
                "dequantizing multiplies (data * scale is close to x).")
    index = tuple(int(i) for i in torch.unravel_index(torch.argmax(error - bound), error.shape))
    return (f"data * scale is not x rounded to the nearest e4m3 value: at [{_format_index(index, X_DIMS)}] "
            f"data * scale = {(values * row_scales)[index].item():.4g} for x = {x64[index].item():.4g} "
            f"(allowed error {bound[index].item():.2g}). Divide x by its block's scale, clamp to "
            "[-448, 448] and cast with .to(torch.float8_e4m3fn), which rounds to nearest.")


def _shape_mistake(x, block, scales) -> str | None:
    """A message for scales whose shape says which dimension the blocks were taken along."""
    batch, heads, seqlen, head_dim = x.shape
    num_blocks = cdiv(seqlen, block)
    shape = tuple(scales.shape) if isinstance(scales, torch.Tensor) else None
    if shape is None or shape == (batch, heads, num_blocks):
        return None
    known = {
        (batch, heads, seqlen, cdiv(head_dim, block)): "you made blocks along head_dim (the last dim)",
        (batch, heads, num_blocks, head_dim): "you took one scale per column of each block",
        (batch, heads, seqlen): "you took one scale per row",
        (batch, heads, seqlen // block): "the last, shorter block has no scale (N / block rounded down)",
        (batch, heads, seqlen // block, 1): "your scales keep a trailing dim of 1",
    }
    what = known.get(shape)
    if what is None:
        return None
    return (f"scales has shape {shape}: {what}. A block is {block} consecutive rows (tokens) of one "
            f"(batch, head), all {head_dim} columns, and gets one scale: scales is (B, H, ceil(N / block)) "
            f"= {(batch, heads, num_blocks)}, the last block holding the N % block rows left over.")


def judge_quantize(case, outcome) -> Verdict:
    """quantize_blocks(x, block) -> (data (B, H, N, d) float8_e4m3fn, scales (B, H, ceil(N / block)))."""
    x, block = case.args
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    actual = unpack(outcome["outputs"], ("data", "scales"))
    if isinstance(actual, str):
        return Verdict(False, actual)
    shape_mistake = _shape_mistake(x, block, actual["scales"])
    if shape_mistake:
        return Verdict(False, shape_mistake)
    expected = quantize_e4m3(x, block)
    specs = {"data": Expected(expected.values(), expected.values(), torch.float8_e4m3fn, X_DIMS),
             "scales": Expected(expected.scales, expected.scales, torch.float32, SCALE_DIMS)}
    problem = structure_problem(actual, specs)
    if problem:
        return Verdict(False, problem)
    if not _scales_match(actual["scales"], expected.scales):
        return Verdict(False, _scales_diagnosis(x, block, actual["scales"], expected))
    problem = _data_diagnosis(x, block, actual["data"], expected)
    return Verdict(False, problem) if problem else PASS


# ----------------------------------------------------------------------------- hadamard


def butterflies(x: torch.Tensor, pairing: str = "right", rounds: int | None = None) -> torch.Tensor:
    """x H / sqrt(d) by log2(d) rounds of butterflies, or with a mistake. x: (..., d), float64.

    pairing "neighbours": every round pairs elements 2i and 2i + 1 (the stride never grows);
    "interleaved": pairs x[i] and x[i + h] but writes a + b and a - b next to each other;
    "reversed": writes b - a where a - b belongs. rounds: how many rounds run (None: log2(d)).
    """
    head_dim = x.shape[-1]
    y = x.reshape(-1, head_dim)
    half, done = 1, 0
    while half < head_dim and (rounds is None or done < rounds):
        width = 1 if pairing == "neighbours" else half
        pairs = y.reshape(-1, head_dim // (2 * width), 2, width)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        difference = b - a if pairing == "reversed" else a - b
        y = torch.stack((a + b, difference), dim=-1 if pairing == "interleaved" else 2).reshape(-1, head_dim)
        half, done = half * 2, done + 1
    return (y / math.sqrt(head_dim)).reshape(x.shape)


def _far(actual, expected) -> bool:
    """True when y misses the reference by more than 5% of its length (not a rounding matter)."""
    y, reference = actual["y"].double(), expected["y"].reference
    return bool(torch.isfinite(y).all()) and float((y - reference).norm()) > 0.05 * float(reference.norm())


def _transform_detectors(x):
    x64 = x.double()

    def permuted(actual, expected, comparisons):
        y, reference = actual["y"].double(), expected["y"].reference
        bound = comparisons["y"].bound
        if not _far(actual, expected):
            return None
        if (y.sort(dim=-1).values - reference.sort(dim=-1).values).abs().max() <= bound:
            return ("your outputs hold the right values in the wrong positions: the butterflies pair "
                    "the right elements but write a + b and a - b to other places. In the round with "
                    "stride h, x[i] and x[i + h] (i in the first half of a block of 2h) are replaced by "
                    "a + b at i and a - b at i + h.")
        return None

    def lengths(actual, expected, comparisons):
        y = actual["y"].double()
        ratio = y.norm(dim=-1) / x64.norm(dim=-1)
        ratio = ratio[torch.isfinite(ratio)]
        if not _far(actual, expected) or not ratio.numel() or (ratio.max() - ratio.min()) > 1e-2 * ratio.mean():
            return None
        factor = ratio.mean().item()
        if abs(factor - 1) > 1e-2:
            return (f"every row comes out {factor:.3g} times as long as it went in, but x H / sqrt(d) keeps "
                    "lengths (H H^T = d I): each round of butterflies makes a row sqrt(2) times longer, so "
                    "log2(d) rounds (h = 1, 2, ..., d / 2) and one division by sqrt(d) keep it. Count your "
                    "rounds and your divisions.")
        return ("your transform keeps lengths, but it is not x H / sqrt(d) with Sylvester's H: check "
                "which elements each round pairs (stride h = 1, 2, 4, ..., d / 2). hadamard(torch.eye(d)) "
                "* sqrt(d) must give H, where H_1 = [1] and H_2n = [[H_n, H_n], [H_n, -H_n]].")

    return [permuted, lengths]


def judge_hadamard(case, outcome) -> Verdict:
    """hadamard(x) -> x H / sqrt(d) over the last dim, same shape and dtype as x."""
    (x,) = case.args
    head_dim = x.shape[-1]
    x64 = x.double()
    dims = ("batch", "head", "row", "column")[-x.ndim:] if x.ndim <= 4 else \
        tuple(f"axis {i}" for i in range(x.ndim))

    def expected():
        return {"y": Expected(hadamard_transform(x64), hadamard_transform(x), x.dtype, dims, _floor(x.dtype))}

    def candidates():
        reference = hadamard_transform(x64)
        yield ("not normalized: you returned x H. Divide by sqrt(d), so that the transform is "
               "orthogonal and keeps lengths (H H^T = d I).", lambda: {"y": reference * math.sqrt(head_dim)})
        yield ("divided by d instead of sqrt(d): H H^T = d I, so H / sqrt(d) is orthogonal and H / d "
               "shrinks every row by sqrt(d).", lambda: {"y": reference / math.sqrt(head_dim)})
        yield ("every round pairs the same neighbours (elements 2i and 2i + 1): the stride must double "
               "each round, h = 1, 2, 4, ..., d / 2, pairing x[i] with x[i + h]. Two butterflies on the "
               "same pair undo each other (up to a factor 2).",
               lambda: {"y": butterflies(x64, "neighbours")})
        yield ("your butterflies write a + b and a - b next to each other: in the round with stride h, "
               "a + b goes to position i and a - b to position i + h, where a = x[i] and b = x[i + h].",
               lambda: {"y": butterflies(x64, "interleaved")})
        yield ("your butterflies compute b - a where a - b belongs: in the round with stride h, a = x[i] and "
               "b = x[i + h] become a + b at i and a - b at i + h.", lambda: {"y": butterflies(x64, "reversed")})
        rounds = head_dim.bit_length() - 1
        if rounds >= 1:
            strides = ", ".join(str(2 ** i) for i in range(rounds)) if rounds <= 4 else \
                f"1, 2, ..., d / 2 = {head_dim // 2}"
            yield (f"one round of butterflies is missing: d = {head_dim} takes log2(d) = {rounds} "
                   f"round{'s' if rounds > 1 else ''}, with strides h = {strides} (while h < d, not while "
                   "2 h < d).", lambda: {"y": butterflies(x64, rounds=rounds - 1)})

    return judge_outputs(case, _as_tuple(outcome), ("y",), expected, candidates=candidates,
                         detectors=_transform_detectors(x), error_hints=[NON_CONTIGUOUS_HINT],
                         limit_message="The fast transform needs no d x d matrix: log2(d) rounds of "
                                       "butterflies over the d values of each row, O(d log d) work.")


# ----------------------------------------------------------------------------- rotate_qk


def _signs_used(rotated: torch.Tensor, original: torch.Tensor) -> torch.Tensor | None:
    """The signs s with rotated = hadamard(original * s), or None when there are none.

    H / sqrt(d) is symmetric and orthogonal, its own inverse: hadamard(x M) = x * s.
    """
    if rotated.shape != original.shape or not torch.isfinite(rotated).all():
        return None
    unrotated = hadamard_transform(rotated.double()).reshape(-1, original.shape[-1])
    x = original.double().reshape(-1, original.shape[-1])
    usable = x.abs() > 0.25
    if not usable.any(dim=0).all():
        return None
    ratio = torch.where(usable, unrotated / torch.where(usable, x, 1.0), torch.nan)
    signs = torch.sign(ratio.nanmean(dim=0))
    if not (((ratio - signs).abs() <= 0.1) | ~usable).all():
        return None
    return signs


def _rotation_detectors(q, k, signs):
    def other_signs(actual, expected, comparisons):
        used = {name: _signs_used(actual[name], original) for name, original in (("qm", q), ("km", k))}
        if any(s is None for s in used.values()):
            return None
        right = signs.double()
        differ = {name: int((s != right).sum()) for name, s in used.items()}
        if differ["qm"] and differ["km"] and torch.equal(used["qm"], used["km"]):
            return ("q and k were rotated with the same signs, but not with the signs argument: use the "
                    "signs you are given (the kernel and its caller must agree on M).")
        if differ["qm"] or differ["km"]:
            name = "k" if differ["km"] else "q"
            return (f"{name} was rotated with signs that differ from the signs argument in "
                    f"{max(differ.values())} of {right.numel()} coordinates: Q and K must be multiplied "
                    "by the same M, or (QM)(KM)^T is no longer QK^T.")
        return None

    def scores_changed(actual, expected, comparisons):
        qm, km = actual["qm"].double(), actual["km"].double()
        if qm.shape[:-2] != km.shape[:-2] or qm.shape[-1] != km.shape[-1]:
            return None
        exact = q.double() @ k.double().transpose(-2, -1)
        error = (qm @ km.transpose(-2, -1) - exact).abs().max().item()
        if error > 1e-2 * exact.abs().max().item():
            return (f"(QM)(KM)^T differs from QK^T by up to {error:.3g}: Q and K must be rotated by the "
                    "same orthogonal M = diag(signs) H / sqrt(d), which leaves every score unchanged.")
        return None

    return [other_signs, scores_changed]


def judge_rotate(case, outcome) -> Verdict:
    """rotate_qk(q, k, signs) -> (q M, k M), M = diag(signs) H / sqrt(d), in the dtypes of q and k."""
    q, k, signs = case.args
    q64, k64, s64 = q.double(), k.double(), signs.double()
    root_d = math.sqrt(q.shape[-1])

    def expected():
        qm, km = incoherent_rotation(q64, k64, s64)
        base_q, base_k = incoherent_rotation(q, k, signs)
        return {"qm": Expected(qm, base_q, q.dtype, Q_DIMS, _floor(q.dtype)),
                "km": Expected(km, base_k, k.dtype, K_DIMS, _floor(k.dtype))}

    def candidates():
        qm, km = incoherent_rotation(q64, k64, s64)
        yield ("k is returned unrotated: K must get the same rotation as Q for (QM)(KM)^T = QK^T. "
               "(V is never rotated: O = PV would come out multiplied by M.)", lambda: {"qm": qm, "km": k64})
        yield ("q is returned unrotated: Q must get the same rotation as K for (QM)(KM)^T = QK^T.",
               lambda: {"qm": q64, "km": km})
        yield ("the signs of k are applied after the transform: M = diag(signs) H / sqrt(d), so "
               "k M = hadamard(k * signs), signs first. Applied on one side only, the two sides no longer "
               "use the same M.", lambda: {"qm": qm, "km": hadamard_transform(k64) * s64})
        yield ("the signs of q are applied after the transform: M = diag(signs) H / sqrt(d), so "
               "q M = hadamard(q * signs), signs first. Applied on one side only, the two sides no longer "
               "use the same M.", lambda: {"qm": hadamard_transform(q64) * s64, "km": km})
        yield ("the signs are applied after the transform: M = diag(signs) H / sqrt(d) multiplies by the "
               "signs first, x M = hadamard(x * signs).",
               lambda: {"qm": hadamard_transform(q64) * s64, "km": hadamard_transform(k64) * s64})
        yield ("the signs are ignored: M = diag(signs) H / sqrt(d). Without the random signs the rotation "
               "is always the same, and an outlier pattern aligned with H is not spread.",
               lambda: {"qm": hadamard_transform(q64), "km": hadamard_transform(k64)})
        yield ("k is rotated without the signs (hadamard(k), not hadamard(k * signs)): Q and K must be "
               "multiplied by the same M = diag(signs) H / sqrt(d), or (QM)(KM)^T is no longer QK^T.",
               lambda: {"qm": qm, "km": hadamard_transform(k64)})
        yield ("q is rotated without the signs (hadamard(q), not hadamard(q * signs)): Q and K must be "
               "multiplied by the same M = diag(signs) H / sqrt(d), or (QM)(KM)^T is no longer QK^T.",
               lambda: {"qm": hadamard_transform(q64), "km": km})
        yield ("your rotation is not normalized (q H instead of q H / sqrt(d)): is your hadamard "
               "dividing by sqrt(d)?", lambda: {"qm": qm * root_d, "km": km * root_d})
        if q.shape == k.shape:
            yield "you returned (k M, q M): return (q M, k M), in the order of the arguments.", \
                lambda: {"qm": km, "km": qm}

    return judge_outputs(case, outcome, ("qm", "km"), expected, candidates=candidates,
                         detectors=_rotation_detectors(q, k, signs), error_hints=[NON_CONTIGUOUS_HINT])
