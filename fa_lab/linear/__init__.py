"""Flash linear attention (chapter 08): causal linear attention, its gated variants and the delta rule.

Softmax attention reads every past key at every step; linear attention drops the softmax, so the
past folds into a fixed-size state ``S`` (d_k, d_v) per head and each token costs O(d_k d_v), however
long the sequence. Variants differ in how the state is updated (:mod:`.recurrent` states each one):

>>> o, _ = linear_attention(q, k, v)                                   # S_t = S_{t-1} + k_t^T v_t
>>> o, _ = linear_attention(q, k, v, g)        # g (B, H, N): simple GLA, RetNet's decay; (B, H, N, d_k): GLA
>>> o, state = delta_rule(q, k, v, beta, output_final_state=True)      # DeltaNet
>>> o, state = delta_rule(q, k, v, beta, g, initial_state=state)       # Gated DeltaNet

Each has three forms that compute the same thing (and the tests hold them to each other in float64):
``form="recurrent"`` (the definition, token by token: :mod:`.recurrent`), ``"parallel"`` (one masked
(Q K^T o D) V over the sequence, O(N^2): :mod:`.parallel`) and ``"chunk"`` (chunks of ``chunk_size``
tokens: a state pass and an output pass, fla's h/o decomposition: :mod:`.chunk`, and for the delta rule
the WY representation with :func:`solve_tril`: :mod:`.delta`).

Names and semantics follow flash-linear-attention (fla) where it has the feature: ``g`` is a log-decay
(``exp(g)`` in (0, 1], e.g. ``F.logsigmoid(x)``), the state is (d_k, d_v) (fla's ``h``), the scale
defaults to d_k ** -0.5, and a call returns ``(o, final_state)``, the final state None unless
``output_final_state``. Layout is SDPA's instead of fla's token-major default: q, k (B, H, N, d_k),
v (B, H, N, d_v). The delta rule expects L2-normalized keys (fla's ``use_qk_l2norm_in_kernel``
normalizes them; here the caller does): with ``|k| = 1`` and beta in [0, 1], ``I - beta k^T k``
shrinks the state instead of amplifying it.
"""
from __future__ import annotations

from .chunk import chunk_gla
from .delta import chunk_delta_rule
from .inputs import FORMS, IMPLS, check_linear_call, compute_dtype
from .parallel import parallel_delta_rule, parallel_gla
from .recurrent import recurrent_delta_rule, recurrent_gla
from .tril import solve_tril

__all__ = ["FORMS", "IMPLS", "delta_rule", "linear_attention", "solve_tril"]


def _cast(dtype, *tensors):
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def linear_attention(q, k, v, g=None, scale: float | None = None, initial_state=None,
                     output_final_state: bool = False, form: str = "chunk", chunk_size: int = 64,
                     impl: str = "torch"):
    """Causal linear attention, plain or gated. Returns (o, final_state).

    q, k: (batch, heads, seqlen, head_dim_k); v: (batch, heads, seqlen, head_dim_v).
    g: None (plain: S_t = S_{t-1} + k_t^T v_t), (B, H, N) log-decays, one per head and step (simple GLA,
        S_t = exp(g_t) S_{t-1} + k_t^T v_t), or (B, H, N, d_k), one per key dimension (GLA,
        S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t); finite and <= 0.
    scale: multiplies q, default d_k ** -0.5; o_t = scale * q_t S_t.
    initial_state: None or (B, H, d_k, d_v), the state before token 0 (a cache from an earlier call).
    output_final_state: also return the state after the last token, (B, H, d_k, d_v) float32 (float64
        for float64 inputs); otherwise final_state is None.
    form: "recurrent", "parallel" or "chunk" (module docstring). chunk_size: tokens per chunk, any
        int >= 1 for impl="torch" (a ragged last chunk is padded with zeros, which change nothing).
    impl: "torch" (PyTorch, any of float64/32/16/bfloat16; computes in float32, or float64 for float64
        inputs) or "triton" (float32/16/bfloat16 inputs: form="chunk" runs the h and o kernels of
        :mod:`fa_lab.kernels.portable.linear_chunk` with chunk_size 16, 32, 64 or 128, form="recurrent"
        the fused recurrent kernel of :mod:`fa_lab.kernels.portable.linear_recurrent`).
    o has q's dtype. Gradients reach q, k, v, g and initial_state; impl="triton" computes them with the
    backward kernels of :mod:`fa_lab.kernels.portable.linear_chunk_bwd` (form="chunk"), or by autograd
    through the PyTorch chunkwise form recomputed in float32 (form="recurrent", a decode-time form).
    """
    call = check_linear_call(q, k, v, g, None, initial_state, scale, output_final_state, form, chunk_size, impl,
                             delta=False)
    if impl == "triton":
        from ..kernels import triton_chunk_linear_attention, triton_fused_recurrent

        if form == "chunk":
            o, state = triton_chunk_linear_attention(q, k, v, g, initial_state, call.scale, chunk_size)
        else:
            o, state = triton_fused_recurrent(q, k, v, g, None, initial_state, call.scale)
    else:
        args = _cast(compute_dtype(q), q, k, v, g, initial_state)
        if form == "recurrent":
            o, state = recurrent_gla(*args[:4], call.scale, args[4])
        elif form == "parallel":
            o, state = parallel_gla(*args[:4], call.gate, call.scale, args[4])
        else:
            o, state = chunk_gla(*args[:4], call.gate, call.scale, args[4], chunk_size)
    return o.to(q.dtype), (state if output_final_state else None)


def delta_rule(q, k, v, beta, g=None, scale: float | None = None, initial_state=None,
               output_final_state: bool = False, form: str = "chunk", chunk_size: int = 64, impl: str = "torch"):
    """The delta rule (DeltaNet) or, with g, the gated delta rule (Gated DeltaNet). Returns (o, final_state).

    S_t = exp(g_t) (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t   (exp(g_t) = 1 without g),
    o_t = scale * q_t S_t. The state is corrected toward v_t for key k_t at rate beta_t rather than
    only added to: ``S_t = S' + k_t^T beta_t (v_t - k_t S')`` with ``S' = exp(g_t) S_{t-1}``.

    q, k: (B, H, N, d_k), k L2-normalized (module docstring); v: (B, H, N, d_v).
    beta: (B, H, N) in [0, 1]. g: None or (B, H, N) log-decays (<= 0), one per head and step.
    scale, initial_state, output_final_state, form, chunk_size: as in :func:`linear_attention`. form="chunk"
        uses the WY representation and :func:`solve_tril` (16 x 16 blocks) per chunk.
    impl: "torch", or "triton": form="chunk" runs the WY representation, the h pass and the o pass as
        kernels (:mod:`fa_lab.kernels.portable.linear_delta`), form="recurrent" the fused
        recurrent kernel. Gradients reach q, k, v, beta, g and initial_state (impl="triton", form="chunk":
        backward kernels, with or without g; form="recurrent": autograd through the PyTorch chunkwise form
        recomputed in float32).
    (fla's chunk_gated_delta_rule takes (q, k, v, g, beta); here g is optional and comes after beta.)
    """
    call = check_linear_call(q, k, v, g, beta, initial_state, scale, output_final_state, form, chunk_size, impl,
                             delta=True)
    if impl == "triton":
        from ..kernels import triton_chunk_delta_rule, triton_fused_recurrent

        if form == "chunk":
            o, state = triton_chunk_delta_rule(q, k, v, beta, g, initial_state, call.scale, chunk_size)
        else:
            o, state = triton_fused_recurrent(q, k, v, g, beta, initial_state, call.scale)
    else:
        q_, k_, v_, beta_, g_, h0 = _cast(compute_dtype(q), q, k, v, beta, g, initial_state)
        if form == "recurrent":
            o, state = recurrent_delta_rule(q_, k_, v_, beta_, g_, call.scale, h0)
        elif form == "parallel":
            o, state = parallel_delta_rule(q_, k_, v_, beta_, g_, call.scale, h0)
        else:
            o, state = chunk_delta_rule(q_, k_, v_, beta_, g_, call.scale, h0, chunk_size)
    return o.to(q.dtype), (state if output_final_state else None)
