"""The chunkwise (gated) delta rule's state pass as a Triton kernel; its o pass is gated linear attention's.

:mod:`fa_lab.linear.delta` turns each chunk into gated linear attention over corrected values
``v_new = u - w h_c``, with w and u from the WY representation. The launcher here computes w and u in
PyTorch (:func:`fa_lab.linear.delta.prepare_wy_repr`: the masked ``K K^T``, :func:`fa_lab.linear.solve_tril`
and two matmuls per chunk, all chunks at once; fla writes these as kernels too), rounds them to the
inputs' dtype as fla stores them, and launches:

- :func:`chunk_delta_fwd_h_kernel`, grid ``(cdiv(d_v, BLOCK_V), batch * heads)``: one program holds all
  d_k rows of a BLOCK_V-wide slice of one head's state (``w h`` sums over the whole key dimension) and
  walks the chunks: store ``h_c``, form ``v_new = u - w h_c`` and store it, then
  ``h <- exp(G_last) h + (K o exp(G_last - G))^T v_new``. fla splits d_k into 64-row register tiles
  (its ``blockdim64``) so that d_k = 256 fits; here one tile of the padded d_k is left to the compiler;
- :func:`.linear_chunk.chunk_fwd_o_kernel` with v_new in place of v.

Gates are in log2 units with RCP_LN2 folded in once, as in :mod:`.linear_chunk`. The backward is autograd
through :func:`fa_lab.linear.delta.chunk_delta_rule` recomputed in float32 (:class:`.linear_chunk.RecomputedBackward`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .linear_chunk import state_tile


@triton.jit
def chunk_delta_fwd_h_kernel(k_ptr, w_ptr, u_ptr, g_ptr, h0_ptr, h_ptr, v_new_ptr, ht_ptr, seqlen, chunks, d_k, d_v,
                             CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                             GATED: tl.constexpr, HAS_H0: tl.constexpr, PRECISION: tl.constexpr):
    """Start states and corrected values of one head's state columns ``pid_v * BLOCK_V ...``.

    k_ptr, w_ptr (B*H, N, d_k), u_ptr and v_new_ptr (B*H, N, d_v), contiguous, in the inputs' dtype;
    g_ptr float32 (B*H, chunks * CHUNK), the log2-unit gate cumulated per chunk (read if GATED);
    h0_ptr, ht_ptr (B*H, d_k, d_v) and h_ptr (B*H, chunks, d_k, d_v) float32.
    """
    pid_v, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    cols_k, cols_v, k_ok, v_ok, tile, tile_ok, h = state_tile(h0_ptr, bh, 0, pid_v, d_k, d_v, BLOCK_K, BLOCK_V,
                                                              HAS_H0)
    for c in range(chunks):
        tl.store(h_ptr + (bh * chunks + c) * d_k * d_v + tile, h, mask=tile_ok)
        rows = c * CHUNK + tl.arange(0, CHUNK)
        row_ok = rows < seqlen
        key_rows = (bh * seqlen + rows)[:, None] * d_k + cols_k[None, :]
        value_rows = (bh * seqlen + rows)[:, None] * d_v + cols_v[None, :]
        w = tl.load(w_ptr + key_rows, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        u = tl.load(u_ptr + value_rows, mask=row_ok[:, None] & v_ok[None, :], other=0.0)
        v_new = u.to(tl.float32) - tl.dot(w, h.to(w.dtype), input_precision=PRECISION)
        tl.store(v_new_ptr + value_rows, v_new.to(v_new_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
        k = tl.load(k_ptr + key_rows, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if GATED:
            g = tl.load(g_ptr + bh * chunks * CHUNK + rows)
            g_last = tl.load(g_ptr + bh * chunks * CHUNK + c * CHUNK + CHUNK - 1)
            h = h * tl.math.exp2(g_last)
            k = (k * tl.math.exp2(g_last - g)[:, None]).to(w.dtype)
        h = tl.dot(tl.trans(k), v_new.to(w.dtype), h, input_precision=PRECISION)
    tl.store(ht_ptr + bh * d_k * d_v + tile, h, mask=tile_ok)


def delta_chunk_forward(q, k, v, beta, g, initial_state, scale: float, chunk_size: int):
    """WY in PyTorch, then the h kernel and the o kernel (no autograd). q, k (B, H, N, d_k), v (B, H, N, d_v),
    beta (B, H, N), g None or (B, H, N). Returns (o in q.dtype, final state (B, H, d_k, d_v) float32)."""
    from ...linear.chunk import chunk_local_cumsum
    from ...linear.decay import from_chunks, to_chunks
    from ...linear.delta import prepare_wy_repr
    from ..common import cdiv, on_device
    from .linear_chunk import block_size, chunk_fwd_o_kernel, log2_cumulated_gate, output_warps

    batch, heads, seqlen, d_k = q.shape
    d_v = v.shape[-1]
    chunks = cdiv(seqlen, chunk_size)
    gate = "none" if g is None else "scalar"
    k_chunks, v_chunks, beta_chunks = (to_chunks(t.float(), chunk_size) for t in (k, v, beta))
    cum = None if g is None else chunk_local_cumsum(g.float(), chunk_size)
    w, u = (from_chunks(t, seqlen).to(q.dtype).contiguous()
            for t in prepare_wy_repr(k_chunks, v_chunks, beta_chunks, cum, gate))
    q, k = q.contiguous(), k.contiguous()
    cum2 = log2_cumulated_gate(g, chunk_size) if g is not None else q
    h0 = initial_state.float().contiguous() if initial_state is not None else q
    h = torch.empty(batch * heads, chunks, d_k, d_v, dtype=torch.float32, device=q.device)
    v_new = torch.empty(batch, heads, seqlen, d_v, dtype=q.dtype, device=q.device)
    final_state = torch.empty(batch, heads, d_k, d_v, dtype=torch.float32, device=q.device)
    o = torch.empty_like(v_new)
    block_v = block_size(d_v, 32)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    with on_device(q):
        chunk_delta_fwd_h_kernel[(cdiv(d_v, block_v), batch * heads)](
            k, w, u, cum2, h0, h, v_new, final_state, seqlen, chunks, d_k, d_v, CHUNK=chunk_size,
            BLOCK_K=block_size(d_k, 256), BLOCK_V=block_v, GATED=g is not None, HAS_H0=initial_state is not None,
            PRECISION=precision)
        block_v = block_size(d_v)
        chunk_fwd_o_kernel[(chunks, batch * heads, cdiv(d_v, block_v))](
            q, k, v_new, cum2, h, o, seqlen, chunks, d_k, d_v, scale, CHUNK=chunk_size, BLOCK_K=block_size(d_k),
            BLOCK_V=block_v, GATE=int(g is not None), PRECISION=precision, num_warps=output_warps(chunk_size))
    return o, final_state


def triton_chunk_delta_rule(q, k, v, beta, g, initial_state, scale: float, chunk_size: int):
    """Differentiable chunkwise (gated) delta rule on checked inputs: returns (o in q.dtype, final state
    float32). The backward is autograd through the PyTorch chunkwise form in float32."""
    from ...linear.delta import chunk_delta_rule
    from .linear_chunk import RecomputedBackward, check_kernel_inputs

    check_kernel_inputs(q, v, chunk_size)
    kernel = lambda q, k, v, g, beta, h0: delta_chunk_forward(q, k, v, beta, g, h0, scale, chunk_size)
    reference = lambda q, k, v, g, beta, h0: chunk_delta_rule(q, k, v, beta, g, scale, h0, 64)
    return RecomputedBackward.apply(kernel, reference, q, k, v, g, beta, initial_state)
