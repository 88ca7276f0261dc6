"""The gate arithmetic the parallel and chunkwise forms share: cumulated log-decays and masked decay matrices.

A gate is a log-decay ``g_t <= 0`` (decay ``alpha_t = exp(g_t)``). Over a span of tokens its inclusive
cumulative sum ``G_t = g_1 + ... + g_t`` turns every product of decays into a difference: the decay
from token j to token i >= j is ``alpha_{j+1} ... alpha_i = exp(G_i - G_j)``, at most 1. Everything
here keeps to such differences with ``i >= j`` and never forms ``exp(-G_j)`` alone, which overflows
once the decays of a span multiply below ~1e-38 (float32); the mask is applied to the exponent
(-inf above the diagonal), so no inf * 0 ever makes a NaN, in the forward or the backward.

The PyTorch forms use ``exp`` on natural-log gates, as the definition reads; the Triton kernels fold
log2(e) into the cumulated gate once and use ``exp2`` (:mod:`fa_lab.kernels.portable.linear_chunk`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..block_info import cdiv


def to_chunks(t: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """(B, H, N, ...) -> (B, H, chunks, chunk_size, ...), the ragged last chunk padded with zeros.

    Zeros are neutral for every operand: a padded key and value add nothing to the state, a padded
    log-decay 0 decays nothing, a padded beta 0 leaves the delta rule's state unchanged.
    """
    seqlen = t.shape[2]
    chunks = cdiv(seqlen, chunk_size)
    pad = chunks * chunk_size - seqlen
    if pad:
        widths = [0, 0] * (t.ndim - 3) + [0, pad]
        t = F.pad(t, widths)
    return t.reshape(*t.shape[:2], chunks, chunk_size, *t.shape[3:])


def from_chunks(t: torch.Tensor, seqlen: int) -> torch.Tensor:
    """(B, H, chunks, C, ...) -> (B, H, N, ...), the padding dropped."""
    return t.flatten(2, 3)[:, :, :seqlen]


def causal_decay(cum: torch.Tensor, span_dim: int = -1) -> torch.Tensor:
    """exp(G_i - G_j) for i >= j and 0 above the diagonal.

    cum: (..., n) cumulated log-decays -> (..., n, n); with ``span_dim=-2``, cum (..., n, d_k) ->
    (..., n, n, d_k) (one matrix per key dimension, GLA's gate).
    """
    if span_dim == -1:
        diff = cum[..., :, None] - cum[..., None, :]
        n = cum.shape[-1]
        keep = torch.ones(n, n, dtype=torch.bool, device=cum.device).tril()
    else:
        diff = cum[..., :, None, :] - cum[..., None, :, :]
        n = cum.shape[-2]
        keep = torch.ones(n, n, dtype=torch.bool, device=cum.device).tril()[..., None]
    return torch.exp(diff.masked_fill(~keep, float("-inf")))


def causal_scores(q, k, cum, gate: str) -> torch.Tensor:
    """The masked, decayed score matrix (q k^T o D) over one span of n tokens, i >= j kept.

    q, k: (..., n, d_k); cum: None (no gate), (..., n) (scalar gate: D_ij = exp(G_i - G_j)) or
    (..., n, d_k) (per-dim gate: sum_c q_ic k_jc exp(G_ic - G_jc), which no single matrix D
    expresses; it materializes (..., n, n, d_k)). Returns (..., n, n).
    """
    if gate == "per_dim":
        decay = causal_decay(cum, span_dim=-2)
        return torch.einsum("...ic,...jc,...ijc->...ij", q, k, decay)
    scores = q @ k.transpose(-2, -1)
    if gate == "scalar":
        return scores * causal_decay(cum)
    n = q.shape[-2]
    return scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), 0.0)


def read_state(q, state, cum, gate: str):
    """What token i reads from the state a span starts with: q_i (diag(exp(G_i)) S_0).

    q: (..., n, d_k), state: (..., d_k, d_v), cum as in :func:`causal_scores`. Returns (..., n, d_v).
    A scalar gate scales the product, a per-dim gate the query's columns.
    """
    if gate == "none":
        return q @ state
    if gate == "scalar":
        return (q @ state) * torch.exp(cum)[..., None]
    return (q * torch.exp(cum)) @ state


def advance_state(state, k, v, cum, gate: str):
    """The state at the end of a span: diag(exp(G_last)) S_0 + sum_i (k_i o exp(G_last - G_i))^T v_i.

    state: (..., d_k, d_v), k: (..., n, d_k), v: (..., n, d_v) (the delta rule passes its corrected
    values), cum as in :func:`causal_scores`. Returns (..., d_k, d_v).
    """
    if gate == "none":
        return state + k.transpose(-2, -1) @ v
    if gate == "scalar":
        last = cum[..., -1:]
        return state * torch.exp(last)[..., None] + (k * torch.exp(last - cum)[..., None]).transpose(-2, -1) @ v
    last = cum[..., -1:, :]
    return state * torch.exp(last).transpose(-2, -1) + (k * torch.exp(last - cum)).transpose(-2, -1) @ v
