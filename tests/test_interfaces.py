"""Chapter 05's interfaces: grouped-query attention, local windows, the soft cap, ALiBi and packed
variable-length batches, against definitions written here one score at a time, then every impl
that takes them under the tolerance rule (forward, LSE and gradients)."""
from __future__ import annotations

import math

import pytest
import torch

import fa_lab
from fa_lab.flash_torch import _Tiles, flash_attention
from fa_lab.reference import reference_attention
from fa_lab.testing import LSE_FLOOR, check_attention, compare, make_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter


def attention_by_definition(q, k, v, causal, scale, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """(out, lse) in float64 from flash-attn's definitions, one (batch, head, query, key) at a time."""
    batch, heads, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    offset, (left, right) = seqlen_k - seqlen_q, window
    out = torch.zeros(batch, heads, seqlen_q, head_dim, dtype=torch.float64)
    lse = torch.full((batch, heads, seqlen_q), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            kv = h // (heads // heads_kv)
            slope = 0.0 if alibi_slopes is None else float(alibi_slopes.expand(batch, heads)[b, h])
            for i in range(seqlen_q):
                scores, values = [], []
                for j in range(seqlen_k):
                    visible = ((not causal or j <= i + offset) and (left < 0 or j >= i + offset - left)
                               and (right < 0 or j <= i + offset + right))
                    if not visible:
                        continue
                    s = scale * float(q[b, h, i].double() @ k[b, kv, j].double())
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    scores.append(s - slope * abs(i + offset - j))
                    values.append(v[b, kv, j].double())
                if scores:
                    top = max(scores)
                    weights = [math.exp(s - top) for s in scores]
                    total = sum(weights)
                    out[b, h, i] = sum(w * x for w, x in zip(weights, values)) / total
                    lse[b, h, i] = top + math.log(total)
    return out, lse


OPTION_CASES = [  # (heads, heads_kv, seqlen_q, seqlen_k, causal, window, softcap, alibi)
    (4, 2, 9, 13, False, (-1, -1), 0.0, None),
    (4, 1, 13, 9, True, (-1, -1), 0.0, None),
    (2, 2, 11, 11, False, (3, 2), 0.0, None),
    (2, 1, 7, 12, True, (4, -1), 0.0, None),
    (2, 2, 12, 7, False, (-1, 1), 0.0, None),
    (2, 2, 10, 10, False, (0, 0), 0.0, None),
    (2, 2, 9, 9, False, (-1, -1), 2.5, None),
    (4, 2, 8, 11, True, (-1, -1), 0.0, "heads"),
    (2, 1, 8, 8, False, (2, 3), 1.5, "batch"),
]


def _slopes(kind, batch, heads, generator):
    if kind is None:
        return None
    shape = (heads,) if kind == "heads" else (batch, heads)
    return torch.rand(shape, generator=generator) * 0.5 + 0.05


@pytest.mark.parametrize("heads, heads_kv, seqlen_q, seqlen_k, causal, window, softcap, alibi", OPTION_CASES)
def test_the_reference_is_the_definition(heads, heads_kv, seqlen_q, seqlen_k, causal, window, softcap, alibi,
                                         generator):
    q, k, v = make_qkv(2, heads, seqlen_q, seqlen_k, 8, generator=generator, heads_kv=heads_kv,
                       requires_grad=False)
    q = q * 2.0  # scores of a few units, so that the soft cap bends them
    slopes = _slopes(alibi, 2, heads, generator)
    options = {"window": window, "softcap": softcap, "alibi_slopes": slopes}
    out, lse = reference_attention(q, k, v, causal, 0.4, **options)
    want_out, want_lse = attention_by_definition(q, k, v, causal, 0.4, **options)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)


def _impl(name, **options):
    def run(q, k, v, causal, scale, **given):
        return fa_lab.attention(q, k, v, causal, scale, impl=name, return_lse=True, **given, **options)
    return run


def _tiled(q, k, v, causal, scale, **options):  # small tiles: ragged edges, bands across several tiles
    slopes = options.get("alibi_slopes")
    if slopes is not None:
        options = {**options, "alibi_slopes": slopes.expand(q.shape[0], q.shape[1])}
    return flash_attention(q, k, v, causal, scale, 8, 4, **options)


@pytest.mark.parametrize("impl", ["naive", "torch", "torch_small_tiles", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, heads_kv, seqlen_q, seqlen_k, causal, window, softcap, alibi", OPTION_CASES)
def test_impls_meet_the_tolerance_rule_with_every_option(impl, dtype, heads, heads_kv, seqlen_q, seqlen_k, causal,
                                                         window, softcap, alibi, generator):
    if impl == "triton":
        if dtype == torch.float32:
            pytest.skip("the Triton kernels take float16 and bfloat16")
        pytest.importorskip("triton")
    q, k, v = make_qkv(2, heads, 3 * seqlen_q, 3 * seqlen_k, 16, dtype, generator=generator, heads_kv=heads_kv)
    run = _tiled if impl == "torch_small_tiles" else _impl(impl)
    check_attention(run, q, k, v, causal, None, generator=generator, window=window, softcap=softcap,
                    alibi_slopes=_slopes(alibi, 2, heads, generator))


def test_rows_that_see_no_key_give_zeros_and_minus_infinity(generator):
    """A window (0, 0) with Nq > Nk: the first Nq - Nk rows sit above the keys, the rest see one key each."""
    q, k, v = make_qkv(1, 2, 20, 12, 16, generator=generator)
    for impl in ("naive", "torch"):
        out, lse = fa_lab.attention(q, k, v, impl=impl, window=(0, 0), return_lse=True)
        assert torch.equal(out[:, :, :8], torch.zeros_like(out[:, :, :8]))
        assert torch.isinf(lse[:, :, :8]).all() and (lse[:, :, :8] < 0).all()
        torch.testing.assert_close(out[:, :, 8:], v.detach().float(), rtol=1e-6, atol=1e-6)  # one key: P = 1


def test_a_window_visits_only_the_band(generator):
    q, k, _ = make_qkv(1, 1, 1024, 1024, 16, generator=generator, requires_grad=False)
    tiles = _Tiles(q, k, True, None, (100, -1), 0.0, None)
    for i0 in range(0, 1024, 64):
        visited = [j0 for j0, _ in tiles.key_tiles(i0, i0 + 64, 64)]
        assert len(visited) <= 3 and visited[-1] <= i0 < visited[0] + 64 + 100 + 64


def _packed(lengths_q, lengths_k, heads, heads_kv, head_dim, dtype, generator):
    q = torch.randn(sum(lengths_q), heads, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(sum(lengths_k), heads_kv, head_dim, generator=generator).to(dtype) for _ in range(2))
    offsets = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lengths_q,
                                                                                                   lengths_k)]
    return q, k, v, *offsets


def _varlen_run(impl, q, k, v, cu_q, cu_k, dout, **options):
    """(out, lse, dq, dk, dv) of attention_varlen on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa_lab.attention_varlen(*leaves, cu_q, cu_k, impl=impl, return_lse=True, **options)
    out.backward(dout)
    return (out, lse, *(t.grad for t in leaves))


def _varlen_reference(q, k, v, cu_q, cu_k, dout, causal, window, alibi_slopes, softcap=0.0):
    """(out, lse, dq, dk, dv) in float64, each sequence through reference_attention on its own slices."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64)
    total = 0.0
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        dense = [t[a:e].transpose(0, 1)[None] for t, (a, e) in zip(leaves, ((q0, q1), (k0, k1), (k0, k1)))]
        slopes = None if alibi_slopes is None else alibi_slopes[b:b + 1]
        o, l = reference_attention(*dense, causal, None, window=window, alibi_slopes=slopes, softcap=softcap)
        out[q0:q1], lse[:, q0:q1] = o[0].transpose(0, 1).detach(), l[0].detach()
        total = total + (o[0].transpose(0, 1) * dout[q0:q1].double()).sum()
    if torch.is_tensor(total):
        total.backward()
    return (out, lse, *(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves))


@pytest.mark.parametrize("impl", ["naive", "torch", "triton"])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, -1)), (False, (3, 3))])
def test_varlen_equals_attention_per_sequence(impl, causal, window, generator):
    """Lengths with empty sequences on both sides, GQA, ALiBi per sequence, under the tolerance rule
    (the baseline: the naive impl in the same dtype); gradients too. The Triton kernels walk the
    sequences' tiles in one launch."""
    dtype = torch.float32
    if impl == "triton":
        pytest.importorskip("triton")
        dtype = torch.float16
    lengths_q, lengths_k = [5, 0, 37, 9, 3], [7, 4, 41, 0, 12]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, 40, dtype, generator)
    slopes = torch.rand(len(lengths_q), 4, generator=generator) * 0.3
    dout = torch.randn(q.shape, generator=generator).to(dtype)
    options = {"causal": causal, "window": window, "alibi_slopes": slopes}
    actual = _varlen_run(impl, q, k, v, cu_q, cu_k, dout, **options)
    baseline = _varlen_run("naive", q, k, v, cu_q, cu_k, dout, **options)
    reference = _varlen_reference(q, k, v, cu_q, cu_k, dout, causal, window, slopes)
    assert actual[0].shape == (sum(lengths_q), 4, 40) and actual[1].shape == (4, sum(lengths_q))
    assert torch.equal(actual[0][37 + 5:37 + 5 + 9], torch.zeros_like(actual[0][42:51]))  # sequence 3 sees no key
    assert torch.isinf(actual[1][:, 42:51]).all()
    for name, got, want, base in zip(("out", "lse", "dq", "dk", "dv"), actual, reference, baseline):
        result = compare(name, got, want, base, dtype, floor=LSE_FLOOR if name == "lse" else None)
        assert result.ok, str(result)


def _cu(*bounds):
    return torch.tensor(bounds, dtype=torch.int32)


@pytest.mark.parametrize("change, error, words", [
    ({"cu_seqlens_q": _cu(0, 3, 2, 6)}, ValueError, ["cu_seqlens_q", "non-decreasing"]),
    ({"cu_seqlens_q": _cu(1, 3, 6)}, ValueError, ["cu_seqlens_q", "start at 0"]),
    ({"cu_seqlens_k": _cu(0, 3, 7)}, ValueError, ["cu_seqlens_k", "ends at 7", "6 tokens"]),
    ({"cu_seqlens_k": _cu(0, 6)}, ValueError, ["2 sequences", "1"]),
    ({"cu_seqlens_q": _cu(0, 3, 6).long()}, TypeError, ["int32"]),
    ({"max_seqlen_q": 2}, ValueError, ["max_seqlen_q", "longest", "3"]),
    ({"alibi_slopes": torch.ones(3)}, ValueError, ["alibi_slopes", "(2,)", "(2, 2)"]),
    ({"alibi_slopes": torch.ones(2, dtype=torch.float64)}, TypeError, ["alibi_slopes", "float32"]),
    ({"window": (-3, 0)}, ValueError, ["window", "-1"]),
    ({"softcap": -1.0}, ValueError, ["softcap"]),
    ({"k": torch.randn(6, 3, 8)}, ValueError, ["heads"]),
])
def test_varlen_bad_input_names_the_argument(change, error, words):
    args = {"q": torch.randn(6, 2, 8), "k": torch.randn(6, 1, 8), "v": torch.randn(6, 1, 8),
            "cu_seqlens_q": _cu(0, 3, 6), "cu_seqlens_k": _cu(0, 2, 6), **change}
    if "k" in change:
        args["v"] = change["k"]
    with pytest.raises(error) as raised:
        fa_lab.attention_varlen(**args)
    for word in words:
        assert word in str(raised.value)


@pytest.mark.parametrize("change, words", [
    ({"cu_seqlens_q": _cu(0, 3, 2, 6), "cu_seqlens_k": _cu(0, 2, 4, 6)}, ["cu_seqlens_q", "non-decreasing"]),
    ({"cu_seqlens_k": _cu(0, 3, 7)}, ["cu_seqlens_k", "ends at 7"]),
    ({"cu_seqlens_k": _cu(0, 6)}, ["2 sequences", "1"]),
    ({"max_seqlen_k": 3}, ["max_seqlen_k", "longest", "4"]),
])
def test_varlen_kernels_check_the_offsets_before_any_launch(change, words, monkeypatch):
    """The one-launch kernels read cu_seqlens where the schedule needs them (fa_lab.varlen.PackedBounds):
    bad values still raise the API's ValueError, and no kernel is launched."""
    pytest.importorskip("triton")
    from fa_lab.kernels.portable import attention as portable

    def no_schedule(*_args, **_kwargs):
        raise AssertionError("a schedule was built from bad offsets")
    monkeypatch.setattr(portable, "_cached_schedule", no_schedule)
    args = {"q": torch.randn(6, 2, 16).half(), "k": torch.randn(6, 1, 16).half(), "v": torch.randn(6, 1, 16).half(),
            "cu_seqlens_q": _cu(0, 3, 6), "cu_seqlens_k": _cu(0, 2, 6), **change}
    with pytest.raises(ValueError) as raised:
        fa_lab.attention_varlen(**args, impl="triton")
    for word in words:
        assert word in str(raised.value)


@pytest.mark.parametrize("by_keys", [False, True])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 2)), (True, (9, -1)),
                                            (False, (-1, 0)), (False, (0, 7))])
def test_tile_schedule_orders_the_tiles_by_their_work(by_keys, causal, window, generator):
    """The varlen schedule, built with tensor operations, against a loop over BlockInfo: every (sequence, start)
    tile once, sorted by its work (the keys a query tile visits, the query rows a key tile meets), largest first,
    ties in (sequence, start) order. Random lengths, some 0, queries longer and shorter than keys."""
    from fa_lab.block_info import BlockInfo
    from fa_lab.kernels.portable.attention import tile_schedule

    block = 8
    lengths = torch.randint(0, 40, (2, 9), generator=generator)
    lengths[:, 3] = 0
    bounds_q, bounds_k = ([0] + torch.cumsum(row, 0).tolist() for row in lengths)
    expected = []
    for sequence, (q0, q1, k0, k1) in enumerate(zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:])):
        info = BlockInfo(q1 - q0, k1 - k0, causal, window)
        for start in range(0, (k1 - k0) if by_keys else (q1 - q0), block):
            if by_keys:
                work = max(info.seqlen_q - info.first_query(start), 0)
            else:
                begin, end = info.key_range(start, start + block)
                work = max(end - begin, 0)
            expected.append((-work, sequence, start))
    expected = [[sequence, start] for _, sequence, start in sorted(expected)]
    assert tile_schedule(bounds_q, bounds_k, block, by_keys, causal, window).tolist() == expected


def check_device_tiles(launch, head_dim, device, generator):
    """A packed forward scheduled from offsets left on the device (DeviceTiles: an upper bound of tiles, the
    rest of an empty sequence) computes what the host-scheduled launch computes, to the bit, on every packed row;
    rows past the packed total are there and are not read."""
    from fa_lab.kernels.common import kernel_operand
    from fa_lab.kernels.portable.attention import NO_OPTIONS, DeviceTiles

    lengths_q, lengths_k = [1, 70, 0, 129, 5, 0], [3, 200, 17, 128, 0, 0]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 2, 1, head_dim, torch.bfloat16, generator)
    spare = torch.randn(37, 2, head_dim, generator=generator).to(q.dtype)  # rows past cu_q[-1]
    q, k, v = (kernel_operand(t.to(device).contiguous()) for t in (torch.cat([q, spare]), k, v))
    cu_q, cu_k = cu_q.to(device), cu_k.to(device)
    total = sum(lengths_q)
    want_out, want_lse = launch(q, k, v, cu_q, cu_k, (cu_q.tolist(), cu_k.tolist()), False, 0.3, NO_OPTIONS)
    got_out, got_lse = launch(q, k, v, cu_q, cu_k, DeviceTiles(cu_q, cu_k, len(q)), False, 0.3, NO_OPTIONS)
    assert torch.equal(got_out[:total], want_out[:total]) and torch.equal(got_lse[:, :total], want_lse[:, :total])
    with pytest.raises(ValueError, match="without a mask"):
        launch(q, k, v, cu_q, cu_k, DeviceTiles(cu_q, cu_k, len(q)), True, 0.3, NO_OPTIONS)


def test_device_tiles_schedule_what_the_host_schedules(generator):
    pytest.importorskip("triton")
    from fa_lab.kernels.portable.attention import triton_varlen_forward

    check_device_tiles(triton_varlen_forward, 32, DEVICE, generator)


@pytest.mark.gpu
def test_gpu_device_tiles_on_the_gluon_kernel(generator):
    from fa_lab.kernels.hopper.attention import gluon_varlen_forward

    check_device_tiles(gluon_varlen_forward, 128, "cuda", generator)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("switch", ["split_loops", "rescale_early"])
def test_gpu_packed_forward_switches_keep_the_bits(head_dim, causal, switch, generator):
    """The Gluon forward of a packed batch (empty and one-key sequences, ragged ends, grouped K/V) computes O and lse
    bit for bit the same with the switch on as off: three K/V loops or one, O rescaled at the step's end or before
    the next P V; without a window, with windows narrower and wider than a tile, and with a soft cap."""
    from fa_lab.kernels.common import kernel_operand
    from fa_lab.kernels.hopper.attention import HopperOptions, gluon_varlen_forward
    from fa_lab.kernels.portable.attention import ScoreOptions

    lengths_q, lengths_k = [1, 700, 0, 129, 300, 2000], [3, 900, 17, 128, 300, 2000]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, head_dim, torch.bfloat16, generator)
    q, k, v = (kernel_operand(t.cuda().contiguous()) for t in (q, k, v))
    cu_q, cu_k = cu_q.cuda(), cu_k.cuda()
    bounds = (cu_q.tolist(), cu_k.tolist())
    for given in (ScoreOptions(), ScoreOptions(window=(100, -1)), ScoreOptions(window=(64, 64)),
                  ScoreOptions(window=(1024, 0)), ScoreOptions(softcap=30.0)):
        off, on = (gluon_varlen_forward(q, k, v, cu_q, cu_k, bounds, causal, head_dim ** -0.5, given,
                                        HopperOptions(**{switch: flag})) for flag in (False, True))
        for name, a, b in zip(("out", "lse"), off, on):
            assert torch.equal(a, b), (name, given)


def test_varlen_reads_a_cu_seqlens_tensor_once_per_version(monkeypatch, generator):
    """A model passes one cu_seqlens to every layer: the offsets are read once and kept with the tensor
    (fa_lab.varlen.PackedBounds). A write by a torch operation makes the next call read them again, so a
    bad value written in place still raises, and a good one changes the result."""
    from fa_lab.varlen import PackedBounds

    reads = []
    read = PackedBounds._read
    monkeypatch.setattr(PackedBounds, "_read", lambda self: reads.append(1) or read(self))
    q, k, v, cu_q, cu_k = _packed([5, 9, 3], [7, 4, 12], 2, 1, 16, torch.float32, generator)
    first = fa_lab.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    again = fa_lab.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert len(reads) == 1 and torch.equal(first, again)
    cu_q[1] = 20  # 0, 20, 14, 17: no longer non-decreasing
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        fa_lab.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert len(reads) == 2
    cu_q[1] = 8  # lengths 8, 6, 3: a valid batch again, with different sequences
    moved = fa_lab.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert len(reads) == 3
    expected = fa_lab.attention_varlen(q, k, v, cu_q.clone(), cu_k.clone(), causal=True)
    assert torch.equal(moved, expected) and not torch.equal(moved[:5], first[:5])
    with pytest.raises(ValueError, match="max_seqlen_q is 7"):  # per-call checks run on values already read
        fa_lab.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=7)
    with torch.inference_mode():  # inference tensors count no writes: every call reads
        cu = cu_q.clone()
        fa_lab.attention_varlen(q, k, v, cu, cu_k, causal=True)
        fa_lab.attention_varlen(q, k, v, cu, cu_k, causal=True)
    assert len(reads) == 6  # the clone for `expected` and both inference-mode calls read; nothing else did


def test_dense_bad_options_and_impls_that_do_not_take_them():
    q, k, v = make_qkv(1, 4, 8, 8, 16, requires_grad=False, heads_kv=2)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        fa_lab.attention(q, k, v, alibi_slopes=torch.ones(2))
    with pytest.raises(TypeError, match="window must be a pair"):
        fa_lab.attention(q, k, v, window=4)
    with pytest.raises(NotImplementedError, match="'triton_hopper_fp8' does not take window"):
        fa_lab.attention(q.half(), k.half(), v.half(), impl="triton_hopper_fp8", window=(2, 2))
    with pytest.raises(NotImplementedError, match="softcap"):
        fa_lab.attention(q.half(), k.half(), v.half(), impl="triton_hopper_fp8", softcap=5.0)


def test_the_hopper_impl_runs_score_options_through_the_triton_kernels(generator):
    pytest.importorskip("triton")
    q, k, v = make_qkv(1, 4, 24, 30, 32, torch.float16, generator=generator, heads_kv=2)
    check_attention(_impl("triton_hopper"), q, k, v, True, None, generator=generator, window=(5, -1), softcap=3.0)


def test_grouped_heads_through_the_triton_kernels(generator):
    pytest.importorskip("triton")
    q, k, v = make_qkv(1, 4, 40, 33, 32, torch.float16, generator=generator, heads_kv=2)
    check_attention(_impl("triton"), q, k, v, True, None, generator=generator)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU")),
    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("heads_kv, causal, window, softcap", [(2, True, (-1, -1), 0.0), (4, False, (9, 3), 4.0)])
def test_the_backward_with_atomic_dq_meets_the_tolerance_rule(device, heads_kv, causal, window, softcap, generator):
    """The one-kernel backward that adds each tile pair's dQ into a float32 buffer (atomic_dq, the
    ablation of benchmarks/h200_bwd_atomic_dq.json) gives dq, dk, dv within the tolerance rule, with
    grouped heads, a window and the soft cap."""
    pytest.importorskip("triton")
    from fa_lab.kernels import load_triton
    from fa_lab.reference import naive_attention

    load_triton()
    from fa_lab.kernels.portable.attention import ScoreOptions, triton_backward, triton_forward

    dtype = torch.float16
    q, k, v = make_qkv(2, 4, 45, 70, 32, dtype, device, generator=generator, heads_kv=heads_kv)
    scale = 32 ** -0.5
    options = ScoreOptions(window=window, softcap=softcap)
    out, lse = triton_forward(q, k, v, causal, scale, options=options)
    grad_out = torch.randn(out.shape, generator=generator).to(device, dtype)
    grads = triton_backward(q, k, v, out, lse, grad_out, causal, scale, options=options, atomic_dq=True)
    references = []
    for fn, cast in ((reference_attention, torch.Tensor.double), (naive_attention, torch.Tensor.clone)):
        leaves = [cast(t.detach()).requires_grad_() for t in (q, k, v)]
        fn(*leaves, causal, scale, window=window, softcap=softcap)[0].backward(cast(grad_out))
        references.append([t.grad for t in leaves])
    for name, got, reference, baseline in zip(("dq", "dk", "dv"), grads, *references):
        result = compare(name, got, reference, baseline, dtype)
        assert result.ok, str(result)


GPU_CASES = [  # (heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, window, softcap, alibi)
    (8, 2, 1000, 1000, 128, True, (-1, -1), 0.0, False),
    (8, 1, 333, 1025, 64, False, (-1, -1), 0.0, False),
    (4, 4, 1537, 1537, 128, False, (256, 0), 0.0, False),
    (8, 2, 900, 1200, 64, True, (100, -1), 30.0, False),
    (4, 4, 777, 777, 128, False, (64, 64), 0.0, True),
    (8, 4, 513, 700, 96, True, (-1, -1), 50.0, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "triton_hopper"])
@pytest.mark.parametrize("heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, window, softcap, alibi", GPU_CASES)
def test_gpu_option_matrix(impl, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, window, softcap, alibi,
                           generator):
    q, k, v = make_qkv(2, heads, seqlen_q, seqlen_k, head_dim, torch.bfloat16, "cuda", generator=generator,
                       heads_kv=heads_kv)
    slopes = (torch.rand(2, heads, generator=generator) * 0.1).cuda() if alibi else None
    check_attention(_impl(impl), q, k, v, causal, None, generator=generator, window=window, softcap=softcap,
                    alibi_slopes=slopes)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "triton_hopper"])
@pytest.mark.parametrize("causal, window, softcap", [(True, (-1, -1), 0.0), (False, (-1, -1), 0.0),
                                                     (True, (200, -1), 0.0), (False, (-1, -1), 20.0)])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_gpu_varlen_in_one_launch(impl, causal, window, softcap, head_dim, generator, monkeypatch):
    """A packed batch with empty sequences on both sides, rows that see no key, sequences shorter than a
    tile and ragged last tiles, GQA and ALiBi per sequence, against float64 per sequence. triton_hopper's
    forward must be the Gluon kernel (its partial tiles are stored row by row, next to the next sequence's
    rows)."""
    import fa_lab.kernels.hopper.attention as hopper

    def not_portable(*_args, **_kwargs):
        raise AssertionError("the packed batch went to the portable forward")
    monkeypatch.setattr(hopper, "triton_varlen_forward", not_portable)
    lengths_q = [1, 700, 0, 129, 1500, 64, 3]
    lengths_k = [1, 900, 17, 0, 1500, 300, 3]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, 2, head_dim, torch.bfloat16, generator)
    q, k, v, cu_q, cu_k = (t.cuda() for t in (q, k, v, cu_q, cu_k))
    slopes = (torch.rand(len(lengths_q), 8, generator=generator) * 0.1).cuda()
    dout = torch.randn(q.shape, generator=generator).to(q.device, q.dtype)
    options = {"causal": causal, "window": window, "alibi_slopes": slopes, "softcap": softcap}
    actual = _varlen_run(impl, q, k, v, cu_q, cu_k, dout, **options)
    baseline = _varlen_run("naive", q, k, v, cu_q, cu_k, dout, **options)
    reference = _varlen_reference(*(t.cpu() for t in (q, k, v, cu_q, cu_k, dout)), causal, window, slopes.cpu(),
                                  softcap)
    for name, got, want, base in zip(("out", "lse", "dq", "dk", "dv"), actual, reference, baseline):
        result = compare(name, got, want, base, torch.bfloat16, floor=LSE_FLOOR if name == "lse" else None)
        assert result.ok, str(result)


@pytest.mark.gpu
@pytest.mark.parametrize("dq_mode", ["turns", "partial", "split", "named"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, heads_kv, head_dim, dtype", [(8, 2, 128, torch.bfloat16), (4, 4, 64, torch.bfloat16),
                                                             (4, 1, 128, torch.float16)])
def test_gpu_gluon_varlen_backward(causal, heads, heads_kv, head_dim, dtype, dq_mode, generator, monkeypatch):
    """The Gluon FA3 backward of a packed batch (the portable one is monkeypatched away), with each dQ scheme
    ("split" at d = 128): empty sequences on both sides, sequences shorter than a tile, key tiles that end inside
    the packed tensor next to the next sequence's keys, more queries than keys and fewer, grouped K/V; out, lse
    and gradients against float64 per sequence."""
    import fa_lab.kernels.hopper.attention as hopper

    if dq_mode == "split" and head_dim != 128:
        pytest.skip("dq_mode='split' runs at head_dim 128 only")

    def not_portable(*_args, **_kwargs):
        raise AssertionError("the packed batch went to the portable backward")
    gluon = hopper.gluon_varlen_backward
    monkeypatch.setattr(hopper, "triton_varlen_backward", not_portable)
    monkeypatch.setattr(hopper, "gluon_varlen_backward", lambda *args: gluon(*args[:-1], dq_mode))
    monkeypatch.setattr(hopper, "GLUON_VARLEN_BACKWARD_AUTO", True)
    monkeypatch.setattr(hopper, "gluon_backward_is_faster", lambda *_args: True)
    lengths_q = [1, 700, 0, 129, 1500, 64, 3, 300]
    lengths_k = [1, 900, 17, 0, 1500, 300, 3, 200]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, heads, heads_kv, head_dim, dtype, generator)
    q, k, v, cu_q, cu_k = (t.cuda() for t in (q, k, v, cu_q, cu_k))
    dout = torch.randn(q.shape, generator=generator).to(q.device, q.dtype)
    actual = _varlen_run("triton_hopper", q, k, v, cu_q, cu_k, dout, causal=causal)
    baseline = _varlen_run("naive", q, k, v, cu_q, cu_k, dout, causal=causal)
    reference = _varlen_reference(*(t.cpu() for t in (q, k, v, cu_q, cu_k, dout)), causal, (-1, -1), None)
    for name, got, want, base in zip(("out", "lse", "dq", "dk", "dv"), actual, reference, baseline):
        result = compare(name, got, want, base, dtype, floor=LSE_FLOOR if name == "lse" else None)
        assert result.ok, str(result)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "triton_hopper"])
def test_gpu_a_varlen_call_is_captured_by_a_cuda_graph_once_its_offsets_are_known(impl, generator):
    """After a first call has read cu_seqlens (fa_lab.varlen.PackedBounds), the same call reads nothing back
    from the GPU, so a CUDA graph can capture it; the replay equals the eager call."""
    q, k, v, cu_q, cu_k = _packed([300, 0, 129, 1000], [300, 17, 200, 1000], 8, 2, 128, torch.bfloat16,
                                  generator)
    q, k, v, cu_q, cu_k = (t.cuda() for t in (q, k, v, cu_q, cu_k))
    with torch.no_grad():
        eager = fa_lab.attention_varlen(q, k, v, cu_q, cu_k, causal=True, impl=impl)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks
            fa_lab.attention_varlen(q, k, v, cu_q, cu_k, causal=True, impl=impl)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fa_lab.attention_varlen(q, k, v, cu_q, cu_k, causal=True, impl=impl)
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_a_right_bound_of_zero_is_the_causal_mask(generator):
    from fa_lab.block_info import canonical_mask

    assert canonical_mask(False, (-1, 0)) == (True, (-1, -1))
    assert canonical_mask(False, (5, 0)) == (True, (5, -1))
    assert canonical_mask(True, (5, 3)) == (True, (5, -1))
    assert canonical_mask(False, (2, 3)) == (False, (2, 3))
    q, k, v = make_qkv(1, 2, 20, 27, 16, generator=generator, requires_grad=False)
    for impl in ("naive", "torch"):
        torch.testing.assert_close(fa_lab.attention(q, k, v, impl=impl, window=(-1, 0)),
                                   fa_lab.attention(q, k, v, causal=True, impl=impl))


def test_varlen_takes_strided_offsets(generator):
    q = torch.randn(10, 2, 16, generator=generator).half()  # 10 tokens, 2 query heads over 1 K/V head
    k, v = (torch.randn(10, 1, 16, generator=generator).half() for _ in range(2))
    strided = torch.tensor([0, 4, 4, 10, 10, 10], dtype=torch.int32)[::2]  # (0, 4, 10), stride 2
    packed = strided.contiguous()
    for impl in ("torch", "triton"):
        torch.testing.assert_close(fa_lab.attention_varlen(q, k, v, strided, strided, impl=impl),
                                   fa_lab.attention_varlen(q, k, v, packed, packed, impl=impl))
