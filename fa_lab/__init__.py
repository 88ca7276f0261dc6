"""FlashAttention Lab: the public API.

>>> out = fa_lab.attention(q, k, v, causal=False, scale=None, impl="torch")
>>> out, lse = fa_lab.attention(q, k, v, causal=True, impl="triton", return_lse=True)
"""
from __future__ import annotations

from .inputs import check_qkv, resolve_scale
from .kernels import use_interpreter_without_gpu

use_interpreter_without_gpu()  # before anything imports triton: see fa_lab/kernels/__init__.py

__version__ = "0.1.0"

IMPLS = ("naive", "torch", "triton", "triton_hopper", "triton_hopper_fp8")


def attention(q, k, v, causal: bool = False, scale: float | None = None, impl: str = "torch",
              return_lse: bool = False):
    """Exact softmax attention, in SDPA's layout.

    q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads, seqlen_k, head_dim).
    causal: bottom-right aligned (query i sees keys j <= i + seqlen_k - seqlen_q);
        a query that sees no key returns zeros and lse = -inf.
    scale: softmax scale, default head_dim ** -0.5.
    impl: "naive" (materializes S and P), "torch" (tiled online softmax in plain
        PyTorch), "triton" (Triton kernels: compiled on CUDA, interpreted on CPU;
        float16 and bfloat16 only), "triton_hopper" (the FlashAttention-3-style
        forward for Hopper, with the "triton" backward), "triton_hopper_fp8" (FP8
        e4m3 forward with per-tile scales and a Hadamard rotation of q and k;
        forward only: a backward through it raises RuntimeError).
    Returns out (dtype of q) or, with return_lse, (out, lse) where lse: (batch,
    heads, seqlen_q) float32 is detached. Gradients flow to q, k, v for every impl.
    """
    check_qkv(q, k, v)
    scale = resolve_scale(scale, q.shape[-1])
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if impl == "naive":
        from .reference import naive_attention
        out, lse = naive_attention(q, k, v, causal, scale)
    elif impl == "torch":
        from .flash_torch import flash_attention
        out, lse = flash_attention(q, k, v, causal, scale)
    elif impl == "triton":
        from .kernels import triton_attention
        out, lse = triton_attention(q, k, v, causal, scale)
    elif impl == "triton_hopper":
        from .kernels import triton_hopper_attention
        out, lse = triton_hopper_attention(q, k, v, causal, scale)
    elif impl == "triton_hopper_fp8":
        from .kernels import triton_hopper_fp8_attention
        out, lse = triton_hopper_fp8_attention(q, k, v, causal, scale)
    else:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}; got {impl!r}")
    return (out, lse.detach()) if return_lse else out
