"""The chunkwise (gated) delta rule as Triton kernels: the WY representation, the state pass and the o pass.

:mod:`fa_lab.linear.delta` turns each chunk into gated linear attention over corrected values
``v_new = u - w h_c``, with w and u from the WY representation. The launcher here runs:

- :func:`chunk_wy_kernel`, grid ``(chunks, batch * heads)``: one program per chunk forms the masked,
  decayed ``diag(beta) K K^T``, inverts ``I + L`` in registers by block doubling
  (:func:`block_doubling_inverse`), and stores ``w = T (beta o K)`` and ``u = T (beta o V)`` in the
  inputs' dtype, as fla stores them (fla writes this as three kernels: ``chunk_scaled_dot_kkt``,
  ``solve_tril``, ``recompute_w_u``);
- :func:`chunk_delta_fwd_h_kernel`, grid ``(cdiv(d_v, BLOCK_V), batch * heads)``: one program holds all
  d_k rows of a BLOCK_V-wide slice of one head's state (``w h`` sums over the whole key dimension) and
  walks the chunks: store ``h_c``, form ``v_new = u - w h_c`` and store it, then
  ``h <- exp(G_last) h + (K o exp(G_last - G))^T v_new``. fla splits d_k into 64-row register tiles
  (its ``blockdim64``) so that d_k = 256 fits; here one tile of the padded d_k is left to the compiler;
- :func:`.linear_chunk.chunk_fwd_o_kernel` with v_new in place of v.

Gates are in log2 units with RCP_LN2 folded in once, as in :mod:`.linear_chunk`. The backward of the
delta rule is kernels too (:func:`delta_chunk_backward`: the states walked back by
:func:`chunk_delta_bwd_dh_kernel`, the chunk-parallel passes of :mod:`.linear_chunk_bwd`, and the WY
representation's backward, :func:`chunk_wy_bwd_kernel`), with and without the gate.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .linear_chunk import chunk_tile, load_rows, state_tile
from .linear_launch import block_size, launch_meta, state_pass_tiles


@triton.jit
def wy_inverse(k_ptr, beta_ptr, g_ptr, t_ptr, bh, c, seqlen, chunks, d_k, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
               GATED: tl.constexpr, PRECISION: tl.constexpr, INVERSE: tl.constexpr, GRAM: tl.constexpr):
    """One chunk's ``T = (I + L)^{-1}``, ``L = strictly_lower(diag(beta) (K K^T o D))``, in registers.

    Returns (T, L, K K^T, beta, the key scale beta o 2^G (beta without a gate)), float32 (C, C) or (C,).
    T comes from block doubling (:func:`block_doubling_inverse`): log2(C) steps of two (C, C) matmuls, where
    forward substitution takes C serial steps of (C, C) vector work. INVERSE: 0 computes T, 1 computes it and
    stores it into t_ptr (B*H, chunks * CHUNK, CHUNK) float32 (the forward, for the backward), 2 loads it
    from there (the backward). GRAM False (with INVERSE 2 only: T needs them otherwise) skips K K^T, and the
    L and K K^T returned are zeros: the backward's recomputation of w and u needs neither.
    """
    rows = c * CHUNK + tl.arange(0, CHUNK)
    row_ok = rows < seqlen
    beta = tl.load(beta_ptr + bh * seqlen + rows, mask=row_ok, other=0.0).to(tl.float32)
    gram = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    if GRAM or INVERSE != 2:
        for start_k in range(0, d_k, BLOCK_K):
            cols_k = start_k + tl.arange(0, BLOCK_K)
            k = load_rows(k_ptr, bh, rows, seqlen, cols_k, d_k)
            gram = tl.dot(k, tl.trans(k), gram, input_precision=PRECISION)
    below = tl.arange(0, CHUNK)[:, None] > tl.arange(0, CHUNK)[None, :]
    key_scale = beta
    if GATED:
        g = tl.load(g_ptr + bh * chunks * CHUNK + rows)
        lower = beta[:, None] * gram * tl.math.exp2(tl.where(below, g[:, None] - g[None, :], float("-inf")))
        key_scale = beta * tl.math.exp2(g)
    else:
        lower = tl.where(below, beta[:, None] * gram, 0.0)
    inverse_offsets = (bh * chunks * CHUNK + rows)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    if INVERSE == 2:
        inverse = tl.load(t_ptr + inverse_offsets)
    else:
        inverse = block_doubling_inverse(lower, CHUNK, PRECISION)
        if INVERSE == 1:
            tl.store(t_ptr + inverse_offsets, inverse)
    return inverse, lower, gram, beta, key_scale


@triton.jit
def block_doubling_inverse(lower, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """``(I + L)^{-1}`` of a strictly lower triangular (C, C) float32 tile L, C a power of two.

    T starts as the inverse of I + L's 1 x 1 diagonal blocks (I) and doubles the block size each step: in a
    block ``[[A, 0], [X, B]]`` of twice the size, ``[[A, 0], [X, B]]^{-1} = [[A^-1, 0], [-B^-1 X A^-1,
    B^-1]]``, and with ``L_s`` the X parts of L (rows in the second half of a 2s block, columns in its first
    half), ``T L_s T`` is exactly ``B^-1 X A^-1`` there and zero elsewhere: ``T <- T - T (L_s T)``. Every
    intermediate T is a set of diagonal blocks of the final inverse, so no entry grows past the inverse's
    own. (fla's ``solve_tril`` inverts 16 x 16 blocks by substitution and merges them the same way.)
    The matmuls run at PRECISION, TF32 for 16-bit inputs: a float64 simulation of that rounding
    (docs/experiments/linear_and_ring.md) shows it adds less to w's error than w's own rounding to bf16.
    """
    row, col = tl.arange(0, CHUNK)[:, None], tl.arange(0, CHUNK)[None, :]
    inverse = tl.where(row == col, 1.0, 0.0)
    for level in tl.static_range(7):  # block sizes 1, 2, ..., 64 -> twice that: C up to 128
        if (1 << level) < CHUNK:
            half = 1 << level
            crossing = (row // (2 * half) == col // (2 * half)) & (row % (2 * half) >= half) & \
                (col % (2 * half) < half)
            cross = tl.dot(tl.where(crossing, lower, 0.0), inverse, input_precision=PRECISION)
            inverse = inverse - tl.dot(inverse, cross, input_precision=PRECISION)
    return inverse


@triton.jit
def chunk_wy_kernel(k_ptr, v_ptr, beta_ptr, g_ptr, t_ptr, w_ptr, u_ptr, seqlen, chunks, d_k, d_v,
                    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, GATED: tl.constexpr,
                    PRECISION: tl.constexpr, INVERSE: tl.constexpr = 0):
    """The WY representation of one chunk: ``w = T (beta o 2^G o K)``, ``u = T (beta o V)`` with T from
    :func:`wy_inverse`. Grid (chunks, B*H).

    k_ptr, w_ptr (B*H, N, d_k), v_ptr, u_ptr (B*H, N, d_v) contiguous; beta_ptr (B*H, N); g_ptr float32
    (B*H, chunks * CHUNK), the log2-unit gate cumulated per chunk (read if GATED); t_ptr: T, stored or read as
    INVERSE says (:func:`wy_inverse`).
    """
    c, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = c * CHUNK + tl.arange(0, CHUNK)
    inverse, _, _, beta, key_scale = wy_inverse(k_ptr, beta_ptr, g_ptr, t_ptr, bh, c, seqlen, chunks, d_k, CHUNK,
                                                BLOCK_K, GATED, PRECISION, INVERSE, GRAM=False)
    _apply_to_rows(inverse, key_scale, k_ptr, w_ptr, bh, rows, seqlen, d_k, BLOCK_K, PRECISION)
    _apply_to_rows(inverse, beta, v_ptr, u_ptr, bh, rows, seqlen, d_v, BLOCK_V, PRECISION)


@triton.jit
def _apply_to_rows(matrix, row_scale, src_ptr, dst_ptr, bh, rows, seqlen, width, BLOCK: tl.constexpr,
                   PRECISION: tl.constexpr):
    """dst = matrix (diag(row_scale) src) for one chunk's rows of (B*H, N, width) tensors, BLOCK columns at a
    time, stored in dst's dtype."""
    for start in range(0, width, BLOCK):
        offsets, tile_ok = chunk_tile(bh, rows, seqlen, start + tl.arange(0, BLOCK), width)
        src = tl.load(src_ptr + offsets, mask=tile_ok, other=0.0).to(tl.float32)
        out = tl.dot(matrix, src * row_scale[:, None], input_precision=PRECISION)
        tl.store(dst_ptr + offsets, out.to(dst_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit
def _add_outer(acc, grad_ptr, src_ptr, row_scale, bh, rows, seqlen, width, BLOCK: tl.constexpr,
               PRECISION: tl.constexpr):
    """acc + grad (diag(row_scale) src)^T over one chunk's rows of (B*H, N, width) tensors, BLOCK columns at a
    time: a matmul's gradient with respect to its left factor. Operands rounded to src's
    dtype (a 16-bit matmul for 16-bit inputs), accumulated in float32."""
    dtype = src_ptr.dtype.element_ty
    for start in range(0, width, BLOCK):
        offsets, tile_ok = chunk_tile(bh, rows, seqlen, start + tl.arange(0, BLOCK), width)
        src = tl.load(src_ptr + offsets, mask=tile_ok, other=0.0)
        grad = tl.load(grad_ptr + offsets, mask=tile_ok, other=0.0).to(dtype)
        acc = tl.dot(grad, tl.trans((src * row_scale[:, None]).to(dtype)), acc, input_precision=PRECISION)
    return acc


@triton.jit
def chunk_wy_bwd_kernel(k_ptr, v_ptr, beta_ptr, g_ptr, t_ptr, dw_ptr, du_ptr, dk_direct_ptr, dk_ptr, dv_ptr,
                        dbeta_ptr, dgate_ptr, seqlen, chunks, d_k, d_v, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_V: tl.constexpr, GATED: tl.constexpr, PRECISION: tl.constexpr,
                        INVERSE: tl.constexpr = 0):
    """The WY representation's backward for one chunk: given dW and dU ((B*H, N, d_k) and (B*H, N, d_v), in
    the inputs' dtype), write dK (k's dtype, (B*H, N, d_k): its share plus the direct one, dk_direct_ptr, in k's
    dtype), dV (v's dtype), dbeta (float32, (B*H, N)) and, if GATED, its share of the cumulated gate's
    gradient (float32, (B*H, chunks * CHUNK)). T computed or loaded as INVERSE says (:func:`wy_inverse`).
    Grid (chunks, B*H). The (C, d)-wide matmuls take their operands in k's dtype (T^T, dW, dU and the
    symmetric dL term rounded to it; float32 accumulators), as fla's WY backward does; the (C, C) ones
    stay at PRECISION.

    With ``W = T Ks``, ``U = T Vb``, ``Ks = beta o 2^G o K``, ``Vb = beta o V``, ``T = (I + L)^{-1}`` and
    ``L_ij = beta_i (k_i . k_j) 2^(G_i - G_j)`` below the diagonal: ``dKs = T^T dW``, ``dVb = T^T dU``,
    ``dT = dW Ks^T + dU Vb^T``, ``dL = strictly_lower(-T^T dT T^T)``. L's entries give
    ``dbeta_i += sum_j dL_ij L_ij / beta_i`` and ``dK += (M + M^T) K`` with ``M = diag(beta) dL o D``;
    the gate, which enters as e^{+G_i} on rows and e^{-G_j} on columns, gets ``rowsum(dL o L) -
    colsum(dL o L)`` and, through Ks, ``ks_t . dks_t``.
    """
    c, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = c * CHUNK + tl.arange(0, CHUNK)
    row_ok = rows < seqlen
    dtype = k_ptr.dtype.element_ty
    inverse, lower, gram, beta, key_scale = wy_inverse(k_ptr, beta_ptr, g_ptr, t_ptr, bh, c, seqlen, chunks, d_k,
                                                       CHUNK, BLOCK_K, GATED, PRECISION, INVERSE, GRAM=True)
    inverse_t = tl.trans(inverse).to(dtype)  # T^T as the 16-bit operand of the (C, d)-wide matmuls
    d_inverse = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dT = dW Ks^T + dU Vb^T
    d_inverse = _add_outer(d_inverse, dw_ptr, k_ptr, key_scale, bh, rows, seqlen, d_k, BLOCK_K, PRECISION)
    d_inverse = _add_outer(d_inverse, du_ptr, v_ptr, beta, bh, rows, seqlen, d_v, BLOCK_V, PRECISION)
    d_beta = tl.zeros([CHUNK], dtype=tl.float32)
    for start_v in range(0, d_v, BLOCK_V):
        value_rows, tile_ok = chunk_tile(bh, rows, seqlen, start_v + tl.arange(0, BLOCK_V), d_v)
        v = tl.load(v_ptr + value_rows, mask=tile_ok, other=0.0).to(tl.float32)
        du = tl.load(du_ptr + value_rows, mask=tile_ok, other=0.0).to(dtype)
        d_vb = tl.dot(inverse_t, du, input_precision=PRECISION)
        tl.store(dv_ptr + value_rows, (d_vb * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=tile_ok)
        d_beta += tl.sum(v * d_vb, axis=1)
    below = tl.arange(0, CHUNK)[:, None] > tl.arange(0, CHUNK)[None, :]
    d_lower = tl.dot(tl.trans(inverse), d_inverse, input_precision=PRECISION)
    d_lower = tl.where(below, -tl.dot(d_lower, tl.trans(inverse), input_precision=PRECISION), 0.0)
    if GATED:
        g = tl.load(g_ptr + bh * chunks * CHUNK + rows)
        decay = tl.math.exp2(tl.where(below, g[:, None] - g[None, :], float("-inf")))
        d_beta += tl.sum(d_lower * gram * decay, axis=1)
        sym = beta[:, None] * d_lower * decay
        d_gate = tl.sum(d_lower * lower, axis=1) - tl.sum(d_lower * lower, axis=0)
    else:
        d_beta += tl.sum(d_lower * gram, axis=1)
        sym = beta[:, None] * d_lower
    sym = sym + tl.trans(sym)
    for start_k in range(0, d_k, BLOCK_K):
        key_rows, tile_ok = chunk_tile(bh, rows, seqlen, start_k + tl.arange(0, BLOCK_K), d_k)
        k = tl.load(k_ptr + key_rows, mask=tile_ok, other=0.0)
        dw = tl.load(dw_ptr + key_rows, mask=tile_ok, other=0.0).to(dtype)
        d_ks = tl.dot(inverse_t, dw, input_precision=PRECISION)
        k_dot = tl.sum(k.to(tl.float32) * d_ks, axis=1)
        if GATED:
            d_beta += k_dot * tl.math.exp2(g)
            d_gate += k_dot * key_scale
        else:
            d_beta += k_dot
        dk = tl.dot(sym.to(dtype), k, d_ks * key_scale[:, None], input_precision=PRECISION)
        dk += tl.load(dk_direct_ptr + key_rows, mask=tile_ok, other=0.0).to(tl.float32)
        tl.store(dk_ptr + key_rows, dk.to(dk_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(dbeta_ptr + bh * seqlen + rows, d_beta, mask=row_ok)
    if GATED:
        tl.store(dgate_ptr + bh * chunks * CHUNK + rows, d_gate)


@triton.jit
def chunk_delta_fwd_h_kernel(k_ptr, w_ptr, u_ptr, g_ptr, h0_ptr, h_ptr, v_new_ptr, ht_ptr, seqlen, chunks, d_k, d_v,
                             CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                             GATED: tl.constexpr, HAS_H0: tl.constexpr, PRECISION: tl.constexpr):
    """Start states and corrected values of one head's state columns ``pid_v * BLOCK_V ...``.

    k_ptr, w_ptr (B*H, N, d_k), u_ptr and v_new_ptr (B*H, N, d_v), contiguous, in the inputs' dtype;
    g_ptr float32 (B*H, chunks * CHUNK), the log2-unit gate cumulated per chunk (read if GATED);
    h0_ptr, ht_ptr (B*H, d_k, d_v) float32; h_ptr (B*H, chunks, d_k, d_v) in its own dtype (rounded on
    store, as :func:`.linear_chunk.chunk_fwd_h_kernel` stores it).
    """
    pid_v, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    cols_k, cols_v, _, _, tile, tile_ok, h = state_tile(h0_ptr, bh, 0, pid_v, d_k, d_v, BLOCK_K, BLOCK_V, HAS_H0)
    for c in range(chunks):
        tl.store(h_ptr + (bh * chunks + c) * d_k * d_v + tile, h.to(h_ptr.dtype.element_ty), mask=tile_ok)
        rows = c * CHUNK + tl.arange(0, CHUNK)
        key_rows, key_ok = chunk_tile(bh, rows, seqlen, cols_k, d_k)
        value_rows, value_ok = chunk_tile(bh, rows, seqlen, cols_v, d_v)
        w = tl.load(w_ptr + key_rows, mask=key_ok, other=0.0)
        u = tl.load(u_ptr + value_rows, mask=value_ok, other=0.0)
        v_new = u.to(tl.float32) - tl.dot(w, h.to(w.dtype), input_precision=PRECISION)
        tl.store(v_new_ptr + value_rows, v_new.to(v_new_ptr.dtype.element_ty), mask=value_ok)
        k = tl.load(k_ptr + key_rows, mask=key_ok, other=0.0)
        if GATED:
            g = tl.load(g_ptr + bh * chunks * CHUNK + rows)
            g_last = tl.load(g_ptr + bh * chunks * CHUNK + c * CHUNK + CHUNK - 1)
            h = h * tl.math.exp2(g_last)
            k = (k * tl.math.exp2(g_last - g)[:, None]).to(w.dtype)
        h = tl.dot(tl.trans(k), v_new.to(w.dtype), h, input_precision=PRECISION)
    tl.store(ht_ptr + bh * d_k * d_v + tile, h, mask=tile_ok)


@triton.jit
def chunk_delta_bwd_dh_kernel(q_ptr, k_ptr, w_ptr, do_ptr, dv_local_ptr, dht_ptr, dh_ptr, dv_new_ptr, dh0_ptr, g_ptr,
                              h_ptr, ht_ptr, dlast_ptr, seqlen, chunks, d_k, d_v, scale, CHUNK: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_DHT: tl.constexpr,
                              GATED: tl.constexpr, PRECISION: tl.constexpr):
    """The delta rule's dh pass, the h pass reversed, for one BLOCK_V-wide slice of one head's state.

    Walking the chunks backwards from the final state's gradient (dht_ptr, read if HAS_DHT): store
    dH_{c+1}; form the corrected values' gradient ``dV_new = dV_local + K dH_{c+1}`` (dv_local_ptr: the
    intra-chunk term) and store it (dv_new_ptr; both in the inputs' dtype, as fla keeps them); then, since
    h_{c+1} = h_c + K^T V_new and V_new = U - W h_c, ``dH_c = dH_{c+1} + scale Q^T dO - W^T dV_new``, with the
    stored (rounded) dV_new. Ends with the initial state's gradient (dh0_ptr). q, k, w (B*H, N, d_k), do
    (B*H, N, d_v) contiguous; the stored states (h_ptr, dh_ptr) in their own dtype, the inputs' as the h pass's.

    GATED (g_ptr as the h pass reads it): ``h_{c+1} = 2^G_last h_c + (K o 2^(G_last - G))^T V_new``, so
    ``dV_new = dV_local + (K o 2^(G_last - G)) dH_{c+1}``, ``dH_c = 2^G_last dH_{c+1} + scale (Q o 2^G)^T dO
    - W^T dV_new``, and the chunk's last cumulated gate gets ``<dH_{c+1}, h_{c+1}>``, this slice's share
    of which goes to dlast_ptr (cdiv(d_v, BLOCK_V), B*H, chunks) float32 (h_ptr: the chunk start states,
    ht_ptr: the final state).
    """
    pid_v, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    dtype = do_ptr.dtype.element_ty
    cols_k, cols_v, _, _, tile, tile_ok, dh = state_tile(dht_ptr, bh, 0, pid_v, d_k, d_v, BLOCK_K, BLOCK_V,
                                                         HAS_DHT)
    for back in range(chunks):
        c = chunks - 1 - back
        tl.store(dh_ptr + (bh * chunks + c) * d_k * d_v + tile, dh.to(dh_ptr.dtype.element_ty), mask=tile_ok)
        rows = c * CHUNK + tl.arange(0, CHUNK)
        key_rows, key_ok = chunk_tile(bh, rows, seqlen, cols_k, d_k)
        value_rows, value_ok = chunk_tile(bh, rows, seqlen, cols_v, d_v)
        # Operands in the inputs' dtype (16-bit matmuls, float32 accumulators, dH carried in float32), each
        # (C, d_k) tile loaded and scaled just before its one matmul.
        key_scale = tl.full([CHUNK], 1.0, tl.float32)  # 2^(G_last - G) on the keys, 2^G on the queries
        query_scale = tl.full([CHUNK], 1.0, tl.float32) * scale
        if GATED:
            g = tl.load(g_ptr + bh * chunks * CHUNK + rows)
            g_last = tl.load(g_ptr + bh * chunks * CHUNK + c * CHUNK + CHUNK - 1)
            if c + 1 < chunks:
                h_next = tl.load(h_ptr + (bh * chunks + c + 1) * d_k * d_v + tile, mask=tile_ok,
                                 other=0.0).to(tl.float32)
            else:
                h_next = tl.load(ht_ptr + bh * d_k * d_v + tile, mask=tile_ok, other=0.0)
            tl.store(dlast_ptr + (pid_v * tl.num_programs(1) + bh) * chunks + c, tl.sum(tl.sum(dh * h_next, 1), 0))
            key_scale = tl.math.exp2(g_last - g)
            query_scale = query_scale * tl.math.exp2(g)
        k = (tl.load(k_ptr + key_rows, mask=key_ok, other=0.0) * key_scale[:, None]).to(dtype)
        dv_local = tl.load(dv_local_ptr + value_rows, mask=value_ok, other=0.0).to(tl.float32)
        dv_new = tl.dot(k, dh.to(dtype), dv_local, input_precision=PRECISION).to(dtype)
        tl.store(dv_new_ptr + value_rows, dv_new, mask=value_ok)
        if GATED:
            dh = dh * tl.math.exp2(g_last)
        q = (tl.load(q_ptr + key_rows, mask=key_ok, other=0.0) * query_scale[:, None]).to(dtype)
        do = tl.load(do_ptr + value_rows, mask=value_ok, other=0.0)
        dh = tl.dot(tl.trans(q), do, dh, input_precision=PRECISION)
        w = tl.load(w_ptr + key_rows, mask=key_ok, other=0.0)
        dh -= tl.dot(tl.trans(w), dv_new, input_precision=PRECISION)
    tl.store(dh0_ptr + bh * d_k * d_v + tile, dh, mask=tile_ok)


def delta_chunk_backward(q, k, v, beta, g, initial_state, grad_o, grad_state, scale: float, chunk_size: int,
                         inverse=None):
    """(dq, dk, dv, dbeta, dg, d initial_state) of the (gated) delta rule on kernel-ready inputs, shapes as
    :func:`delta_chunk_forward`; grad_state None or (B, H, d_k, d_v). dq, dk, dv in the inputs' dtype,
    dbeta, dg (None without g) and the initial state's gradient float32.

    The kernels recompute w and u (:func:`chunk_wy_kernel`), the states and corrected values (the
    forward's h pass), the intra-chunk dV (:func:`.linear_chunk_bwd.chunk_bwd_dv_kernel` without its
    carried term), walk the states back (:func:`chunk_delta_bwd_dh_kernel`), form dQ, the direct dK and dW
    (:func:`.linear_chunk_bwd.chunk_bwd_dqk_kernel` over v_new), and carry dW and dU = dV_new through the
    WY representation to k, v and beta (:func:`chunk_wy_bwd_kernel`). With a gate, each of them also
    returns its part of the gradient of the gate cumulated within the chunk; dg is their sum, cumulated
    backwards within each chunk (g_t enters every cumulated G_s with s >= t of its chunk).
    """
    from ..common import cdiv, on_device
    from .linear_chunk_bwd import chunk_bwd_dqk_kernel, chunk_bwd_dv_kernel
    from .linear_gate import log2_cumulated_gate

    batch, heads, seqlen, d_k = q.shape
    d_v = v.shape[-1]
    chunks = cdiv(seqlen, chunk_size)
    gated = g is not None
    q, k, v, beta, grad_o = (t.contiguous() for t in (q, k, v, beta, grad_o.to(q.dtype)))
    cum = log2_cumulated_gate(g, chunk_size) if gated else q
    h0 = initial_state.float().contiguous() if initial_state is not None else q
    dht = grad_state.float().contiguous() if grad_state is not None else q
    w, u = torch.empty_like(k), torch.empty_like(v)
    states = torch.empty(batch * heads, chunks, d_k, d_v, dtype=q.dtype, device=q.device)  # as fla keeps them
    d_states = torch.empty_like(states)
    final_state = torch.empty(batch, heads, d_k, d_v, dtype=torch.float32, device=q.device)
    d_initial = torch.empty_like(final_state)
    v_new = torch.empty(batch, heads, seqlen, d_v, dtype=q.dtype, device=q.device)
    # The intra-chunk dV, dV_new and dW pass between kernels in the inputs' dtype, as fla's do: half the
    # bytes of float32 in four of the six launches.
    dv_local, dv_new = torch.empty_like(v_new), torch.empty_like(v_new)
    dq, dk_direct, dw = torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    load = dict(INVERSE=2) if inverse is not None else {}  # the forward's T, else recomputed
    inverse = inverse if inverse is not None else q
    d_beta = torch.empty(beta.shape, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    block_k, block_v = block_size(d_k), block_size(d_v)
    wide = dict(CHUNK=chunk_size, BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=precision)
    def meta(kernel, variant=None) -> dict:
        return launch_meta(kernel, chunk_size, variant)
    sweep = dict(CHUNK=chunk_size, PRECISION=precision, **state_pass_tiles(d_k, d_v))
    slices = cdiv(d_v, sweep["BLOCK_V"])
    gate_parts = {name: torch.empty(shape, dtype=torch.float32, device=q.device) if gated else q
                  for name, shape in (("last", (slices, batch * heads, chunks)),
                                      ("qk", (cdiv(d_k, block_k), batch * heads, seqlen)),
                                      ("wy", (batch * heads, chunks * chunk_size)))}
    with on_device(q):
        chunk_wy_kernel[(chunks, batch * heads)](k, v, beta, cum, inverse, w, u, seqlen, chunks, d_k, d_v,
                                                 GATED=gated, **meta(chunk_wy_kernel, "recompute" if load else None),
                                                 **load, **wide)
        chunk_delta_fwd_h_kernel[(slices, batch * heads)](
            k, w, u, cum, h0, states, v_new, final_state, seqlen, chunks, d_k, d_v, GATED=gated,
            HAS_H0=initial_state is not None, **meta(chunk_delta_fwd_h_kernel), **sweep)
        chunk_bwd_dv_kernel[(chunks, batch * heads, cdiv(d_v, block_v))](
            q, k, grad_o, cum, q, dv_local, seqlen, chunks, d_k, d_v, scale, GATE=int(gated), CARRIED=False,
            **meta(chunk_bwd_dv_kernel), **wide)
        chunk_delta_bwd_dh_kernel[(slices, batch * heads)](
            q, k, w, grad_o, dv_local, dht, d_states, dv_new, d_initial, cum, states, final_state, gate_parts["last"],
            seqlen, chunks, d_k, d_v, scale, HAS_DHT=grad_state is not None, GATED=gated,
            **meta(chunk_delta_bwd_dh_kernel), **sweep)
        chunk_bwd_dqk_kernel[(chunks, batch * heads, cdiv(d_k, block_k))](
            q, k, v_new, grad_o, cum, states, d_states, dq, dk_direct, gate_parts["qk"], dv_new, dw, seqlen, chunks,
            d_k, d_v, scale, GATE=int(gated), DELTA=True, **meta(chunk_bwd_dqk_kernel, "delta"), **wide)
        chunk_wy_bwd_kernel[(chunks, batch * heads)](k, v, beta, cum, inverse, dw, dv_new, dk_direct, dk, dv, d_beta,
                                                     gate_parts["wy"], seqlen, chunks, d_k, d_v, GATED=gated,
                                                     **meta(chunk_wy_bwd_kernel), **load, **wide)
    dg = None
    if gated:
        d_cum = gate_parts["wy"]
        d_cum[:, :seqlen] += gate_parts["qk"].sum(0)
        d_cum = d_cum.view(batch * heads, chunks, chunk_size)
        d_cum[:, :, -1] += gate_parts["last"].sum(0)  # the chunk's last cumulated gate scales h_{c+1}
        dg = d_cum.flip(-1).cumsum(-1).flip(-1).flatten(1)[:, :seqlen].reshape(batch, heads, seqlen)
    return dq, dk, dv, d_beta, dg, d_initial


class ChunkDeltaFunction(torch.autograd.Function):
    """Kernels both ways for the (gated) delta rule: :func:`delta_chunk_forward` and
    :func:`delta_chunk_backward`. forward(q, k, v, beta, g, initial_state, scale, chunk_size) -> (o, final_state)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, initial_state, scale, chunk_size):
        o, final_state, inverse = delta_chunk_forward(q, k, v, beta, g, initial_state, scale, chunk_size,
                                                      keep_inverse=any(ctx.needs_input_grad[:6]))
        ctx.save_for_backward(q, k, v, beta, g, initial_state, inverse)
        ctx.args = scale, chunk_size
        return o, final_state

    @staticmethod
    def backward(ctx, grad_o, grad_state):
        q, k, v, beta, g, initial_state, inverse = ctx.saved_tensors
        dq, dk, dv, d_beta, dg, d_initial = delta_chunk_backward(q, k, v, beta, g, initial_state, grad_o, grad_state,
                                                                 *ctx.args, inverse=inverse)
        return (dq, dk, dv, d_beta.to(beta.dtype), None if g is None else dg.to(g.dtype),
                None if initial_state is None else d_initial.to(initial_state.dtype), None, None)


def delta_chunk_forward(q, k, v, beta, g, initial_state, scale: float, chunk_size: int, keep_inverse: bool = False):
    """The WY kernel, then the h kernel and the o kernel (no autograd). q, k (B, H, N, d_k), v (B, H, N, d_v),
    beta (B, H, N), g None or (B, H, N). Returns (o in q.dtype, final state (B, H, d_k, d_v) float32, the WY
    inverse T (B*H, chunks * C, C) float32 if keep_inverse, for the backward, else None)."""
    from ..common import cdiv, on_device
    from .linear_chunk import chunk_fwd_o_kernel
    from .linear_gate import log2_cumulated_gate

    batch, heads, seqlen, d_k = q.shape
    d_v = v.shape[-1]
    chunks = cdiv(seqlen, chunk_size)
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    cum2 = log2_cumulated_gate(g, chunk_size) if g is not None else q
    h0 = initial_state.float().contiguous() if initial_state is not None else q
    w, u = torch.empty_like(k), torch.empty_like(v)  # the WY matrices, rounded to the inputs' dtype as fla does
    inverse = torch.empty(batch * heads, chunks * chunk_size, chunk_size, dtype=torch.float32,
                          device=q.device) if keep_inverse else None
    h = torch.empty(batch * heads, chunks, d_k, d_v, dtype=q.dtype, device=q.device)  # read by the o pass only
    v_new = torch.empty(batch, heads, seqlen, d_v, dtype=q.dtype, device=q.device)
    final_state = torch.empty(batch, heads, d_k, d_v, dtype=torch.float32, device=q.device)
    o = torch.empty_like(v_new)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    with on_device(q):
        chunk_wy_kernel[(chunks, batch * heads)](k, v, beta, cum2, inverse if keep_inverse else q, w, u, seqlen, chunks,
                                                 d_k, d_v, INVERSE=int(keep_inverse), CHUNK=chunk_size,
                                                 BLOCK_K=block_size(d_k), BLOCK_V=block_size(d_v),
                                                 GATED=g is not None, PRECISION=precision,
                                                 **launch_meta(chunk_wy_kernel, chunk_size))
        tiles = state_pass_tiles(d_k, d_v)
        chunk_delta_fwd_h_kernel[(cdiv(d_v, tiles["BLOCK_V"]), batch * heads)](
            k, w, u, cum2, h0, h, v_new, final_state, seqlen, chunks, d_k, d_v, CHUNK=chunk_size,
            GATED=g is not None, HAS_H0=initial_state is not None, PRECISION=precision,
            **launch_meta(chunk_delta_fwd_h_kernel, chunk_size), **tiles)
        block_v = block_size(d_v)
        chunk_fwd_o_kernel[(chunks, batch * heads, cdiv(d_v, block_v))](
            q, k, v_new, cum2, h, o, seqlen, chunks, d_k, d_v, scale, CHUNK=chunk_size, BLOCK_K=block_size(d_k),
            BLOCK_V=block_v, GATE=int(g is not None), PRECISION=precision,
            **launch_meta(chunk_fwd_o_kernel, chunk_size))
    return o, final_state, inverse


def triton_chunk_delta_rule(q, k, v, beta, g, initial_state, scale: float, chunk_size: int):
    """Differentiable chunkwise (gated) delta rule on checked inputs: returns (o in q.dtype, final state
    float32); the backward is kernels too (:class:`ChunkDeltaFunction`)."""
    from .linear_chunk import check_kernel_inputs

    check_kernel_inputs(q, v, chunk_size)
    return ChunkDeltaFunction.apply(q, k, v, beta, g, initial_state, scale, chunk_size)
