"""Chunkwise gated linear attention as two Triton passes: fla's ``chunk_fwd_h`` and ``chunk_fwd_o``.

The math is :mod:`fa_lab.linear.chunk`'s. With chunks of C tokens and G the log-decay cumulated
inside each chunk:

- the ``h`` pass, grid ``(cdiv(d_k, BLOCK_K), cdiv(d_v, BLOCK_V), batch * heads)``: one program owns a
  (BLOCK_K, BLOCK_V) tile of one head's state, keeps it in float32 registers, and walks the chunks in
  order, storing each chunk's start state ``h_c`` (in the inputs' dtype, which the o pass rounds it to
  for its matmul anyway) before folding the chunk in:
  ``h <- diag(exp(G_last)) h + (K o exp(G_last - G))^T V``;
- the ``o`` pass, grid ``(chunks, batch * heads, cdiv(d_v, BLOCK_V))``: one program per chunk and
  value block, all chunks in parallel, computes ``diag(exp(G)) Q h_c`` (the inter-chunk term) plus the
  intra-chunk causal term ``(Q K^T o D) V``, with d_k walked in BLOCK_K steps.

GLA's per-dim gate has no single decay matrix D, and the factorization ``(q_i e^{G_i}) (k_j e^{-G_j})``
overflows once a chunk's decays multiply below float32's range. So its intra-chunk scores A are computed
once per chunk by their own kernel (:func:`chunk_gla_fwd_a_kernel`, fla's ``chunk_gla_fwd_intra_gk``),
which cuts the chunk into sub-chunks of 16 tokens, one per program: between a query sub-chunk and an
earlier key sub-chunk it factors through the query sub-chunk's first row r, ``e^{G_i - G_r} e^{G_r - G_j}``,
both factors <= 1, so the products are tensor-core matmuls; inside the diagonal sub-chunk it forms the
exact pairwise decays, one key row at a time. The o pass (:func:`chunk_gla_fwd_o_kernel`) is then
``(Q o e^G) h_c + A V``, as wide as the plain one.

Why ``exp2`` and where log2(e) goes: a GPU's special-function unit computes 2^x (``ex2``), so ``exp(x)``
costs a multiply by log2(e) and an ``ex2`` per element. The launcher multiplies the cumulated gate by
``RCP_LN2 = 1 / ln 2 = log2(e)`` (fla's name; :data:`fa_lab.kernels.common.LOG2E` here) once per token,
in the kernel that cumulates it (:mod:`.linear_gate`), and every decay in both passes is then one ``exp2`` of a
difference: ``exp(G_i - G_j) = exp2(G_i * RCP_LN2 - G_j * RCP_LN2)``. The multiply is paid N times
(d_k N for GLA) instead of once per element of every C x C decay tile and state tile.

Operands reach ``tl.dot`` in the inputs' dtype (decayed keys and scores are rounded to it, as fla does),
with float32 accumulators; float32 inputs run ``input_precision="ieee"`` (not TF32). A ragged last
chunk is masked on load; the gate is padded with zero log-decays to whole chunks before it is cumulated,
so the padded chunk's last row holds the cumulated decay of its last real token.

The backward is kernels too, :mod:`.linear_chunk_bwd` (fla's dh, dv and dqk passes; the delta rule's
in :mod:`.linear_delta`). Only the fused recurrence (:mod:`.linear_recurrent`, the decode-time form)
recomputes in PyTorch: :class:`RecomputedBackward` runs a kernel forward and, on backward, autograd
through the PyTorch chunk form in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .linear_launch import SCORE_BLOCK_K, block_size, h_pass_tiles, launch_meta

GATE_CODES = {"none": 0, "scalar": 1, "per_dim": 2}  # the kernels' GATE constexpr, by fa_lab.linear's gate kind
SUB_CHUNK = 16  # GLA's intra-chunk score kernel's (and its dqk pass's) sub-chunk: the smallest tl.dot tile
CHUNK_SIZES = (16, 32, 64, 128)


@triton.jit
def state_tile(h0_ptr, bh, pid_k, pid_v, d_k, d_v, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
               HAS_H0: tl.constexpr):
    """Tile (pid_k, pid_v) of head ``bh``'s (d_k, d_v) state: (cols_k, cols_v, k_ok, v_ok, tile, tile_ok, h)
    with its key and value columns, their masks, its offsets within one state and its start value, h0's
    tile (h0_ptr (B*H, d_k, d_v) float32) when HAS_H0, else zeros (float32)."""
    cols_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = cols_k < d_k, cols_v < d_v
    tile = cols_k[:, None] * d_v + cols_v[None, :]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    h = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    if HAS_H0:
        h += tl.load(h0_ptr + bh * d_k * d_v + tile, mask=tile_ok, other=0.0)
    return cols_k, cols_v, k_ok, v_ok, tile, tile_ok, h


@triton.jit
def chunk_fwd_h_kernel(k_ptr, v_ptr, g_ptr, h0_ptr, h_ptr, ht_ptr, seqlen, chunks, d_k, d_v,
                       CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, GATE: tl.constexpr,
                       HAS_H0: tl.constexpr, PRECISION: tl.constexpr):
    """Store every chunk's start state of one (BLOCK_K, BLOCK_V) state tile of one (batch, head).

    k_ptr (B*H, N, d_k), v_ptr (B*H, N, d_v) contiguous; g_ptr: the cumulated gate in log2 units,
    float32 (B*H, chunks * CHUNK) (GATE 1) or (B*H, chunks * CHUNK, d_k) (GATE 2); h0_ptr (B*H, d_k, d_v)
    float32 (read if HAS_H0); ht_ptr (B*H, d_k, d_v) float32 output; h_ptr (B*H, chunks, d_k, d_v) output in
    its own dtype (the state is carried in float32 and rounded on store: the forward stores it in the
    inputs' dtype, which the o pass rounds it to anyway, the backward's recomputation in float32).
    """
    pid_k, pid_v, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    cols_k, cols_v, k_ok, v_ok, tile, tile_ok, h = state_tile(h0_ptr, bh, pid_k, pid_v, d_k, d_v, BLOCK_K, BLOCK_V,
                                                              HAS_H0)
    padded = chunks * CHUNK
    for c in range(chunks):
        tl.store(h_ptr + (bh * chunks + c) * d_k * d_v + tile, h.to(h_ptr.dtype.element_ty), mask=tile_ok)
        rows = c * CHUNK + tl.arange(0, CHUNK)
        k = load_rows(k_ptr, bh, rows, seqlen, cols_k, d_k)
        v = load_rows(v_ptr, bh, rows, seqlen, cols_v, d_v)
        last = bh * padded + c * CHUNK + CHUNK - 1
        if GATE == 1:
            g = tl.load(g_ptr + bh * padded + rows)
            g_last = tl.load(g_ptr + last)
            h = h * tl.math.exp2(g_last)
            k = (k * tl.math.exp2(g_last - g)[:, None]).to(v.dtype)
        elif GATE == 2:
            g = tl.load(g_ptr + (bh * padded + rows)[:, None] * d_k + cols_k[None, :], mask=k_ok[None, :], other=0.0)
            g_last = tl.load(g_ptr + last * d_k + cols_k, mask=k_ok, other=0.0)
            h = h * tl.math.exp2(g_last)[:, None]
            k = (k * tl.math.exp2(g_last[None, :] - g)).to(v.dtype)
        h = tl.dot(tl.trans(k), v, h, input_precision=PRECISION)
    tl.store(ht_ptr + bh * d_k * d_v + tile, h, mask=tile_ok)


@triton.jit
def chunk_fwd_o_kernel(q_ptr, k_ptr, v_ptr, g_ptr, h_ptr, o_ptr, seqlen, chunks, d_k, d_v, scale,
                       CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, GATE: tl.constexpr,
                       PRECISION: tl.constexpr):
    """o of one chunk and value block, no gate (GATE 0) or a scalar gate (GATE 1).

    q_ptr, k_ptr (B*H, N, d_k), v_ptr and o_ptr (B*H, N, d_v) contiguous; g_ptr, h_ptr as
    :func:`chunk_fwd_h_kernel` takes and writes them.
    """
    c, bh, pid_v = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    rows = c * CHUNK + tl.arange(0, CHUNK)
    cols_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = cols_v < d_v
    acc = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
    scores = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for start_k in range(0, d_k, BLOCK_K):
        cols_k = start_k + tl.arange(0, BLOCK_K)
        k_ok = cols_k < d_k
        q = load_rows(q_ptr, bh, rows, seqlen, cols_k, d_k)
        k = load_rows(k_ptr, bh, rows, seqlen, cols_k, d_k)
        h = tl.load(h_ptr + (bh * chunks + c) * d_k * d_v + cols_k[:, None] * d_v + cols_v[None, :],
                    mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        acc = tl.dot(q, h.to(q.dtype), acc, input_precision=PRECISION)
        scores = tl.dot(q, tl.trans(k), scores, input_precision=PRECISION)
    causal = rows[:, None] >= rows[None, :]
    if GATE == 1:
        g = tl.load(g_ptr + bh * chunks * CHUNK + rows)
        acc = acc * tl.math.exp2(g)[:, None]
        scores = scores * tl.math.exp2(tl.where(causal, g[:, None] - g[None, :], float("-inf")))
    else:
        scores = tl.where(causal, scores, 0.0)
    v = load_rows(v_ptr, bh, rows, seqlen, cols_v, d_v)
    acc = tl.dot(scores.to(v.dtype), v, acc, input_precision=PRECISION)
    out_rows, out_ok = chunk_tile(bh, rows, seqlen, cols_v, d_v)
    tl.store(o_ptr + out_rows, (acc * scale).to(o_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def chunk_tile(bh, rows, seqlen, cols, width):
    """(offsets, mask) of the rows x cols tile of head row ``bh`` of a contiguous (B*H, N, width) tensor;
    the mask drops rows past N and columns past width."""
    return (bh * seqlen + rows)[:, None] * width + cols[None, :], (rows < seqlen)[:, None] & (cols < width)[None, :]


@triton.jit
def load_rows(ptr, bh, rows, seqlen, cols, width):
    """rows x cols of a contiguous (B*H, N, width) tensor in its own dtype, zeros outside N and width.
    :func:`chunk_tile`'s tile written out: built through it, GLA's score kernel spills 8 bytes a thread on
    sm_90 (tests/test_portable_sm90_builds.py)."""
    return tl.load(ptr + (bh * seqlen + rows)[:, None] * width + cols[None, :],
                   mask=(rows < seqlen)[:, None] & (cols < width)[None, :], other=0.0)


@triton.jit
def gla_scores(q_ptr, k_ptr, g_ptr, bh, rows_s, rows_t, row_r, seqlen, padded, d_k, SUB: tl.constexpr,
               BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """(SUB, SUB) float32 scores ``sum_d q_i[d] k_j[d] 2^(G_i[d] - G_j[d])`` of query rows ``rows_s`` against
    the rows ``rows_t`` of an earlier key sub-chunk under GLA's per-dim gate (g_ptr (B*H, padded, d_k) in log2
    units), d_k walked in BLOCK_K steps: the decays go through the query sub-chunk's first row ``row_r``,
    ``2^(G_i - G_r) 2^(G_r - G_j)``, both factors <= 1, and the product is one tensor-core matmul."""
    dtype = q_ptr.dtype.element_ty
    scores = tl.zeros([SUB, SUB], dtype=tl.float32)
    for start_k in range(0, d_k, BLOCK_K):
        cols_k = start_k + tl.arange(0, BLOCK_K)
        q_s = load_rows(q_ptr, bh, rows_s, seqlen, cols_k, d_k).to(tl.float32)
        g_s = load_rows(g_ptr, bh, rows_s, padded, cols_k, d_k)
        k_t = load_rows(k_ptr, bh, rows_t, seqlen, cols_k, d_k).to(tl.float32)
        g_t = load_rows(g_ptr, bh, rows_t, padded, cols_k, d_k)
        g_r = tl.load(g_ptr + (bh * padded + row_r) * d_k + cols_k, mask=cols_k < d_k, other=0.0)
        q_r = (q_s * tl.math.exp2(g_s - g_r[None, :])).to(dtype)
        k_r = (k_t * tl.math.exp2(g_r[None, :] - g_t)).to(dtype)
        scores = tl.dot(q_r, tl.trans(k_r), scores, input_precision=PRECISION)
    return scores


@triton.jit
def lower_triangle(SUB: tl.constexpr):
    """(SUB, SUB) bool: row i >= column j, the causal pairs of a diagonal sub-chunk."""
    return tl.arange(0, SUB)[:, None] >= tl.arange(0, SUB)[None, :]


@triton.jit
def gla_diagonal_scores(q_ptr, k_ptr, g_ptr, bh, first, seqlen, padded, d_k, SUB: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """(SUB, SUB) float32 scores of the diagonal sub-chunk starting at row ``first`` with its exact pairwise
    decays, masked above the diagonal (in the exponent, so nothing overflows): one key row at a time, each a
    (SUB, BLOCK_K) product reduced over d_k, d_k walked in BLOCK_K steps."""
    rows = first + tl.arange(0, SUB)
    sub = tl.arange(0, SUB)
    scores = tl.zeros([SUB, SUB], dtype=tl.float32)
    for start_k in range(0, d_k, BLOCK_K):
        cols_k = start_k + tl.arange(0, BLOCK_K)
        k_ok = cols_k < d_k
        q_s = load_rows(q_ptr, bh, rows, seqlen, cols_k, d_k).to(tl.float32)
        g_s = load_rows(g_ptr, bh, rows, padded, cols_k, d_k)
        for t in range(0, SUB):
            k_t = tl.load(k_ptr + (bh * seqlen + first + t) * d_k + cols_k, mask=k_ok & (first + t < seqlen),
                          other=0.0).to(tl.float32)
            g_t = tl.load(g_ptr + (bh * padded + first + t) * d_k + cols_k, mask=k_ok, other=0.0)
            decay = tl.math.exp2(tl.where((sub >= t)[:, None], g_s - g_t[None, :], float("-inf")))
            scores = tl.where((sub == t)[None, :], scores + tl.sum(q_s * k_t[None, :] * decay, axis=1)[:, None],
                              scores)
    return scores


@triton.jit
def chunk_gla_fwd_a_kernel(q_ptr, k_ptr, g_ptr, a_ptr, seqlen, chunks, d_k, CHUNK: tl.constexpr, SUB: tl.constexpr,
                           BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """GLA's intra-chunk scores, one sub-chunk of SUB query rows per program: a_ptr (B*H, chunks * CHUNK,
    CHUNK) gets ``A[t, s] = sum_d q_t[d] k_s[d] 2^(G_t[d] - G_s[d])`` for s <= t of the same chunk, the
    earlier key sub-chunks by :func:`gla_scores`, the diagonal one by :func:`gla_diagonal_scores`, and zeros
    above the diagonal. Grid (chunks * (CHUNK // SUB), B*H)."""
    pid, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    c, i = pid // (CHUNK // SUB), pid % (CHUNK // SUB)
    padded = chunks * CHUNK
    first = c * CHUNK + i * SUB
    rows_i = first + tl.arange(0, SUB)
    a_rows = a_ptr + (bh * padded + rows_i)[:, None] * CHUNK + tl.arange(0, SUB)[None, :]
    for j in range(0, i):
        block = gla_scores(q_ptr, k_ptr, g_ptr, bh, rows_i, c * CHUNK + j * SUB + tl.arange(0, SUB), first, seqlen,
                           padded, d_k, SUB, BLOCK_K, PRECISION)
        tl.store(a_rows + j * SUB, block.to(a_ptr.dtype.element_ty))
    block = gla_diagonal_scores(q_ptr, k_ptr, g_ptr, bh, first, seqlen, padded, d_k, SUB, BLOCK_K)
    tl.store(a_rows + i * SUB, block.to(a_ptr.dtype.element_ty))
    for j in range(i + 1, CHUNK // SUB):
        tl.store(a_rows + j * SUB, tl.zeros([SUB, SUB], dtype=a_ptr.dtype.element_ty))


@triton.jit
def chunk_gla_fwd_o_kernel(q_ptr, v_ptr, g_ptr, h_ptr, a_ptr, o_ptr, seqlen, chunks, d_k, d_v, scale,
                           CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                           PRECISION: tl.constexpr):
    """o of one chunk and value block under GLA's per-dim gate: ``(Q o 2^G) h_c + A V`` with A from
    :func:`chunk_gla_fwd_a_kernel` (pointers as in :func:`chunk_fwd_o_kernel`; g_ptr (B*H, chunks * CHUNK,
    d_k)). Grid (chunks, B*H, cdiv(d_v, BLOCK_V))."""
    c, bh, pid_v = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    dtype = q_ptr.dtype.element_ty
    padded = chunks * CHUNK
    rows = c * CHUNK + tl.arange(0, CHUNK)
    cols_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = cols_v < d_v
    acc = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
    for start_k in range(0, d_k, BLOCK_K):  # inter-chunk: (q o 2^G) h_c
        cols_k = start_k + tl.arange(0, BLOCK_K)
        q = load_rows(q_ptr, bh, rows, seqlen, cols_k, d_k).to(tl.float32)
        g = load_rows(g_ptr, bh, rows, padded, cols_k, d_k)
        h = tl.load(h_ptr + (bh * chunks + c) * d_k * d_v + cols_k[:, None] * d_v + cols_v[None, :],
                    mask=(cols_k < d_k)[:, None] & v_ok[None, :], other=0.0)
        acc = tl.dot((q * tl.math.exp2(g)).to(dtype), h.to(dtype), acc, input_precision=PRECISION)
    scores = tl.load(a_ptr + (bh * padded + rows)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :])
    v = load_rows(v_ptr, bh, rows, seqlen, cols_v, d_v)
    acc = tl.dot(scores.to(dtype), v, acc, input_precision=PRECISION)
    out_rows, out_ok = chunk_tile(bh, rows, seqlen, cols_v, d_v)
    tl.store(o_ptr + out_rows, (acc * scale).to(o_ptr.dtype.element_ty), mask=out_ok)


# ---------------------------------------------------------------- launchers


def check_kernel_inputs(q, v, chunk_size: int | None) -> None:
    """Refuse what the linear-attention kernels cannot run, before any launch."""
    from .. import interpreting

    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"impl='triton' runs float16, bfloat16 and float32; q has dtype {q.dtype}: "
                        "use impl='torch' for float64")
    if not q.is_cuda and not interpreting():
        raise ValueError(f"q is on {q.device}, but this machine has CUDA, so Triton compiles kernels for the GPU. "
                         "Move the inputs to 'cuda', or use impl='torch' on the CPU.")
    for name, dim in (("head_dim_k", q.shape[-1]), ("head_dim_v", v.shape[-1])):
        if dim > 256:
            raise ValueError(f"impl='triton' takes {name} up to 256, got {dim}")
    if chunk_size is not None and chunk_size not in CHUNK_SIZES:
        raise ValueError(f"impl='triton' with form='chunk' needs chunk_size in {CHUNK_SIZES} (a power of two: "
                         f"a chunk is one tl.dot tile), got {chunk_size}; impl='torch' takes any chunk_size")


def gla_intra_scores(q, k, cum, chunk_size: int, dtype):
    """GLA's intra-chunk scores A, (B*H, chunks * C, C) in ``dtype`` (:func:`chunk_gla_fwd_a_kernel`), of
    contiguous q, k (B, H, N, d_k) and the log2 cumulated gate ``cum`` (:func:`.linear_gate.log2_cumulated_gate`)."""
    from ..common import cdiv

    batch, heads, seqlen, d_k = q.shape
    chunks = cdiv(seqlen, chunk_size)
    scores = torch.empty(batch * heads, chunks * chunk_size, chunk_size, dtype=dtype, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    chunk_gla_fwd_a_kernel[(chunks * (chunk_size // SUB_CHUNK), batch * heads)](
        q, k, cum, scores, seqlen, chunks, d_k, CHUNK=chunk_size, SUB=SUB_CHUNK, BLOCK_K=block_size(d_k, SCORE_BLOCK_K),
        PRECISION=precision, **launch_meta(chunk_gla_fwd_a_kernel, chunk_size))
    return scores


def chunk_forward(q, k, v, g, initial_state, scale: float, chunk_size: int):
    """Run both passes (no autograd). q, k (B, H, N, d_k), v (B, H, N, d_v), g None, (B, H, N) or
    (B, H, N, d_k); returns (o (B, H, N, d_v) in q.dtype, final state (B, H, d_k, d_v) float32)."""
    from ...linear.inputs import gate_kind
    from ..common import cdiv, on_device
    from .linear_gate import log2_cumulated_gate

    batch, heads, seqlen, d_k = q.shape
    d_v = v.shape[-1]
    chunks = cdiv(seqlen, chunk_size)
    kind = gate_kind(g)
    gate = GATE_CODES[kind]
    q, k, v = (t.contiguous() for t in (q, k, v))
    cum = log2_cumulated_gate(g, chunk_size) if g is not None else q
    h0 = initial_state.float().contiguous() if initial_state is not None else q
    h = torch.empty(batch * heads, chunks, d_k, d_v, dtype=q.dtype, device=q.device)  # read by the o pass only
    final_state = torch.empty(batch, heads, d_k, d_v, dtype=torch.float32, device=q.device)
    o = torch.empty(batch, heads, seqlen, d_v, dtype=q.dtype, device=q.device)
    block_k, block_v = block_size(d_k), block_size(d_v)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    tiles = h_pass_tiles(kind, d_k, d_v)
    with on_device(q):
        chunk_fwd_h_kernel[(cdiv(d_k, tiles["BLOCK_K"]), cdiv(d_v, tiles["BLOCK_V"]), batch * heads)](
            k, v, cum, h0, h, final_state, seqlen, chunks, d_k, d_v, CHUNK=chunk_size, GATE=gate,
            HAS_H0=initial_state is not None, PRECISION=precision,
            **launch_meta(chunk_fwd_h_kernel, chunk_size, kind), **tiles)
        grid = (chunks, batch * heads, cdiv(d_v, block_v))
        if gate == GATE_CODES["per_dim"]:
            scores = gla_intra_scores(q, k, cum, chunk_size, q.dtype)
            chunk_gla_fwd_o_kernel[grid](q, v, cum, h, scores, o, seqlen, chunks, d_k, d_v, scale, CHUNK=chunk_size,
                                         BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=precision,
                                         **launch_meta(chunk_gla_fwd_o_kernel, chunk_size))
        else:
            chunk_fwd_o_kernel[grid](q, k, v, cum, h, o, seqlen, chunks, d_k, d_v, scale, CHUNK=chunk_size,
                                     BLOCK_K=block_k, BLOCK_V=block_v, GATE=gate, PRECISION=precision,
                                     **launch_meta(chunk_fwd_o_kernel, chunk_size))
    return o, final_state


class RecomputedBackward(torch.autograd.Function):
    """A kernel forward with a PyTorch backward: autograd through ``reference`` recomputed in float32.

    forward(kernel, reference, q, k, v, g, beta, initial_state) -> (o, final_state), where both
    callables take (q, k, v, g, beta, initial_state) (None for absent ones) and return (o, final state).
    """

    @staticmethod
    def forward(ctx, kernel, reference, q, k, v, g, beta, initial_state):
        ctx.reference = reference
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        return kernel(q, k, v, g, beta, initial_state)

    @staticmethod
    def backward(ctx, grad_o, grad_state):
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().float().requires_grad_(n) for t, n in zip(inputs, needs)]
            o, final_state = ctx.reference(*leaves)
            wanted = [i for i, leaf in enumerate(leaves) if leaf is not None and leaf.requires_grad]
            grads = torch.autograd.grad((o, final_state), [leaves[i] for i in wanted],
                                        (grad_o.float(), grad_state.float()), allow_unused=True)
        result = [None] * len(inputs)
        for i, grad in zip(wanted, grads):
            result[i] = None if grad is None else grad.to(inputs[i].dtype)
        return (None, None, *result)


class ChunkLinearFunction(torch.autograd.Function):
    """Kernels both ways: :func:`chunk_forward`, and the backward passes of :mod:`.linear_chunk_bwd`.
    forward(q, k, v, g, initial_state, scale, chunk_size) -> (o, final_state)."""

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale, chunk_size):
        ctx.save_for_backward(q, k, v, g, initial_state)
        ctx.args = scale, chunk_size
        return chunk_forward(q, k, v, g, initial_state, scale, chunk_size)

    @staticmethod
    def backward(ctx, grad_o, grad_state):
        from .linear_chunk_bwd import chunk_backward

        q, k, v, g, initial_state = ctx.saved_tensors
        dq, dk, dv, dg, d_initial = chunk_backward(q, k, v, g, initial_state, grad_o, grad_state, *ctx.args)
        return (dq, dk, dv, None if g is None else dg.to(g.dtype),
                None if initial_state is None else d_initial.to(initial_state.dtype), None, None)


def triton_chunk_linear_attention(q, k, v, g, initial_state, scale: float, chunk_size: int):
    """Differentiable chunkwise linear attention / simple GLA / GLA (by g's shape) on checked inputs.

    Returns (o (B, H, N, d_v) in q.dtype, final state (B, H, d_k, d_v) float32); the backward is kernels
    too (:class:`ChunkLinearFunction`).
    """
    check_kernel_inputs(q, v, chunk_size)
    return ChunkLinearFunction.apply(q, k, v, g, initial_state, scale, chunk_size)
