"""The chunkwise (gated) delta rule through the WY representation (fla's ``chunk_gated_delta_rule_fwd``).

Inside a chunk that starts from state h, each token's correction ``v_new_t = beta_t (v_t - k_t S_{t-1})``
depends on all the corrections before it in the chunk: unrolled (see :mod:`.parallel`),

    v_new_t + beta_t sum_{j<t} (k_t k_j^T) D_tj v_new_j  =  beta_t v_t - beta_t exp(G_t) k_t h,

one unit lower-triangular system ``A V_new = diag(beta) V - diag(beta exp(G)) K h`` per chunk, with
``A = I + strictly_lower(diag(beta) (K K^T o D))``. Its inverse T (:func:`.tril.solve_tril`) does not
depend on h, so the chunk's products of Householder-like factors ``prod (I - beta_t k_t^T k_t)``
collapse into two matrices computed for all chunks at once, the WY representation:

    w = T (beta exp(G) o K)   (C, d_k),        u = T (beta o V)   (C, d_v),      v_new = u - w h.

What is left is gated linear attention with ``v_new`` in place of ``v``: the h pass walks the chunks
(``v_new = u - w h_c``, then ``h_{c+1}`` from :func:`.decay.advance_state`), and the o pass is
:func:`.chunk.chunk_fwd_o`'s. Only the h pass is sequential, and it is a matmul per chunk.

Inputs are checked and in the compute dtype, shapes as in :mod:`.recurrent`; ragged chunks are padded
(beta = 0 and k = 0 there: the padding neither changes the state nor reads it).
"""
from __future__ import annotations

import torch

from .chunk import chunk_fwd_o, chunk_local_cumsum
from .decay import advance_state, causal_scores, from_chunks, to_chunks
from .tril import solve_tril


def prepare_wy_repr(k, v, beta, cum, gate: str):
    """w (B, H, chunks, C, d_k) and u (B, H, chunks, C, d_v) of every chunk; k, v, beta (B, H, chunks, C)
    and cum chunked (:func:`.chunk.chunk_local_cumsum`), gate "none" or "scalar"."""
    kkt = torch.tril(beta[..., None] * causal_scores(k, k, cum, gate), diagonal=-1)  # A - I
    t = solve_tril(kkt)
    beta_k = beta[..., None] * k if gate == "none" else (beta * torch.exp(cum))[..., None] * k
    return t @ beta_k, t @ (beta[..., None] * v)


def chunk_delta_fwd_h(k, w, u, cum, gate: str, initial_state):
    """The delta rule's h pass: returns (h (B, H, chunks, d_k, d_v) start states, v_new (B, H, chunks,
    C, d_v) the corrected values, final state (B, H, d_k, d_v))."""
    batch, heads, chunks = k.shape[:3]
    state = initial_state if initial_state is not None else k.new_zeros(batch, heads, k.shape[-1], u.shape[-1])
    starts, corrected = [], []
    for c in range(chunks):
        starts.append(state)
        v_new = u[:, :, c] - w[:, :, c] @ state
        corrected.append(v_new)
        state = advance_state(state, k[:, :, c], v_new, None if cum is None else cum[:, :, c], gate)
    return torch.stack(starts, dim=2), torch.stack(corrected, dim=2), state


def chunk_delta_rule(q, k, v, beta, g, scale: float, initial_state, chunk_size: int):
    """The delta rule (g None) or the gated delta rule (g (B, H, N)), chunkwise. Returns (o (B, H, N, d_v),
    final state (B, H, d_k, d_v))."""
    seqlen = q.shape[2]
    gate = "none" if g is None else "scalar"
    q, k, v, beta = (to_chunks(t, chunk_size) for t in (q, k, v, beta))
    cum = None if g is None else chunk_local_cumsum(g, chunk_size)
    w, u = prepare_wy_repr(k, v, beta, cum, gate)
    h, v_new, final_state = chunk_delta_fwd_h(k, w, u, cum, gate, initial_state)
    return from_chunks(chunk_fwd_o(q, k, v_new, cum, gate, h, scale), seqlen), final_state
