"""The Hopper forward (impl "triton_hopper") and the FP8 forward (impl "triton_hopper_fp8")."""
import dataclasses
import itertools

import pytest
import torch

import fa_lab
from fa_lab.kernels.portable.configs import TileConfig
from fa_lab.testing import check_attention, make_qkv

pytest.importorskip("triton")
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from fa_lab.kernels.hopper.fa3_softmax import exp2_mixed  # noqa: E402

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")


def hopper_impl(q, k, v, causal, scale):
    return fa_lab.attention(q, k, v, causal=causal, scale=scale, impl="triton_hopper", return_lse=True)


@CPU_ONLY
@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (113, 203), (203, 113), (64, 64), (70, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_hopper_variants(pipeline, seqlen_q, seqlen_k, causal, generator):
    from fa_lab.kernels.hopper import HopperOptions, triton_hopper_attention

    q, k, v = make_qkv(1, 2, seqlen_q, seqlen_k, 40, torch.bfloat16, generator=generator)
    options = HopperOptions(kernel="triton", pipeline=pipeline)
    fn = lambda *a: triton_hopper_attention(*a, config=TileConfig(32, 32), options=options)
    check_attention(fn, q, k, v, causal, None, generator=generator)


@CPU_ONLY
def test_interpreter_hopper_through_api(generator):
    q, k, v = make_qkv(1, 2, 50, 70, 64, torch.float16, generator=generator, strided=True)
    check_attention(hopper_impl, q, k, v, True, None, generator=generator)


@CPU_ONLY
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_fp8_matches_the_cpu_emulation(causal, generator):
    """The kernel computes what the FP8 emulation in fa_lab.fp8 computes (same quantization, same P scale)."""
    from fa_lab.fp8 import fp8_attention_forward, rmse
    from fa_lab.kernels.hopper import triton_hopper_fp8_attention
    from fa_lab.reference import reference_attention

    q, k, v = (torch.randn(1, 2, n, 64, generator=generator).bfloat16() for n in (96, 160, 160))
    reference = reference_attention(q, k, v, causal)[0]
    out = triton_hopper_fp8_attention(q, k, v, causal, None, config=TileConfig(32, 32), rotate=False)[0]
    kernel_rmse = rmse(out, reference)
    emulated_rmse = rmse(fp8_attention_forward(q, k, v, causal, block_q=32, block_k=32, incoherent=False),
                         reference)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert abs(kernel_rmse - emulated_rmse) <= 0.05 * emulated_rmse, (kernel_rmse, emulated_rmse)
    assert kernel_rmse < 0.05  # far from garbage: e4m3 keeps 3 mantissa bits


def _prequantized(generator, device, heads=4, heads_kv=2):
    """bf16-valued q, k, v quantized to e4m3 as flash-attn's FP8 interface takes them: one float32 descale per
    (batch, KV head), q's shared by the query heads of a group. Returns ((q8, k8, v8), descales, dequantized)."""
    q = torch.randn(2, heads, 96, 64, generator=generator) * 2
    k, v = (torch.randn(2, heads_kv, 160, 64, generator=generator) for _ in range(2))
    group = heads // heads_kv

    def quantize(x, per):
        descale = x.unflatten(1, (x.shape[1] // per, per)).abs().amax(dim=(2, 3, 4)) / 448.0  # (B, Hkv)
        x8 = (x / descale.repeat_interleave(per, dim=1)[..., None, None]).to(torch.float8_e4m3fn)
        return x8, descale, x8.float() * descale.repeat_interleave(per, dim=1)[..., None, None]

    parts = [quantize(x, per) for x, per in ((q, group), (k, 1), (v, 1))]
    return tuple(p[0].to(device) for p in parts), tuple(p[1].to(device) for p in parts), [p[2] for p in parts]


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=CPU_ONLY), pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_takes_already_quantized_inputs_with_descales(device, causal, generator):
    """e4m3 q, k, v with flash-attn's (batch, heads_kv) descales, grouped heads: the output is attention of the
    dequantized inputs to e4m3's P rounding (bf16 out), and a wrong descale is caught."""
    from fa_lab.fp8 import rmse
    from fa_lab.reference import reference_attention

    pytest.importorskip("triton")
    (q8, k8, v8), (qd, kd, vd), dequantized = _prequantized(generator, device)
    reference = reference_attention(*(t.double() for t in dequantized), causal)[0]
    out = fa_lab.attention(q8, k8, v8, causal, impl="triton_hopper_fp8", q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4, 96, 64)
    assert rmse(out.cpu(), reference) < 0.015  # (about 0.004 on a CPU: P rounded to e4m3, out to bf16)
    doubled = fa_lab.attention(q8, k8, v8, causal, impl="triton_hopper_fp8", q_descale=qd, k_descale=kd,
                               v_descale=vd * 2)
    assert rmse(doubled.cpu(), reference) > 10 * rmse(out.cpu(), reference)


def test_already_quantized_inputs_bad_input_names_the_argument(generator):
    (q8, k8, v8), (qd, kd, vd), dequantized = _prequantized(generator, "cpu")
    fp8 = dict(impl="triton_hopper_fp8", q_descale=qd, k_descale=kd, v_descale=vd)
    with pytest.raises(ValueError, match="v_descale missing"):
        fa_lab.attention(q8, k8, v8, impl="triton_hopper_fp8", q_descale=qd, k_descale=kd)
    with pytest.raises(TypeError, match="q, k and v all in float8_e4m3fn"):
        fa_lab.attention(dequantized[0].bfloat16(), k8, v8, **fp8)
    with pytest.raises(TypeError, match="q_descale"):
        fa_lab.attention(*(t.bfloat16() for t in dequantized), q_descale=qd)
    with pytest.raises(ValueError, match="impl='triton_hopper_fp8' only"):
        fa_lab.attention(q8, k8, v8, impl="triton", q_descale=qd, k_descale=kd, v_descale=vd)
    with pytest.raises(ValueError, match=r"k_descale must have shape \(batch, heads_kv\) = \(2, 2\)"):
        fa_lab.attention(q8, k8, v8, **{**fp8, "k_descale": kd[:, :1]})
    with pytest.raises(TypeError, match="v_descale must be float32"):
        fa_lab.attention(q8, k8, v8, **{**fp8, "v_descale": vd.double()})
    with pytest.raises(ValueError, match="q_descale must be finite and positive"):
        fa_lab.attention(q8, k8, v8, **{**fp8, "q_descale": -qd})
    with pytest.raises(NotImplementedError, match="take no window"):
        fa_lab.attention(q8, k8, v8, window=(8, 0), **fp8)


def test_fp8_is_forward_only(generator):
    q, k, v = make_qkv(1, 1, 32, 32, 32, torch.bfloat16, "cuda" if torch.cuda.is_available() else "cpu",
                       generator=generator)
    out = fa_lab.attention(q, k, v, impl="triton_hopper_fp8")
    with pytest.raises(RuntimeError, match="forward-only"):
        out.sum().backward()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("causal, stages, pingpong, persistent",
                         [(False, 2, False, False), (True, 3, True, False), (False, 2, False, True),
                          (True, 2, False, True), (True, 3, True, True)])
def test_gluon_kernel_compiles_for_sm90_within_its_resources(head_dim, fp8, causal, stages, pingpong, persistent):
    _check_sm90_build(head_dim, fp8, causal, stages, pingpong, persistent, window=False)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("persistent", [False, True])
def test_gluon_window_kernel_compiles_for_sm90_within_its_resources(head_dim, persistent):
    """The windowed variant (both band edges masked, the loop starting at the band's first tile), bf16."""
    _check_sm90_build(head_dim, False, False, 2, False, persistent, window=True)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("varlen, softcap, alibi, window", [(True, False, False, False), (False, True, False, False),
                                                            (False, False, True, False), (True, True, True, True)])
def test_gluon_option_kernels_compile_for_sm90_within_their_resources(head_dim, varlen, softcap, alibi, window):
    """The packed-batch, soft-cap and ALiBi variants (and all of them with a window), bf16, causal; the soft
    cap's tanh is the one special-function instruction."""
    build = _check_sm90_build(head_dim, False, True, 2, False, False, window=window, varlen=varlen,
                              softcap=softcap, alibi=alibi)
    assert ("tanh.approx.f32" in build.ptx) == softcap


def test_softcap_forms_build_for_sm90_without_spills():
    """The soft cap's switches, offline at d = 128 without a mask (split loops, persistent): with Q scaled beforehand
    the full tiles' loop loses the multiply before each tanh (64 FMUL a thread); with the row max first it takes two
    more tanh a step (one per row a thread holds); nothing spills. The switches reach the kernel as SOFTCAP's bits,
    and drop out where they do not apply (the max first under ALiBi, Q scaled in packed batches and FP8)."""
    from fa_lab.kernels.hopper.attention import HopperOptions, fa3_launch_constants
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90, fa3_forward_job

    forms = [{}, dict(softcap_q_scaled=True), dict(softcap_max_first=True)]
    builds = compile_all_for_sm90([fa3_forward_job(128, False, persistent=True, softcap=True, split_loops=True,
                                                   **form) for form in forms])
    full = [[loop["opcodes"] for loop in build.loop_census if loop["opcodes"]["FSEL"] == 2] for build in builds]
    assert all(len(loops) == 2 and build.kv_loop_spills == 0 for loops, build in zip(full, builds))
    shipped, q_scaled, max_first = full
    for a, b, c in zip(shipped, q_scaled, max_first):
        assert (a["FMUL"] - b["FMUL"], a["MUFU"] - b["MUFU"]) == (64, 0)
        assert c["MUFU"] - a["MUFU"] == 2
    options = HopperOptions(consumers=2, split_loops=True, softcap_max_first=True, softcap_q_scaled=True)
    bits = {args: fa3_launch_constants(options, False, False, True, *args)["SOFTCAP"]
            for args in itertools.product((True, False), (False, True), (False, True), (False, True))}
    assert bits[(True, False, False, False)] == 7 and bits[(True, True, False, False)] == 5
    assert bits[(True, False, True, False)] == 3 and bits[(True, False, False, True)] == 3
    assert all(value == 0 for (softcap, *_), value in bits.items() if not softcap)


def test_exp2_polynomial_keeps_a_bf16_probability_exact_enough():
    """The polynomial exp2_mixed takes off the MUFU, evaluated in float32 in the PTX's steps (x raised to -127, its
    floor, which the PTX gets by adding 1.5 * 2**23 rounding down, 2**f by Horner, the floor added to the exponent
    bits): within 1e-4 of 2**x relative (a bf16 P rounds to 2**-9), and exactly 0 for -inf and from -127 down; the
    PTX's float literals are the coefficients, and each count of four builds its own mix of the two."""
    import struct

    from fa_lab.kernels.hopper.fa3_softmax import EXP2_POLY_C1, EXP2_POLY_C2, EXP2_POLY_C3, EXP2_PTX, exp2_ptx

    x = torch.cat([torch.rand(100_000) * -126, torch.rand(10_000) * 8, torch.tensor([0.0, -126.0, -1e-7])])
    lowest = torch.tensor([float("-inf"), -127.0, -127.5, -300.0])
    clamped = torch.cat([x, lowest]).clamp(min=-127.0)
    floor = torch.floor(clamped)
    f = clamped - floor
    c1, c2, c3 = (torch.tensor(c, dtype=torch.float32) for c in (EXP2_POLY_C1, EXP2_POLY_C2, EXP2_POLY_C3))
    poly = (f * c3 + c2) * f
    poly = (poly + c1) * f + 1.0
    bits = poly.view(torch.int32) + (floor.to(torch.int32) << 23)
    got = bits.view(torch.float32)
    want = torch.exp2(x.double())
    assert ((got[:len(x)].double() - want).abs() / want).max() < 1e-4
    assert torch.equal(got[len(x):], torch.zeros(4))
    literals = set(exp2_ptx(1).split("0f")[1:])
    for coefficient in (EXP2_POLY_C1, EXP2_POLY_C2, EXP2_POLY_C3):
        assert any(literal.startswith(struct.pack(">f", coefficient).hex().upper()) for literal in literals)
    assert [ptx.count("ex2.approx") for ptx in EXP2_PTX.value] == [4, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="on_fma"):
        exp2_ptx(5)
    from fa_lab.kernels.hopper.attention import HopperOptions, fa3_launch_constants

    with pytest.raises(ValueError, match="exp2_on_fma"):
        fa3_launch_constants(HopperOptions(consumers=2, split_loops=True, exp2_on_fma=-1), False, False, True,
                             False, False, False, False)


def test_exp2_on_fma_moves_exponentials_off_the_mufu_without_spills():
    """HopperOptions(exp2_on_fma=n), offline at d = 128 (split loops, persistent) with and without the soft cap and in
    FP8: each full-tile loop takes 16 n MUFU fewer (a thread's 64 probabilities, n in four), pays 7 instructions for
    each on the FMA units, and nothing spills."""
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90, fa3_forward_job

    kinds = [dict(softcap=True), dict(), dict(fp8=True)]
    builds = compile_all_for_sm90([fa3_forward_job(128, False, persistent=True, split_loops=True, exp2_on_fma=n,
                                                   **kind) for kind in kinds for n in (0, 2)])
    assert all(build.kv_loop_spills == 0 for build in builds)
    for mufu_only, on_fma in zip(builds[::2], builds[1::2]):
        loops = [[loop["opcodes"] for loop in build.loop_census if loop["opcodes"]["FSEL"] == 2]
                 for build in (mufu_only, on_fma)]
        assert len(loops[0]) == len(loops[1]) == 2
        for before, after in zip(*loops):
            assert before["MUFU"] - after["MUFU"] == 32
            assert 6 * 32 <= sum(after.values()) - sum(before.values()) <= 8 * 32


@pytest.mark.parametrize("head_dim, causal, persistent, window, fp8", [(128, False, False, False, False),
                                                                    (128, True, True, False, False),
                                                                    (64, False, False, False, False),
                                                                    (128, False, True, True, False),
                                                                    (128, False, True, False, True)])
def test_split_loops_give_the_full_tiles_a_loop_without_a_mask(head_dim, causal, persistent, window, fp8):
    """HopperOptions(split_loops=True): each consumer walks its full tiles in a loop of their own, which selects
    only the row maximum's two values (FSEL; a mask selects every score) and is shorter than the single loop; its
    masked loops test one bound (a window's edges: one select per score, where the single loop selects twice), and
    nothing spills."""
    build = _check_sm90_build(head_dim, fp8, causal, 2, False, persistent, window, split_loops=True)
    single = _check_sm90_build(head_dim, fp8, causal, 2, False, persistent, window)
    census = build.loop_census
    full = [loop for loop in census if loop["opcodes"]["FSEL"] == 2]
    assert len(full) == 2
    assert len(census) == (6 if window else 4)
    masked = [loop["instructions"] for loop in census if loop not in full]
    assert max(loop["instructions"] for loop in full) < min(loop["instructions"] for loop in single.loop_census)
    if window:
        assert all(loop["opcodes"]["FSEL"] == 66 for loop in census if loop not in full)
        assert all(loop["opcodes"]["FSEL"] == 130 for loop in single.loop_census)
        assert max(masked) < min(loop["instructions"] for loop in single.loop_census)


@pytest.mark.parametrize("head_dim, causal, persistent, fp8, split_loops, pingpong",
                         [(128, False, False, False, True, False), (128, True, True, False, True, False),
                          (128, False, True, True, False, False), (64, False, False, False, True, False),
                          (128, False, False, False, True, True)])
def test_rescale_early_issues_each_steps_wgmmas_together(head_dim, causal, persistent, fp8, split_loops, pingpong):
    """HopperOptions(rescale_early=True): O's rescale moved to the end of the step whose softmax computed its factor
    (flash-attn-4's place). Rescaled just before P V's issue, ptxas puts the multiplies (20 or more FMUL a loop)
    between S's first WGMMA instruction and the rest; moved, none (FP8: one, a tile scale) stand between a step's
    WGMMAs, which then lie closer together, as in flash-attn-4's loop (d = 128: its 16 within 47 instructions,
    docs/experiments/hopper_forward.md). With ping-pong on three loops a consumer then also passes the turn on
    sooner (the multiplies no longer stand between its wait for the turn and its arrive). Same loops otherwise: no
    spills, the same instruction counts within a few."""
    from fa_lab.kernels.hopper.sm90_offline import sass_opcode

    def between_wgmmas(build):  # per loop: (instructions from its first WGMMA to its last, FMUL among them)
        result = []
        for body, loop in zip(build.loop_bodies, build.loop_census):
            inside = body[loop["wgmma_at"][0]:loop["wgmma_at"][-1]]
            result.append((len(inside), sum(1 for text in inside if sass_opcode(text).startswith("FMUL"))))
        return result

    def turn_held(build):  # per loop: instructions from the wait for the turn to the arrive that passes it on
        return [[index for index, kind, _ in named if kind == "ARV"][0] - named[0][0]
                for named in build.named_barriers]

    early = _check_sm90_build(head_dim, fp8, causal, 2, pingpong, persistent, False, split_loops=split_loops,
                              rescale_early=True)
    late = _check_sm90_build(head_dim, fp8, causal, 2, pingpong, persistent, False, split_loops=split_loops)
    assert len(early.loop_bodies) == len(late.loop_bodies)
    for (span, multiplies), (late_span, late_multiplies) in zip(between_wgmmas(early), between_wgmmas(late)):
        assert multiplies <= 1 and late_multiplies >= 20 and span < late_span, (between_wgmmas(early),
                                                                                between_wgmmas(late))
    assert all(abs(len(a) - len(b)) <= 4 for a, b in zip(early.loop_bodies, late.loop_bodies))
    if pingpong:
        assert all(held + 50 < late_held for held, late_held in zip(turn_held(early), turn_held(late)))


@pytest.mark.parametrize("causal", [False, True])
def test_convert_p_late_issues_the_fp8_scores_first(causal):
    """HopperOptions(convert_p_late=True): in FP8's three loops ptxas packs P_{j-1} into e4m3 (the F2FP work) before
    it issues S_j when the source converts P first; converted after S_j's issue, the step's first WGMMA comes 40 or
    more instructions sooner (at 36-44 instead of 88-92, as in FP8's single loop, 33). No spills; for 16-bit P the
    switch changes nothing (the conversion is a no-op there)."""
    def first_wgmma(build):
        return [loop["wgmma_at"][0] for loop in build.loop_census]

    late = _check_sm90_build(128, True, causal, 2, False, True, False, split_loops=True, convert_p_late=True)
    early = _check_sm90_build(128, True, causal, 2, False, True, False, split_loops=True)
    assert all(a + 40 <= b for a, b in zip(first_wgmma(late), first_wgmma(early))), (first_wgmma(late),
                                                                                       first_wgmma(early))
    bf16 = [_check_sm90_build(128, False, causal, 2, False, False, False, split_loops=True, convert_p_late=flag)
            for flag in (False, True)]
    assert [len(body) for body in bf16[0].loop_bodies] == [len(body) for body in bf16[1].loop_bodies]


def test_pingpong_takes_turns_through_named_barriers_around_the_wgmma_issue():
    """With PINGPONG each consumer's K/V loop waits for its turn on its own hardware named barrier (256 threads: its
    128 and the other consumer's arrive) before it issues the step's WGMMAs and passes the turn on right after
    them, as FA3's warp-scheduler barriers do; consumer c waits on TURN_BARRIER + c and arrives on the other's."""
    from fa_lab.kernels.hopper.fa3_state import TURN_BARRIER
    from fa_lab.kernels.hopper.sm90_offline import compile_fa3_for_sm90

    turns = set()
    build = compile_fa3_for_sm90(128, False, pingpong=True)
    for body, named in zip(build.loop_bodies, build.named_barriers):
        syncs = [(index, barrier) for index, kind, barrier in named if kind == "SYNC"]
        arrives = [(index, barrier) for index, kind, barrier in named if kind == "ARV"]
        wgmmas = [index for index, text in enumerate(body) if "HGMMA" in text]
        assert len(syncs) == len(arrives) == 1, (syncs, arrives)
        assert syncs[0][0] < wgmmas[0] and wgmmas[-1] < arrives[0][0]
        turns.add((syncs[0][1], arrives[0][1]))
    first = TURN_BARRIER.value
    assert turns == {(first, first + 1), (first + 1, first)}


@pytest.mark.parametrize("causal, loop_spills", [(False, 0), (True, 8)])
def test_three_consumers_at_d64_build_for_sm90(causal, loop_spills):
    """The default's 192-row tiles at d = 64 (three consumers of 160 registers, persistent, in the K/V loops the
    default takes where it takes three consumers): no spills in the K/V loops without a mask; causal, ptxas keeps 8
    loads and stores there, in the loops of the diagonal's masked tiles (18 in a single loop; both builds measured
    faster all the same: attention.THREE_CONSUMERS_MIN_KEYS and SPLIT_LOOPS_MIN_KEYS)."""
    from fa_lab.kernels.hopper.attention import THREE_CONSUMERS_MIN_KEYS, split_loops_by_default
    from fa_lab.kernels.hopper.sm90_offline import SM90_SHARED_LIMIT, compile_fa3_for_sm90

    split = split_loops_by_default(64, causal, THREE_CONSUMERS_MIN_KEYS[(64, causal)])
    assert split
    build = compile_fa3_for_sm90(64, causal, consumers=3, persistent=True, split_loops=split)
    assert build.kv_loop_spills == loop_spills and build.shared_bytes <= SM90_SHARED_LIMIT
    assert "setmaxnreg.inc.sync.aligned.u32 \t160" in build.ptx


def test_the_gluon_backward_steps_128_rows_at_d64_and_64_at_d128():
    """BWD_ROWS as the launchers read it (docs/experiments/backward.md, "128-row steps at d = 64"); a step of any
    other size is refused before a descriptor is built."""
    from fa_lab.kernels.hopper.fa3_backward import bwd_rows

    assert (bwd_rows(64), bwd_rows(128), bwd_rows(64, rows=64)) == (128, 64, 64)
    with pytest.raises(ValueError, match="64 or 128 query rows, got 96"):
        bwd_rows(128, rows=96)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_backward_compiles_for_sm90_within_its_resources(head_dim):
    """The Gluon FA3 backward builds for sm_90 on this machine, causal and not, dense and packed, dense with a window
    (the band's edges masked in their own branch), with dQ in turns,
    as partial tiles and (d = 128) as column halves, in steps of its default rows (128 at d = 64, 64 at d = 128)
    and, at d = 64, of 64 rows too: shared memory within 227 KiB, the consumer warpgroups raised to 240 registers,
    dQ added by a TMA reduce-add, the WGMMAs of the five products (N = the step's rows for S and dP, d-wide ones for
    dV, dK and dQ). With the products' accumulators started from -lse2 and -D, the row vectors no longer sit beside
    them: on Triton 3.6 the loops keep at most one value in local memory (7 / 51 loads and stores at d = 128 dense
    before, 17 / 68 packed, and 226 / 360 for 128-row steps at d = 64). ptxas injects one WGMMA wait, in one
    consumer between S^T and dP^T (docs/experiments/backward.md, "Offline: a wait ptxas adds"), and no more. P^T is
    rounded to bf16 two values an instruction (F2FP), never one at a time (F2F: 32 a step before ``_widen``), and
    the products' start rows come ready from the producer (no float additions in the consumers' loops: before, a
    step divided -lse2 by the scale and negated D there). A score costs two multiplies, the exponent's argument and
    dS: dQ leaves the loop unscaled (the launcher scales it as it casts; before, 64 more FMUL a thread in a dQ
    step at d = 128)."""
    from fa_lab.kernels.hopper.sm90_offline import SM90_SHARED_LIMIT, compile_all_for_sm90, fa3_backward_job

    variants = [(causal, varlen, mode, None, False) for varlen in (False, True) for causal in (False, True)
                for mode in ("turns", "named")]
    variants += [(causal, False, mode, None, False) for causal in (False, True)
                 for mode in ("partial", "split") if head_dim == 128 or mode != "split"]
    if head_dim == 64:
        variants += [(causal, varlen, "turns", 64, False) for varlen in (False, True) for causal in (False, True)]
    variants += [(False, False, mode, None, True) for mode in ("turns", "named")]  # a band, causal folded in
    builds = compile_all_for_sm90([fa3_backward_job(head_dim, causal, varlen=varlen, dq_mode=mode, rows=rows,
                                                    window=window)
                                   for causal, varlen, mode, rows, window in variants])
    for (causal, varlen, mode, rows, window), build in zip(variants, builds):
        step_rows = rows or (128 if head_dim == 64 else 64)
        assert build.shared_bytes <= SM90_SHARED_LIMIT
        assert "setmaxnreg.inc.sync.aligned.u32 \t240" in build.ptx
        assert "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add" in build.ptx
        assert f"wgmma.mma_async.sync.aligned.m64n{step_rows}k16.f32.bf16.bf16" in build.ptx
        assert f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32.bf16.bf16" in build.ptx
        assert build.kv_loop_spills <= 1, (causal, varlen, mode, rows, window, build.kv_loop_spills)
        assert build.injected_waits <= 1 and not build.serialized_wgmma, (causal, varlen, mode, rows, window)
        assert build.loop_instructions("F2F.BF16.F32") == 0 and build.loop_instructions("F2FP.BF16.F32.PACK_AB") > 0
        assert build.loop_instructions("FADD") == build.loop_instructions("FFMA") == 0  # start rows come ready
        scores_per_thread = step_rows * 64 // 128  # a consumer's 64 keys x the step's rows, over 128 threads
        assert build.loop_instructions("FMUL") == len(build.loop_bodies) * 2 * scores_per_thread


def test_the_named_dq_scheme_hands_ds_over_through_named_barriers():
    """backward_dq="named": the dS rows a turn's consumer waits for come through hardware named barriers (its READY
    barrier waited with bar.sync, the other consumer's arrive; FREE the other way round), and Q's release frees the
    step's dO slot: 4 warpgroup barriers a step (Triton's, before single-thread mbarrier arrives) instead of 8."""
    from fa_lab.kernels.hopper.fa3_backward import DS_FREE, DS_READY
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90, fa3_backward_job

    turns, named = compile_all_for_sm90([fa3_backward_job(128, True, dq_mode=mode) for mode in ("turns", "named")])
    assert [loop["warpgroup_barriers"] for loop in turns.loop_census] == [8, 8]
    assert [loop["warpgroup_barriers"] for loop in named.loop_census] == [4, 4]
    ids = {(kind, barrier) for loop in named.named_barriers for _, kind, barrier in loop}
    slots = (0, 1)
    assert ids == {(kind, base + slot) for kind in ("SYNC", "ARV") for base in (DS_READY.value, DS_FREE.value)
                   for slot in slots}
    assert not any(turns.named_barriers)


def test_the_gluon_backward_launchers_scale_dq_as_they_cast_it(generator):
    """The Gluon backward adds dS K unscaled into its float32 dQ; the launchers' cast applies the softmax scale, in
    the output's dtype, in one pass."""
    from fa_lab.kernels.hopper.attention import _scaled_dq

    dq_sum = torch.randn(2, 3, 17, 64, generator=generator)
    for dtype in (torch.bfloat16, torch.float16):
        dq = _scaled_dq(dq_sum, 0.09, dtype)
        assert dq.dtype == dtype and dq.shape == dq_sum.shape
        assert torch.equal(dq, (dq_sum * 0.09).to(dtype))


def test_the_committed_flash_attn_4_census_holds_our_current_loops():
    """benchmarks/sass_census_fa4.json (notebook 04, section 8, prints it) counts our K/V loops beside flash-attn-4's
    for the same configurations: its half of ours is what the current kernels build (after a change of them,
    ``benchmarks/fa4_sass_census.py --ours`` refreshes it)."""
    import json
    from pathlib import Path

    from fa_lab.kernels.hopper.sm90_offline import census_row_job, compile_all_for_sm90

    census = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "sass_census_fa4.json").read_text())
    def spec(row):
        return row["kernel"], row["head_dim"], row["causal"], row["case"], row["seqlen"]

    ours = [row for row in census["builds"] if row["impl"] == "triton_hopper"]
    assert {spec(row) for row in ours} == {spec(row) for row in census["builds"] if row["impl"] == "fa4"}
    for row, build in zip(ours, compile_all_for_sm90([census_row_job(row) for row in ours])):
        assert build.loop_census == row["loops"], spec(row)


def test_the_fp8_quantization_launches_fit_the_programs_per_sm_their_docstrings_say():
    """Both quantization passes as quantize_fp8_operands launches them, built for sm_90 on this machine: the Triton
    pass and the Gluon pass (d = 128 and 64, bf16 and fp16) take 8 warps at most 128 registers without spilling,
    and two programs fit an SM by registers and by shared memory. The Gluon pass moves Q's and K's tiles in and out
    by TMA (two copies each way), issues the next tile's copy between this tile's product and its store, feeds the
    product from shared memory (no ldmatrix), and converts with saturation (``satfinite``), the Triton pass's clamp
    to +-448."""
    from fa_lab.kernels.hopper.sm90_offline import (
        compile_all_for_sm90,
        ctas_per_sm,
        ctas_per_sm_by_registers,
        fp8_quant_gluon_job,
        fp8_quant_job,
    )

    triton_pass, *gluon_passes = compile_all_for_sm90([fp8_quant_job(), fp8_quant_gluon_job(128),
                                                       fp8_quant_gluon_job(64), fp8_quant_gluon_job(128, "fp16")])
    for build in (triton_pass, *gluon_passes):
        assert build.stack_bytes == 0 and build.local_bytes == 0
        assert ctas_per_sm(build.shared_bytes) >= 2, build.shared_bytes
        assert ctas_per_sm_by_registers(build.registers, 8) >= 2, build.registers
    for build in gluon_passes:
        assert build.ptx.count("cp.async.bulk.tensor") >= 4 and "ldmatrix" not in build.ptx
        assert "cvt.rn.satfinite.e4m3x2.f32" in build.ptx
        # In the Q/K loop the next tile's copy is issued after the product and before this tile's store.
        loop = build.ttgir[build.ttgir.index("scf.for"):]
        loop = loop[:loop.index("scf.for", 1)]
        product, copy_in, copy_out = (loop.index(op) for op in ("warp_group_dot ", "async_tma_copy_global_to_local",
                                                                "async_tma_copy_local_to_global"))
        assert product < copy_in < copy_out


def test_a_packed_batch_takes_the_gluon_backward_by_the_dense_rule(monkeypatch):
    """hopper_varlen_backward, once GLUON_VARLEN_BACKWARD_AUTO allows it, asks gluon_backward_is_faster about the
    keys of the sequence an average key sits in (varlen_keys_per_sequence), and goes to the portable kernels
    otherwise or when asked to; before, "auto" keeps the portable backward."""
    import fa_lab.kernels.hopper.attention as hopper
    from fa_lab.kernels.portable.attention import NO_OPTIONS

    assert hopper.varlen_keys_per_sequence([0, 4096, 4196]) == (4096 ** 2 + 100 ** 2) // 4196
    assert hopper.varlen_keys_per_sequence([0, 0, 0]) == 0
    calls = []
    monkeypatch.setattr(hopper, "uses_gluon_backward", lambda *args: True)
    monkeypatch.setattr(hopper, "gluon_varlen_backward", lambda *args: calls.append("gluon"))
    monkeypatch.setattr(hopper, "triton_varlen_backward", lambda *args: calls.append("triton"))
    q, k = torch.empty(10, 2, 128), torch.empty(10, 1, 128)
    cases = [([0, 4096, 4196], True, "auto"), ([0, 1000, 2000], True, "auto"), ([0, 1000, 2000], False, "auto"),
             ([0, 4096, 4196], True, "triton"), ([0, 1000, 2000], True, "gluon")]

    def run(auto):
        monkeypatch.setattr(hopper, "GLUON_VARLEN_BACKWARD_AUTO", auto)
        calls.clear()
        for bounds_k, causal, backward in cases:
            hopper.hopper_varlen_backward(q, k, k, None, None, None, None, None, ([0, 5, 10], bounds_k), causal,
                                          1.0, NO_OPTIONS, hopper.HopperOptions(backward=backward))
        return list(calls)
    assert run(True) == ["gluon", "triton", "gluon", "triton", "gluon"]
    assert run(False) == ["triton", "triton", "triton", "triton", "gluon"]


def test_the_default_backward_follows_the_recorded_h200_run():
    """HopperOptions.backward="auto" picks, at every shape of benchmarks/h200_backward.json, the backward that
    was faster there: the Gluon one where gluon_backward_is_faster says so, and where it does not, the Gluon
    one was slower or within 2% (at d = 64 causal, 4K keys, the two are level)."""
    import json
    from pathlib import Path

    from fa_lab.kernels.hopper.attention import gluon_backward_is_faster

    rows = json.loads((Path(__file__).parent.parent / "benchmarks" / "h200_backward.json").read_text())["rows"]
    speed = {(r["impl"], r["head_dim"], r["causal"], r["seqlen_k"]): r["bwd_tflops"] for r in rows}
    shapes = {key[1:] for key in speed}
    assert len(shapes) == 20
    for head_dim, causal, seqlen in sorted(shapes):
        ratio = speed[("triton_hopper", head_dim, causal, seqlen)] / speed[("triton", head_dim, causal, seqlen)]
        if gluon_backward_is_faster(head_dim, causal, seqlen):
            assert ratio >= 1.0, (head_dim, causal, seqlen, ratio)
        else:
            assert ratio <= 1.02, (head_dim, causal, seqlen, ratio)


def test_the_default_persistent_choice_follows_the_recorded_h200_run():
    """HopperOptions.persistent None takes the persistent kernel exactly where benchmarks/h200_persistent_bf16.json
    had its median at least 2% ahead of one tile per CTA, at every (head_dim, causal, seqlen) it measured, from
    PERSISTENT_MIN_KEYS keys on (the shortest it measured: see the constant's comment); and a windowed call from
    PERSISTENT_MIN_KEYS keys, as benchmarks/h200_window_variants.json had it ahead."""
    import json
    import statistics
    from pathlib import Path

    from fa_lab.kernels.hopper.attention import PERSISTENT_MIN_KEYS, persistent_by_default

    log = json.loads((Path(__file__).parent.parent / "benchmarks" / "h200_persistent_bf16.json").read_text())["log"]
    assert len(log) == 20
    for shape in log:
        gain = statistics.median(shape["persistent"]) / statistics.median(shape["one_tile"])
        chosen = persistent_by_default(shape["head_dim"], shape["causal"], shape["seqlen"], banded=False)
        assert chosen == (gain >= 1.02 and shape["seqlen"] >= PERSISTENT_MIN_KEYS), (shape, gain)
        assert persistent_by_default(shape["head_dim"], shape["causal"], shape["seqlen"], banded=True) == (
            shape["seqlen"] >= PERSISTENT_MIN_KEYS)
    window = json.loads((Path(__file__).parent.parent / "benchmarks" / "h200_window_variants.json").read_text())
    medians = window["median_tflops"]
    assert medians["persistent window"] >= 1.02 * medians["one_tile window"]
    assert persistent_by_default(128, False, window["seqlen"], banded=True)


def test_the_persistent_minimum_follows_the_recorded_host_bound_run():
    """From PERSISTENT_MIN_KEYS keys, the shortest length benchmarks/h100_persistent_host_bound.log timed, do_bench
    (as the protocol times, the host's issue time included) had the persistent kernel ahead of one tile per CTA at
    every causal length, with inputs requiring grad and without."""
    import re
    from pathlib import Path

    from fa_lab.kernels.hopper.attention import PERSISTENT_MIN_KEYS

    log = (Path(__file__).parent.parent / "benchmarks" / "h100_persistent_host_bound.log").read_text()
    timed = {(int(n), causal == "True", grad, persistent == "True"): float(ms) for n, causal, grad, persistent, ms
             in re.findall(r"N=(\d+) causal=(\w+) grad=(\w+) persistent=(\w+): do_bench ([\d.]+) ms", log)}
    assert len(timed) == 16 and min(n for n, *_ in timed) == PERSISTENT_MIN_KEYS
    for (n, causal, grad, persistent), ms in timed.items():
        if causal and persistent:
            assert ms < timed[(n, causal, grad, False)], (n, grad)


def test_gluon_forward_launches_what_its_plan_resolves(monkeypatch):
    """gluon_forward with the GPU launch replaced by a recorder (CPU tensors): the grid, the tile schedule and the
    compile-time arguments it launches with follow the defaults' tables where the options leave a choice open and
    the options where they make it, and a second call of the same kind reuses the plan _forward_plan resolved."""
    import fa_lab.kernels.hopper.attention as hopper
    from fa_lab.kernels.hopper.fa3_config import CONSUMER_REGS, launch_maxnreg

    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(hopper, "cached_launch", Recorder)
    monkeypatch.setattr(hopper, "sm_count", lambda device: 132)
    hopper._forward_plan.cache_clear()
    try:
        cases = [(64, 4096, False, (-1, -1), hopper.HopperOptions()),  # three consumers, persistent, three loops
                 (64, 1024, True, (-1, -1), hopper.HopperOptions()),  # two, one tile per CTA, one loop
                 (128, 4096, True, (256, 0), hopper.HopperOptions()),  # a causal band: WINDOW, not CAUSAL
                 (128, 2048, False, (-1, -1), hopper.HopperOptions(consumers=3, persistent=False, split_loops=False,
                                                                    rescale_early=True, stages=3))]
        for head_dim, seqlen, causal, window, options in cases:
            q = torch.randn(2, 4, seqlen, head_dim).to(torch.bfloat16)
            k = v = torch.randn(2, 2, seqlen, head_dim).to(torch.bfloat16)
            for _repeat in range(2):
                out, lse = hopper.gluon_forward(q, k, v, causal, 0.1, options, window=window)
            assert out.shape == q.shape and lse.shape == q.shape[:3] and len(launches) == 2
            (grid, _args, kwargs), (again_grid, args, again_kwargs) = launches  # (args: the second call's)
            assert again_grid == grid and again_kwargs == kwargs
            launches.clear()
            banded = window[0] >= 0
            consumers = options.consumers or hopper.consumers_by_default(head_dim, causal, seqlen, banded)
            persistent = options.persistent
            if persistent is None:
                persistent = hopper.persistent_by_default(head_dim, causal, seqlen, banded, consumers=consumers)
            split_loops = options.split_loops
            if split_loops is None:
                split_loops = hopper.split_loops_by_default(head_dim, causal and not banded, seqlen)
            tiles = 2 * 4 * -(-seqlen // (64 * consumers))
            assert grid == ((min(tiles, 132),) if persistent else (tiles,))
            assert kwargs == dict(CONSUMERS=consumers, STAGES=options.stages, CAUSAL=causal and not banded,
                                  PINGPONG=False, FP8=False, PERSISTENT=persistent,
                                  CONSUMER_REGS=CONSUMER_REGS[consumers], WINDOW=banded, VARLEN=False, SOFTCAP=False,
                                  ALIBI=False, SPLIT_LOOPS=split_loops, RESCALE_EARLY=options.rescale_early,
                                  CONVERT_P_LATE=False, EXP2_ON_FMA=0, num_warps=4, maxnreg=launch_maxnreg(consumers))
            descriptors, (o_ptr, lse_ptr) = args[:4], args[4:6]
            assert all(d.base is t for d, t in zip(descriptors, (q, k, v, out))) and o_ptr is out and lse_ptr is lse
            assert [d.block_shape[2] for d in descriptors] == [64, 128, 128, 64]
            heads, group, seqlen_q, seqlen_k, left, right, schedule = args[10:17]
            assert (heads, group, seqlen_q, seqlen_k) == (4, 2, seqlen, seqlen)
            assert (left, right) == ((256, 0) if banded else (0, 0))
            assert (schedule is not lse) == persistent
        assert hopper._forward_plan.cache_info().hits == len(cases)
    finally:
        hopper._forward_plan.cache_clear()


def test_the_default_consumer_count_follows_the_recorded_h200_run():
    """HopperOptions.consumers None takes three consumers (persistent) at d = 64 exactly where
    benchmarks/h200_three_consumers.json had them at least 3% ahead of two; two at d = 128, in windows and in FP8."""
    import json
    from pathlib import Path

    from fa_lab.kernels.hopper.attention import consumers_by_default, persistent_by_default

    run = json.loads((Path(__file__).parent.parent / "benchmarks" / "h200_three_consumers.json").read_text())
    medians = run["median_tflops"]
    for seqlen in (4096, 8192, 16384):
        for causal in (False, True):
            name = f"d64 {seqlen // 1024}K {'causal' if causal else 'full'}"
            gain = medians[f"{name} registers_3wg_persistent"] / medians[f"{name} registers"]
            assert (consumers_by_default(64, causal, seqlen, banded=False) == 3) == (gain >= 1.03), (name, gain)
    assert consumers_by_default(64, False, 2048, banded=False) == 2  # (not measured below 4K keys)
    assert consumers_by_default(128, False, 16384, banded=False) == 2
    assert consumers_by_default(64, False, 16384, banded=True) == 2
    assert consumers_by_default(64, False, 16384, banded=False, fp8=True) == 2
    assert consumers_by_default(64, False, 16384, banded=False, alibi=True) == 2
    assert persistent_by_default(64, False, 16384, banded=False, consumers=3)


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_keeps_two_consumers_because_three_spill(causal):
    """Why ALiBi calls at d = 64 keep two consumer warpgroups: with three (160 registers a thread) the K/V loops of
    the ALiBi build (persistent, as the default runs it) keep over 100 loads and stores in local memory; with two,
    none."""
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90, fa3_forward_job

    three, two = compile_all_for_sm90([fa3_forward_job(64, causal, consumers=consumers, persistent=True, alibi=True)
                                       for consumers in (3, 2)])
    assert three.kv_loop_spills > 100 and two.kv_loop_spills == 0


def test_the_backward_takes_lse2_and_d_from_the_producer_as_the_recorded_run_has_it_faster():
    """The rows_by_producer defaults of gluon_backward and gluon_varlen_backward against
    benchmarks/h200_backward_row_vectors.json (best of two rounds) and h200_varlen_row_vectors.json (medians of three):
    the producer's loads ahead at every shape, and the offline build of the dense default in shared memory."""
    import inspect
    import json
    import statistics
    from pathlib import Path

    from fa_lab.kernels.hopper.attention import gluon_backward, gluon_varlen_backward
    from fa_lab.kernels.hopper.sm90_offline import SM90_SHARED_LIMIT, compile_all_for_sm90, fa3_backward_job

    runs = Path(__file__).parent.parent / "benchmarks"
    log = json.loads((runs / "h200_backward_row_vectors.json").read_text())["log"]
    assert {(e["head_dim"], e["causal"]) for e in log} == {(64, False), (64, True), (128, False), (128, True)}
    assert all(max(e["producer"]) > max(e["consumers"]) for e in log)
    packed = json.loads((runs / "h200_varlen_row_vectors.json").read_text())["log"]
    assert {(e["head_dim"], e["causal"]) for e in packed} == {(64, True), (128, False), (128, True)}
    assert all(statistics.median(e["producer"]) > statistics.median(e["consumers"]) for e in packed)
    for launcher in (gluon_backward, gluon_varlen_backward):
        assert inspect.signature(launcher).parameters["rows_by_producer"].default is True
    for build in compile_all_for_sm90([fa3_backward_job(head_dim=d, causal=True) for d in (64, 128)]):
        assert build.shared_bytes <= SM90_SHARED_LIMIT and build.kv_loop_spills == 0


def test_rows_ahead_takes_the_rows_loads_off_the_path_from_a_free_slot_to_its_copies():
    """gluon_backward(rows_ahead=True): the producer issues a step's copies as soon as its slot is free, then stores
    the step's lse2 and D rows (loaded an iteration before) and announces them by a second arrival on the slot's
    ready barrier, then loads the next step's rows. In its SASS loop: the copies, then the stores, then every global
    load. As shipped: the loads, the stores (which wait for them), then the copies. Same shared memory, and no spills
    in the consumers' loops, dense (d = 64 and 128, causal or not) and packed."""
    from fa_lab.kernels.hopper.sm90_offline import (
        SM90_SHARED_LIMIT,
        compile_all_for_sm90,
        fa3_backward_job,
        loop_bodies_issuing,
        sass_opcode,
    )

    variants = [(d, causal, False, ahead) for d in (64, 128) for causal in (False, True) for ahead in (False, True)]
    variants += [(128, True, True, ahead) for ahead in (False, True)]
    builds = compile_all_for_sm90([fa3_backward_job(d, causal, varlen=varlen, rows_ahead=ahead)
                                   for d, causal, varlen, ahead in variants])
    for (d, causal, varlen, ahead), build in zip(variants, builds):
        assert build.shared_bytes <= SM90_SHARED_LIMIT and build.kv_loop_spills == 0
        [producer] = loop_bodies_issuing(build.sass, "UTMALDG")
        opcodes = [sass_opcode(text) for text in producer]
        loads, stores, copies = ([i for i, op in enumerate(opcodes) if op.startswith(prefix)]
                                 for prefix in ("LDG", "STS", "UTMALDG"))
        assert loads and stores and copies, (d, causal, varlen)
        if ahead:
            assert max(copies) < min(stores) and max(stores) < min(loads), (d, causal, varlen, opcodes)
        else:
            assert max(loads) < min(stores) and max(stores) < min(copies), (d, causal, varlen, opcodes)


def test_packed_batches_and_the_dq_scheme_follow_the_recorded_h200_runs():
    """GLUON_VARLEN_BACKWARD_AUTO is on exactly when the Gluon backward of a packed batch was faster than the
    portable one in every case of benchmarks/h200_varlen_backward.json. The default dQ scheme of each head_dim
    (DQ_MODE_BY_HEAD_DIM) had the highest geometric mean over the shapes of benchmarks/h200_backward_dq.json (each
    shape's median round); on the packed cases (d = 128) the default's had the highest geometric mean of time too,
    and it was within 1% of the fastest scheme in each case."""
    import json
    import math
    import statistics
    from pathlib import Path

    import fa_lab.kernels.hopper.attention as hopper

    benchmarks = Path(__file__).parent.parent / "benchmarks"
    cases = json.loads((benchmarks / "h200_varlen_backward.json").read_text())["cases"]
    assert len(cases) == 4
    assert hopper.GLUON_VARLEN_BACKWARD_AUTO == all(c["ms"]["gluon_turns"] < c["ms"]["portable"] for c in cases)
    assert hopper.HopperOptions().backward_dq is None
    shapes = json.loads((benchmarks / "h200_backward_dq.json").read_text())["log"]
    assert len(shapes) == 16 and all(mode in shape for shape in shapes for mode in ("turns", "partial", "named"))
    for head_dim in (64, 128):
        mine = [shape for shape in shapes if shape["head_dim"] == head_dim]
        modes = [mode for mode in hopper.DQ_MODES if all(mode in shape for shape in mine)]
        score = {mode: math.fsum(math.log(statistics.median(shape[mode])) for shape in mine) for mode in modes}
        assert max(score, key=score.get) == hopper.dq_mode_by_default(head_dim), (head_dim, score)
    packed = {mode: math.fsum(math.log(case["ms"][f"gluon_{mode}"]) for case in cases) for mode in hopper.DQ_MODES}
    assert min(packed, key=packed.get) == hopper.dq_mode_by_default(128), packed
    for case in cases:
        fastest = min(case["ms"][f"gluon_{mode}"] for mode in hopper.DQ_MODES)
        assert case["ms"][f"gluon_{hopper.dq_mode_by_default(128)}"] <= 1.01 * fastest, case


def test_the_default_split_loops_follow_the_recorded_h200_run():
    """HopperOptions.split_loops None splits the K/V steps at every shape of benchmarks/h200_split_loops.json where
    three loops ran at least 1% ahead of one (medians of three rounds), and keeps one loop wherever they ran 1%
    behind or more; each shape gave the same bits both ways. FP8 keeps one loop, as its own run
    (benchmarks/h200_split_loops_fp8.json) had three loops behind at every shape."""
    import json
    import statistics
    from pathlib import Path

    from fa_lab.kernels.hopper.attention import split_loops_by_default

    log = json.loads((Path(__file__).parent.parent / "benchmarks" / "h200_split_loops.json").read_text())["log"]
    assert len(log) == 21 and all(shape["same_bits"] for shape in log)
    for shape in log:
        gain = statistics.median(shape["split_loops"]) / statistics.median(shape["one_loop"])
        banded = tuple(shape["window"]) != (-1, -1)
        chosen = split_loops_by_default(shape["head_dim"], shape["causal"] and not banded, shape["seqlen"])
        assert chosen if gain >= 1.01 else (not chosen if gain <= 0.99 else True), (shape, gain)
    fp8_log = json.loads((Path(__file__).parent.parent / "benchmarks" / "h200_split_loops_fp8.json").read_text())["log"]
    assert len(fp8_log) == 12 and all(shape["same_bits"] for shape in fp8_log)
    assert all(statistics.median(shape["split_loops"]) < statistics.median(shape["one_loop"]) for shape in fp8_log)
    assert not any(split_loops_by_default(shape["head_dim"], shape["causal"], shape["seqlen"], fp8=True)
                   for shape in fp8_log)


def _check_sm90_build(head_dim, fp8, causal, stages, pingpong, persistent, window, **options):
    """Every Gluon variant builds for sm_90 on this machine: no register spills in the K/V loop, shared memory
    within 227 KiB, and the FA3 structure visible in the PTX (consumer warpgroups raised to 240 registers,
    async WGMMAs). ptxas may keep a few scalars on the stack (the persistent loop's per-tile values), loaded
    once per work tile: at most 4 words, none of them touched inside the K/V loop. ptxas neither serializes the
    WGMMAs nor injects a wait of its own: the products the kernel leaves in flight stay in flight (the Gluon
    backward has one such wait, docs/experiments/backward.md). A step shuffles between threads only for the row
    maximum (2 rows a thread, 2 shuffles a row): each thread keeps its own partial row sums until the loop ends
    (before, 4 more shuffles a step summed them across a row's four threads)."""
    from fa_lab.kernels.hopper.sm90_offline import SM90_SHARED_LIMIT, compile_fa3_for_sm90

    build = compile_fa3_for_sm90(head_dim, causal, stages=stages, pingpong=pingpong, fp8=fp8, persistent=persistent,
                                 window=window, **options)
    assert build.kv_loop_spills == 0, "ptxas spilled registers inside the K/V loop"
    assert build.stack_bytes <= 16 and build.local_bytes == 0, "ptxas spilled more than a few scalars"
    assert build.shared_bytes <= SM90_SHARED_LIMIT
    assert build.injected_waits == 0, "ptxas made a warpgroup wait for a product the kernel left in flight"
    assert not build.serialized_wgmma, "ptxas serialized the WGMMAs for want of registers"
    assert build.loop_instructions("SHFL") == 4 * len(build.loop_bodies)
    assert "setmaxnreg.inc.sync.aligned.u32 \t240" in build.ptx
    operand = "e4m3.e4m3" if fp8 else "bf16.bf16"
    assert f"wgmma.mma_async.sync.aligned.m64n128k{32 if fp8 else 16}.f32.{operand}" in build.ptx
    return build


def test_kv_loop_spills_counts_local_memory_in_the_innermost_wgmma_loop_only():
    """The SASS reading behind the spill check: a load from the stack counts inside the K/V loop (the
    innermost predicated backward branch around a GMMA), not outside it, nor in a retry block's jump back."""
    from fa_lab.kernels.hopper.sm90_offline import kv_loop_spills

    def sass(*lines):
        return "\n".join(f"        /*{16 * i:04x}*/   {line} ;" for i, line in enumerate(lines))

    code = ["MOV R1, R2", "LDL R3, [R1]",  # 0x00, 0x10: before the inner loop, once per outer iteration
            "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", "FADD R5, R5, R6", "@P0 BRA 0x0020",  # inner loop
            "@P1 BRA 0x0010", "STL [R1], R3", "BRA 0x0030"]  # outer back edge; an unpredicated jump back
    assert kv_loop_spills(sass(*code)) == 0
    code[3] = "LDL R5, [R1+0x4]"
    assert kv_loop_spills(sass(*code)) == 1
    with pytest.raises(ValueError):
        kv_loop_spills(sass("MOV R1, R2", "@P0 BRA 0x0000"))


def test_gluon_fp8_key_order_matches_the_kernels_reordering_of_p(generator):
    """The host order of V^T's keys and the kernel's reordering of P's columns (fa3_softmax.p_operand's reshape and
    permute, replayed here in torch) pair every key's probability with that key's value row."""
    from fa_lab.kernels.common import gluon_fp8_key_order
    from fa_lab.kernels.hopper import quantize_for_kernel

    p = torch.rand(64, 128, generator=generator, dtype=torch.float64)
    v = torch.randn(128, 16, generator=generator, dtype=torch.float64)
    reordered_p = p.reshape(64, 4, 2, 2, 4, 2).permute(0, 1, 2, 4, 3, 5).reshape(64, 128)
    order = gluon_fp8_key_order(128)
    assert sorted(order.tolist()) == list(range(128))
    torch.testing.assert_close(reordered_p @ v[order], p @ v)

    q, k, v = (torch.randn(1, 2, n, 64, generator=generator) for n in (40, 70, 70))
    config = TileConfig(128, 128)
    natural = quantize_for_kernel(q, k, v, config, gluon=False)[2]
    ordered = quantize_for_kernel(q, k, v, config, gluon=True)[2]
    assert ordered.shape[-1] == 96  # 70 keys padded to 32
    padded = torch.nn.functional.pad(natural.view(torch.uint8), (0, 96 - natural.shape[-1]))
    assert torch.equal(ordered.view(torch.uint8), padded[..., gluon_fp8_key_order(70)])


# ---------------------------------------------------------------- GPU (device machine)

@pytest.mark.parametrize("device", [pytest.param("cpu", marks=CPU_ONLY), pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype, head_dim, rotate", [(torch.bfloat16, 64, True), (torch.float16, 128, True),
                                                      (torch.bfloat16, 128, False)])
@pytest.mark.parametrize("launch", [{}, dict(programs=1, stages=2, kernel="triton")],
                         ids=["default", "triton_one_program_pipelined"])
def test_fused_fp8_quantization_matches_the_pytorch_path(device, dtype, head_dim, rotate, launch, generator):
    """The quantization pass (its default: the Gluon pass on the H200, the Triton pass in the interpreter; or the
    Triton pass with one program walking every tile, pipelined) gives the PyTorch path's V^T bytes and largest V
    scale exactly (both divide amax by 448 in IEEE arithmetic, also on a GPU), V's exponents to float32 rounding
    (log2 is computed in the kernel); Q and K, rotated in float32 there and in the input's dtype here, within one
    e4m3 step and at least as close to the exact (float64) rotation."""
    from fa_lab.fp8 import hadamard_transform, random_signs
    from fa_lab.kernels.hopper import GLUON_TILES, V_SCALE_FLOOR, quantize_for_kernel
    from fa_lab.kernels.hopper.fp8_quant import quantize_fp8_operands

    q, k, v = ((3 * torch.randn(2, 2, n, head_dim, generator=generator)).to(device, dtype) for n in (200, 300, 300))
    v[0, 0, :128] *= 1e-3  # a quiet V tile: its exponent differs from the head's
    v[1, 1, 128:256] = 0  # an all-zero V tile: its exponent is the floor's, log2(V_SCALE_FLOOR)
    signs = random_signs(head_dim, torch.Generator().manual_seed(0)) if rotate else None
    fused = quantize_fp8_operands(q, k, v, signs, 128, V_SCALE_FLOOR, **launch)
    reference = quantize_for_kernel(q, k, v, GLUON_TILES, rotate, gluon=True, fused=False)
    assert torch.equal(fused[2].view(torch.uint8), reference[2].view(torch.uint8))
    torch.testing.assert_close(fused[3][2], reference[3][2], rtol=0, atol=1e-5)
    assert torch.equal(fused[3][3], reference[3][3])
    for x, x8, descale, x8_ref, descale_ref in ((q, fused[0], fused[3][0], reference[0], reference[3][0]),
                                                (k, fused[1], fused[3][1], reference[1], reference[3][1])):
        exact = x.double() if signs is None else hadamard_transform(x.double() * signs.to(device).double())
        torch.testing.assert_close(descale, descale_ref, rtol=1e-2, atol=0)

        def error(data, scales, exact=exact):
            rows = scales.repeat_interleave(128, dim=-1)[..., :exact.shape[2], None].double()
            return (data.double() * rows - exact).pow(2).mean().sqrt().item()

        assert error(x8, descale) <= 1.02 * error(x8_ref, descale_ref)
        assert error(x8, descale) <= 0.05 * exact.pow(2).mean().sqrt().item()  # e4m3: 3 mantissa bits


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 64)])
def test_gpu_the_gluon_quantization_gives_the_triton_passs_bytes(dtype, head_dim, generator):
    """On the H200 the Gluon pass (the default where it applies) writes the Triton pass's bytes: Q, K and V^T in
    e4m3 and every descale and exponent, at odd lengths, with a quiet and an all-zero V tile. Q and K that TMA
    cannot read (a start 2 bytes past a 16-byte boundary) take the Triton pass."""
    from fa_lab.kernels.common import tma_readable
    from fa_lab.kernels.hopper import V_SCALE_FLOOR
    from fa_lab.kernels.hopper.fp8_attention import rotation_signs
    from fa_lab.kernels.hopper.fp8_quant import quantize_fp8_operands
    from fa_lab.kernels.hopper.fp8_quant_gluon import gluon_quantization_applies

    def same(x, y):
        return torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.dtype == torch.float8_e4m3fn else \
            torch.equal(x, y)

    signs = rotation_signs(head_dim, torch.device("cuda"))
    for nq, nk in ((200, 300), (1000, 333), (4096, 4096)):
        q, k, v = ((3 * torch.randn(2, 3, n, head_dim, generator=generator)).to("cuda", dtype) for n in (nq, nk, nk))
        v[0, 0, :128] *= 1e-3
        v[1, 1, 128:256] = 0
        assert gluon_quantization_applies(q.reshape(-1, nq, head_dim), k.reshape(-1, nk, head_dim), 128, True)
        by_gluon = quantize_fp8_operands(q, k, v, signs, 128, V_SCALE_FLOOR)
        by_triton = quantize_fp8_operands(q, k, v, signs, 128, V_SCALE_FLOOR, kernel="triton")
        for x, y in zip((*by_gluon[:3], *by_gluon[3]), (*by_triton[:3], *by_triton[3])):
            assert same(x, y), (nq, nk)
    storage = torch.randn(2 * 2 * 200 * head_dim + 1, generator=generator).to("cuda", dtype)
    shifted = storage[1:].view(2, 2, 200, head_dim)  # (one element past the allocation's aligned start)
    k, v = (torch.randn(2, 2, 300, head_dim, generator=generator).to("cuda", dtype) for _ in range(2))
    rows = shifted.reshape(-1, 200, head_dim)
    assert not tma_readable(rows) and not gluon_quantization_applies(rows, k.reshape(-1, 300, head_dim), 128, True)
    fallback = quantize_fp8_operands(shifted, k, v, signs, 128, V_SCALE_FLOOR)
    aligned = quantize_fp8_operands(shifted.clone(), k, v, signs, 128, V_SCALE_FLOOR)
    for x, y in zip((*fallback[:3], *fallback[3]), (*aligned[:3], *aligned[3])):
        assert same(x, y)


@pytest.mark.gpu
def test_gpu_triton_hopper_runs_the_gluon_kernel_where_it_applies():
    from fa_lab.kernels.hopper import HopperOptions, uses_gluon

    assert uses_gluon(torch.empty(1, 1, 8, 128, device="cuda"), HopperOptions())
    assert uses_gluon(torch.empty(1, 1, 8, 80, device="cuda"), HopperOptions())
    assert not uses_gluon(torch.empty(1, 1, 8, 256, device="cuda"), HopperOptions())
    assert not uses_gluon(torch.empty(1, 1, 8, 128, device="cuda"), HopperOptions(kernel="triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("switches", [dict(stages=3), dict(pingpong=True), dict(stages=3, pingpong=True),
                                      dict(kernel="triton")], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1000, 1100), (1100, 1000), (239, 1), (128, 4096)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_hopper_switches(switches, dtype, seqlen_q, seqlen_k, causal, generator):
    from fa_lab.kernels.hopper import HopperOptions, triton_hopper_attention

    options = HopperOptions(**switches)
    q, k, v = make_qkv(2, 3, seqlen_q, seqlen_k, 128, dtype, "cuda", generator=generator)
    check_attention(lambda *a: triton_hopper_attention(*a, options=options), q, k, v, causal, None, grads=False,
                    generator=generator)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, heads_kv, seqlen_q, seqlen_k, causal",
                         [(4, 4, 4100, 4096, False), (6, 2, 4096, 4500, False), (2, 1, 1000, 16384, True),
                          (2, 2, 16384, 16384, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("score_options", [{}, dict(softcap=30.0), dict(alibi_slopes=True)], ids=str)
def test_gpu_three_consumers_by_default(heads, heads_kv, seqlen_q, seqlen_k, causal, dtype, score_options,
                                        generator):
    """At d = 64 from THREE_CONSUMERS_MIN_KEYS keys the default forward runs 192-row tiles (three consumers,
    persistent; ALiBi two): grouped K/V, ragged lengths, softcap and ALiBi through fa_lab.attention."""
    from fa_lab.kernels.hopper.attention import consumers_by_default

    assert consumers_by_default(64, causal, seqlen_k, banded=False) == 3
    if score_options.get("alibi_slopes"):
        score_options = dict(alibi_slopes=torch.rand(heads, generator=generator).cuda())
    q, k, v = make_qkv(1, heads, seqlen_q, seqlen_k, 64, dtype, "cuda", generator=generator, heads_kv=heads_kv)

    def attention(q, k, v, causal, scale, **options):
        return fa_lab.attention(q, k, v, causal=causal, scale=scale, impl="triton_hopper", return_lse=True,
                                **options)

    check_attention(attention, q, k, v, causal, None, grads=False, generator=generator, **score_options)


@pytest.mark.gpu
@pytest.mark.parametrize("exp2_on_fma", [0, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1000, 1100), (1100, 1000), (4096, 4096)])
def test_gpu_fp8_gluon_matches_the_triton_fp8_kernel(causal, seqlen_q, seqlen_k, exp2_on_fma, generator):
    """Same quantization blocks, so the same error as the Triton FP8 kernel; V tiles whose scales differ by
    1e15 (the Gluon kernel folds their ratio into P's exponent) stay finite and accurate; with half the
    exponentials on the FMA units (HopperOptions.exp2_on_fma) too."""
    from fa_lab.fp8 import rmse
    from fa_lab.kernels.hopper import FP8_OPTIONS, HopperOptions, triton_hopper_fp8_attention
    from fa_lab.reference import reference_attention

    q, k, v = (torch.randn(2, 3, n, 128, generator=generator).bfloat16() for n in (seqlen_q, seqlen_k, seqlen_k))
    v[:, :, 128:256] *= 1e-12
    v[:, :, 256:384] *= 1e3
    reference = reference_attention(q.double(), k.double(), v.double(), causal)[0]
    errors = {}
    for kernel, options in (("gluon", dataclasses.replace(FP8_OPTIONS, exp2_on_fma=exp2_on_fma)),
                            ("triton", HopperOptions(kernel="triton"))):
        out = triton_hopper_fp8_attention(q.cuda(), k.cuda(), v.cuda(), causal, None, options=options)[0]
        assert torch.isfinite(out).all()
        errors[kernel] = rmse(out.cpu().double(), reference)
    assert abs(errors["gluon"] - errors["triton"]) <= 0.15 * errors["triton"], errors


@pytest.mark.gpu
def test_gpu_cached_launches_compute_what_ordinary_launches_compute(generator, monkeypatch):
    """The Gluon forward and backward launched through fa_lab.kernels.launch (each call checked against Triton's
    binder by the conftest) give the bits of the ordinary launch, over shapes whose lengths, heads and head sizes
    specialize differently (multiples of 16 or not, grouped K/V, a window, both kernels' grids): O, dK and dV
    exactly; dQ, which the Gluon backward's CTAs add up in float32 in whatever order they finish (it is not
    deterministic, even between two ordinary launches), within that order's rounding."""
    import fa_lab.kernels.hopper.attention as hopper
    from fa_lab.kernels.launch import _LAUNCHES

    cases = [(2, 8, 8, 1000, 1000, 128, True, (-1, -1)), (1, 8, 2, 517, 1333, 64, False, (-1, -1)),
             (3, 4, 4, 2048, 2048, 128, False, (256, 0)), (2, 8, 8, 1024, 1024, 96, True, (-1, -1)),
             (1, 4, 4, 16, 17, 128, True, (-1, -1)), (2, 4, 2, 4096, 4096, 128, True, (-1, -1))]
    for batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, window in cases:
        q = torch.randn(batch, heads, seqlen_q, head_dim, generator=generator).bfloat16().cuda().requires_grad_()
        k, v = (torch.randn(batch, heads_kv, seqlen_k, head_dim, generator=generator).bfloat16().cuda()
                .requires_grad_() for _ in range(2))
        grad = torch.randn(q.shape, generator=generator).bfloat16().cuda()
        results = []
        for ordinary in (True, False, False):  # the second cached call is the one that skips the binder
            with monkeypatch.context() as patch:
                if ordinary:
                    patch.setattr(hopper, "cached_launch", lambda kernel: kernel)
                out = fa_lab.attention(q, k, v, causal=causal, impl="triton_hopper", window=window)
                results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
        for cached in results[1:]:
            case = (batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal)
            for name, expected, got in zip(("out", "dq", "dk", "dv"), results[0], cached):
                if name == "dq":
                    torch.testing.assert_close(got.float(), expected.float(), rtol=0,
                                               atol=2 ** -7 * expected.abs().max().item(), msg=str(case))
                else:
                    assert torch.equal(expected, got), (name, case)
    launched = {kernel.fn.__name__ for kernel, launch in _LAUNCHES.items() if launch._compiled}
    assert {"attention_fwd_fa3_kernel", "attention_bwd_fa3_kernel"} <= launched, launched


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("switches", [dict(), dict(stages=3, pingpong=True)], ids=str)
@pytest.mark.parametrize("batch, heads, seqlen_q, seqlen_k, head_dim",
                         [(4, 16, 1000, 1100, 128), (4, 16, 1100, 1000, 64), (2, 16, 4096, 4096, 128),
                          (1, 3, 700, 300, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_persistent_kernel_computes_what_one_tile_per_cta_computes(fp8, switches, batch, heads, seqlen_q,
                                                                         seqlen_k, head_dim, causal, generator):
    """Each work tile runs the same instructions whichever CTA takes it, so the persistent kernel's output
    is bit for bit the one-tile-per-CTA kernel's. Most shapes have more work tiles than SMs, so CTAs loop,
    and the ring's and Q's barrier phases run across tiles; (700, 300) causal has rows that see no key."""
    from fa_lab.kernels.hopper import (
        GLUON_TILES,
        HopperOptions,
        fp8_forward,
        quantize_for_kernel,
        triton_hopper_attention,
    )

    q, k, v = make_qkv(batch, heads, seqlen_q, seqlen_k, head_dim, torch.bfloat16, "cuda", generator=generator)
    options = {persistent: HopperOptions(persistent=persistent, **switches) for persistent in (False, True)}
    if fp8:  # one quantization for both kernels
        q8, k8, vt8, descales = quantize_for_kernel(q, k, v, GLUON_TILES, True, gluon=True)
        outs = [fp8_forward(q8, k8, vt8, descales, causal, head_dim ** -0.5, GLUON_TILES, q.dtype,
                            head_dim, options[persistent]) for persistent in (False, True)]
    else:
        outs = [triton_hopper_attention(q, k, v, causal, None, options=options[persistent])
                for persistent in (False, True)]
        check_attention(lambda *a: triton_hopper_attention(*a, options=options[True]), q, k, v, causal, None,
                        grads=False, generator=generator)
    assert torch.isfinite(outs[1][0]).all()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])  # out and lse


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(97, 97), (1024, 1024), (1025, 1025), (2048, 2048), (113, 203),
                                                (1023, 1024), (239, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_hopper(head_dim, seqlen_q, seqlen_k, causal, generator):
    q, k, v = make_qkv(2, 3, seqlen_q, seqlen_k, head_dim, torch.bfloat16, "cuda", generator=generator)
    check_attention(hopper_impl, q, k, v, causal, None, generator=generator)


@pytest.mark.gpu
@pytest.mark.parametrize("impl, heads_kv, options", [
    ("triton_hopper", 8, dict(causal=True)),
    ("triton_hopper", 2, dict(window=(300, 0))),
    ("triton_hopper", 8, dict(softcap=30.0)),
    ("triton_hopper_fp8", 8, dict(causal=True)),
])
def test_gpu_attention_never_waits_for_the_gpu(impl, heads_kv, options, generator, assert_never_waits):
    """fa_lab.attention's Gluon paths issue every launch without reading anything back to the host, forward and (bf16)
    backward (a read would leave the GPU idle while the host waits, which short calls feel most); a read of the
    output does read back."""
    q, k, v = make_qkv(2, 8, 1500, 1500, 128, torch.bfloat16, "cuda", generator=generator, heads_kv=heads_kv,
                       requires_grad=impl == "triton_hopper")
    grad = torch.randn(q.shape, generator=generator).to("cuda", torch.bfloat16)
    outputs = []

    def call():
        outputs.append(fa_lab.attention(q, k, v, impl=impl, **options))
        if impl == "triton_hopper":
            outputs[-1].backward(grad)
    assert_never_waits(call, lambda: outputs[-1].float().abs().max().item())


@pytest.mark.gpu
def test_gpu_fp8_error_on_outlier_data_matches_the_table():
    """RMSE on the FA3 paper's outlier data within 2x of reproduce_error_table's flash_fp8 row."""
    from fa_lab.fp8 import ERROR_TABLE_SHAPE, outlier_qkv, reproduce_error_table, rmse
    from fa_lab.reference import reference_attention

    s = ERROR_TABLE_SHAPE
    q64, k64, v64 = outlier_qkv(s["batch"], s["heads"], s["seqlen_q"], s["seqlen_k"], s["head_dim"],
                                torch.Generator().manual_seed(1))
    out = fa_lab.attention(*(t.to("cuda", torch.float16) for t in (q64, k64, v64)), impl="triton_hopper_fp8")
    error = rmse(out.cpu(), reference_attention(q64, k64, v64)[0])
    table = reproduce_error_table(seed=1)
    assert table["flash_fp8"] / 2 <= error <= 2 * table["flash_fp8"], (error, table["flash_fp8"])
    assert error < table["flash_fp8_no_incoherent"]  # the rotation is doing its job


@pytest.mark.gpu
@pytest.mark.parametrize("heads, heads_kv", [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1000, 1100), (239, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_gpu_gluon_reads_grouped_kv_in_place(heads, heads_kv, head_dim, seqlen_q, seqlen_k, causal, persistent,
                                             generator, monkeypatch):
    """Grouped-query attention through the Gluon kernel: query head h reads K/V head h // group from the
    (B, heads_kv, N, d) tensors themselves (no expanded copy is made), forward and gradients."""
    import fa_lab.kernels.hopper.attention as hopper
    from fa_lab.kernels.hopper import HopperOptions, triton_hopper_attention

    def no_copy(*_args):
        raise AssertionError("the Gluon path expanded K/V")
    monkeypatch.setattr(hopper, "expand_kv", no_copy)
    options = HopperOptions(persistent=persistent)
    q, k, v = make_qkv(2, heads, seqlen_q, seqlen_k, head_dim, torch.bfloat16, "cuda", generator=generator,
                       heads_kv=heads_kv)
    check_attention(lambda *a: triton_hopper_attention(*a, options=options), q, k, v, causal, None,
                    generator=generator)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(256, 0), (100, -1), (64, 64), (-1, 5), (3000, 3000)])
@pytest.mark.parametrize("seqlen_q, seqlen_k, head_dim", [(1000, 1100, 128), (1100, 1000, 64), (239, 1, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("persistent, split_loops", [(False, False), (True, False), (False, True), (True, True)])
def test_gpu_gluon_window(window, seqlen_q, seqlen_k, head_dim, causal, persistent, split_loops, generator,
                          monkeypatch):
    """A local window in the Gluon kernel (not handed to the portable one): the loop starts at the band's
    first K/V tile and masks both edges (split_loops: each edge in a loop of its own, one bound each); windows
    wider than the sequence, narrower than a tile, and rows that see no key included; grouped K/V; forward and
    gradients against the float64 reference."""
    import fa_lab.kernels.hopper.attention as hopper
    from fa_lab.kernels.hopper import HopperOptions, triton_hopper_attention

    def not_portable(*_args, **_kwargs):
        raise AssertionError("the window went to the portable kernel")
    monkeypatch.setattr(hopper, "triton_forward", not_portable)
    options = HopperOptions(persistent=persistent, split_loops=split_loops)
    q, k, v = make_qkv(2, 4, seqlen_q, seqlen_k, head_dim, torch.bfloat16, "cuda", generator=generator, heads_kv=2)
    check_attention(lambda q, k, v, causal, scale, window: triton_hopper_attention(
        q, k, v, causal, scale, options=options, window=window), q, k, v, causal, None, generator=generator,
        window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q, seqlen_k, head_dim, dtype", [(1000, 1100, 128, torch.bfloat16),
                                                                 (1100, 1000, 64, torch.float16),
                                                                 (239, 1, 128, torch.bfloat16),
                                                                 (2048, 2048, 128, torch.bfloat16),
                                                                 (2048, 4096, 64, torch.bfloat16)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("switch, other",
                         [(switch, other) for switch in ("split_loops", "rescale_early", "convert_p_late")
                          for other in ("one_tile_per_cta", "persistent", "defaults", "one_loop")
                          if (switch, other) != ("split_loops", "one_loop")])
def test_gpu_forward_switches_keep_the_bits(seqlen_q, seqlen_k, head_dim, dtype, causal, switch, other, generator):
    """A switch that reorders the Gluon forward's work but not its arithmetic leaves O and lse the same bit for bit:
    split_loops (three K/V loops against one; P rounded the same way whether carried packed or not),
    rescale_early (O meets the same multiplications in the same order) and convert_p_late (P packed after S_j's
    issue). Beside ``other``: one tile per CTA, persistent, the defaults (three consumers at d = 64 from 4K keys), and
    for the last two switches one loop; no window, windows wider and narrower than a tile, a soft cap, and ALiBi (one
    loop in the kernel); with the defaults, rescale_early and convert_p_late also in the FP8 kernel, one loop and
    three. (One item per ``other``, so that each compiles a few kernels and workers share the rest.)"""
    from fa_lab.kernels.hopper import HopperOptions, triton_hopper_attention
    from fa_lab.kernels.hopper.attention import FP8_OPTIONS
    from fa_lab.kernels.hopper.fp8_attention import triton_hopper_fp8_attention

    q, k, v = make_qkv(2, 4, seqlen_q, seqlen_k, head_dim, dtype, "cuda", generator=generator, heads_kv=2)
    slopes = (torch.rand(2, 4, generator=generator) * 0.1).cuda()
    cases = [{}, dict(window=(1024, 0)), dict(window=(100, -1)), dict(window=(64, 64)), dict(window=(300, 200)),
             dict(softcap=30.0), dict(softcap=30.0, window=(256, 0)), dict(alibi_slopes=slopes, window=(256, 0))]
    others = dict(one_tile_per_cta=dict(persistent=False), persistent=dict(persistent=True), defaults={},
                  one_loop=dict(persistent=True, split_loops=False))
    for given in cases:
        off, on = (triton_hopper_attention(q, k, v, causal, None, **given,
                                           options=HopperOptions(**others[other], **{switch: flag}))
                   for flag in (False, True))
        for name, a, b in zip(("out", "lse"), off, on):
            assert torch.equal(a, b), (name, given)
    # FP8 once per switch and shape (its own tests have no one-key rows)
    if other == "defaults" and switch != "split_loops" and dtype == torch.bfloat16 and seqlen_k > 1:
        k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))  # (FP8 takes one K/V head per query head)
        for split_loops in (False, True):
            off, on = (triton_hopper_fp8_attention(q, k, v, causal, None, options=dataclasses.replace(
                FP8_OPTIONS, split_loops=split_loops, **{switch: flag})) for flag in (False, True))
            for name, a, b in zip(("out", "lse"), off, on):
                assert torch.equal(a, b), ("fp8", split_loops, name)


@pytest.mark.gpu
@pytest.mark.parametrize("softcap, alibi", [(30.0, False), (0.0, True), (5.0, True)])
@pytest.mark.parametrize("window", [(-1, -1), (100, -1)])
@pytest.mark.parametrize("seqlen_q, seqlen_k, head_dim", [(1000, 1100, 128), (1100, 1000, 64), (239, 1, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_gpu_gluon_softcap_and_alibi(softcap, alibi, window, seqlen_q, seqlen_k, head_dim, causal, persistent,
                                     generator, monkeypatch):
    """The soft cap and ALiBi in the Gluon kernel (not handed to the portable one), alone, together and with a
    window, grouped K/V, per-(batch, head) slopes; forward and gradients against the float64 reference."""
    import fa_lab.kernels.hopper.attention as hopper
    from fa_lab.kernels.hopper import HopperOptions

    def not_portable(*_args, **_kwargs):
        raise AssertionError("the options went to the portable kernel")
    monkeypatch.setattr(hopper, "triton_forward", not_portable)
    _check_gluon_score_options(HopperOptions(persistent=persistent), softcap, alibi, window, seqlen_q, seqlen_k,
                               head_dim, causal, generator)


def _check_gluon_score_options(options, softcap, alibi, window, seqlen_q, seqlen_k, head_dim, causal, generator):
    """triton_hopper_attention at ``options`` on grouped bf16 q, k, v (2 x 4 query heads over 2 K/V heads), with the
    soft cap and per-(batch, head) ALiBi slopes, against the float64 reference (forward and gradients)."""
    from fa_lab.kernels.hopper import triton_hopper_attention

    q, k, v = make_qkv(2, 4, seqlen_q, seqlen_k, head_dim, torch.bfloat16, "cuda", generator=generator, heads_kv=2)
    slopes = (torch.rand(2, 4, generator=generator) * 0.1).cuda() if alibi else None
    check_attention(lambda q, k, v, causal, scale, **given: triton_hopper_attention(
        q, k, v, causal, scale, options=options, **given), q, k, v, causal, None, generator=generator,
        window=window, softcap=softcap, alibi_slopes=slopes)


@pytest.mark.gpu
@pytest.mark.parametrize("switches", [dict(softcap_max_first=True), dict(softcap_q_scaled=True),
                                      dict(softcap_max_first=True, softcap_q_scaled=True)], ids=str)
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (100, -1)])
@pytest.mark.parametrize("seqlen_q, seqlen_k, head_dim", [(1000, 1100, 128), (1100, 1000, 64), (239, 1, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gluon_softcap_variants(switches, alibi, window, seqlen_q, seqlen_k, head_dim, causal, generator):
    """The soft cap's other forms in the Gluon forward (the row max before the cap, Q scaled before the kernel), with
    and without ALiBi (which keeps the cap before the max), masks and one-key rows, against the float64 reference."""
    from fa_lab.kernels.hopper import HopperOptions

    _check_gluon_score_options(HopperOptions(**switches), 30.0, alibi, window, seqlen_q, seqlen_k, head_dim, causal,
                               generator)


@gluon.jit
def _exp2_mixed_kernel(x_ptr, out_ptr, ON_FMA: gl.constexpr, N: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    offsets = gl.arange(0, N, layout=layout)
    gl.store(out_ptr + offsets, exp2_mixed(gl.load(x_ptr + offsets), ON_FMA))


@pytest.mark.gpu
@pytest.mark.parametrize("on_fma", [1, 2, 3, 4])
def test_gpu_exp2_mixed_is_exp2_within_1e4(on_fma):
    """exp2_mixed on the device: the MUFU's values where it keeps them, the polynomial's within 1e-4 relative of
    2**x elsewhere (x from -126 to 8, FP8's P is scaled up), and exactly 0 for -inf and from -127 down."""
    blocks = 4 * 128
    x = torch.cat([torch.rand(blocks * 60) * -126, torch.rand(blocks * 3) * 8, torch.tensor(
        [float("-inf"), -127.0, -127.5, -300.0] * (blocks // 4))]).cuda()
    outs = {}
    for n in (0, on_fma):
        outs[n] = torch.empty_like(x)
        _exp2_mixed_kernel[(1,)](x, outs[n], n, x.numel(), num_warps=4)
    by_mufu = torch.arange(x.numel(), device="cuda") % 4 < 4 - on_fma
    assert torch.equal(outs[on_fma][by_mufu], outs[0][by_mufu])
    normal = x > -126  # (the MUFU's ftz flushes results below 2**-126 to 0)
    want = torch.exp2(x[normal].double())
    assert ((outs[on_fma][normal].double() - want).abs() / want).max() < 1e-4
    lowest = x <= -127
    assert torch.equal(outs[on_fma][lowest], torch.zeros_like(x[lowest]))


@pytest.mark.gpu
@pytest.mark.parametrize("on_fma", [1, 2, 4])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("window", [(-1, -1), (100, -1)])
@pytest.mark.parametrize("seqlen_q, seqlen_k, head_dim", [(1000, 1100, 128), (1100, 1000, 64), (239, 1, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gluon_exp2_on_fma(on_fma, softcap, window, seqlen_q, seqlen_k, head_dim, causal, generator):
    """The Gluon forward with exponentials on the FMA units (HopperOptions.exp2_on_fma), with and without the soft
    cap, masks, windows and one-key rows (rows that see no key stay zero), against the float64 reference."""
    from fa_lab.kernels.hopper import HopperOptions

    _check_gluon_score_options(HopperOptions(exp2_on_fma=on_fma), softcap, False, window, seqlen_q, seqlen_k,
                               head_dim, causal, generator)


GLUON_BACKWARD_CASES = [  # (batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype)
    (2, 4, 4, 1000, 1000, 128, True, torch.bfloat16),
    (1, 8, 2, 777, 777, 128, False, torch.bfloat16),
    (2, 8, 1, 333, 1025, 64, False, torch.bfloat16),
    (1, 4, 2, 700, 513, 128, True, torch.float16),
    (1, 4, 4, 513, 700, 64, True, torch.bfloat16),
    (1, 2, 2, 64, 1000, 128, True, torch.float16),
    (2, 2, 2, 130, 129, 128, False, torch.bfloat16),
    (1, 4, 1, 2048, 2048, 128, True, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dq_mode", ["turns", "partial", "split", "named"])
@pytest.mark.parametrize("batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype", GLUON_BACKWARD_CASES)
def test_gpu_gluon_backward_meets_the_tolerance_rule(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal,
                                                     dtype, dq_mode, generator, monkeypatch):
    """The Gluon FA3 backward (not the portable one), with each dQ scheme ("split" at d = 128, where it runs):
    grouped K/V, causal with more or fewer queries than keys, ragged tiles at both ends, bf16 and fp16; gradients
    against the float64 reference."""
    import fa_lab.kernels.hopper.attention as hopper

    if dq_mode == "split" and head_dim != 128:
        pytest.skip("dq_mode='split' runs at head_dim 128 only")

    def not_portable(*_args, **_kwargs):
        raise AssertionError("the backward went to the portable kernels")
    monkeypatch.setattr(hopper, "triton_backward", not_portable)
    options = hopper.HopperOptions(backward="gluon", backward_dq=dq_mode)
    q, k, v = make_qkv(batch, heads, seqlen_q, seqlen_k, head_dim, dtype, "cuda", generator=generator,
                       heads_kv=heads_kv)
    check_attention(lambda q, k, v, causal, scale: hopper.triton_hopper_attention(q, k, v, causal, scale,
                                                                                  options=options),
                    q, k, v, causal, None, generator=generator)


GLUON_WINDOW_CASES = [  # (batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, window)
    (1, 4, 2, 1000, 1000, 128, True, (256, 0)),
    (2, 4, 4, 777, 777, 128, False, (100, 50)),
    (1, 4, 1, 513, 700, 64, False, (300, -1)),
    (1, 2, 2, 900, 600, 64, True, (90, 0)),
    (1, 2, 2, 600, 900, 128, False, (-1, 7)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dq_mode", ["turns", "named"])
@pytest.mark.parametrize("batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, window", GLUON_WINDOW_CASES)
def test_gpu_gluon_backward_with_a_window(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, window,
                                          dq_mode, generator, monkeypatch):
    """The Gluon backward (not the portable one) under a band: causal with a left bound, both sides bounded, one
    side only, more queries than keys and fewer (rows that see no key); gradients against the float64 reference."""
    import fa_lab.kernels.hopper.attention as hopper

    def not_portable(*_args, **_kwargs):
        raise AssertionError("the backward went to the portable kernels")
    monkeypatch.setattr(hopper, "triton_backward", not_portable)
    options = hopper.HopperOptions(backward="gluon", backward_dq=dq_mode)
    q, k, v = make_qkv(batch, heads, seqlen_q, seqlen_k, head_dim, torch.bfloat16, "cuda", generator=generator,
                       heads_kv=heads_kv)
    check_attention(lambda q, k, v, causal, scale, **mask: hopper.triton_hopper_attention(
        q, k, v, causal, scale, options=options, **mask), q, k, v, causal, None, generator=generator, window=window)


def _check_gluon_backward_with(launch_kwargs, case, generator, monkeypatch):
    """The Gluon backward (HopperOptions(backward="gluon")) with gluon_backward(**launch_kwargs), one
    GLUON_BACKWARD_CASES case, against the float64 reference."""
    import fa_lab.kernels.hopper.attention as hopper

    batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype = case
    original = hopper.gluon_backward
    monkeypatch.setattr(hopper, "gluon_backward",
                        lambda *args, **kwargs: original(*args, **kwargs, **launch_kwargs))
    options = hopper.HopperOptions(backward="gluon")
    q, k, v = make_qkv(batch, heads, seqlen_q, seqlen_k, head_dim, dtype, "cuda", generator=generator,
                       heads_kv=heads_kv)
    check_attention(lambda q, k, v, causal, scale: hopper.triton_hopper_attention(q, k, v, causal, scale,
                                                                                  options=options),
                    q, k, v, causal, None, generator=generator)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [case for case in GLUON_BACKWARD_CASES if case[5] == 64], ids=str)
def test_gpu_gluon_backward_in_64_row_steps_at_d64(case, generator, monkeypatch):
    """The Gluon backward at d = 64 with steps of 64 query rows (its default is 128, BWD_ROWS) also meets the rule."""
    _check_gluon_backward_with(dict(rows=64), case, generator, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GLUON_BACKWARD_CASES, ids=str)
def test_gpu_gluon_backward_with_row_vectors_loaded_by_the_consumers(case, generator, monkeypatch):
    """gluon_backward(rows_by_producer=False): each consumer loads lse2 and D itself (the producer brings them by
    default, which the other backward tests check)."""
    _check_gluon_backward_with(dict(rows_by_producer=False), case, generator, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GLUON_BACKWARD_CASES, ids=str)
def test_gpu_gluon_backward_with_row_vectors_loaded_a_step_ahead(case, generator, monkeypatch):
    """gluon_backward(rows_ahead=True): the producer loads each step's lse2 and D one step ahead; the rule holds."""
    _check_gluon_backward_with(dict(rows_ahead=True), case, generator, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_split", [2, 4])
@pytest.mark.parametrize("case", [case for case in GLUON_BACKWARD_CASES if case[1] // case[2] % 4 == 0] +
                         [(1, 8, 2, 1000, 1000, 128, True, torch.bfloat16)], ids=str)
def test_gpu_gluon_backward_with_the_group_split_across_ctas(case, kv_split, generator, monkeypatch):
    """gluon_backward(kv_split=2 or 4): each CTA walks a part of its group's query heads and stores float32 partial
    dK, dV, summed by the launcher; the rule holds (grouped K/V, causal and not, ragged tiles, d = 64 and 128)."""
    _check_gluon_backward_with(dict(kv_split=kv_split), case, generator, monkeypatch)


def test_the_group_split_must_divide_the_group():
    """gluon_backward refuses a kv_split that does not divide the query heads per K/V head before anything runs
    (CPU tensors: nothing is launched)."""
    from fa_lab.kernels.hopper.attention import gluon_backward

    q, k, v = make_qkv(1, 8, 64, 64, 64, torch.bfloat16, heads_kv=2, requires_grad=False)
    lse = torch.zeros(1, 8, 64)
    for bad in (3, 0, 8, 2.0, True):
        with pytest.raises(ValueError, match="kv_split must be a divisor of the group of 4"):
            gluon_backward(q, k, v, q, lse, q, True, 0.125, kv_split=bad)


def test_the_group_split_builds_for_sm90_without_spills():
    """With kv_split > 1 the kernel stores float32 dK, dV partials (8-byte stores, 16-bit ones otherwise); the
    loops stay free of spills and the default build is the one the other offline tests hold."""
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90, fa3_backward_job

    configs = [(128, True, 2), (128, False, 4), (64, True, 2), (128, True, 1)]
    builds = compile_all_for_sm90([fa3_backward_job(head_dim, causal, kv_split=split)
                                   for head_dim, causal, split in configs])
    for (head_dim, causal, split), build in zip(configs, builds):
        assert build.kv_loop_spills == 0 and build.stack_bytes == 0, (head_dim, causal, split)
        wide = build.sass.count("STG.E.64")
        assert (wide >= head_dim) if split > 1 else (wide == 0), (head_dim, causal, split, wide)


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_rows_ahead_keeps_the_bits_of_dk_and_dv(varlen, generator):
    """rows_ahead moves the producer's loads, not the arithmetic: dK and dV bit for bit those of the default, dQ
    (added up in float32 in whatever order the CTAs reach a tile) within float32 rounding of it. Grouped K/V, causal,
    a ragged last tile; and a packed batch with an empty sequence and sequences shorter than a step."""
    from fa_lab.kernels.hopper.attention import (
        gluon_backward,
        gluon_forward,
        gluon_varlen_backward,
        gluon_varlen_forward,
    )
    from fa_lab.kernels.portable.attention import ScoreOptions

    if varlen:
        lengths = [300, 0, 17, 1000, 64]
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
        q, k, v, grad = (torch.randn(sum(lengths), 8, 128, generator=generator).to("cuda", torch.bfloat16)
                         for _ in range(4))
        k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
        bounds = (cu.tolist(), cu.tolist())
        out, lse = gluon_varlen_forward(q, k, v, cu, cu, bounds, True, 128 ** -0.5, ScoreOptions())
        runs = [gluon_varlen_backward(q, k, v, out, lse, grad, cu, cu, bounds, True, 128 ** -0.5, rows_ahead=ahead)
                for ahead in (False, True)]
    else:
        q, k, v = make_qkv(2, 8, 700, 700, 128, torch.bfloat16, "cuda", generator=generator, heads_kv=2)
        grad = torch.randn(q.shape, generator=generator).to("cuda", q.dtype)
        out, lse = gluon_forward(q, k, v, True, 128 ** -0.5)
        runs = [gluon_backward(q, k, v, out, lse, grad, True, 128 ** -0.5, rows_ahead=ahead) for ahead in (False, True)]
    (dq0, dk0, dv0), (dq1, dk1, dv1) = runs
    assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1)
    torch.testing.assert_close(dq1.float(), dq0.float(), rtol=0, atol=2 ** -7 * dq0.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("head_group", [1, 2, 4, 8])
def test_gpu_gluon_backward_in_any_head_group_order(head_group, generator):
    """The dense launch's CTA order (gluon_backward(head_group=...), fa3_backward.key_tile_of_cta) changes only when
    each (key tile, head) runs: dK and dV, each computed whole by one CTA, are bit for bit those of head by head
    order; dQ, added up in float32 in another order, within float32 rounding of it. A causal grouped-query call of
    8 (batch, K/V head) pairs with 5 key tiles each (the last ragged)."""
    from fa_lab.kernels.hopper.attention import gluon_backward, gluon_forward

    q, k, v = make_qkv(2, 16, 600, 600, 128, torch.bfloat16, "cuda", generator=generator, heads_kv=4)
    grad = torch.randn(q.shape, generator=generator).to("cuda", q.dtype)
    out, lse = gluon_forward(q, k, v, True, 128 ** -0.5)
    dq, dk, dv = gluon_backward(q, k, v, out, lse, grad, True, 128 ** -0.5, head_group=head_group)
    dq1, dk1, dv1 = gluon_backward(q, k, v, out, lse, grad, True, 128 ** -0.5, head_group=1)
    assert torch.equal(dk, dk1) and torch.equal(dv, dv1)
    torch.testing.assert_close(dq.float(), dq1.float(), rtol=0, atol=2 ** -7 * dq1.abs().max().item())


@pytest.mark.gpu
def test_gpu_the_default_backward_is_the_gluon_one_where_it_was_measured_faster(monkeypatch):
    """impl="triton_hopper" takes the Gluon backward where gluon_backward_is_faster (without a mask at any length;
    causal from 2K keys at d = 128 and 64, a window too), the portable one for short causal calls and wherever a
    soft cap or ALiBi is given."""
    import fa_lab.kernels.hopper.attention as hopper

    calls = []
    original = hopper.gluon_backward
    monkeypatch.setattr(hopper, "gluon_backward", lambda *args, **kwargs: calls.append(
        (args[0].shape[-1], args[1].shape[2], tuple(kwargs.get("window", (-1, -1))) != (-1, -1)))
        or original(*args, **kwargs))
    for head_dim, seqlen, causal, window, softcap in (
            (128, 300, False, (-1, -1), 0.0), (128, 2048, True, (-1, -1), 0.0), (128, 300, True, (-1, -1), 0.0),
            (64, 300, False, (-1, -1), 0.0), (128, 2048, True, (100, 0), 0.0), (128, 2048, True, (-1, -1), 30.0)):
        q, k, v = (torch.randn(1, 2, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        fa_lab.attention(q, k, v, causal=causal, impl="triton_hopper", window=window,
                         softcap=softcap).sum().backward()
    assert calls == [(128, 300, False), (128, 2048, False), (64, 300, False), (128, 2048, True)]
