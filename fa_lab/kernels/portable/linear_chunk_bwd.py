"""The backward of chunkwise linear attention, simple GLA (one log-decay per head and token) and GLA (one
per key dimension) as three Triton passes, the mirror of :mod:`.linear_chunk`'s forward.

Notation per chunk of C tokens: Q, K (C, d_k), V, dO (C, d_v), b the gate cumulated inside the chunk in
log2 units (b_last its last row), D_ts = 2^(b_t - b_s) for t >= s (0 above the diagonal), h_c the state
entering chunk c and dH_c the gradient of the loss with respect to it. The forward was
``o_t = scale (2^b_t q_t h_c + sum_s (q_t . k_s) D_ts v_s)`` and
``h_{c+1} = 2^b_last h_c + sum_s 2^(b_last - b_s) k_s^T v_s``, so:

- the ``dh`` pass walks the chunks backwards, one program per (BLOCK_K, BLOCK_V) tile of one head's
  state (the ``h`` pass reversed): ``dH_c = 2^b_last dH_{c+1} + scale (2^b o Q)^T dO``, starting from
  the final state's gradient, storing dH_{c+1} for chunk c and ending with the initial state's gradient;
- the ``dv`` pass, one program per (chunk, head, value block):
  ``dV = (scale (Q K^T) o D)^T dO + (2^(b_last - b) o K) dH_{c+1}``;
- the ``dqk`` pass, one program per (chunk, head, key block), d_v walked in blocks:
  ``dA = scale (dO V^T) o D``, ``dQ = scale 2^b o (dO h_c^T) + dA K``,
  ``dK = dA^T Q + 2^(b_last - b) o (V dH_{c+1}^T)``, and each token's gate term ``q_t . dq_t - k_t . dk_t``
  summed over its key block.

GLA's per-dim gate has no single decay matrix D. Its backward computes the intra-chunk scores A once per
chunk, as the forward does (:func:`fa_lab.kernels.portable.linear_chunk.chunk_gla_fwd_a_kernel`), and their
gradient ``dA = scale (dO V^T)`` masked, once per chunk (:func:`chunk_bwd_da_kernel`); the dv pass then
reads A (:func:`chunk_gla_bwd_dv_kernel`) and the dqk pass reads dA in 16 x 16 blocks, factoring each
decay through a reference row sub-chunk by sub-chunk (:func:`chunk_gla_bwd_dqk_kernel`). Its gate term is
per key dimension, ``q_t o dq_t - k_t o dk_t``.

The gate's gradient follows from writing every decay through the global cumulative sum G of g:
each term pairs q_t e^{G_t} with k_s e^{-G_s}, so dL/dG_t = q_t . dq_t - k_t . dk_t, plus, at the last
token, the final state's <h_N, dh_N> (h_N carries e^{G_N}); g_i enters every G_t with t >= i, so dg
is the reverse cumulative sum of dL/dG (``reverse_cumsum``'s kernel, over (B, H, N)). The states h_c are recomputed
by the forward's ``h`` kernel rather than kept from the forward (they are d_k d_v floats per chunk).
Precision: the dv passes take operands in the inputs' dtype, dH and the decayed scores rounded to it, as
fla's do. Every other matmul that involves a float32 quantity (a state, its gradient, a decayed or scaled
operand, a score tile) keeps it in float32 and runs as TF32 (IEEE float32 for float32 inputs) instead of
rounding it to the inputs' bf16/fp16; only products of two input tensors (Q K^T, dO V^T) take 16-bit
operands there. The gate's gradient is a reverse sum over the whole sequence of differences of such
products (q . dq - k . dk, which dV does not enter), so their rounding to bf16 is what it cannot afford: it
took dg past the tests' error bound (docs/experiments/linear_and_ring.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .linear_chunk import chunk_tile, load_rows, lower_triangle, state_tile
from .linear_launch import DQK_BLOCK_V, DV_BLOCK_V, block_size, h_pass_tiles, launch_meta


@triton.jit
def chunk_bwd_dh_kernel(q_ptr, do_ptr, g_ptr, dht_ptr, dh_ptr, dh0_ptr, seqlen, chunks, d_k, d_v, scale,
                        CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, GATE: tl.constexpr,
                        HAS_DHT: tl.constexpr, PRECISION: tl.constexpr):
    """dH_{c+1} of every chunk c for one (BLOCK_K, BLOCK_V) state tile of one (batch, head).

    q_ptr (B*H, N, d_k), do_ptr (B*H, N, d_v) contiguous; g_ptr as the forward's h pass reads it;
    dht_ptr (B*H, d_k, d_v) float32, the final state's gradient (read if HAS_DHT); dh_ptr
    (B*H, chunks, d_k, d_v) and dh0_ptr (B*H, d_k, d_v) float32 outputs.
    """
    pid_k, pid_v, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    cols_k, cols_v, k_ok, v_ok, tile, tile_ok, dh = state_tile(dht_ptr, bh, pid_k, pid_v, d_k, d_v, BLOCK_K,
                                                               BLOCK_V, HAS_DHT)
    padded = chunks * CHUNK
    for back in range(chunks):
        c = chunks - 1 - back
        tl.store(dh_ptr + (bh * chunks + c) * d_k * d_v + tile, dh, mask=tile_ok)
        rows = c * CHUNK + tl.arange(0, CHUNK)
        q = load_rows(q_ptr, bh, rows, seqlen, cols_k, d_k)
        do = load_rows(do_ptr, bh, rows, seqlen, cols_v, d_v)
        last = bh * padded + c * CHUNK + CHUNK - 1
        if GATE == 1:
            g = tl.load(g_ptr + bh * padded + rows)
            dh = dh * tl.math.exp2(tl.load(g_ptr + last))
            q = q.to(tl.float32) * (tl.math.exp2(g) * scale)[:, None]
        elif GATE == 2:
            g = tl.load(g_ptr + (bh * padded + rows)[:, None] * d_k + cols_k[None, :], mask=k_ok[None, :], other=0.0)
            dh = dh * tl.math.exp2(tl.load(g_ptr + last * d_k + cols_k, mask=k_ok, other=0.0))[:, None]
            q = q.to(tl.float32) * tl.math.exp2(g) * scale
        else:
            q = q.to(tl.float32) * scale
        dh = tl.dot(tl.trans(q), do.to(tl.float32), dh, input_precision=PRECISION)
    tl.store(dh0_ptr + bh * d_k * d_v + tile, dh, mask=tile_ok)


@triton.jit
def _decay(g_ptr, bh, c, chunks, rows, CHUNK: tl.constexpr, GATE: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """(D (C, C) with the causal mask, 2^b (C,), 2^(b_last - b) (C,)) of chunk c; no gate: ones. TRANSPOSED:
    D^T in place of D (row s, column t: 2^(b_t - b_s) for t >= s)."""
    if TRANSPOSED:
        causal = rows[None, :] >= rows[:, None]
    else:
        causal = rows[:, None] >= rows[None, :]
    if GATE == 1:
        g = tl.load(g_ptr + (bh * chunks + c) * CHUNK + tl.arange(0, CHUNK))
        g_last = tl.load(g_ptr + (bh * chunks + c) * CHUNK + CHUNK - 1)
        if TRANSPOSED:
            decay = tl.math.exp2(tl.where(causal, g[None, :] - g[:, None], float("-inf")))
        else:
            decay = tl.math.exp2(tl.where(causal, g[:, None] - g[None, :], float("-inf")))
        return decay, tl.math.exp2(g), tl.math.exp2(g_last - g)
    ones = tl.full([CHUNK], 1.0, tl.float32)
    return tl.where(causal, 1.0, 0.0), ones, ones


@triton.jit
def chunk_bwd_dv_kernel(q_ptr, k_ptr, do_ptr, g_ptr, dh_ptr, dv_ptr, seqlen, chunks, d_k, d_v, scale,
                        CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, GATE: tl.constexpr,
                        PRECISION: tl.constexpr, CARRIED: tl.constexpr = True):
    """dV of one chunk and value block; grid (chunks, B*H, cdiv(d_v, BLOCK_V)). dh_ptr: the dh pass's output.
    Without CARRIED only the intra-chunk term (the delta rule adds the carried one in its dh pass).

    The scores are formed transposed, ``K Q^T``, rather than as ``Q K^T`` then ``tl.trans``-ed (a transposed
    matmul result feeding another matmul is what Triton miscompiles on sm_90, chapter 07), and the matmuls
    take operands in the inputs' dtype, dH and the decayed scores rounded to it, as fla's dv pass does."""
    c, bh, pid_v = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    dtype = q_ptr.dtype.element_ty
    rows = c * CHUNK + tl.arange(0, CHUNK)
    cols_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = cols_v < d_v
    scores_t = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # K Q^T
    carried = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)  # K dH_{c+1}
    for start_k in range(0, d_k, BLOCK_K):
        cols_k = start_k + tl.arange(0, BLOCK_K)
        k_ok = cols_k < d_k
        q = load_rows(q_ptr, bh, rows, seqlen, cols_k, d_k)
        k = load_rows(k_ptr, bh, rows, seqlen, cols_k, d_k)
        scores_t = tl.dot(k, tl.trans(q), scores_t, input_precision=PRECISION)
        if CARRIED:
            dh = tl.load(dh_ptr + (bh * chunks + c) * d_k * d_v + cols_k[:, None] * d_v + cols_v[None, :],
                         mask=k_ok[:, None] & v_ok[None, :], other=0.0)
            carried = tl.dot(k, dh.to(dtype), carried, input_precision=PRECISION)
    decay_t, _, to_last = _decay(g_ptr, bh, c, chunks, rows, CHUNK, GATE, TRANSPOSED=True)
    do = load_rows(do_ptr, bh, rows, seqlen, cols_v, d_v)
    dv = tl.dot((scores_t * decay_t * scale).to(dtype), do, carried * to_last[:, None], input_precision=PRECISION)
    out_rows, out_ok = chunk_tile(bh, rows, seqlen, cols_v, d_v)
    tl.store(dv_ptr + out_rows, dv.to(dv_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def chunk_bwd_dqk_kernel(q_ptr, k_ptr, v_ptr, do_ptr, g_ptr, h_ptr, dh_ptr, dq_ptr, dk_ptr, dgate_ptr, dv_new_ptr,
                         dw_ptr, seqlen, chunks, d_k, d_v, scale, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_V: tl.constexpr, GATE: tl.constexpr, PRECISION: tl.constexpr,
                         DELTA: tl.constexpr = False):
    """dQ, dK of one chunk and key block, and (GATE 1) the key block's share of q . dq - k . dk per token;
    grid (chunks, B*H, cdiv(d_k, BLOCK_K)). h_ptr: the forward's chunk start states; dgate_ptr
    (cdiv(d_k, BLOCK_K), B*H, N) float32. DELTA (the delta rule: v_ptr holds v_new): also
    ``dW = -dV_new h_c^T`` into dw_ptr (B*H, N, d_k) from dv_new_ptr (B*H, N, d_v), both in the inputs' dtype.
    DELTA's matmuls over d_v and dQ's intra-chunk term take their operands in the inputs' dtype (float32
    accumulators), the states rounded to it as fla's ``chunk_bwd_dqkwg`` does: 16-bit tensor-core matmuls
    where they were TF32. (Under a scalar gate without DELTA, the same rounding took the gate's gradient, a
    difference of q . dq and k . dk, past the tests' bound: those stay TF32, as the module docstring says.)"""
    c, bh, pid_k = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    dtype = do_ptr.dtype.element_ty if DELTA else tl.float32
    rows = c * CHUNK + tl.arange(0, CHUNK)
    row_ok = rows < seqlen
    cols_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = cols_k < d_k
    d_scores = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dO V^T
    dq = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)  # dO h_c^T
    dk = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)  # V dH_{c+1}^T
    dw = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)  # -dV_new h_c^T (DELTA)
    state = (bh * chunks + c) * d_k * d_v
    for start_v in range(0, d_v, BLOCK_V):
        cols_v = start_v + tl.arange(0, BLOCK_V)
        v_ok = cols_v < d_v
        v = load_rows(v_ptr, bh, rows, seqlen, cols_v, d_v)
        do = load_rows(do_ptr, bh, rows, seqlen, cols_v, d_v)
        tile = cols_k[:, None] * d_v + cols_v[None, :]
        tile_ok = k_ok[:, None] & v_ok[None, :]
        h = tl.load(h_ptr + state + tile, mask=tile_ok, other=0.0).to(dtype)
        dh = tl.load(dh_ptr + state + tile, mask=tile_ok, other=0.0).to(dtype)
        d_scores = tl.dot(do, tl.trans(v), d_scores, input_precision=PRECISION)
        dq = tl.dot(do.to(dtype), tl.trans(h), dq, input_precision=PRECISION)
        dk = tl.dot(v.to(dtype), tl.trans(dh), dk, input_precision=PRECISION)
        if DELTA:
            dv_new = load_rows(dv_new_ptr, bh, rows, seqlen, cols_v, d_v).to(dtype)
            dw = tl.dot(dv_new, tl.trans(h), dw, input_precision=PRECISION)
    decay, from_start, to_last = _decay(g_ptr, bh, c, chunks, rows, CHUNK, GATE)
    q = load_rows(q_ptr, bh, rows, seqlen, cols_k, d_k)
    k = load_rows(k_ptr, bh, rows, seqlen, cols_k, d_k)
    d_scores = d_scores * decay * scale
    dq = tl.dot(d_scores.to(dtype), k.to(dtype), dq * (from_start * scale)[:, None], input_precision=PRECISION)
    # (float32 here: a 16-bit tl.trans of a dot's result is the pattern that sm_90 miscompiles, chapter 07)
    dk = tl.dot(tl.trans(d_scores), q.to(tl.float32), dk * to_last[:, None], input_precision=PRECISION)
    out_rows, out_ok = chunk_tile(bh, rows, seqlen, cols_k, d_k)
    tl.store(dq_ptr + out_rows, dq.to(dq_ptr.dtype.element_ty), mask=out_ok)
    tl.store(dk_ptr + out_rows, dk.to(dk_ptr.dtype.element_ty), mask=out_ok)
    if DELTA:
        tl.store(dw_ptr + out_rows, (-dw).to(dw_ptr.dtype.element_ty), mask=out_ok)
    if GATE == 1:
        dgate = tl.sum(q.to(tl.float32) * dq - k.to(tl.float32) * dk, axis=1)
        tl.store(dgate_ptr + (pid_k * tl.num_programs(1) + bh) * seqlen + rows, dgate, mask=row_ok)


@triton.jit
def chunk_gla_bwd_dv_kernel(k_ptr, do_ptr, g_ptr, a_ptr, dh_ptr, dv_ptr, seqlen, chunks, d_k, d_v, scale,
                            CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                            PRECISION: tl.constexpr):
    """dV of one chunk and value block under GLA's per-dim gate:
    ``dV = (2^(G_last - G) o K) dH_{c+1} + scale A^T dO``, with a_ptr the float32 intra-chunk scores of
    :func:`fa_lab.kernels.portable.linear_chunk.chunk_gla_fwd_a_kernel`. Grid (chunks, B*H, cdiv(d_v, BLOCK_V));
    g_ptr (B*H, chunks * CHUNK, d_k). Operands in the inputs' dtype, as in :func:`chunk_bwd_dv_kernel`."""
    c, bh, pid_v = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    dtype = k_ptr.dtype.element_ty
    padded = chunks * CHUNK
    rows = c * CHUNK + tl.arange(0, CHUNK)
    cols_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = cols_v < d_v
    last = bh * padded + c * CHUNK + CHUNK - 1
    dv = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
    for start_k in range(0, d_k, BLOCK_K):
        cols_k = start_k + tl.arange(0, BLOCK_K)
        k_ok = cols_k < d_k
        k = load_rows(k_ptr, bh, rows, seqlen, cols_k, d_k).to(tl.float32)
        g = load_rows(g_ptr, bh, rows, padded, cols_k, d_k)
        g_last = tl.load(g_ptr + last * d_k + cols_k, mask=k_ok, other=0.0)
        dh = tl.load(dh_ptr + (bh * chunks + c) * d_k * d_v + cols_k[:, None] * d_v + cols_v[None, :],
                     mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        dv = tl.dot((k * tl.math.exp2(g_last[None, :] - g)).to(dtype), dh.to(dtype), dv, input_precision=PRECISION)
    scores = tl.load(a_ptr + (bh * padded + rows)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :])
    do = load_rows(do_ptr, bh, rows, seqlen, cols_v, d_v)
    dv = tl.dot(tl.trans(scores * scale).to(dtype), do, dv, input_precision=PRECISION)
    out_rows, out_ok = chunk_tile(bh, rows, seqlen, cols_v, d_v)
    tl.store(dv_ptr + out_rows, dv.to(dv_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def chunk_bwd_da_kernel(do_ptr, v_ptr, da_ptr, seqlen, chunks, d_v, scale, CHUNK: tl.constexpr,
                        BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    """The intra-chunk score gradient, once per chunk: da_ptr (B*H, chunks * CHUNK, CHUNK) float32 gets
    ``dA[t, s] = scale dO_t . v_s`` for s <= t of the same chunk, zeros above. Grid (chunks, B*H)."""
    c, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = c * CHUNK + tl.arange(0, CHUNK)
    d_scores = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for start_v in range(0, d_v, BLOCK_V):
        cols_v = start_v + tl.arange(0, BLOCK_V)
        do = load_rows(do_ptr, bh, rows, seqlen, cols_v, d_v)
        v = load_rows(v_ptr, bh, rows, seqlen, cols_v, d_v)
        d_scores = tl.dot(do, tl.trans(v), d_scores, input_precision=PRECISION)
    d_scores = tl.where(lower_triangle(CHUNK), d_scores * scale, 0.0)
    tl.store(da_ptr + (bh * chunks * CHUNK + rows)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :], d_scores)


@triton.jit
def chunk_gla_bwd_dqk_kernel(q_ptr, k_ptr, v_ptr, do_ptr, g_ptr, h_ptr, dh_ptr, da_ptr, dq_ptr, dk_ptr, dgate_ptr,
                             seqlen, chunks, d_k, d_v, scale, CHUNK: tl.constexpr, SUB: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    """dQ, dK of one sub-chunk of SUB rows and key block under GLA's per-dim gate, and the gate term
    ``q o dq - k o dk`` per token and key dimension (dgate_ptr (B*H, N, d_k) float32). Grid
    (chunks * (CHUNK // SUB), B*H, cdiv(d_k, BLOCK_K)); da_ptr: :func:`chunk_bwd_da_kernel`'s scale dO V^T.

    For the program's rows i, with r their first row and n their last:
    ``dQ_i = scale 2^G_i o (dO_i h_c^T) + sum_{j < i} (dA_ij (K_j o 2^(G_r - G_j))) o 2^(G_i - G_r) + diag``,
    ``dK_i = 2^(G_last - G_i) o (V_i dH_{c+1}^T) + sum_{j > i} (dA_ji^T (Q_j o 2^(G_j - G_n))) o 2^(G_n - G_i)
    + diag``: every factor of an earlier or later sub-chunk's decays goes through r or n and is <= 1, so those
    are tensor-core matmuls (as in :func:`fa_lab.kernels.portable.linear_chunk.gla_scores`); the diagonal
    sub-chunk's exact pairwise decays take one row of its keys (or queries) at a time."""
    pid, bh, pid_k = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    subs = CHUNK // SUB
    c, i = pid // subs, pid % subs
    padded = chunks * CHUNK
    first = c * CHUNK + i * SUB
    rows = first + tl.arange(0, SUB)
    cols_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = cols_k < d_k
    state = (bh * chunks + c) * d_k * d_v
    dq = tl.zeros([SUB, BLOCK_K], dtype=tl.float32)  # dO_i h_c^T
    dk = tl.zeros([SUB, BLOCK_K], dtype=tl.float32)  # V_i dH_{c+1}^T
    for start_v in range(0, d_v, BLOCK_V):
        cols_v = start_v + tl.arange(0, BLOCK_V)
        tile = cols_k[:, None] * d_v + cols_v[None, :]
        tile_ok = k_ok[:, None] & (cols_v < d_v)[None, :]
        h = tl.load(h_ptr + state + tile, mask=tile_ok, other=0.0)
        dh = tl.load(dh_ptr + state + tile, mask=tile_ok, other=0.0)
        dq = tl.dot(load_rows(do_ptr, bh, rows, seqlen, cols_v, d_v).to(tl.float32), tl.trans(h), dq,
                    input_precision=PRECISION)
        dk = tl.dot(load_rows(v_ptr, bh, rows, seqlen, cols_v, d_v).to(tl.float32), tl.trans(dh), dk,
                    input_precision=PRECISION)
    g_i = load_rows(g_ptr, bh, rows, padded, cols_k, d_k)
    g_last = tl.load(g_ptr + (bh * padded + c * CHUNK + CHUNK - 1) * d_k + cols_k, mask=k_ok, other=0.0)
    dq = dq * tl.math.exp2(g_i) * scale
    dk = dk * tl.math.exp2(g_last[None, :] - g_i)
    da_rows = (bh * padded + rows)[:, None] * CHUNK  # row i's dA entries, column s - c * CHUNK
    g_r = tl.load(g_ptr + (bh * padded + first) * d_k + cols_k, mask=k_ok, other=0.0)
    earlier = tl.zeros([SUB, BLOCK_K], dtype=tl.float32)
    for j in range(0, i):
        rows_j = c * CHUNK + j * SUB + tl.arange(0, SUB)
        k_j = load_rows(k_ptr, bh, rows_j, seqlen, cols_k, d_k).to(tl.float32)
        g_j = load_rows(g_ptr, bh, rows_j, padded, cols_k, d_k)
        d_scores = tl.load(da_ptr + da_rows + j * SUB + tl.arange(0, SUB)[None, :])
        earlier = tl.dot(d_scores, k_j * tl.math.exp2(g_r[None, :] - g_j), earlier, input_precision=PRECISION)
    dq += earlier * tl.math.exp2(g_i - g_r[None, :])
    g_n = tl.load(g_ptr + (bh * padded + first + SUB - 1) * d_k + cols_k, mask=k_ok, other=0.0)
    later = tl.zeros([SUB, BLOCK_K], dtype=tl.float32)
    for j in range(i + 1, subs):
        rows_j = c * CHUNK + j * SUB + tl.arange(0, SUB)
        q_j = load_rows(q_ptr, bh, rows_j, seqlen, cols_k, d_k).to(tl.float32)
        g_j = load_rows(g_ptr, bh, rows_j, padded, cols_k, d_k)
        d_scores = tl.load(da_ptr + (bh * padded + rows_j)[:, None] * CHUNK + i * SUB + tl.arange(0, SUB)[None, :])
        later = tl.dot(tl.trans(d_scores), q_j * tl.math.exp2(g_j - g_n[None, :]), later, input_precision=PRECISION)
    dk += later * tl.math.exp2(g_n[None, :] - g_i)
    sub = tl.arange(0, SUB)
    for t in range(0, SUB):  # the diagonal sub-chunk: row t of its keys (for dQ) and of its queries (for dK)
        row = first + t
        row_ok = k_ok & (row < seqlen)
        g_t = tl.load(g_ptr + (bh * padded + row) * d_k + cols_k, mask=k_ok, other=0.0)
        k_t = tl.load(k_ptr + (bh * seqlen + row) * d_k + cols_k, mask=row_ok, other=0.0).to(tl.float32)
        q_t = tl.load(q_ptr + (bh * seqlen + row) * d_k + cols_k, mask=row_ok, other=0.0).to(tl.float32)
        column = tl.load(da_ptr + (bh * padded + rows) * CHUNK + i * SUB + t)  # dA[s, t] for s in i
        line = tl.load(da_ptr + (bh * padded + row) * CHUNK + i * SUB + sub)  # dA[t, s] for s in i
        after, before = (sub >= t)[:, None], (sub <= t)[:, None]
        dq += column[:, None] * k_t[None, :] * tl.math.exp2(tl.where(after, g_i - g_t[None, :], float("-inf")))
        dk += line[:, None] * q_t[None, :] * tl.math.exp2(tl.where(before, g_t[None, :] - g_i, float("-inf")))
    out, out_ok = chunk_tile(bh, rows, seqlen, cols_k, d_k)
    q_i = tl.load(q_ptr + out, mask=out_ok, other=0.0).to(tl.float32)
    k_i = tl.load(k_ptr + out, mask=out_ok, other=0.0).to(tl.float32)
    tl.store(dq_ptr + out, dq.to(dq_ptr.dtype.element_ty), mask=out_ok)
    tl.store(dk_ptr + out, dk.to(dk_ptr.dtype.element_ty), mask=out_ok)
    tl.store(dgate_ptr + out, q_i * dq - k_i * dk, mask=out_ok)


def chunk_backward(q, k, v, g, initial_state, grad_o, grad_state, scale: float, chunk_size: int):
    """(dq, dk, dv, dg, d initial_state) of chunkwise linear attention / simple GLA / GLA on kernel-ready inputs.

    q, k (B, H, N, d_k), v and grad_o (B, H, N, d_v); g None, (B, H, N) or (B, H, N, d_k); initial_state
    None or (B, H, d_k, d_v); grad_state None or (B, H, d_k, d_v), the final state's gradient. dq, dk, dv
    have the inputs' dtype, dg (g's shape) and the initial state's gradient are float32 (dg None without
    a gate).
    """
    from ...linear.inputs import gate_kind
    from ..common import cdiv, on_device
    from .linear_chunk import GATE_CODES, SUB_CHUNK, chunk_fwd_h_kernel, gla_intra_scores
    from .linear_gate import log2_cumulated_gate, reverse_cumsum

    batch, heads, seqlen, d_k = q.shape
    d_v = v.shape[-1]
    chunks = cdiv(seqlen, chunk_size)
    kind = gate_kind(g)
    gate = GATE_CODES[kind]
    per_dim = gate == GATE_CODES["per_dim"]
    q, k, v, grad_o = (t.contiguous() for t in (q, k, v, grad_o.to(q.dtype)))
    cum = log2_cumulated_gate(g, chunk_size) if g is not None else q
    h0 = initial_state.float().contiguous() if initial_state is not None else q
    dht = grad_state.float().contiguous() if grad_state is not None else q
    states = torch.empty(batch * heads, chunks, d_k, d_v, dtype=torch.float32, device=q.device)
    final_state = torch.empty(batch, heads, d_k, d_v, dtype=torch.float32, device=q.device)
    d_states = torch.empty_like(states)
    d_initial = torch.empty_like(final_state)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    block_k, block_v = block_size(d_k), block_size(d_v)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    shapes = dict(CHUNK=chunk_size, BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=precision)
    with on_device(q):
        tiles = h_pass_tiles(kind, d_k, d_v)
        chunk_fwd_h_kernel[(cdiv(d_k, tiles["BLOCK_K"]), cdiv(d_v, tiles["BLOCK_V"]), batch * heads)](
            k, v, cum, h0, states, final_state, seqlen, chunks, d_k, d_v, CHUNK=chunk_size, GATE=gate,
            HAS_H0=initial_state is not None, PRECISION=precision,
            **launch_meta(chunk_fwd_h_kernel, chunk_size, kind), **tiles)
        state_grid = (cdiv(d_k, block_k), cdiv(d_v, block_v), batch * heads)
        chunk_bwd_dh_kernel[state_grid](q, grad_o, cum, dht, d_states, d_initial, seqlen, chunks, d_k, d_v, scale,
                                        GATE=gate, HAS_DHT=grad_state is not None,
                                        **launch_meta(chunk_bwd_dh_kernel, chunk_size, kind), **shapes)
        if per_dim:
            scores = gla_intra_scores(q, k, cum, chunk_size, torch.float32)
            d_scores = torch.empty_like(scores)
            chunk_bwd_da_kernel[(chunks, batch * heads)](grad_o, v, d_scores, seqlen, chunks, d_v, scale,
                                                         CHUNK=chunk_size, BLOCK_V=block_v, PRECISION=precision,
                                                         **launch_meta(chunk_bwd_da_kernel, chunk_size))
            chunk_gla_bwd_dv_kernel[(chunks, batch * heads, cdiv(d_v, block_v))](
                k, grad_o, cum, scores, d_states, dv, seqlen, chunks, d_k, d_v, scale,
                **launch_meta(chunk_gla_bwd_dv_kernel, chunk_size), **shapes)
            shapes.update(SUB=SUB_CHUNK, BLOCK_K=block_size(d_k, 32))
            dgate = torch.empty(batch * heads, seqlen, d_k, dtype=torch.float32, device=q.device)
            chunk_gla_bwd_dqk_kernel[(chunks * (chunk_size // SUB_CHUNK), batch * heads, cdiv(d_k, shapes["BLOCK_K"]))](
                q, k, v, grad_o, cum, states, d_states, d_scores, dq, dk, dgate, seqlen, chunks, d_k, d_v, scale,
                **launch_meta(chunk_gla_bwd_dqk_kernel, chunk_size), **shapes)
            d_cum = dgate.view(batch, heads, seqlen, d_k)
        else:
            dgate = torch.empty(cdiv(d_k, block_k), batch * heads, seqlen, dtype=torch.float32, device=q.device)
            dv_shapes = {**shapes, "BLOCK_V": block_size(d_v, DV_BLOCK_V)}
            chunk_bwd_dv_kernel[(chunks, batch * heads, cdiv(d_v, dv_shapes["BLOCK_V"]))](
                q, k, grad_o, cum, d_states, dv, seqlen, chunks, d_k, d_v, scale, GATE=gate,
                **launch_meta(chunk_bwd_dv_kernel, chunk_size, "carried"), **dv_shapes)
            chunk_bwd_dqk_kernel[(chunks, batch * heads, cdiv(d_k, block_k))](
                q, k, v, grad_o, cum, states, d_states, dq, dk, dgate, q, q, seqlen, chunks, d_k, d_v, scale,
                GATE=gate, **launch_meta(chunk_bwd_dqk_kernel, chunk_size),
                **{**shapes, "BLOCK_V": block_size(d_v, DQK_BLOCK_V)})
            d_cum = dgate.sum(0).view(batch, heads, seqlen)
    if g is None:
        return dq, dk, dv, None, d_initial
    if grad_state is not None:  # h_N carries e^{G_N}: the last token's share
        shared = final_state * grad_state.float()
        d_cum[:, :, -1] += shared.sum(-1) if per_dim else shared.sum((-2, -1))
    return dq, dk, dv, reverse_cumsum(d_cum), d_initial
