"""Which implementation computes :func:`fa_lab.attention`, on arguments already checked.

Every impl takes grouped-query attention. The chapter-05 score options (a local window,
the soft cap, ALiBi) are in ``"naive"``, ``"torch"`` and ``"triton"``, whose kernels also read
grouped K/V natively. ``"triton_hopper"`` reads grouped K/V and takes every option in its Gluon kernel
(elsewhere: the portable kernels, as ``"triton"``); ``"triton_hopper_fp8"``
(inference only) receives grouped K/V expanded to one head per query head and refuses the options
with a message that says so.
"""
from __future__ import annotations

from .block_info import BlockInfo
from .reference import expand_kv

IMPLS = ("naive", "torch", "triton", "triton_hopper", "triton_hopper_fp8")
WITH_SCORE_OPTIONS = ("naive", "torch", "triton", "triton_hopper")


def has_score_options(seqlen_q: int, seqlen_k: int, causal: bool, window, softcap: float, alibi_slopes) -> bool:
    """Whether the call needs more than causal masking: a window that causal alone does not give,
    a soft cap or ALiBi slopes."""
    return BlockInfo(seqlen_q, seqlen_k, causal, tuple(window)).banded or bool(softcap) or alibi_slopes is not None


def run(q, k, v, causal: bool, scale: float, impl: str, window=(-1, -1), softcap: float = 0.0,
        alibi_slopes=None):
    """(out, lse) of one dense call: q (B, H, Nq, d), k, v (B, Hkv, Nk, d), slopes (B, H) or None."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}; got {impl!r}")
    options = {"window": tuple(window), "softcap": softcap, "alibi_slopes": alibi_slopes}
    if impl == "naive":
        from .reference import naive_attention
        return naive_attention(q, k, v, causal, scale, **options)
    if impl == "torch":
        from .flash_torch import flash_attention
        return flash_attention(q, k, v, causal, scale, **options)
    scored = has_score_options(q.shape[2], k.shape[2], causal, window, softcap, alibi_slopes)
    if impl == "triton_hopper":
        from .kernels import triton_hopper_attention
        return triton_hopper_attention(q, k, v, causal, scale, **options)
    if impl == "triton":
        from .kernels import triton_attention
        return triton_attention(q, k, v, causal, scale, **options)
    if scored:
        given = [name for name, off in (("window", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None))
                 if options[name] != off]
        raise NotImplementedError(f"impl={impl!r} does not take {' or '.join(given)}; "
                                  f"{', '.join(map(repr, WITH_SCORE_OPTIONS))} do")
    from .kernels import triton_hopper_fp8_attention
    return triton_hopper_fp8_attention(q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), causal, scale)


def run_prequantized_fp8(q8, k8, v8, descales, causal: bool, scale: float, window, softcap, alibi_slopes):
    """impl="triton_hopper_fp8" on float8_e4m3fn q8 (B, H, Nq, d), k8, v8 (B, Hkv, Nk, d) with flash-attn's
    (batch, heads_kv) descales (checked by ``inputs.check_fp8_inputs``): K, V and their descales expanded to
    one head per query head, as the FP8 kernels read them, and q_descale, per KV head like flash-attn's, to
    each query head of the group. Returns (out bfloat16, lse)."""
    if has_score_options(q8.shape[2], k8.shape[2], causal, window, softcap, alibi_slopes):
        raise NotImplementedError("float8_e4m3fn inputs (impl='triton_hopper_fp8') take no window, softcap or "
                                  "alibi_slopes")
    from .kernels import triton_hopper_fp8_prequantized

    heads = q8.shape[1]
    per_head = tuple(d.repeat_interleave(heads // d.shape[1], dim=1) for d in descales)
    return triton_hopper_fp8_prequantized(q8, expand_kv(k8, heads), expand_kv(v8, heads), per_head, causal, scale)
