"""FlashAttention Lab: the public API.

>>> out = fa_lab.attention(q, k, v, causal=False, scale=None, impl="torch")
>>> out, lse = fa_lab.attention(q, k, v, causal=True, impl="triton", return_lse=True)
"""
from __future__ import annotations

from .impls import IMPLS
from .inputs import check_flag, check_fp8_inputs, check_options, check_qkv
from .kernels import use_interpreter_without_gpu
from .score_mods import check_alibi_slopes

use_interpreter_without_gpu()  # before anything imports triton: see fa_lab/kernels/__init__.py

from .context_parallel import ring_attention  # noqa: E402  (after the interpreter switch, like every import)
from .kvcache import attention_with_kvcache  # noqa: E402
from .varlen import attention_varlen  # noqa: E402

__version__ = "0.1.0"
__all__ = ["IMPLS", "attention", "attention_varlen", "attention_with_kvcache", "ring_attention"]


def attention(q, k, v, causal: bool = False, scale: float | None = None, impl: str = "torch",
              return_lse: bool = False, window=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
              q_descale=None, k_descale=None, v_descale=None):
    """Exact softmax attention, in SDPA's layout.

    q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads_kv, seqlen_k, head_dim), where
        heads is a multiple of heads_kv (grouped-query attention: query head h reads key/value
        head h // (heads // heads_kv); heads_kv = 1 is multi-query attention).
    causal: bottom-right aligned (query i sees keys j <= i + seqlen_k - seqlen_q);
        a query that sees no key returns zeros and lse = -inf.
    scale: softmax scale, default head_dim ** -0.5.
    window: (left, right), flash-attn's window_size: query i sees keys j with
        i + o - left <= j <= i + o + right, o = seqlen_k - seqlen_q; -1 leaves a side unbounded;
        causal=True means right = 0.
    softcap: if > 0, scores become softcap * tanh(scores / softcap) (Gemma 2).
    alibi_slopes: float32 (heads,) or (batch, heads); adds -slope * |i + o - j| to each score.
    impl: "naive" (materializes S and P), "torch" (tiled online softmax in plain
        PyTorch), "triton" (Triton kernels: compiled on CUDA, interpreted on CPU;
        float16 and bfloat16 only), "triton_hopper" (the FlashAttention-3-style
        forward and backward for Hopper; the "triton" backward for causal calls below 2K keys, where
        it measured faster, head_dims other than 64 and 128, and the soft cap and ALiBi), "triton_hopper_fp8" (FP8
        e4m3 forward with per-tile scales and a Hadamard rotation of q and k;
        forward only: a backward through it raises RuntimeError). window, softcap and
        alibi_slopes are in every impl but "triton_hopper_fp8"; "triton_hopper" takes them in
        its Gluon forward on sm_90 and in the "triton" kernels elsewhere (:mod:`fa_lab.impls`).
    q_descale, k_descale, v_descale: for inputs already quantized (flash-attn's FP8 convention): q, k, v
        in float8_e4m3fn, each descale float32 (batch, heads_kv), x = x8 * descale, impl
        "triton_hopper_fp8" only, without score options; no rotation and no quantization pass run, and
        out is bfloat16.
    Returns out (dtype of q) or, with return_lse, (out, lse) where lse: (batch,
    heads, seqlen_q) float32 is detached. Gradients flow to q, k, v for every impl.
    """
    descales = (q_descale, k_descale, v_descale)
    prequantized = check_fp8_inputs(q, k, v, descales, impl)  # (which checks q, k, v itself)
    if not prequantized:
        check_qkv(q, k, v)
    causal, scale, window, softcap = check_options(q.shape[-1], causal, scale, window, softcap)
    check_flag("return_lse", return_lse)
    if prequantized:
        from .impls import run_prequantized_fp8
        out, lse = run_prequantized_fp8(q, k, v, descales, causal, scale, window, softcap, alibi_slopes)
    else:
        slopes = check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[1], q.device)
        from .impls import run
        out, lse = run(q, k, v, causal, scale, impl, window, softcap, slopes)
    return (out, lse.detach()) if return_lse else out
