"""impl="triton": the launchers of the plain-Triton kernels and their autograd.Function.

The kernels (:mod:`.forward`, :mod:`.backward`, :mod:`.pipelined_forward`) read and write tiles
through tensor descriptors over (batch, heads, seqlen, head_dim) tensors. The launchers take
operands prepared by :func:`fa_lab.kernels.common.kernel_operand` (head_dim padded to a multiple
of 8, unit stride in head_dim, 16-byte aligned strides), pick the tile configuration and launch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...block_info import BlockInfo
from .. import interpreting, load_triton
from ..common import LOG2E, cdiv, check_triton_inputs, descriptor, head_dim_bucket, kernel_operand, on_device
from .configs import TileConfig, backward_config, forward_config


@dataclass(frozen=True)
class ScoreOptions:
    """Chapter 05's options as the kernels take them: window (left, right), softcap (0: off),
    alibi_slopes ((B, H) float32 or None). Grouped K/V heads are read off the tensors' shapes."""

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None

    def kernel_args(self, q, k, causal: bool, scale: float) -> tuple[tuple, dict]:
        """(runtime arguments, constexprs) after qk_scale in every kernel: group, left, right,
        softcap_scale, softcap_log2, slopes_ptr; CAUSAL, WINDOW, SOFTCAP, ALIBI, GQA. A window that
        bounds more than causal does takes the kernels' windowed path, with causal folded in."""
        group = q.shape[1] // k.shape[1]
        info = BlockInfo(q.shape[2], k.shape[2], causal, self.window)
        left, right = info.window_bounds() if info.banded else (0, 0)
        softcap_scale = scale / self.softcap if self.softcap else 0.0
        slopes = self.alibi_slopes
        slopes = slopes.float().contiguous() if slopes is not None else torch.empty(1, device=q.device)
        constexprs = dict(CAUSAL=causal and not info.banded, WINDOW=info.banded, SOFTCAP=bool(self.softcap),
                          ALIBI=self.alibi_slopes is not None, GQA=group > 1)
        return (group, left, right, softcap_scale, self.softcap * LOG2E, slopes), constexprs


NO_OPTIONS = ScoreOptions()


def triton_forward(q, k, v, causal: bool, scale: float, config: TileConfig | None = None,
                   options: ScoreOptions = NO_OPTIONS):
    """Forward on prepared operands q: (B, H, Nq, d8), k, v: (B, Hkv, Nk, d8).

    Returns (out: (B, H, Nq, d8) in q.dtype, lse: (B, H, Nq) float32).
    """
    from .forward import attention_fwd_kernel

    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    config = config or forward_config(head_dim, causal, interpreting())
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    grid = (cdiv(seqlen_q, config.block_m), batch * heads)
    option_args, constexprs = options.kernel_args(q, k, causal, scale)
    attention_fwd_kernel[grid](
        descriptor(q, config.block_m), descriptor(k, config.block_n), descriptor(v, config.block_n),
        descriptor(out, config.block_m), lse, heads, seqlen_q, seqlen_k, scale * LOG2E, *option_args,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim_bucket(head_dim),
        REVERSE_GRID=causal, num_warps=config.num_warps, num_stages=config.num_stages, **constexprs,
    )
    return out, lse


def pipelined_forward(q, k, v, out, lse, descales, causal: bool, scale: float, config: TileConfig,
                      pipeline: bool = False, warp_specialize: bool = False, fp8: bool = False):
    """Launch :mod:`.pipelined_forward` on prepared operands, writing out and lse (as :func:`triton_forward`).

    v is V (B, H, Nk, d8) or, in FP8, V^T (B, H, d8, Nk); descales: the (B, H, tiles) float32 descales
    of q, k and v in FP8 (any three pointers otherwise: they are not read).
    """
    from .pipelined_forward import attention_fwd_pipelined_kernel

    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    head_dim_pad = head_dim_bucket(head_dim)
    desc_v = descriptor(v, head_dim_pad, config.block_n) if fp8 else descriptor(v, config.block_n)
    grid = (cdiv(seqlen_q, config.block_m), batch * heads)
    attention_fwd_pipelined_kernel[grid](
        descriptor(q, config.block_m), descriptor(k, config.block_n), desc_v, descriptor(out, config.block_m),
        lse, *descales, heads, seqlen_q, seqlen_k, scale * LOG2E,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim_pad, CAUSAL=causal,
        PIPELINE=pipeline, WARP_SPECIALIZE=warp_specialize, FP8=fp8,
        num_warps=config.num_warps, num_stages=config.num_stages)


def triton_backward(q, k, v, out, lse, grad_out, causal: bool, scale: float, config: TileConfig | None = None,
                    options: ScoreOptions = NO_OPTIONS):
    """Backward on prepared operands (as :func:`triton_forward`); grad_out like out.

    Returns (dq, dk, dv) in q.dtype, shaped like q, k, v (dk, dv summed over each group of query heads).
    """
    from .backward import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel, attention_bwd_preprocess_kernel

    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    config = config or backward_config(head_dim, interpreting())
    grad_out = grad_out.contiguous()
    rows = batch * heads * seqlen_q
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    pre_block = 64
    attention_bwd_preprocess_kernel[(cdiv(rows, pre_block),)](
        out, grad_out, lse, delta, lse2, rows, head_dim, LOG2E, HEAD_DIM=head_dim_bucket(head_dim), BLOCK=pre_block)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    option_args, constexprs = options.kernel_args(q, k, causal, scale)
    meta = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim_bucket(head_dim),
                num_warps=config.num_warps, num_stages=config.num_stages, **constexprs)
    attention_bwd_dkdv_kernel[(cdiv(seqlen_k, config.block_n), batch * k.shape[1])](
        descriptor(q, config.block_m), descriptor(k, config.block_n), descriptor(v, config.block_n),
        descriptor(grad_out, config.block_m), descriptor(dk, config.block_n), descriptor(dv, config.block_n),
        lse2, delta, heads, seqlen_q, seqlen_k, scale * LOG2E, scale, *option_args, **meta)
    attention_bwd_dq_kernel[(cdiv(seqlen_q, config.block_m), batch * heads)](
        descriptor(q, config.block_m), descriptor(k, config.block_n), descriptor(v, config.block_n),
        descriptor(grad_out, config.block_m), descriptor(dq, config.block_m),
        lse2, delta, heads, seqlen_q, seqlen_k, scale * LOG2E, scale, *option_args, **meta)
    return dq, dk, dv


class TritonAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves the prepared q, k, v, O and the LSE for the backward.

    ``forward_fn(qp, kp, vp, causal, scale) -> (out, lse)`` runs on prepared operands
    (:func:`triton_forward` with a tile config, or the Hopper forward); the backward is
    always :func:`triton_backward`.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, forward_fn, bwd_config, options=NO_OPTIONS):
        head_dim = q.shape[-1]
        qp, kp, vp = kernel_operand(q), kernel_operand(k), kernel_operand(v)
        with on_device(q):
            out, lse = forward_fn(qp, kp, vp, causal, scale)
        ctx.save_for_backward(qp, kp, vp, out, lse)
        ctx.args = (causal, scale, bwd_config, head_dim, options)
        ctx.mark_non_differentiable(lse)
        return out[..., :head_dim], lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        qp, kp, vp, out, lse = ctx.saved_tensors
        causal, scale, bwd_config, head_dim, options = ctx.args
        grad_out = kernel_operand(grad_out.to(qp.dtype))
        with on_device(qp):
            dq, dk, dv = triton_backward(qp, kp, vp, out, lse, grad_out, causal, scale, bwd_config, options)
        return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim], None, None, None, None, None


def triton_attention(q, k, v, causal: bool, scale: float | None,
                     fwd_config: TileConfig | None = None, bwd_config: TileConfig | None = None,
                     window=(-1, -1), softcap: float = 0.0, alibi_slopes=None):
    """Differentiable Triton attention on float16/bfloat16 q: (B, H, Nq, d), k, v: (B, Hkv, Nk, d):
    returns (out, lse). window, softcap, alibi_slopes ((B, H) float32): as :func:`fa_lab.attention`."""
    load_triton()
    check_triton_inputs(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    options = ScoreOptions(tuple(window), float(softcap), alibi_slopes)
    forward_fn = functools.partial(triton_forward, config=fwd_config, options=options)
    return TritonAttentionFunction.apply(q, k, v, causal, scale, forward_fn, bwd_config, options)
