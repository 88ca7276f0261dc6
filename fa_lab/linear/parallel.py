"""The parallel form: the whole sequence as one masked matrix product, as softmax attention is written.

Unrolling the recurrence of :mod:`.recurrent` over a sequence that starts from state S_0 gives, with
G the cumulated log-decay of :mod:`.decay`,

    o_i = scale * ( sum_{j <= i} (q_i k_j^T) D_ij v_j  +  q_i diag(exp(G_i)) S_0 ),   D_ij = exp(G_i - G_j),

that is ``O = scale * ((Q K^T o D) V + ...)``: softmax attention with the softmax replaced by the
causal decay mask D (all ones without a gate, so plain linear attention is ``tril(Q K^T) V``). It costs
O(N^2) like softmax attention, and O(N^2 d_k) memory for GLA's per-dim gate, whose D is one matrix per
key dimension: references only.

The delta rule has a parallel form too: its corrected values ``v_new_t = beta_t (v_t - k_t S_{t-1})``
solve one unit lower-triangular system over the sequence (the row t of which reads
``v_new_t + beta_t sum_{j<t} (k_t k_j^T) D_tj v_new_j = beta_t (v_t - k_t diag(exp(G_t)) S_0)``),
and then the output is the parallel form above with ``v_new`` in place of ``v``. Here the system is
solved by ``torch.linalg.solve_triangular``, independently of the chunkwise form's :func:`.tril.solve_tril`.

Inputs are checked and in the compute dtype, shapes as in :mod:`.recurrent`; each function returns
(o (B, H, N, d_v), final state (B, H, d_k, d_v)).
"""
from __future__ import annotations

import torch

from .decay import advance_state, causal_scores, read_state


def _start(q, v, initial_state):
    if initial_state is not None:
        return initial_state
    return q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])


def parallel_gla(q, k, v, g, gate: str, scale: float, initial_state):
    """Linear attention, simple GLA or GLA (``gate``: "none", "scalar", "per_dim") as (Q K^T o D) V."""
    cum = None if g is None else torch.cumsum(g, dim=2)
    state = _start(q, v, initial_state)
    o = causal_scores(q, k, cum, gate) @ v + read_state(q, state, cum, gate)
    return scale * o, advance_state(state, k, v, cum, gate)


def parallel_delta_rule(q, k, v, beta, g, scale: float, initial_state):
    """The (gated, if g is given) delta rule through one triangular solve over the whole sequence."""
    gate = "none" if g is None else "scalar"
    cum = None if g is None else torch.cumsum(g, dim=2)
    state = _start(q, v, initial_state)
    seqlen = q.shape[2]
    eye = torch.eye(seqlen, dtype=q.dtype, device=q.device)
    system = eye + torch.tril(beta[..., None] * causal_scores(k, k, cum, gate), diagonal=-1)
    rhs = beta[..., None] * (v - read_state(k, state, cum, gate))
    v_new = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = causal_scores(q, k, cum, gate) @ v_new + read_state(q, state, cum, gate)
    return scale * o, advance_state(state, k, v_new, cum, gate)
