"""The interfaces benchmark's CPU-side parts: its cases and FLOP counts, the arguments it gives the
upstream kernels, its rows against the schema, and the ratios it reports (the GPU run itself is
`fa-lab bench interfaces` on the device)."""
from __future__ import annotations

import pytest
import torch

from fa_lab.bench import interfaces
from fa_lab.bench.schema import validate_results
from fa_lab.block_info import BlockInfo


def test_every_case_holds_16k_tokens_and_counts_the_pairs_its_masks_keep():
    cases = interfaces.interface_cases()
    assert {c.case for c in cases} == {"mha", "gqa", "varlen", "dense_same_tokens", "window", "softcap", "alibi"}
    for case in cases:
        assert interfaces.TOKENS - len(case.lengths) < sum(case.lengths) <= interfaces.TOKENS
    varlen = next(c for c in cases if c.case == "varlen")
    low, high = interfaces.VARLEN_LENGTHS
    assert varlen.varlen and all(low <= n <= high for n in varlen.lengths[:-1])
    dense = next(c for c in cases if c.case == "dense_same_tokens")
    assert len(dense.lengths) == len(varlen.lengths)
    window = next(c for c in cases if c.case == "window")
    n, (left, _) = window.lengths[0], window.window
    assert window.pairs() == sum(min(i, left) + 1 for i in range(n))  # each row: itself and up to 1024 before
    gqa = next(c for c in cases if c.case == "gqa")
    assert gqa.heads_kv == interfaces.GQA_HEADS_KV and gqa.flops() == next(c for c in cases if c.case == "mha").flops()


def test_flops_by_brute_force_on_a_small_case():
    case = interfaces.InterfaceCase("varlen", (5, 9), causal=True, window=(3, -1), heads=2, head_dim=4, varlen=True)
    pairs = sum(int(BlockInfo(n, n, True, (3, -1)).mask().sum()) for n in (5, 9))
    assert case.pairs() == pairs and case.flops() == 4 * 2 * 4 * pairs
    assert case.flops(backward=True) == 2.5 * case.flops()


def test_the_upstream_window_argument():
    assert interfaces.fa4_window((-1, -1), False) == (None, None)
    assert interfaces.fa4_window((1024, 0), False) == (1024, 0)
    assert interfaces.fa4_window((-1, -1), True) == (None, 0)
    assert interfaces.fa4_window((7, 3), False) == (7, 3)


def test_rows_follow_the_schema_and_the_ratios_read_them():
    cases = [interfaces.InterfaceCase("mha", (interfaces.OPTION_SEQLEN,)),
             interfaces.InterfaceCase("softcap", (interfaces.OPTION_SEQLEN,), softcap=30.0),
             interfaces.InterfaceCase("varlen", (5, 7), True, varlen=True)]

    def prepare(case):  # a stand-in impl on the CPU: a tiny attention through autograd
        q = torch.randn(1, 2, 8, 4, requires_grad=True)
        return (lambda: torch.softmax(q @ q.transpose(-2, -1), -1) @ q), (q,)

    def timer(fn, return_mode, grad_to_none=()):
        fn()
        return {"mha": 2.0, "softcap": 2.2, "varlen": 1.0}[current[0].case]

    rows = []
    for case in cases:
        current = [case]
        rows.append(interfaces.measure("triton", prepare, case, timer))
    rows.append(interfaces.measure("fa4", lambda case: (_ for _ in ()).throw(ValueError("refused")), cases[0], timer))
    validate_results({"device": "test", "torch": torch.__version__, "triton": None, "date": "2026-12-01",
                      "rows": rows})
    assert rows[2]["lengths"] == [5, 7] and rows[0]["lengths"] is None and rows[-1]["fwd_ms"] is None
    assert rows[0]["fwd_tflops"] == pytest.approx(cases[0].flops() / 2e-3 / 1e12)
    found = dict(interfaces.ratios(rows, ours=("triton",)))
    assert found["softcap forward time / none, triton"] == pytest.approx(1.1)


def test_the_first_forward_timing_is_thrown_away():
    """measure keeps the second timing of the forward: the first of a shape measured low on the H200."""
    calls = []

    def timer(fn, return_mode, grad_to_none=()):
        calls.append(fn)
        return (5.0, 2.0, 3.0)[len(calls) - 1]  # discarded forward, kept forward, backward

    def prepare(case):
        q = torch.randn(1, 2, 8, 4, requires_grad=True)
        return (lambda: (q * 2).sum(-1)), (q,)

    row = interfaces.measure("triton", prepare, interfaces.InterfaceCase("mha", (interfaces.OPTION_SEQLEN,)), timer)
    assert (row["fwd_ms"], row["bwd_ms"]) == (2.0, 3.0) and calls[0] is calls[1]


def test_decode_headline_rows_keep_the_median_of_interleaved_rounds():
    """interleaved times every row once per round, all rows in turn, and keeps each row's median; a refused
    row stays null."""
    from fa_lab.bench import decode

    order = []
    times = {"triton": iter([3.0, 1.0, 2.0]), "sdpa_gqa": iter([5.0, 4.0, 6.0])}

    def timer(fn, return_mode):
        return fn()

    def make(impl):
        def call():
            order.append(impl)
            return next(times[impl])
        return [call]

    def refuse(_):
        raise ValueError("refused")

    nbytes = decode.kv_bytes(8, 4096)
    entries = [(decode.decode_row(impl, 8, 4096, None, 2, timer="eager"), make, (impl,))
               for impl in ("triton", "sdpa_gqa")]
    entries.append((decode.decode_row("fa4", 8, 4096, None, None, timer="eager"), refuse, ("fa4",)))
    rows = decode.interleaved(entries, 3, timer, 4.0, nbytes)
    assert order == ["triton", "sdpa_gqa"] * 3
    assert [r["fwd_ms"] for r in rows] == [2.0, 5.0, None]
    assert rows[0]["tbps"] == pytest.approx(nbytes / 2e-3 / 1e12) and rows[2]["tbps"] is None
    validate_results({"device": "test", "torch": torch.__version__, "triton": None, "date": "2026-12-03",
                      "rows": rows})


def test_decode_rows_follow_the_schema_and_the_heuristic_gap_reads_them():
    from fa_lab.bench import decode

    assert decode.kv_bytes(1, 65536) == 2 * 65536 * 8 * 128 * 2
    rows = []
    def timer_of(ms):
        return lambda fn, return_mode: ms

    def refuse():
        raise ValueError("refused")

    for impl, splits, ms in (("triton", 4, 2.0), ("triton_forced", 2, 2.5), ("triton_forced", 8, 1.9)):
        row = decode.decode_row(impl, 1, 65536, 256, splits, timer="eager")
        rows.append(decode.measure(row, lambda: [lambda: None], (), timer_of(ms), 4.0, decode.kv_bytes(1, 65536)))
    rows.append(decode.measure(decode.decode_row("fa4_paged", 1, 65536, 256, None), refuse, (), None, 4.0, 0))
    validate_results({"device": "test", "torch": torch.__version__, "triton": None, "date": "2026-12-01",
                      "rows": rows})
    assert rows[0]["tbps"] == pytest.approx(decode.kv_bytes(1, 65536) / 2e-3 / 1e12)
    assert rows[-1]["tbps"] is None
    assert decode.copies_for(decode.kv_bytes(1, 4096)) * decode.kv_bytes(1, 4096) >= decode.L2_SPAN
    assert decode.copies_for(decode.kv_bytes(32, 65536)) == 2
    [(batch, seqlen_k, page_size, ratio)] = decode.heuristic_gaps(rows)
    assert (batch, seqlen_k, page_size) == (1, 65536, 256) and ratio == pytest.approx(1.9 / 2.0)


def test_the_sparse_benchmarks_selection_is_nsas_and_its_pairs_are_counted_exactly():
    """nsa_selection: each query's own block, past blocks only, no block twice, -1 where the past is short;
    selection_pairs: the visible pairs of that selection, counted here from its dense mask."""
    from fa_lab.bench import sparse as bench
    from fa_lab.sparse import check_key_tiles, selection_mask

    seqlen = 300  # 5 blocks of 64: early queries have fewer past blocks than SELECTED
    selection = bench.nsa_selection(seqlen, torch.Generator().manual_seed(1), device="cpu")
    assert selection.shape == (1, bench.HEADS_KV, seqlen, min(bench.SELECTED, 5)) and selection.dtype == torch.int32
    own = torch.arange(seqlen) // bench.BLOCK_K
    assert bool((selection == own.view(1, 1, -1, 1)).any(-1).all())
    assert bool((selection <= own.view(1, 1, -1, 1)).all())
    assert bool(((selection >= 0).sum(-1) == (own + 1).clamp(max=selection.shape[-1]).view(1, 1, -1)).all())
    q = torch.randn(1, bench.HEADS, seqlen, 8)
    k = torch.randn(1, bench.HEADS_KV, seqlen, 8)
    check_key_tiles(selection, q, k, 1, bench.BLOCK_K, causal=True)  # accepted as a causal selection
    mask = selection_mask(selection, seqlen, seqlen, 1, bench.BLOCK_K) & torch.ones(seqlen, seqlen).tril().bool()
    assert bench.selection_pairs(selection) == int(mask.sum())
    rows = [bench.sparse_row(impl, 16384) for impl in bench.IMPLS]
    rows[0].update(fwd_ms=2.0, bwd_ms=5.0)
    rows[1].update(fwd_ms=3.0, bwd_ms=6.0)
    validate_results({"device": "test", "torch": torch.__version__, "triton": None, "date": "2026-12-01",
                      "rows": rows})
    found = dict(bench.speedups(rows))
    assert found["nsa_select: fla_nsa time / ours fwd, 16K"] == pytest.approx(1.5)
    assert "nsa_select: dense time / ours fwd, 16K" not in found


def test_the_sparse_benchmarks_nsa_pairs_are_the_three_branches_masks():
    """nsa_pairs: the compressed, selected and window branches' visible pairs, summed over the query heads, as
    their dense masks count them."""
    from fa_lab.bench import sparse as bench
    from fa_lab.block_info import BlockInfo
    from fa_lab.sparse import selection_mask

    seqlen = bench.NSA_WINDOW + 3 * bench.BLOCK_K + 10
    selection = bench.nsa_selection(seqlen, torch.Generator().manual_seed(3), device="cpu")
    rows = torch.arange(seqlen)[:, None]
    compressed = int(((torch.arange(seqlen // bench.NSA_BLOCK_CMP) + 1) * bench.NSA_BLOCK_CMP - 1 <= rows).sum())
    window = int(BlockInfo(seqlen, seqlen, causal=True, window=(bench.NSA_WINDOW - 1, 0)).mask().sum())
    chosen = selection_mask(selection, seqlen, seqlen, 1, bench.BLOCK_K) & BlockInfo(seqlen, seqlen, True).mask()
    group = bench.HEADS // bench.HEADS_KV
    assert bench.nsa_pairs(selection, seqlen) == (compressed + window) * bench.HEADS + int(chosen.sum()) * group


def test_the_sparse_benchmarks_moba_pairs_sparsity_curve_and_plot():
    """moba_pairs counts the pairs of MoBA's mask; the sparsity curve reads the kept share from the rows'
    FLOPs; the plot draws the rows it is given."""
    from fa_lab.bench import sparse as bench
    from fa_lab.sparse import moba_gate, moba_mask

    q, k = torch.randn(1, 2, 100, 8), torch.randn(1, 2, 100, 8)
    selected = moba_gate(q, k, 16, 3)
    assert bench.moba_pairs(selected, 16) == int(moba_mask(selected, 100, 16).sum())
    rows = []
    for impl, case, selected_blocks, fwd_ms, kept in (("dense", "nsa_select", 16, 40.0, 1.0),
                                                       ("triton", "nsa_select", 16, 5.0, 0.06),
                                                       ("triton", "nsa_select", 4, 2.0, 0.015),
                                                       ("triton", "nsa", 16, 8.0, 0.08),
                                                       ("triton", "moba", 3, 9.0, 0.25),
                                                       ("dense", "moba", 3, 20.0, 1.0)):
        row = bench.sparse_row(impl, bench.SWEEP_SEQLEN, case=case, selected=selected_blocks)
        row.update(fwd_ms=fwd_ms, bwd_ms=3 * fwd_ms, fwd_tflops=100.0 * kept / fwd_ms)
        rows.append(row)
    validate_results({"device": "test", "torch": torch.__version__, "triton": None, "date": "2026-12-01",
                      "rows": rows})
    assert bench.sparsity_curve(rows) == [(pytest.approx(0.015), 20.0, 20.0), (pytest.approx(0.06), 8.0, 8.0)]
    found = dict(bench.speedups(rows))
    assert found["moba: dense time / ours fwd, 32K"] == pytest.approx(20 / 9)
    assert found["nsa_select: dense time / ours bwd, 32K"] == pytest.approx(8.0)
    assert found["nsa: dense time / ours fwd, 32K"] == pytest.approx(5.0)
    assert not any(what.startswith("nsa: None") for what in found)
    figure = bench.plot_sparse({"device": "test", "torch": "x", "triton": None, "date": "2026-12-01", "rows": rows})
    assert len(figure.axes) == 3 and all(ax.lines for ax in figure.axes)


def test_the_linear_benchmarks_inputs_rows_ratios_and_crossover():
    """linear_inputs: each case's tensors with the semantics the kernels expect; rows validate; the
    ratios and the crossover (interpolated on log-log axes) read rows the way the docstrings say."""
    from fa_lab.bench import linear as bench

    generator = torch.Generator().manual_seed(2)
    simple = bench.linear_inputs("simple_gla", 64, generator, device="cpu")
    assert simple["g"].shape == (bench.BATCH, bench.HEADS, 64) and bool((simple["g"] < 0).all())
    gla = bench.linear_inputs("gla", 64, generator, device="cpu")
    assert gla["g"].shape == gla["q"].shape and bool((gla["g"] < 0).all())
    delta = bench.linear_inputs("delta_rule", 64, generator, device="cpu")
    norms = delta["k"].float().norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)
    assert bool(((delta["beta"] > 0) & (delta["beta"] < 1)).all())
    assert all(t.dtype == torch.bfloat16 and t.requires_grad for t in delta.values())

    times = {4096: (1.0, 4.0), 8192: (2.0, 8.0), 16384: (4.0, 16.0)}  # linear in N
    soft = {4096: (0.5, 1.0), 8192: (2.0, 4.0), 16384: (8.0, 16.0)}   # quadratic in N
    rows = []
    for seqlen, (fwd, bwd) in times.items():
        for impl, factor in (("triton", 1.0), ("fla_chunk", 0.8)):
            row = bench.linear_row(impl, "gla", seqlen)
            row.update(fwd_ms=fwd * factor, bwd_ms=bwd * factor)
            rows.append(row)
        row = bench.linear_row("triton_hopper", "softmax", seqlen)
        row.update(fwd_ms=soft[seqlen][0], bwd_ms=soft[seqlen][1])
        rows.append(row)
    validate_results({"device": "test", "torch": torch.__version__, "triton": None, "date": "2026-12-01",
                      "rows": rows})
    found = dict(bench.speed_ratios(rows))
    assert found["gla fla time / ours fwd, 8K"] == pytest.approx(0.8)
    assert bench.crossover(rows, "triton", "gla", "fwd_ms") == pytest.approx(8192)  # equal at 8K: ties count
    # backward: 4x softmax's time at 4K, equal at 16K -> the log gap reaches 0 only at the last length
    assert bench.crossover(rows, "triton", "gla", "bwd_ms") == pytest.approx(16384)
    # fla: 1.6x softmax's time at 4K, 0.8x at 8K -> log gap log 1.6 then log 0.8: a fraction log2(1.6) of the octave
    assert bench.crossover(rows, "fla_chunk", "gla", "fwd_ms") == pytest.approx(4096 * 1.6)
    assert bench.crossover(rows, "triton", "simple_gla") is None  # no rows of that case
    assert bench.plot_linear({"device": "test", "torch": "x", "triton": None, "date": "2026-12-01", "rows": rows})


def test_the_ring_model_hides_a_fast_link_and_exposes_a_slow_one():
    """model_ring on calls whose time is their pair count: with a link too fast to matter the per-GPU
    efficiency is what the schedule's balance allows (1 for non-causal and zig-zag causal rings, lower
    for a contiguous causal one), and a slow link shows up as exposed time."""
    from fa_lab.bench import ring as bench

    n = 64
    call_ms = {(rows, keys, causal): (BlockInfo(rows, keys, causal).visible_pairs() * 1e-3,) * 2
               for rows, keys, causal in bench.distinct_calls(n)}
    assert set(call_ms) == {(n, n, False), (n, n, True), (n, n // 2, False), (n // 2, n, False)}
    fast = bench.model_ring(4, "contiguous", False, n, call_ms, link_bytes_per_s=1e30)
    assert fast["fwd_efficiency"] == pytest.approx(1) and fast["fwd_exposed_ms"] == pytest.approx(0)
    zigzag = bench.model_ring(4, "zigzag", True, n, call_ms, link_bytes_per_s=1e30)
    assert zigzag["fwd_efficiency"] == pytest.approx(1, rel=0.05)  # n / 2 pairs off the diagonal: almost exact
    contiguous = bench.model_ring(4, "contiguous", True, n, call_ms, link_bytes_per_s=1e30)
    assert contiguous["fwd_efficiency"] < 0.7  # the last rank does almost all the work
    slow = bench.model_ring(4, "zigzag", True, n, call_ms, link_bytes_per_s=1e3)
    kv_ms, dkv_ms = (b / 1e3 * 1e3 for b in bench.shard_bytes(n))
    assert slow["fwd_exposed_ms"] > 0 and slow["fwd_ring_ms"] == pytest.approx(3 * kv_ms, rel=0.01)
    assert slow["bwd_ring_ms"] == pytest.approx(3 * kv_ms + 4 * dkv_ms, rel=0.01)


def test_the_kernel_breakdown_sums_per_kernel_and_sorts_by_time():
    """aggregate: per-call microseconds and shares of each kernel name over the profiled calls, largest first;
    format_breakdown: the total in ms and one line per kernel."""
    from fa_lab.bench.breakdown import aggregate, format_breakdown

    events = [("h_pass", 300.0), ("o_pass", 100.0), ("h_pass", 300.0), ("o_pass", 100.0), ("wy", 200.0)]
    times = aggregate(events, repeats=2)
    assert times == [("h_pass", 300.0, 0.6), ("o_pass", 100.0, 0.2), ("wy", 100.0, 0.2)]  # ties: first seen first
    text = format_breakdown("ours gla forward", times, top=2)
    assert text.splitlines()[0] == "ours gla forward: 0.500 ms in 3 kernels" and len(text.splitlines()) == 3
    assert "60.0%  h_pass" in text.splitlines()[1]


def fake_profiled_runs(monkeypatch, fake_times):
    """The linear tuner without a GPU: no inputs, no-op calls, and ``fake_times(call)`` as the profile."""
    from fa_lab.bench import breakdown
    from fa_lab.bench import linear as bench

    monkeypatch.setattr(bench, "case_inputs", lambda case, seqlen: {})
    monkeypatch.setattr(bench, "ours", lambda case, tensors: (lambda: None, []))
    monkeypatch.setattr(breakdown, "backward_call", lambda run, leaves: run)
    monkeypatch.setattr(breakdown, "kernel_times", fake_times)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "environment", lambda device: {"device": "test", "torch": "x", "triton": None,
                                                              "date": "2026-12-01"})


def test_the_linear_warp_tuner_times_every_candidate_and_restores_the_table(monkeypatch, tmp_path):
    """tune_launches: per candidate the whole table takes it, each kernel's times are summed over the forward and
    backward of every case (other kernels, PyTorch's, are left out), the fastest candidate per kernel wins,
    the log is written, and the committed table comes back afterwards."""
    import json

    from fa_lab.bench import linear as bench
    from fa_lab.kernels.portable import linear_launch

    committed = dict(linear_launch.LAUNCH_WARPS)
    best = {"chunk_fwd_o_kernel": 2, "chunk_wy_kernel": 8}  # the fake profile's fastest warps per kernel

    def fake_times(call):
        warps = linear_launch.LAUNCH_WARPS["chunk_fwd_o_kernel"]
        assert set(linear_launch.LAUNCH_WARPS.values()) == {warps}  # every launch at the candidate
        return [(name, 1000.0 * (1 + abs(warps - fastest)), 0.5) for name, fastest in best.items()] + \
            [("at::native::copy", 5.0, 0.0)]

    fake_profiled_runs(monkeypatch, fake_times)
    path = tmp_path / "tuning.json"
    results = bench.tune_launches(path, seqlen=64, cases=("gla", "delta_rule"), progress=lambda line: None)
    assert results["winners"] == best
    assert json.loads(path.read_text()) == results
    entry = next(e for e in results["log"] if e["kernel"] == "chunk_wy_kernel" and e["num_warps"] == 4)
    assert entry["ms"] == pytest.approx(2 * 2 * 5.0)  # 2 cases x (forward + backward) x 5 ms at 4 warps
    assert linear_launch.LAUNCH_WARPS == committed


def test_the_linear_tuner_times_stages_at_the_committed_warps_and_restores_both_tables(monkeypatch, tmp_path):
    """tune_launches(knob="num_stages"): per candidate every kernel of the warp table gets that num_stages, the
    warps stay as committed, the fastest stages per kernel win, and both tables come back afterwards."""
    from fa_lab.bench import linear as bench
    from fa_lab.kernels.portable import linear_launch

    warps, stages = dict(linear_launch.LAUNCH_WARPS), dict(linear_launch.LAUNCH_STAGES)
    best = {"chunk_bwd_dqk_kernel": 2, "chunk_wy_bwd_kernel": 4}

    def fake_times(call):
        assert linear_launch.LAUNCH_WARPS == warps
        now = linear_launch.LAUNCH_STAGES["chunk_bwd_dqk_kernel"]
        assert set(linear_launch.LAUNCH_STAGES[name] for name in warps) == {now}
        return [(name, 1000.0 * (1 + abs(now - fastest)), 0.5) for name, fastest in best.items()]

    fake_profiled_runs(monkeypatch, fake_times)
    results = bench.tune_launches(tmp_path / "stages.json", seqlen=64, cases=("delta_rule",), candidates=(1, 2, 4),
                               knob="num_stages", progress=lambda line: None)
    assert results["winners"] == best and results["knob"] == "num_stages"
    assert {e["num_stages"] for e in results["log"]} == {1, 2, 4}
    assert linear_launch.LAUNCH_WARPS == warps and linear_launch.LAUNCH_STAGES == stages
    with pytest.raises(ValueError, match="knob"):
        bench.tune_launches(tmp_path / "x.json", knob="num_threads")


def test_the_sparse_benchmarks_bars_are_timed_in_turn(monkeypatch):
    """bars_in_turn: each case's call and dense attention's at its shape, one timing of each thrown away, then
    timed in turn, round after round; the ratio is that of the rounds' medians (dense over ours), and bar_ratios
    reads it back."""
    from fa_lab.bench import sparse as bench

    def maker(name):
        return lambda q, k, v, _selection: ((lambda: name), (q, k, v))

    def fake_inputs(heads, heads_kv, seqlen, _generator):
        return torch.randn(1, heads, 4, 8), torch.randn(1, heads_kv, 4, 8), torch.randn(1, heads_kv, 4, 8)

    for name in ("ours_nsa", "ours_moba", "dense"):
        monkeypatch.setattr(bench, name, maker(name))
    monkeypatch.setattr(bench, "bf16_inputs", fake_inputs)
    random_ms = torch.Generator().manual_seed(7)
    order = []

    def timer(call, return_mode):
        assert return_mode == "median"
        order.append(call())
        base = {"ours_nsa": 20.0, "ours_moba": 15.0, "dense": 80.0}[order[-1]]
        return base * (1 + 0.1 * torch.rand((), generator=random_ms).item())

    entry = bench.bars_in_turn(None, 65536, rounds=3, timer=timer)
    assert order == ["ours_nsa", "dense"] * 4 + ["ours_moba", "dense"] * 4  # one timing thrown away, three rounds
    for case in ("nsa", "moba"):
        assert len(entry[f"{case} ms"]) == len(entry[f"{case} dense ms"]) == 3
        expected = sorted(entry[f"{case} dense ms"])[1] / sorted(entry[f"{case} ms"])[1]
        assert entry[f"{case}: dense time / ours fwd"] == pytest.approx(expected, abs=1e-4)
    found = dict(bench.bar_ratios({"bars_in_turn": entry}))
    assert found == {"nsa: dense time / ours fwd, 64K, in turn (3 rounds)": entry["nsa: dense time / ours fwd"],
                     "moba: dense time / ours fwd, 64K, in turn (3 rounds)": entry["moba: dense time / ours fwd"]}
    assert bench.bar_ratios({"rows": []}) == []
