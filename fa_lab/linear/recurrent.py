"""The recurrent form: the definition of each variant, one token at a time.

Per (batch, head) the state ``S`` is a (d_k, d_v) matrix (fla's layout of ``h``); q_t, k_t are rows of
d_k and v_t a row of d_v. With ``alpha_t = exp(g_t)``:

- linear attention:       S_t = S_{t-1} + k_t^T v_t
- gated (scalar g_t):     S_t = alpha_t S_{t-1} + k_t^T v_t               (simple GLA, RetNet's decay)
- gated (per-dim g_t):    S_t = diag(alpha_t) S_{t-1} + k_t^T v_t         (GLA: one decay per key dim)
- delta rule:             S_t = (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t
                              = S_{t-1} + k_t^T beta_t (v_t - k_t S_{t-1})  (correct what S predicts for k_t)
- gated delta rule:       S_t = alpha_t (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t

and every variant reads ``o_t = scale * q_t S_t``. (Papers that keep S as (d_v, d_k) write the delta
rule ``S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``: the same update, transposed.)

These loops are the float64 references of everything else, and the decode step itself: one token
of a generation updates the state once. Inputs are already checked and in the compute dtype:
q, k (B, H, N, d_k), v (B, H, N, d_v), g None, (B, H, N) or (B, H, N, d_k), beta (B, H, N),
initial_state None or (B, H, d_k, d_v). Each returns (o (B, H, N, d_v), final state (B, H, d_k, d_v)).
"""
from __future__ import annotations

import torch


def _start(q, v, initial_state):
    batch, heads, _, head_dim_k = q.shape
    if initial_state is not None:
        return initial_state
    return q.new_zeros(batch, heads, head_dim_k, v.shape[-1])


def _decay(state, g, t):
    """alpha_t S: g (B, H, N) scales the whole state, g (B, H, N, d_k) each key row of it."""
    if g is None:
        return state
    if g.ndim == 3:
        return state * torch.exp(g[:, :, t])[..., None, None]
    return state * torch.exp(g[:, :, t])[..., :, None]


def recurrent_gla(q, k, v, g, scale: float, initial_state):
    """Linear attention, simple GLA or GLA (by g's shape), token by token."""
    state = _start(q, v, initial_state)
    outs = []
    for t in range(q.shape[2]):
        state = _decay(state, g, t) + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    return torch.stack(outs, dim=2), state


def recurrent_delta_rule(q, k, v, beta, g, scale: float, initial_state):
    """The delta rule (g None) or the gated delta rule (g (B, H, N)), token by token."""
    state = _start(q, v, initial_state)
    outs = []
    for t in range(q.shape[2]):
        state = _decay(state, g, t)
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, :, t], state)
        correction = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k[:, :, t, :, None] * correction[:, :, None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    return torch.stack(outs, dim=2), state
