"""fused_recurrent: the token-by-token recurrence as one Triton kernel, the state held in registers.

This is decode: a generated token updates each head's (d_k, d_v) state once and reads it once, and a
whole prompt is the same loop run N times. One program owns the full d_k rows and a BLOCK_V-wide slice
of one head's state and walks the tokens; the state never leaves registers between steps (fla's
``fused_recurrent``). Grid: ``(cdiv(d_v, BLOCK_V), batch * heads)``. Each step, with the recurrences of
:mod:`fa_lab.linear.recurrent`:

- decay: ``S <- alpha_t S`` (a scalar gate) or ``S <- diag(alpha_t) S`` (GLA), ``alpha_t = exp2(g_t * RCP_LN2)``;
- delta rule only: ``v_t <- beta_t (v_t - k_t S)`` (a column sum over d_k, which is why a program holds
  all of d_k: a value column's correction needs the whole key dimension);
- ``S <- S + k_t^T v_t`` and ``o_t = scale * q_t S``.

Splitting d_v across programs needs no communication: each state column evolves on its own.
RCP_LN2 = log2(e) (:data:`fa_lab.kernels.common.LOG2E`) is folded into the one gate value read per
step, so each decay is one ``exp2``; there is no cumulated gate to fold it into here. The state is
float32 throughout, whatever the inputs' dtype.

The backward recomputes in PyTorch (:class:`.linear_chunk.RecomputedBackward`), through the chunkwise
form of the same variant, which has the recurrence's gradients.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import common
from .linear_chunk import state_tile

RCP_LN2 = tl.constexpr(common.LOG2E)


@triton.jit
def fused_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, o_ptr, ht_ptr, seqlen, d_k, d_v, scale,
                           BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                           HAS_H0: tl.constexpr):
    """One (batch, head)'s state columns ``pid_v * BLOCK_V ...`` through all tokens.

    q_ptr, k_ptr (B*H, N, d_k), v_ptr and o_ptr (B*H, N, d_v), contiguous; g_ptr float32 (B*H, N)
    (GATE 1) or (B*H, N, d_k) (GATE 2), natural-log decays; beta_ptr float32 (B*H, N) (read if DELTA);
    h0_ptr (B*H, d_k, d_v) float32 (read if HAS_H0); ht_ptr (B*H, d_k, d_v) float32 output.
    """
    pid_v, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    cols_k, cols_v, k_ok, v_ok, tile, tile_ok, state = state_tile(h0_ptr, bh, 0, pid_v, d_k, d_v, BLOCK_K,
                                                                  BLOCK_V, HAS_H0)
    for t in range(seqlen):
        token = bh * seqlen + t
        q = tl.load(q_ptr + token * d_k + cols_k, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + token * d_k + cols_k, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + token * d_v + cols_v, mask=v_ok, other=0.0).to(tl.float32)
        if GATE == 1:
            state = state * tl.math.exp2(tl.load(g_ptr + token) * RCP_LN2)
        elif GATE == 2:
            g = tl.load(g_ptr + token * d_k + cols_k, mask=k_ok, other=0.0)
            state = state * tl.math.exp2(g * RCP_LN2)[:, None]
        if DELTA:
            v = tl.load(beta_ptr + token) * (v - tl.sum(k[:, None] * state, axis=0))
        state += k[:, None] * v[None, :]
        o = tl.sum(q[:, None] * state, axis=0) * scale
        tl.store(o_ptr + token * d_v + cols_v, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    tl.store(ht_ptr + bh * d_k * d_v + tile, state, mask=tile_ok)


def recurrent_forward(q, k, v, g, beta, initial_state, scale: float):
    """Launch the kernel (no autograd); shapes as :func:`fa_lab.linear.recurrent.recurrent_gla` takes them.
    Returns (o (B, H, N, d_v) in q.dtype, final state (B, H, d_k, d_v) float32)."""
    from ...linear.inputs import gate_kind
    from ..common import cdiv, on_device
    from .linear_chunk import GATE_CODES

    batch, heads, seqlen, d_k = q.shape
    d_v = v.shape[-1]
    gate = GATE_CODES[gate_kind(g)]
    delta = beta is not None
    q, k, v = (t.contiguous() for t in (q, k, v))
    g = g.float().contiguous() if g is not None else q
    beta = beta.float().contiguous() if beta is not None else q
    h0 = initial_state.float().contiguous() if initial_state is not None else q
    o = torch.empty(batch, heads, seqlen, d_v, dtype=q.dtype, device=q.device)
    final_state = torch.empty(batch, heads, d_k, d_v, dtype=torch.float32, device=q.device)
    block_v = min(64, triton.next_power_of_2(d_v))
    with on_device(q):
        fused_recurrent_kernel[(cdiv(d_v, block_v), batch * heads)](
            q, k, v, g, beta, h0, o, final_state, seqlen, d_k, d_v, scale, BLOCK_K=triton.next_power_of_2(d_k),
            BLOCK_V=block_v, GATE=gate, DELTA=delta, HAS_H0=initial_state is not None)
    return o, final_state


def triton_fused_recurrent(q, k, v, g, beta, initial_state, scale: float):
    """Differentiable fused recurrence on checked inputs: linear attention, simple GLA or GLA (beta None, by
    g's shape), or the (gated) delta rule (beta (B, H, N)). Returns (o in q.dtype, final state float32).
    The backward is autograd through the PyTorch chunkwise form in float32 (module docstring)."""
    from ...linear.chunk import chunk_gla
    from ...linear.delta import chunk_delta_rule
    from ...linear.inputs import gate_kind
    from .linear_chunk import RecomputedBackward, check_kernel_inputs

    check_kernel_inputs(q, v, None)
    gate = gate_kind(g)
    kernel = lambda q, k, v, g, beta, h0: recurrent_forward(q, k, v, g, beta, h0, scale)
    if beta is None:
        reference = lambda q, k, v, g, beta, h0: chunk_gla(q, k, v, g, gate, scale, h0, 64)
    else:
        reference = lambda q, k, v, g, beta, h0: chunk_delta_rule(q, k, v, beta, g, scale, h0, 64)
    return RecomputedBackward.apply(kernel, reference, q, k, v, g, beta, initial_state)
