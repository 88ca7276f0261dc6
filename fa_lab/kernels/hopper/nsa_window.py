"""NSA's window branch with the gated sum of NSA's three branches in its epilogue (chapter 07).

NSA's output is gates[..., 0] cmp + gates[..., 1] sel + gates[..., 2] win. As a pass of its own
(:mod:`fa_lab.kernels.portable.nsa_gate`) the sum reads the three branches and writes the output: at 64K tokens,
64 heads and d = 128, 4 GB of traffic. The window branch runs last, on the Gluon forward, whose time goes to the
tensor cores and the MUFU rather than to memory. So its epilogue, holding the window's O, also loads the other two
branches' rows and the gates (issued while the last P V product runs) and stores the sum beside O, through the same
shared-memory buffer (the kernel's ``GATED``, :class:`.fa3_state.GatedSum`). The sum is added in the gate pass's
order, in float32, from the window's O as stored.

The backward is the gate pass's backward (:func:`.portable.nsa_gate.gate_mix_backward`) followed by the window's
(:func:`.attention.hopper_backward`). Where the Gluon forward does not run (not sm_90, the interpreter, other head
dims), :func:`window_and_gated_sum` runs the window through ``fa_lab.attention`` and the sum as its own pass.
"""
from __future__ import annotations

import torch

from ..common import on_device
from ..portable.attention import ScoreOptions
from ..portable.nsa_gate import gate_mix_backward, triton_nsa_gate_mix
from .attention import HopperOptions, gluon_forward, hopper_backward, uses_gluon

GATED_WINDOW = True  # NSA's gated sum in the window branch's epilogue where the Gluon forward runs


class WindowGatedSum(torch.autograd.Function):
    """(NSA's output, the window branch's output) from q (B, H, N, d), k, v (B, H_kv, N, d), the gates
    (B, H, N, 3) (any float dtype) and the other two branches (B, H, N, d), all contiguous, on the Gluon forward
    with GATED."""

    @staticmethod
    def forward(ctx, q, k, v, gates, out_cmp, out_sel, window: int, scale: float):
        summed = torch.empty_like(q)
        options = ScoreOptions((window - 1, 0), 0.0, None)
        with on_device(q):
            out_win, lse = gluon_forward(q, k, v, True, scale, HopperOptions(), window=options.window,
                                         gated_sum=(gates, out_cmp, out_sel, summed))
        ctx.save_for_backward(q, k, v, gates, out_cmp, out_sel, out_win, lse)
        ctx.args = (scale, options)
        return summed, out_win

    @staticmethod
    def backward(ctx, grad_summed, grad_win):
        q, k, v, gates, out_cmp, out_sel, out_win, lse = ctx.saved_tensors
        scale, options = ctx.args
        with on_device(q):
            grad_gates, grad_cmp, grad_sel, grad_own = gate_mix_backward(grad_summed, gates,
                                                                         (out_cmp, out_sel, out_win))
            if grad_win is not None:  # the caller also used the window branch on its own
                grad_own = grad_own + grad_win
            dq, dk, dv = hopper_backward(q, k, v, out_win, lse, grad_own.contiguous(), True, scale, None, options)
        return dq, dk, dv, grad_gates, grad_cmp, grad_sel, None, None


def window_and_gated_sum(q, k, v, gates, out_cmp, out_sel, window: int, scale: float):
    """(NSA's output, its window branch's output): the window branch, causal attention over the last ``window``
    keys (the query's own included), of q (B, H, N, d) over k, v (B, H_kv, N, d), and the gated sum
    gates[..., 0] out_cmp + gates[..., 1] out_sel + gates[..., 2] window, in q's 16-bit dtype. Differentiable in
    every tensor. On sm_90 (GATED_WINDOW) the window's Gluon forward writes the sum in its epilogue; elsewhere
    the window runs through ``fa_lab.attention(impl="triton_hopper")`` and the sum as a pass of its own."""
    operands = (q, k, v, gates, out_cmp, out_sel)
    if (GATED_WINDOW and uses_gluon(q, HopperOptions()) and q.shape[-1] in (64, 128)
            and len({t.dtype for t in (q, k, v, out_cmp, out_sel)}) == 1 and gates.is_floating_point()
            and all(t.is_contiguous() for t in operands)):
        return WindowGatedSum.apply(*operands, window, scale)
    from ... import attention
    out_win = attention(q, k, v, causal=True, scale=scale, window=(window - 1, 0), impl="triton_hopper")
    return triton_nsa_gate_mix(gates, out_cmp, out_sel, out_win), out_win
