"""The chunkwise form of (gated) linear attention: fla's ``chunk_fwd_h`` and ``chunk_fwd_o`` in PyTorch.

Cut the sequence into chunks of C tokens. The state at a chunk's start, ``h_c``, carries everything
before it, so the output of the chunk splits into two terms:

    o_i = scale * ( q_i diag(exp(G_i)) h_c   +   sum_{j in chunk, j <= i} (q_i k_j^T) D_ij v_j )
                    inter-chunk: one matmul       intra-chunk: the parallel form over C tokens

with G cumulated inside the chunk (:func:`chunk_local_cumsum`), and the next start state is

    h_{c+1} = diag(exp(G_last)) h_c + sum_{j in chunk} (k_j o exp(G_last - G_j))^T v_j.

Two passes follow: the ``h`` pass walks the chunks in order and stores every start state (the only
sequential part: N / C steps of a (d_k, C) x (C, d_v) matmul), and the ``o`` pass computes all chunks'
outputs at once, in parallel over chunks. Work is O(N C d) instead of the parallel form's O(N^2 d),
and the matmuls are C-sized, where the recurrent form's are rank one. The Triton kernels of
:mod:`fa_lab.kernels.portable.linear_chunk` are the same two passes.

A ragged last chunk is padded with zeros (:func:`.decay.to_chunks`): any chunk_size >= 1 works, and
the output and the final state are those of the unpadded sequence.
"""
from __future__ import annotations

import torch

from .decay import advance_state, causal_scores, from_chunks, read_state, to_chunks


def chunk_local_cumsum(g, chunk_size: int):
    """g: (B, H, N) or (B, H, N, d_k) log-decays -> (B, H, chunks, C[, d_k]), cumulated within each chunk."""
    return to_chunks(g, chunk_size).cumsum(dim=3)


def chunk_fwd_h(k, v, cum, gate: str, initial_state):
    """The h pass. k: (B, H, chunks, C, d_k), v: (B, H, chunks, C, d_v), cum: None or chunked as
    :func:`chunk_local_cumsum` returns it; initial_state None or (B, H, d_k, d_v).

    Returns (h (B, H, chunks, d_k, d_v): each chunk's start state, final state (B, H, d_k, d_v)).
    """
    batch, heads, chunks = k.shape[:3]
    state = initial_state if initial_state is not None else k.new_zeros(batch, heads, k.shape[-1], v.shape[-1])
    starts = []
    for c in range(chunks):
        starts.append(state)
        state = advance_state(state, k[:, :, c], v[:, :, c], None if cum is None else cum[:, :, c], gate)
    return torch.stack(starts, dim=2), state


def chunk_fwd_o(q, k, v, cum, gate: str, h, scale: float):
    """The o pass, all chunks at once: q, k, v, cum chunked as in :func:`chunk_fwd_h`, h its start
    states. Returns o (B, H, chunks, C, d_v)."""
    return scale * (read_state(q, h, cum, gate) + causal_scores(q, k, cum, gate) @ v)


def chunk_gla(q, k, v, g, gate: str, scale: float, initial_state, chunk_size: int):
    """Linear attention, simple GLA or GLA, chunkwise. Shapes as in :mod:`.recurrent`; returns
    (o (B, H, N, d_v), final state (B, H, d_k, d_v))."""
    seqlen = q.shape[2]
    q, k, v = (to_chunks(t, chunk_size) for t in (q, k, v))
    cum = None if g is None else chunk_local_cumsum(g, chunk_size)
    h, final_state = chunk_fwd_h(k, v, cum, gate, initial_state)
    return from_chunks(chunk_fwd_o(q, k, v, cum, gate, h, scale), seqlen), final_state
