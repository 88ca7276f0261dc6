"""Launchers and the autograd.Function of the Triton FlashAttention kernels.

The kernels (``triton_fwd``, ``triton_bwd``) read and write tiles through tensor
descriptors over (batch, heads, seqlen, head_dim) tensors. This module prepares
operands they can describe (head_dim padded to a multiple of 8, unit stride in
head_dim, 16-byte aligned strides), picks the tile configuration and launches.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from . import interpreting, load_triton
from .configs import TileConfig, backward_config, forward_config, head_dim_bucket

SUPPORTED = (torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634


def check_triton_inputs(q) -> None:
    """Refuse what the kernels cannot run, with the reason."""
    if q.dtype not in SUPPORTED:
        raise TypeError(
            f"impl='triton' runs float16 and bfloat16; q has dtype {q.dtype}. A compiled tl.dot on "
            "float32 runs in TF32 (10-bit mantissa), which would not meet float32 accuracy: use "
            "impl='torch' for float32, or cast q, k, v to bfloat16."
        )
    if not q.is_cuda and not interpreting():
        raise ValueError(
            f"q is on {q.device}, but this machine has CUDA, so Triton compiles kernels for the GPU. "
            "Move q, k, v to 'cuda', or run on CPU with the interpreter by setting TRITON_INTERPRET=1 "
            "before fa_lab first imports triton."
        )


def kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """A view or copy of t: (B, ..., n) that a tensor descriptor can describe.

    The last dim is zero-padded to 16 bytes (8 elements of bf16, 16 of fp8; zero
    head_dim columns change neither QK^T nor the first d columns of PV), and the
    tensor is made contiguous when its last stride is not 1 or another stride or
    the base is not 16-byte aligned.
    """
    item = t.element_size()
    multiple = 16 // item
    if t.shape[-1] % multiple:
        t = F.pad(t, (0, multiple - t.shape[-1] % multiple))
    aligned = t.data_ptr() % 16 == 0 and all((s * item) % 16 == 0 for s in t.stride()[:-1])
    if t.stride(-1) != 1 or not aligned:
        t = t.contiguous()
    return t


def descriptor(t: torch.Tensor, block_rows: int):
    """A descriptor over t: (B, H, N, d8) whose tiles are (1, 1, block_rows, padded head_dim)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_rows, head_dim_bucket(t.shape[-1])])


def triton_forward(q, k, v, causal: bool, scale: float, config: TileConfig | None = None):
    """Forward on prepared operands q: (B, H, Nq, d8), k, v: (B, H, Nk, d8).

    Returns (out: (B, H, Nq, d8) in q.dtype, lse: (B, H, Nq) float32).
    """
    from .triton_fwd import attention_fwd_kernel

    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    config = config or forward_config(head_dim, causal, interpreting())
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    grid = (triton_cdiv(seqlen_q, config.block_m), batch * heads)
    attention_fwd_kernel[grid](
        descriptor(q, config.block_m), descriptor(k, config.block_n), descriptor(v, config.block_n),
        descriptor(out, config.block_m), lse, heads, seqlen_q, seqlen_k, scale * LOG2E,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim_bucket(head_dim),
        CAUSAL=causal, REVERSE_GRID=causal, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, lse


def triton_backward(q, k, v, out, lse, grad_out, causal: bool, scale: float, config: TileConfig | None = None):
    """Backward on prepared operands (as :func:`triton_forward`); grad_out like out.

    Returns (dq, dk, dv), each (B, H, N, d8) in q.dtype.
    """
    from .triton_bwd import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel, attention_bwd_preprocess_kernel

    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    config = config or backward_config(head_dim, causal, interpreting())
    grad_out = grad_out.contiguous()
    rows = batch * heads * seqlen_q
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    pre_block = 64
    attention_bwd_preprocess_kernel[(triton_cdiv(rows, pre_block),)](
        out, grad_out, lse, delta, lse2, rows, head_dim, LOG2E, HEAD_DIM=head_dim_bucket(head_dim), BLOCK=pre_block)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    meta = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim_bucket(head_dim),
                CAUSAL=causal, num_warps=config.num_warps, num_stages=config.num_stages)
    attention_bwd_dkdv_kernel[(triton_cdiv(seqlen_k, config.block_n), batch * heads)](
        descriptor(q, config.block_m), descriptor(k, config.block_n), descriptor(v, config.block_n),
        descriptor(grad_out, config.block_m), descriptor(dk, config.block_n), descriptor(dv, config.block_n),
        lse2, delta, heads, seqlen_q, seqlen_k, scale * LOG2E, scale, **meta)
    attention_bwd_dq_kernel[(triton_cdiv(seqlen_q, config.block_m), batch * heads)](
        descriptor(q, config.block_m), descriptor(k, config.block_n), descriptor(v, config.block_n),
        descriptor(grad_out, config.block_m), descriptor(dq, config.block_m),
        lse2, delta, heads, seqlen_q, seqlen_k, scale * LOG2E, scale, **meta)
    return dq, dk, dv


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def on_device(t: torch.Tensor):
    """The CUDA device context of t (Triton launches on the current device); a no-op on CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


class TritonAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves the prepared q, k, v, O and the LSE for the backward.

    ``forward_fn(qp, kp, vp, causal, scale) -> (out, lse)`` runs on prepared operands
    (:func:`triton_forward` with a tile config, or the Hopper forward); the backward is
    always :func:`triton_backward`.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, forward_fn, bwd_config):
        head_dim = q.shape[-1]
        qp, kp, vp = kernel_operand(q), kernel_operand(k), kernel_operand(v)
        with on_device(q):
            out, lse = forward_fn(qp, kp, vp, causal, scale)
        ctx.save_for_backward(qp, kp, vp, out, lse)
        ctx.args = (causal, scale, bwd_config, head_dim)
        ctx.mark_non_differentiable(lse)
        return out[..., :head_dim], lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        qp, kp, vp, out, lse = ctx.saved_tensors
        causal, scale, bwd_config, head_dim = ctx.args
        grad_out = kernel_operand(grad_out.to(qp.dtype))
        with on_device(qp):
            dq, dk, dv = triton_backward(qp, kp, vp, out, lse, grad_out, causal, scale, bwd_config)
        return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim], None, None, None, None


def triton_attention(q, k, v, causal: bool, scale: float | None,
                     fwd_config: TileConfig | None = None, bwd_config: TileConfig | None = None):
    """Differentiable Triton attention on (B, H, N, d) float16/bfloat16 tensors: returns (out, lse)."""
    load_triton()
    check_triton_inputs(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    forward_fn = functools.partial(triton_forward, config=fwd_config)
    return TritonAttentionFunction.apply(q, k, v, causal, scale, forward_fn, bwd_config)
