"""Chapter 08's linear attention (fa_lab/linear/) and its Triton kernels (kernels/portable/linear_*.py).

As in flash-linear-attention's tests: the recurrent form is the definition, and every other form is
held to it. In float64 the parallel and chunkwise forms (several chunk sizes, ragged lengths, with and
without an initial state) must equal the recurrent one to rounding, outputs, final states and every
gradient; solve_tril must equal torch.linalg.solve_triangular. The kernels (the Triton interpreter on a
CPU, compiled in the ``gpu`` tests) are compared with the float64 recurrence by relative RMSE
(:func:`relative_rmse`, fla's ``get_err_ratio``) under the thresholds of :data:`RMSE_BOUND`.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fa_lab.linear import delta_rule, linear_attention, solve_tril

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels run in Triton's interpreter
GATES = ("none", "scalar", "per_dim")

# Relative RMSE bounds for the kernels against the float64 recurrence (on the same rounded inputs).
# 16-bit: four units of roundoff u (2^-8 for bfloat16, 2^-11 for float16). The output is rounded to
# its dtype once and the operands of every tl.dot (decayed keys, scores, the state) once more, each
# about u / sqrt(3) RMS; we measure about 0.6u (1.1u for the chunkwise delta rule, whose corrected
# values v_new are rounded too before they update the state), so 4u leaves room without admitting a
# wrong kernel (test_rmse_bound_rejects_mistakes: the mistakes it tries cost 0.08 to 3.5, over 16u).
# float32 rounds no operand (ieee dots); accumulation over up to 130 tokens measures ~1e-6.
RMSE_BOUND = {torch.float32: 1e-5, torch.float16: 4 * 2.0 ** -11, torch.bfloat16: 4 * 2.0 ** -8}


def relative_rmse(actual, expected) -> float:
    """sqrt(mean((a - e)^2)) / sqrt(mean(e^2)), in float64 (NaN anywhere gives NaN)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt()).item()


def make_inputs(generator, gate="scalar", delta=False, seqlen=77, d_k=32, d_v=24, dtype=torch.float64,
                device="cpu", batch=2, heads=2, with_state=True):
    """Random (q, k, v, g, beta, initial_state), none of them zeros; k L2-normalized for the delta rule.

    Log-decays logsigmoid(2x + 2) range from strong (decay ~0.1) to weak (~0.999), so both the
    intra-chunk term and the state carried across chunks matter.
    """
    shape = (batch, heads, seqlen)
    randn = lambda *s: torch.randn(*s, generator=generator, dtype=torch.float64)
    q, k, v = randn(*shape, d_k), randn(*shape, d_k), randn(*shape, d_v)
    if delta:
        k = F.normalize(k, dim=-1)
    g = {"none": None, "scalar": F.logsigmoid(2 * randn(*shape) + 2),
         "per_dim": F.logsigmoid(2 * randn(*shape, d_k) + 2)}[gate]
    beta = torch.sigmoid(randn(*shape)) if delta else None
    state = randn(batch, heads, d_k, d_v) if with_state else None
    side = torch.float64 if dtype == torch.float64 else torch.float32  # gates, beta and the state
    cast = lambda t, dt: None if t is None else t.to(device, dt)
    return (*(cast(t, dtype) for t in (q, k, v)), *(cast(t, side) for t in (g, beta, state)))


def run_with_grads(fn, inputs, grad_o, grad_state):
    """fn(q, k, v, g, beta, initial_state) -> (o, final_state) on fresh leaves: returns the dict of o, the
    final state and the gradient of every given input, for the loss <o, grad_o> + <state, grad_state>."""
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    o, state = fn(*leaves)
    torch.autograd.backward((o, state), (grad_o.to(o.device, o.dtype), grad_state.to(state.device, state.dtype)))
    result = {"o": o, "final_state": state}
    result.update({f"d{name}": leaf.grad for name, leaf in zip(names, leaves) if leaf is not None})
    return result


def call(delta: bool, **options):
    """The API as a function of (q, k, v, g, beta, initial_state) -> (o, final_state)."""
    if delta:
        return lambda q, k, v, g, beta, h0: delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True,
                                                       **options)
    return lambda q, k, v, g, beta, h0: linear_attention(q, k, v, g, initial_state=h0, output_final_state=True,
                                                         **options)


def float64_reference(delta, inputs):
    """The recurrence in float64 on the (rounded) inputs of a call in a lower precision."""
    return call(delta, form="recurrent")(*(None if t is None else t.double() for t in inputs))


def assert_equal_in_float64(actual: dict, expected: dict, label: str, bound: float = 1e-10):
    """Every tensor of ``expected`` equal to ``actual``'s up to float64 rounding (relative to its size)."""
    assert actual.keys() == expected.keys()
    for name, e in expected.items():
        a = actual[name]
        assert a is not None and a.shape == e.shape, f"{label}: {name}"
        error = (a - e).abs().max().item() / max(1.0, e.abs().max().item())
        assert error <= bound, f"{label}: {name} differs by {error:.3g} (relative to its max)"


def random_grads(generator, inputs):
    q, v = inputs[0], inputs[2]
    grad_o = torch.randn(v.shape, generator=generator, dtype=torch.float64)
    grad_state = torch.randn(*q.shape[:2], q.shape[-1], v.shape[-1], generator=generator, dtype=torch.float64)
    return grad_o, grad_state


# ---------------------------------------------------------------- the three forms, float64


@pytest.mark.parametrize("seqlen, with_state", [(77, False), (130, True)])
@pytest.mark.parametrize("gate", GATES)
def test_gla_forms_agree(gate, seqlen, with_state, generator):
    inputs = make_inputs(generator, gate, seqlen=seqlen, with_state=with_state)
    grads = random_grads(generator, inputs)
    expected = run_with_grads(call(False, form="recurrent"), inputs, *grads)
    assert_equal_in_float64(run_with_grads(call(False, form="parallel"), inputs, *grads), expected, "parallel")
    for chunk_size in (16, 24, 64, 200):  # 24: not a power of two; 200: one padded chunk
        actual = run_with_grads(call(False, form="chunk", chunk_size=chunk_size), inputs, *grads)
        assert_equal_in_float64(actual, expected, f"chunk {chunk_size}")


@pytest.mark.parametrize("seqlen, with_state", [(77, False), (130, True)])
@pytest.mark.parametrize("gate", ("none", "scalar"))
def test_delta_rule_forms_agree(gate, seqlen, with_state, generator):
    inputs = make_inputs(generator, gate, delta=True, seqlen=seqlen, with_state=with_state)
    grads = random_grads(generator, inputs)
    expected = run_with_grads(call(True, form="recurrent"), inputs, *grads)
    assert_equal_in_float64(run_with_grads(call(True, form="parallel"), inputs, *grads), expected, "parallel")
    for chunk_size in (16, 40, 64):  # 40: a chunk that solve_tril pads to 48
        actual = run_with_grads(call(True, form="chunk", chunk_size=chunk_size), inputs, *grads)
        assert_equal_in_float64(actual, expected, f"chunk {chunk_size}")


def test_recurrence_matches_its_definition(generator):
    """The recurrent references against the update rules written out for one head, token by token."""
    q, k, v, g, beta, state = (t[0, 0] for t in make_inputs(generator, "per_dim", delta=True, seqlen=9,
                                                             d_k=4, d_v=3, batch=1, heads=1))
    scale = 4 ** -0.5
    gla_state, delta_state, gla_out, delta_out = state.clone(), state.clone(), [], []
    for t in range(9):
        gla_state = torch.diag(g[t].exp()) @ gla_state + torch.outer(k[t], v[t])
        gla_out.append(scale * q[t] @ gla_state)
        decay = g[t].mean().exp()  # a scalar gate for the delta rule
        eye = torch.eye(4, dtype=q.dtype)
        transition = decay * (eye - beta[t] * torch.outer(k[t], k[t]))
        delta_state = transition @ delta_state + beta[t] * torch.outer(k[t], v[t])
        delta_out.append(scale * q[t] @ delta_state)
    lift = lambda t: t[None, None]
    o, final = linear_attention(lift(q), lift(k), lift(v), lift(g), initial_state=lift(state), output_final_state=True,
                                form="recurrent")
    torch.testing.assert_close(o[0, 0], torch.stack(gla_out), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final[0, 0], gla_state, rtol=1e-12, atol=1e-12)
    o, final = delta_rule(lift(q), lift(k), lift(v), lift(beta), lift(g.mean(-1)), initial_state=lift(state),
                          output_final_state=True, form="recurrent")
    torch.testing.assert_close(o[0, 0], torch.stack(delta_out), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final[0, 0], delta_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("delta", [False, True])
def test_state_carries_across_calls(delta, generator):
    """Prefill then decode: one call over 77 tokens equals a call over the first 50 followed by one call
    per token, each starting from the state the previous one returned (torch chunk and triton recurrent)."""
    inputs = make_inputs(generator, "scalar", delta=delta, seqlen=77, dtype=torch.float32, device=DEVICE)
    whole, whole_state = call(delta, form="recurrent")(*(t.double() if t is not None else None for t in inputs))
    cut = lambda t, a, b: None if t is None else t[:, :, a:b]
    for impl in ("torch", "triton"):
        q, k, v, g, beta, state = inputs
        form = "chunk" if impl == "torch" else "recurrent"
        outs = []
        for a, b in [(0, 50)] + [(i, i + 1) for i in range(50, 77)]:
            o, state = call(delta, form=form, impl=impl)(cut(q, a, b), cut(k, a, b), cut(v, a, b), cut(g, a, b),
                                                         cut(beta, a, b), state)
            outs.append(o)
        assert relative_rmse(torch.cat(outs, dim=2), whole) < RMSE_BOUND[torch.float32], impl
        assert relative_rmse(state, whole_state) < RMSE_BOUND[torch.float32], impl


def test_non_contiguous_inputs(generator):
    """(B, N, H, d) tensors viewed as (B, H, N, d), as a model's projections give them, in both impls."""
    q, k, v, g, _, state = make_inputs(generator, "per_dim", seqlen=40, dtype=torch.float32, device=DEVICE)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, g)]
    assert not strided[0].is_contiguous()
    expected = linear_attention(q, k, v, g, initial_state=state, output_final_state=True, form="chunk")
    for impl in ("torch", "triton"):
        actual = linear_attention(*strided, initial_state=state, output_final_state=True, impl=impl, chunk_size=16)
        for a, e in zip(actual, expected):
            assert relative_rmse(a, e) < RMSE_BOUND[torch.float32], impl


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_impl_computes_16_bit_inputs_in_float32(dtype, generator):
    """impl="torch" on 16-bit inputs: o in the inputs' dtype (rounded once), the state float32."""
    inputs = make_inputs(generator, "per_dim", seqlen=77, dtype=dtype)
    o, state = call(False, chunk_size=32)(*inputs)
    expected_o, expected_state = float64_reference(False, inputs)
    assert o.dtype == dtype and state.dtype == torch.float32
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    assert relative_rmse(o, expected_o) <= unit  # one rounding of the output: about unit / sqrt(3)
    assert relative_rmse(state, expected_state) <= 1e-5


# ---------------------------------------------------------------- solve_tril


@pytest.mark.parametrize("n", [1, 16, 64, 77, 130])
def test_solve_tril_matches_solve_triangular(n, generator):
    lower = torch.randn(2, 3, n, n, generator=generator, dtype=torch.float64) / n ** 0.5
    a = torch.tril(lower, diagonal=-1) + torch.eye(n, dtype=torch.float64)
    eye = torch.eye(n, dtype=torch.float64)
    expected = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
    # Only the strictly lower triangle is read: a diagonal and an upper triangle of noise change nothing.
    noisy = a + torch.triu(torch.randn(n, n, generator=generator, dtype=torch.float64))
    torch.testing.assert_close(solve_tril(noisy), expected, rtol=1e-10, atol=1e-10)
    assert torch.allclose(solve_tril(a) @ a, eye.expand_as(a), atol=1e-10)
    # and its gradient is the triangular solve's
    grad = torch.randn(a.shape, generator=generator, dtype=torch.float64)
    leaves = [lower.clone().requires_grad_() for _ in range(2)]
    build = lambda t: torch.tril(t, diagonal=-1) + eye
    solve_tril(build(leaves[0])).backward(grad)
    torch.linalg.solve_triangular(build(leaves[1]), eye, upper=False, unitriangular=True).backward(grad)
    torch.testing.assert_close(leaves[0].grad, leaves[1].grad, rtol=1e-9, atol=1e-9)


def test_solve_tril_refuses_non_square():
    with pytest.raises(ValueError, match="square"):
        solve_tril(torch.ones(4, 5))
    with pytest.raises(TypeError, match="floating-point"):
        solve_tril(torch.ones(4, 4, dtype=torch.int64))


# ---------------------------------------------------------------- the Triton kernels


def check_kernel(delta, inputs, dtype, **options):
    o, state = call(delta, impl="triton", **options)(*inputs)
    expected_o, expected_state = float64_reference(delta, inputs)
    assert o.dtype == dtype and state.dtype == torch.float32
    for name, a, e in (("o", o, expected_o), ("final_state", state, expected_state)):
        error = relative_rmse(a, e)
        assert error <= RMSE_BOUND[dtype], f"{name}: relative RMSE {error:.3g} > {RMSE_BOUND[dtype]:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gate, delta, chunk_size, seqlen", [
    ("none", False, 16, 77), ("scalar", False, 32, 130), ("scalar", False, 64, 77), ("per_dim", False, 16, 77),
    ("per_dim", False, 64, 130), ("none", True, 16, 130), ("scalar", True, 32, 77)])
def test_chunk_kernel(gate, delta, chunk_size, seqlen, dtype, generator):
    inputs = make_inputs(generator, gate, delta=delta, seqlen=seqlen, dtype=dtype, device=DEVICE)
    check_kernel(delta, inputs, dtype, form="chunk", chunk_size=chunk_size)


@pytest.mark.parametrize("gated, chunk_size, seqlen", [(False, 64, 150), (True, 32, 77), (True, 16, 40)])
def test_wy_kernel_matches_prepare_wy_repr(gated, chunk_size, seqlen, generator):
    """The WY kernel (the block-doubling inverse in registers) against fa_lab.linear.delta's PyTorch WY with
    solve_tril, in float64, on float32 inputs: w and u of every chunk, a ragged last one included."""
    from fa_lab.kernels.common import cdiv
    from fa_lab.kernels.portable.linear_delta import chunk_wy_kernel
    from fa_lab.kernels.portable.linear_gate import log2_cumulated_gate
    from fa_lab.kernels.portable.linear_launch import block_size
    from fa_lab.linear.chunk import chunk_local_cumsum
    from fa_lab.linear.decay import from_chunks, to_chunks
    from fa_lab.linear.delta import prepare_wy_repr

    _, k, v, g, beta, _ = make_inputs(generator, "scalar" if gated else "none", delta=True, seqlen=seqlen,
                                      dtype=torch.float32, device=DEVICE)
    cum = chunk_local_cumsum(g.double(), chunk_size) if gated else None
    expected = [from_chunks(t, seqlen) for t in prepare_wy_repr(
        *(to_chunks(t.double(), chunk_size) for t in (k, v, beta)), cum, "scalar" if gated else "none")]
    batch, heads, _, d_k = k.shape
    d_v = v.shape[-1]
    chunks = cdiv(seqlen, chunk_size)
    cum2 = log2_cumulated_gate(g, chunk_size) if gated else k
    inverse = torch.empty(batch * heads, chunks * chunk_size, chunk_size, dtype=torch.float32, device=DEVICE)
    results = []
    for mode in (1, 2):  # compute T and store it (the forward), then load it (the backward)
        w, u = torch.empty_like(k), torch.empty_like(v)
        chunk_wy_kernel[(chunks, batch * heads)](
            k, v, beta, cum2, inverse, w, u, seqlen, chunks, d_k, d_v, CHUNK=chunk_size, BLOCK_K=block_size(d_k),
            BLOCK_V=block_size(d_v), GATED=gated, PRECISION="ieee", INVERSE=mode)
        results.append((w, u))
    for name, actual, reference in (("w", results[0][0], expected[0]), ("u", results[0][1], expected[1])):
        error = relative_rmse(actual, reference)
        assert error <= RMSE_BOUND[torch.float32], f"{name}: relative RMSE {error:.3g}"
    assert all(torch.equal(a, b) for a, b in zip(*results)), "w, u from the stored T differ from the computed ones"


@pytest.mark.parametrize("shape", [(1, 2, 4100), (2, 1, 300, 40)])  # a scalar gate past one ROWS step; d_k = 40
def test_gate_cumsum_kernels_match_torch(shape, generator):
    """The gate kernels against PyTorch in float64: the chunk-local cumsum in log2 units (ragged last chunk,
    two column blocks) and the backward's reverse cumsum over the whole sequence (several carried steps)."""
    from fa_lab.kernels.common import LOG2E
    from fa_lab.kernels.portable.linear_gate import log2_cumulated_gate, reverse_cumsum
    from fa_lab.linear.chunk import chunk_local_cumsum

    g = -torch.rand(shape, generator=generator, dtype=torch.float64).to(DEVICE) - 0.01
    expected = (chunk_local_cumsum(g, 64) * LOG2E).flatten(0, 1).flatten(1, 2)
    torch.testing.assert_close(log2_cumulated_gate(g.float(), 64).double(), expected, rtol=1e-5, atol=1e-5)
    x = torch.randn(shape, generator=generator, dtype=torch.float64).to(DEVICE)
    actual = reverse_cumsum(x.float()).double()
    torch.testing.assert_close(actual, x.flip(2).cumsum(2).flip(2), rtol=1e-4, atol=1e-4 * shape[2] ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate, delta", [("none", False), ("scalar", False), ("per_dim", False),
                                         ("none", True), ("scalar", True)])
def test_fused_recurrent_kernel(gate, delta, dtype, generator):
    inputs = make_inputs(generator, gate, delta=delta, seqlen=77, d_k=24, dtype=dtype, device=DEVICE)
    check_kernel(delta, inputs, dtype, form="recurrent")


def test_fused_recurrent_one_step_from_zero_state(generator):
    """A decode step without an initial state: o = scale q (k^T v)."""
    q, k, v, g, _, _ = make_inputs(generator, "scalar", seqlen=1, dtype=torch.float16, device=DEVICE,
                                   with_state=False)
    o, state = linear_attention(q, k, v, g, output_final_state=True, form="recurrent", impl="triton")
    expected_state = k.double().transpose(-2, -1) @ v.double()
    assert relative_rmse(state, expected_state) <= RMSE_BOUND[torch.float16]
    assert relative_rmse(o, q.double() @ expected_state * 32 ** -0.5) <= RMSE_BOUND[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form, gate, delta", [("chunk", "none", False), ("chunk", "scalar", False),
                                               ("chunk", "per_dim", False), ("chunk", "none", True),
                                               ("chunk", "scalar", True), ("recurrent", "scalar", True)])
def test_kernel_gradients(form, gate, delta, dtype, generator):
    """impl="triton" backward against float64: the backward kernels (form="chunk": every gate, the delta rule
    with and without its gate), or autograd through the recomputed PyTorch chunk form (the fused recurrence)."""
    inputs = make_inputs(generator, gate, delta=delta, seqlen=77, dtype=dtype, device=DEVICE)
    grads = random_grads(generator, inputs)
    actual = run_with_grads(call(delta, form=form, impl="triton", chunk_size=32), inputs, *grads)
    expected = run_with_grads(call(delta, form="recurrent"), [None if t is None else t.double() for t in inputs],
                              *grads)
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].dtype == ({"o": dtype, "dq": dtype, "dk": dtype, "dv": dtype}.get(name, torch.float32))
        error = relative_rmse(actual[name], expected[name])
        assert error <= RMSE_BOUND[dtype], f"{name}: relative RMSE {error:.3g} > {RMSE_BOUND[dtype]:.3g}"


def test_rmse_bound_rejects_mistakes(generator):
    """The bounds above are far below what typical mistakes cost: a kernel that dropped the initial
    state, ignored the gate, or applied the gate one token late would fail them even in bfloat16."""
    q, k, v, g, _, state = make_inputs(generator, "scalar", seqlen=77)
    right = linear_attention(q, k, v, g, initial_state=state, form="recurrent")[0]
    late_gate = torch.cat([torch.zeros_like(g[:, :, :1]), g[:, :, :-1]], dim=2)
    mistakes = {"no initial state": linear_attention(q, k, v, g, form="recurrent")[0],
                "no gate": linear_attention(q, k, v, initial_state=state, form="recurrent")[0],
                "gate one token late": linear_attention(q, k, v, late_gate, initial_state=state, form="recurrent")[0]}
    for name, wrong in mistakes.items():
        assert relative_rmse(wrong, right) > 4 * RMSE_BOUND[torch.bfloat16], name


# ---------------------------------------------------------------- bad input


def _bad_calls():
    """(label, call, error type, message fragment); each call gets fresh valid inputs to spoil."""
    ok = lambda **kw: dict(dict(q=(2, 2, 8, 4), k=(2, 2, 8, 4), v=(2, 2, 8, 3)), **kw)
    return [
        ("q 3-D", ok(q=(2, 8, 4)), {}, ValueError, "4 dimensions"),
        ("k shape", ok(k=(2, 2, 8, 5)), {}, ValueError, "k must have q's shape"),
        ("v seqlen", ok(v=(2, 2, 7, 3)), {}, ValueError, "v must have shape"),
        ("g shape", ok(), dict(g=(2, 2, 7)), ValueError, "g must have shape"),
        ("g positive", ok(), dict(g="positive"), ValueError, "must be <= 0"),
        ("g nan", ok(), dict(g="nan"), ValueError, "g must be finite"),
        ("g int", ok(), dict(g="int"), TypeError, "floating-point"),
        ("state shape", ok(), dict(initial_state=(2, 2, 3, 4)), ValueError, "initial_state must have shape"),
        ("chunk 0", ok(), dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
        ("chunk -3", ok(), dict(chunk_size=-3), ValueError, "chunk_size must be a positive int"),
        ("chunk float", ok(), dict(chunk_size=16.0), ValueError, "chunk_size must be a positive int"),
        ("chunk bool", ok(), dict(chunk_size=True), ValueError, "chunk_size must be a positive int"),
        ("form", ok(), dict(form="fused"), ValueError, "form must be one of"),
        ("impl", ok(), dict(impl="cuda"), ValueError, "impl must be one of"),
        ("final flag", ok(), dict(output_final_state=1), TypeError, "output_final_state"),
        ("scale", ok(), dict(scale=-1.0), ValueError, "scale must be"),
        ("triton parallel", ok(), dict(impl="triton", form="parallel"), ValueError, "reference in PyTorch only"),
        ("triton float64", ok(dtype=torch.float64), dict(impl="triton"), TypeError, "use impl='torch' for float64"),
        ("triton chunk 48", ok(), dict(impl="triton", chunk_size=48), ValueError, "chunk_size in"),
    ]


def _tensor(shape, dtype, generator):
    return torch.randn(*shape, generator=generator).to(DEVICE, dtype)


def _spoil(value, shape, generator):
    """A bad g or initial_state: of the given shape (a tuple), positive, NaN or integer."""
    if isinstance(value, tuple):
        bad = -torch.rand(*value, generator=generator)
    elif value == "positive":
        bad = torch.rand(*shape, generator=generator) + 0.1
    elif value == "nan":
        bad = torch.full(shape, float("nan"))
    else:
        bad = -torch.ones(*shape, dtype=torch.int64)
    return bad.to(DEVICE)


@pytest.fixture
def nothing_computed(monkeypatch):
    """Replace every form and launcher by one that fails the test: a refused call must never reach them."""
    import fa_lab.linear as api
    from fa_lab.kernels.portable import linear_chunk, linear_delta, linear_recurrent

    def reached(*args, **kwargs):
        raise AssertionError("bad input reached the computation")

    for name in ("recurrent_gla", "parallel_gla", "chunk_gla", "recurrent_delta_rule", "parallel_delta_rule",
                 "chunk_delta_rule"):
        monkeypatch.setattr(api, name, reached)
    monkeypatch.setattr(linear_chunk, "chunk_forward", reached)
    monkeypatch.setattr(linear_recurrent, "recurrent_forward", reached)
    monkeypatch.setattr(linear_delta, "delta_chunk_forward", reached)


@pytest.mark.parametrize("label, shapes, options, error, message", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_input_refused(label, shapes, options, error, message, generator, nothing_computed):
    dtype = shapes.get("dtype", torch.float32)
    q, k, v = (_tensor(shapes[n], dtype, generator) for n in "qkv")
    options = dict(options)
    for name in ("g", "initial_state"):
        if name in options:
            options[name] = _spoil(options[name], q.shape[:3], generator)
    with pytest.raises(error, match=message):
        linear_attention(q, k, v, **options)


@pytest.mark.parametrize("beta, g, options, error, message", [
    ("above", None, {}, ValueError, "beta must lie in"),
    ("below", None, {}, ValueError, "beta must lie in"),
    ("nan", None, {}, ValueError, "beta must lie in"),
    ("shape", None, {}, ValueError, "beta must have shape"),
    (None, None, {}, TypeError, "beta must be a torch.Tensor"),
    ("ok", "per_dim", {}, ValueError, "g must have shape"),
    ("ok", None, dict(impl="triton", chunk_size=24), ValueError, "chunk_size in"),
])
def test_bad_delta_input_refused(beta, g, options, error, message, generator, nothing_computed):
    q, k, v = (torch.randn(2, 2, 8, 4, generator=generator).to(DEVICE) for _ in range(3))
    betas = {"above": torch.full((2, 2, 8), 1.5), "below": torch.full((2, 2, 8), -0.1),
             "nan": torch.full((2, 2, 8), float("nan")), "shape": torch.rand(2, 2, 7, generator=generator),
             "ok": torch.rand(2, 2, 8, generator=generator)}
    beta = betas[beta].to(DEVICE) if beta is not None else None
    gate = -torch.rand(2, 2, 8, 4, generator=generator).to(DEVICE) if g == "per_dim" else None
    with pytest.raises(error, match=message):
        delta_rule(q, k, v, beta, gate, **options)


def test_beta_at_the_ends_is_accepted(generator):
    """beta = 0 skips a token and beta = 1 overwrites its value: both are valid (sigmoid reaches them in bf16)."""
    q, k, v, _, beta, state = make_inputs(generator, "none", delta=True, seqlen=20)
    beta[:, :, :5], beta[:, :, 5:10] = 0.0, 1.0
    expected = delta_rule(q, k, v, beta, initial_state=state, output_final_state=True, form="recurrent")
    actual = delta_rule(q, k, v, beta, initial_state=state, output_final_state=True, chunk_size=8)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- compiled, on the GPU


def gpu_reference(delta, inputs):
    """The float64 chunkwise form (held to the recurrence by the tests above), fast enough at N = 4096."""
    return call(delta, form="chunk")(*(None if t is None else t.double() for t in inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("gate, delta", [("none", False), ("scalar", False), ("per_dim", False), ("scalar", True)])
def test_gpu_chunk_kernel(gate, delta, generator):
    inputs = make_inputs(generator, gate, delta=delta, seqlen=4096, d_k=128, d_v=128, dtype=torch.bfloat16,
                         device="cuda", batch=1, heads=4)
    o, state = call(delta, impl="triton", form="chunk", chunk_size=64)(*inputs)
    expected_o, expected_state = gpu_reference(delta, inputs)
    assert relative_rmse(o, expected_o) <= RMSE_BOUND[torch.bfloat16]
    assert relative_rmse(state, expected_state) <= RMSE_BOUND[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("gate, delta", [("scalar", False), ("per_dim", False), ("scalar", True)])
def test_gpu_fused_recurrent_kernel(gate, delta, generator):
    inputs = make_inputs(generator, gate, delta=delta, seqlen=4096, d_k=128, d_v=128, dtype=torch.bfloat16,
                         device="cuda", batch=1, heads=4)
    o, state = call(delta, impl="triton", form="recurrent")(*inputs)
    expected_o, expected_state = gpu_reference(delta, inputs)
    assert relative_rmse(o, expected_o) <= RMSE_BOUND[torch.bfloat16]
    assert relative_rmse(state, expected_state) <= RMSE_BOUND[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("gate, delta", [("none", False), ("scalar", False), ("per_dim", False), ("none", True),
                                         ("scalar", True)])
def test_gpu_chunk_kernel_gradients(gate, delta, generator):
    inputs = make_inputs(generator, gate, delta=delta, seqlen=4096, d_k=128, d_v=128, dtype=torch.bfloat16,
                         device="cuda", batch=1, heads=4)
    grads = [t.cuda() for t in random_grads(generator, inputs)]
    actual = run_with_grads(call(delta, impl="triton", form="chunk"), inputs, *grads)
    expected = run_with_grads(call(delta, form="chunk"), [None if t is None else t.double() for t in inputs], *grads)
    for name in expected:
        assert relative_rmse(actual[name], expected[name]) <= RMSE_BOUND[torch.bfloat16], name
