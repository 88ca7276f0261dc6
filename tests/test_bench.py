"""fa-lab bench: the CPU run writes schema-valid JSON, every flag reaches its runner, the schema catches
broken files, and every committed results file follows it and names its device, versions and date."""
from __future__ import annotations

import copy
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from fa_lab import bench
from fa_lab.bench import cli, cpu, gpu, schema, tuning
from fa_lab.iomodel import AttentionShape, attention_flops
from fa_lab.memory import modelled_peak_bytes

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    json_path, png_path = folder / "results.json", folder / "results.png"
    code = bench.main(["cpu", "--quick", "--json", str(json_path), "--plot", str(png_path)])
    return code, json_path, png_path


def test_quick_run_writes_schema_valid_json(quick_run):
    code, json_path, png_path = quick_run
    assert code == 0
    with open(json_path) as source:
        raw = json.load(source)
    assert list(raw) == list(schema.TOP_KEYS)
    results = bench.load_results(json_path)
    assert results["device"].startswith("CPU")
    datetime.date.fromisoformat(results["date"])
    rows = results["rows"]
    assert [(r["impl"], r["seqlen_q"]) for r in rows] == [
        (impl, n) for n in cpu.QUICK.seqlens for impl in ("naive", "torch", "sdpa")]
    for row in rows:
        assert list(row) == list(schema.ROW_KEYS)
        assert (row["dtype"], row["head_dim"], row["heads"], row["causal"]) == ("fp32", 32, 2, False)
        assert row["seqlen_k"] == row["seqlen_q"]
        assert row["bwd_ms"] is None and row["bwd_tflops"] is None  # the CPU run times the forward only
        assert row["bytes"] is None and row["tbps"] is None and row["copy_tbps"] is None  # not memory-bound rows
        assert row["fwd_peak_bytes"] > 0
    assert png_path.stat().st_size > 1000


def test_naive_past_its_limit_is_modelled_not_run(quick_run):
    rows = bench.load_results(quick_run[1])["rows"]
    for row in rows:
        if row["impl"] == "naive" and row["seqlen_q"] > cpu.QUICK.naive_max_seqlen:
            shape = AttentionShape(row["batch"], row["heads"], row["seqlen_q"], row["head_dim"], dtype="fp32")
            assert row["fwd_ms"] is None and row["fwd_tflops"] is None
            assert row["fwd_peak_source"] == "model"
            assert row["fwd_peak_bytes"] == modelled_peak_bytes("naive", shape)
        else:
            assert row["fwd_peak_source"] == "measured"
            assert row["fwd_ms"] > 0 and row["fwd_tflops"] > 0
    assert any(row["fwd_peak_source"] == "model" for row in rows)


def test_table_marks_modelled_and_missing_figures(quick_run):
    results = bench.load_results(quick_run[1])
    table = bench.format_table(results["rows"]).splitlines()
    assert len(table) == 1 + len(results["rows"])
    assert "fwd peak memory" in table[0] and "TB/s" not in table[0]  # no row has bandwidth figures
    naive_modelled = [line for line in table if line.split()[0] == "naive" and "(model)" in line]
    assert len(naive_modelled) == 1 and naive_modelled[0].split()[8] == "-"
    assert "recorded on CPU" in bench.describe(results)


def test_table_shows_bandwidth_columns_for_memory_bound_rows():
    row = schema.empty_row("decode", AttentionShape(4, 8, 1, 128, seqlen_k=8192, dtype="bf16"))
    row.update(fwd_ms=0.01, bytes=34_000_000, tbps=3.4, copy_tbps=4.1)
    header, line = bench.format_table([row]).splitlines()
    assert header.split()[-4:] == ["GB", "TB/s", "copy", "TB/s"]
    assert line.split()[4:6] == ["1", "8192"] and line.split()[-3:] == ["0.034", "3.4", "4.1"]


@pytest.mark.parametrize("breakage, message", [
    (lambda r: r.pop("date"), "date"),
    (lambda r: r["rows"][0].pop("fwd_ms"), "keys"),
    (lambda r: r["rows"][0].update(extra=1), "keys"),
    (lambda r: r["rows"][0].update(seqlen=1024), "keys"),  # a row has seqlen_q and seqlen_k, no key "seqlen"
    (lambda r: r["rows"][1].update(seqlen_q="1K"), "seqlen_q"),
    (lambda r: r["rows"][1].update(seqlen_k=None), "seqlen_k"),
    (lambda r: r["rows"][1].update(fwd_ms="fast"), "fwd_ms"),
    (lambda r: r["rows"][2].update(causal=1), "causal"),
    (lambda r: r["rows"][2].update(bytes=1e9, tbps=3.0), "copy_tbps"),  # TB/s without its peer
    (lambda r: r.update(rows={}), "list"),
])
def test_validation_rejects_broken_results(quick_run, tmp_path, breakage, message):
    results = copy.deepcopy(bench.load_results(quick_run[1]))
    breakage(results)
    with pytest.raises(ValueError, match=message):
        bench.validate_results(results)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(results))
    with pytest.raises(ValueError, match=message):
        bench.load_results(path)
    with pytest.raises(ValueError, match=message):
        bench.save_results(results, tmp_path / "never.json")


def test_plot_results_draws_one_panel_per_metric_with_data(quick_run):
    results = bench.load_results(quick_run[1])
    fig = bench.plot_results(results, metrics=("fwd_ms", "bwd_ms", "fwd_peak_bytes"))
    assert len(fig.axes) == 2  # bwd_ms is null everywhere on a CPU run
    assert len(bench.plot_results(results).axes) == 1  # fwd TFLOP/s only
    with pytest.raises(ValueError, match="bwd_tflops"):
        bench.plot_results(results, metrics=("bwd_tflops",))


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.json")), ids=lambda p: p.name)
def test_committed_results_files_name_device_versions_and_date(path):
    raw = json.loads(path.read_text())
    if "rows" in raw:  # a results file: the whole schema
        bench.load_results(path)
    for key in ("device", "torch", "triton", "date"):  # results files and the logs beside them
        assert isinstance(raw.get(key), str) and raw[key], f"{path.name} lacks {key}"
    datetime.date.fromisoformat(raw["date"])
    assert ("H100" in raw["device"]) == path.name.startswith("h100_"), (path.name, raw["device"])


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.log")), ids=lambda p: p.name)
def test_committed_logs_open_with_device_versions_and_date(path):
    """The device machine is an H200 or, at times, an H100: a log says which (h100_* files are H100 runs)."""
    header = path.read_text().splitlines()[0]
    assert re.match(r"# \d{4}-\d{2}-\d{2}, .*H[12]00.*torch [\d.]+.*triton [\d.]+", header), header
    assert ("H100" in header) == path.name.startswith("h100_"), header


def test_importing_the_package_loads_no_runner_and_no_matplotlib():
    code = ("import sys, fa_lab.bench; loaded = [m for m in ('matplotlib', 'triton', 'fa_lab.bench.cpu', "
            "'fa_lab.bench.gpu', 'fa_lab.bench.hopper', 'fa_lab.bench.cli') if m in sys.modules]; print(loaded)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}).stdout
    assert out.strip() == "[]"


# ---- every flag reaches its runner, or is refused ---------------------------------------------

def test_cpu_flags_replace_the_sweep_fields():
    args = cli.build_parser().parse_args(["cpu", "--quick", "--seqlens", "64", "96", "--batch", "2", "--heads", "3",
                                          "--head-dim", "16", "--dtype", "bf16", "--causal", "both", "--impls",
                                          "torch", "sdpa", "--repeats", "4", "--warmup", "0",
                                          "--naive-max-seqlen", "64"])
    assert cli.cpu_sweep(args) == cpu.CpuSweep(seqlens=(64, 96), batch=2, heads=3, head_dim=16, dtype="bf16",
                                               causals=(False, True), impls=("torch", "sdpa"), repeats=4,
                                               warmup=0, naive_max_seqlen=64)
    assert cli.cpu_sweep(cli.build_parser().parse_args(["cpu"])) == cpu.FULL
    quick = cli.cpu_sweep(cli.build_parser().parse_args(["cpu", "--quick", "--causal", "yes"]))
    assert quick == dataclasses.replace(cpu.QUICK, causals=(True,))


def test_cpu_run_measures_what_the_flags_ask(tmp_path):
    path = tmp_path / "r.json"
    assert bench.main(["cpu", "--seqlens", "48", "--heads", "3", "--head-dim", "16", "--dtype", "bf16",
                       "--causal", "both", "--impls", "sdpa", "--repeats", "1", "--warmup", "0",
                       "--json", str(path)]) == 0
    rows = bench.load_results(path)["rows"]
    assert [(r["impl"], r["seqlen_q"], r["heads"], r["head_dim"], r["dtype"], r["causal"]) for r in rows] == [
        ("sdpa", 48, 3, 16, "bf16", False), ("sdpa", 48, 3, 16, "bf16", True)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("command", [["gpu"], ["hopper", "--log", "never.json"]])
def test_gpu_benchmarks_without_cuda_say_what_they_need(capsys, command):
    assert bench.main(command) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.fixture
def fake_gpu(monkeypatch):
    """CUDA 'available' and named, so the GPU runners' plumbing runs on a CPU; nothing is measured."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "Fake GPU")


def test_gpu_runner_receives_every_option(fake_gpu, monkeypatch, tmp_path):
    measured = []

    def fake_measure(impl, fn, shape):
        measured.append((impl, shape))
        return schema.empty_row(impl, shape)

    monkeypatch.setattr(gpu, "measure", fake_measure)
    path = tmp_path / "r.json"
    assert bench.main(["gpu", "--seqlens", "4096", "8192", "--head-dims", "128", "--causal", "yes",
                       "--impls", "sdpa_flash", "sdpa_math", "--json", str(path)]) == 0
    assert [(impl, s.head_dim, s.causal, s.seqlen_q, s.batch, s.heads, s.dtype) for impl, s in measured] == [
        ("sdpa_flash", 128, True, 4096, 4, 16, "bf16"), ("sdpa_math", 128, True, 4096, 4, 16, "bf16"),
        ("sdpa_flash", 128, True, 8192, 2, 16, "bf16")]  # sdpa_math stops at 4K
    results = bench.load_results(path)
    assert results["device"] == "Fake GPU" and len(results["rows"]) == 3


def test_gpu_tune_flag_tunes_the_asked_head_dims_and_measures_with_the_winners(fake_gpu, monkeypatch, tmp_path):
    winner = types.SimpleNamespace(block_m=64, block_n=64, num_warps=4, num_stages=2)  # a TileConfig's fields
    seen = {}
    monkeypatch.setattr(tuning, "tune", lambda head_dims: seen.setdefault("head_dims", head_dims)
                        and ({(64, False): winner}, {}, [{"kind": "fwd"}]))
    monkeypatch.setattr(gpu, "triton_impl", lambda fwd, bwd: seen.setdefault("configs", (fwd, bwd)))
    monkeypatch.setattr(gpu, "measure", lambda impl, fn, shape: schema.empty_row(impl, shape))
    log = tmp_path / "tuning.json"
    assert bench.main(["gpu", "--tune", str(log), "--head-dims", "64", "--seqlens", "512", "--impls", "triton"]) == 0
    assert seen == {"head_dims": (64,), "configs": ({(64, False): winner}, {})}
    written = json.loads(log.read_text())
    assert written["device"] == "Fake GPU" and written["best_fwd"] == {"64,False": vars(winner)}
    assert written["log"] == [{"kind": "fwd"}]


def test_hopper_runner_receives_every_option(fake_gpu, monkeypatch, tmp_path, capsys):
    from fa_lab.bench import hopper

    calls = {}
    monkeypatch.setattr(hopper, "run_ablation", lambda causals: calls.update(ablation=causals) or [])
    monkeypatch.setattr(hopper, "save_ablation_log", lambda path, entries: calls.update(log=path))

    def fake_protocol(seqlens, causals, json_path, head_dims, resume):
        calls["protocol"] = (seqlens, causals, json_path, head_dims, resume)
        return {**schema.environment("cuda"), "rows": []}

    monkeypatch.setattr(hopper, "run_hopper_protocol", fake_protocol)
    log, path = str(tmp_path / "log.json"), str(tmp_path / "r.json")
    assert bench.main(["hopper", "--log", log, "--seqlens", "2048", "--causal", "no", "--json", path,
                       "--head-dims", "64"]) == 0
    assert calls == {"ablation": (False,), "log": log, "protocol": ((2048,), (False,), path, (64,), False)}
    calls.clear()
    assert bench.main(["hopper", "--json", path, "--resume"]) == 0  # no --log: no ablation
    assert calls == {"protocol": (hopper.HOPPER_SEQLENS, (False, True), path, hopper.HOPPER_HEAD_DIMS, True)}
    assert bench.main(["hopper", "--resume"]) == 2 and "give --json" in capsys.readouterr().err


def test_hopper_protocol_resumes_a_run_cut_short(fake_gpu, monkeypatch, tmp_path):
    """--resume keeps the shapes already measured in the file and measures only the missing ones; a file from
    another device is refused."""
    from fa_lab.bench import hopper

    measured = []
    monkeypatch.setattr(hopper, "measure", lambda impl, fn, shape: measured.append(shape.head_dim)
                        or schema.empty_row(impl, shape))
    monkeypatch.setattr(hopper, "time_fwd_bwd", lambda fn, shape, backward: (2.0, None))
    monkeypatch.setattr(hopper, "quant_row", lambda shape, fn: schema.empty_row("triton_hopper_fp8_quant", shape))
    path = tmp_path / "r.json"
    first = hopper.run_hopper_protocol((2048,), (True,), path, (128,))
    measured.clear()
    both = hopper.run_hopper_protocol((2048,), (True,), path, (128, 64), resume=True)
    assert set(measured) == {64} and both["rows"][:len(first["rows"])] == first["rows"]
    assert {row["head_dim"] for row in bench.load_results(path)["rows"]} == {64, 128}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "Another GPU")
    with pytest.raises(ValueError, match="--resume"):
        hopper.run_hopper_protocol((2048,), (True,), path, (128,), resume=True)


def test_hopper_plot_draws_the_fp8_kernel_alone_and_with_its_quantization(fake_gpu, monkeypatch, tmp_path):
    """fa-lab bench hopper --plot labels the FP8 kernel's line "kernel only" and draws the FP8 forward from bf16
    inputs, quantization included, beside it (from the recorded run), and no line for the quantization alone."""
    from fa_lab.bench import hopper, hopper_report

    recorded = bench.load_results(BENCHMARKS / "h200_hopper.json")
    monkeypatch.setattr(hopper, "run_ablation", lambda causals: [])
    monkeypatch.setattr(hopper, "save_ablation_log", lambda path, entries: None)
    monkeypatch.setattr(hopper, "run_hopper_protocol", lambda *args: recorded)
    figures, plot_hopper = [], hopper_report.plot_hopper
    monkeypatch.setattr(hopper_report, "plot_hopper",
                        lambda results: figures.append(plot_hopper(results)) or figures[0])
    png = tmp_path / "hopper.png"
    assert bench.main(["hopper", "--log", str(tmp_path / "log.json"), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0 and len(figures) == 1
    labels = [text.get_text() for text in figures[0].legends[0].get_texts()]
    assert labels[:3] == ["triton_hopper", "triton_hopper_fp8 (kernel only)", "triton_hopper_fp8 + quantization"]
    assert not {"triton_hopper_fp8", "triton_hopper_fp8_quant", "triton_hopper_fp8_end_to_end"} & set(labels)


def test_fp8_end_to_end_reads_the_one_call_row_or_sums_the_two_others():
    """fp8_end_to_end: the triton_hopper_fp8_end_to_end row's TFLOP/s where the run has one; in an older run, the
    attention's FLOPs over the kernel's and the quantization's medians summed."""
    from fa_lab.bench import hopper_report

    shape = AttentionShape(4, 16, 4096, 128, causal=True)
    flops = attention_flops(shape)

    def row(impl, ms):
        return {**schema.empty_row(impl, shape), "fwd_ms": ms,
                "fwd_tflops": None if impl.endswith("quant") else flops / (ms * 1e-3) / 1e12}

    older = [row("triton_hopper_fp8", 0.5), row("triton_hopper_fp8_quant", 0.25)]
    assert hopper_report.fp8_end_to_end(older) == {(True, 4096): pytest.approx(flops / 0.75e-3 / 1e12)}
    newer = [*older, row("triton_hopper_fp8_end_to_end", 0.6)]
    assert hopper_report.fp8_end_to_end(newer) == {(True, 4096): pytest.approx(flops / 0.6e-3 / 1e12)}
    plotted = hopper_report.with_end_to_end({"rows": newer})["rows"]
    assert [(r["impl"], r["fwd_ms"]) for r in plotted] == [(hopper_report.FP8_KERNEL, 0.5),
                                                           (hopper_report.FP8_END_TO_END, 0.6)]


def test_hopper_protocol_rows_follow_the_asked_shapes(fake_gpu, monkeypatch, tmp_path):
    from fa_lab.bench import hopper

    monkeypatch.setattr(hopper, "measure", lambda impl, fn, shape: schema.empty_row(impl, shape))
    monkeypatch.setattr(hopper, "time_fwd_bwd", lambda fn, shape, backward: (2.0, None))
    monkeypatch.setattr(hopper, "quant_row", lambda shape, fn: schema.empty_row("triton_hopper_fp8_quant", shape))
    path = tmp_path / "r.json"
    results = hopper.run_hopper_protocol((2048,), (True,), path, (128,))
    assert [row["impl"] for row in results["rows"]] == [*hopper.HOPPER_PEERS, "triton_hopper", "triton_hopper_fp8",
                                                        "triton_hopper_fp8_quant", "triton_hopper_fp8_end_to_end"]
    assert {(r["seqlen_q"], r["seqlen_k"], r["head_dim"], r["causal"], r["batch"]) for r in results["rows"]} == {
        (2048, 2048, 128, True, 8)}
    for fp8 in (results["rows"][-3], results["rows"][-1]):
        assert fp8["fwd_ms"] == 2.0
        assert fp8["fwd_tflops"] == pytest.approx(4 * 8 * 16 * 2048**2 * 128 / 2 / 2e-3 / 1e12)
    assert bench.load_results(path) == results


@pytest.mark.parametrize("argv, message", [
    (["gpu", "--heads", "8"], "--heads is not accepted: the FA3 protocol fixes"),
    (["gpu", "--batch", "2"], "--batch is not accepted"),
    (["gpu", "--dtype", "fp16"], "--dtype is not accepted"),
    (["gpu", "--impls", "naive"], "invalid choice: 'naive'"),
    (["hopper", "--log", "x", "--head-dims", "96"], "invalid choice: 96"),
    (["hopper", "--log", "x", "--dtype", "fp16"], "--dtype is not accepted"),
    (["hopper", "--log", "x", "--impls", "flex"], "unrecognized arguments: --impls"),
    (["cpu", "--tune", "t.json"], "unrecognized arguments: --tune"),
    (["--device", "cpu"], "unrecognized arguments: --device"),  # the subcommands replace --device
    (["--device", "cuda"], "invalid choice: 'cuda' (choose from"),
])
def test_flags_a_benchmark_cannot_honour_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["decode", "--tune", "t.json", "--json", "r.json"], "--tune writes only its tuning log: drop --json"),
    (["decode", "--tune", "t.json", "--plot", "p.png", "--no-fa4"], "drop --plot and --no-fa4"),
    (["decode", "--tune", "t.json", "--json", "r.json", "--plot", "p.png", "--no-fa4"],
     "drop --json, --plot and --no-fa4"),
    (["linear", "--tune", "t.json", "--json", "r.json", "--plot", "p.png"],
     "--tune writes only its tuning log: drop --json and --plot"),
    (["linear", "--breakdown", "--tune", "t.json"], "--breakdown and --tune are two different runs"),
    (["linear", "--stages", "2", "3"], "--stages sets what a --tune run times: give --tune PATH"),
    (["linear", "--breakdown", "--stages", "2"], "--stages sets what a --tune run times"),
    (["linear", "--breakdown", "--plot", "p.png"], "--breakdown prints a profile and writes no results: drop --plot"),
    (["sparse", "--breakdown", "--seqlens", "4096"], "at 64K and writes no results: drop --seqlens"),
    (["sparse", "--breakdown", "--json", "r.json"], "drop --json"),
])
def test_modes_that_replace_a_benchmark_refuse_the_flags_they_would_ignore(capsys, argv, message):
    """--tune and --breakdown replace the benchmark: the flags they would drop silently are refused (exit 2),
    before anything needs a GPU, and so is --stages without the --tune it modifies."""
    assert bench.main(argv) == 2
    assert message in capsys.readouterr().err


def test_modes_that_replace_a_benchmark_honour_the_flags_they_take(fake_gpu, monkeypatch, tmp_path):
    """linear --breakdown keeps --cases and the first --seqlens, linear --tune --stages its candidates, decode
    --tune its path, sparse --seqlens its lengths (sparse --breakdown its fixed 64K)."""
    from fa_lab.bench import decode, linear, sparse

    calls = []
    monkeypatch.setattr(linear, "breakdowns", lambda seqlen, cases: calls.append(("linear breakdown", seqlen, cases)))
    monkeypatch.setattr(linear, "tune_launches", lambda path, **kw: calls.append(("linear tune", path, kw)))
    monkeypatch.setattr(decode, "tune_decode", lambda path: calls.append(("decode tune", path)))
    monkeypatch.setattr(sparse, "breakdowns", lambda: calls.append(("sparse breakdown",)))
    monkeypatch.setattr(sparse, "run_sparse", lambda json_path, seqlens: calls.append(("sparse", json_path, seqlens))
                        or {**schema.environment("cuda"), "rows": []})
    assert bench.main(["linear", "--breakdown", "--cases", "gla", "--seqlens", "2048", "8192"]) == 0
    assert bench.main(["linear", "--tune", "t.json", "--stages", "1", "2", "--cases", "delta_rule",
                       "--seqlens", "1024"]) == 0
    assert bench.main(["linear", "--tune", "w.json"]) == 0
    assert bench.main(["decode", "--tune", "d.json"]) == 0
    assert bench.main(["sparse", "--breakdown"]) == 0
    assert bench.main(["sparse", "--seqlens", "4096"]) == 0
    assert bench.main(["sparse"]) == 0
    assert calls == [
        ("linear breakdown", 2048, ("gla",)),
        ("linear tune", "t.json", dict(seqlen=1024, cases=("delta_rule",), candidates=[1, 2], knob="num_stages")),
        ("linear tune", "w.json", dict(seqlen=linear.SEQLENS[0], cases=linear.CASES)),
        ("decode tune", "d.json"),
        ("sparse breakdown",),
        ("sparse", None, (4096,)),
        ("sparse", None, sparse.SEQLENS),
    ]


def test_median_ms_runs_warmup_then_repeats():
    calls = []
    ms = cpu.median_ms(lambda x: calls.append(x), 7, repeats=5, warmup=2)
    assert calls == [7] * 7
    assert ms >= 0


@pytest.mark.parametrize("load, warned", [(0.2, False), (7.5, True)])
def test_busy_machine_warning(monkeypatch, capsys, load, warned):
    monkeypatch.setattr(cpu.os, "getloadavg", lambda: (load, load, load), raising=False)
    monkeypatch.setattr(cpu.os, "cpu_count", lambda: 2)
    cpu.warn_if_busy()
    assert ("load average 7.5 on 2 cores" in capsys.readouterr().err) == warned


def test_host_us_times_rounds_of_calls_after_a_warm_up():
    """fa_lab.bench.host.host_us: warm-up calls, then rounds of timed calls, the queue drained (synchronize) after
    the warm-up and after each round, outside the timing; (median, fastest) microseconds per call."""
    from fa_lab.bench.host import host_us

    counts = {"call": 0, "synchronize": 0}

    def call():
        counts["call"] += 1
        time.sleep(0.0002)

    def synchronize():
        counts["synchronize"] += 1
        time.sleep(0.05)  # (outside the timing: inside, it would add 2,500 us to each of a round's 20 calls)

    median, fastest = host_us(call, calls=20, rounds=3, warmup=4, synchronize=synchronize)
    assert counts == {"call": 4 + 3 * 20, "synchronize": 1 + 3}
    assert 200 <= fastest <= median < 2000


def _csv_line(values) -> str:
    return ",".join(f'"{value}"' for value in values) + "\n"


def test_kernel_profile_record_reads_ncu_pages(tmp_path):
    """benchmarks/kernel_profile.py --record on small hand-written ncu pages: durations converted to ms whatever
    unit ncu chose (so the main kernel is the longest), the main kernel's instructions found by its exact name
    among same-named others, and cut into runs executed equally often with their shares of the samples."""
    spec = importlib.util.spec_from_file_location("kernel_profile", BENCHMARKS / "kernel_profile.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    duration = "gpu__time_duration.sum"
    header = ["ID", "Kernel Name", "Grid Size", "Block Size", duration,
              "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"]
    raw = (_csv_line(header) + _csv_line(["", "", "", "", "us", ""])
           + _csv_line([0, "fill", "(8, 1, 1)", "(128, 1, 1)", "900", "0.5"])
           + _csv_line([1, "main_kernel", "(132, 1, 1)", "(384, 1, 1)", "1,500", "2.25"]))
    (tmp_path / "fwd_plain_raw.csv").write_text(raw)
    columns = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
               "stall_wait", "stall_barrier (Not Issued)"]
    # (source, samples, executions, barrier samples, wait samples): a loop run twice as often as its prologue
    main_rows = [("MOV", 10, 4, 0, 10), ("BAR", 30, 4, 30, 0), ("HGMMA", 50, 8, 0, 50), ("DEPBAR", 10, 8, 10, 0)]
    sass = _csv_line(["Kernel Name", "fill"]) + _csv_line(columns) + _csv_line(["0x0", "EXIT", 5, 8, 0, 5, 0])
    sass += _csv_line(["Kernel Name", "main_kernel"]) + _csv_line(columns)
    for i, (source, samples, executed, barrier, wait) in enumerate(main_rows):
        sass += _csv_line([hex(16 * i), source, samples, executed, barrier, wait, barrier])
    sass += _csv_line(["Kernel Name", "fill"]) + _csv_line(columns) + _csv_line(["0x0", "EXIT", 7, 8, 0, 7, 0])
    (tmp_path / "fwd_plain_sass.csv").write_text(sass)
    out = tmp_path / "profiles.json"
    profile.record(str(tmp_path), str(out), "GPU", "torch", "triton", "2026-12-06")
    recorded = json.loads(out.read_text())
    assert {key: recorded[key] for key in ("device", "torch", "triton", "date")} == {
        "device": "GPU", "torch": "torch", "triton": "triton", "date": "2026-12-06"}
    kernels = recorded["profiles"]["fwd_plain"]["kernels"]
    assert [kernel["ms"] for kernel in kernels] == pytest.approx([0.9, 1.5])
    assert kernels[1]["stalls_per_issue"] == {"barrier": 2.25}
    runs = recorded["profiles"]["fwd_plain"]["main_kernel_regions"]
    assert [(run["first"], run["last"], run["executed"]) for run in runs] == [(0, 1, 4), (2, 3, 8)]
    assert [run["share"] for run in runs] == pytest.approx([0.4, 0.6])
    assert runs[0]["stalls"] == pytest.approx({"barrier": 0.3, "wait": 0.1})
    assert runs[1]["stalls"] == pytest.approx({"wait": 0.5, "barrier": 0.1})
    # the fill kernel takes more than OTHER_KERNEL_SHARE of the call's kernel time: its regions are kept too
    assert recorded["profiles"]["fwd_plain"]["other_kernel_regions"] == {
        "fill": [{"first": 0, "last": 0, "executed": 8, "share": 1.0, "stalls": {"wait": 1.0}}]}


def test_notebook_as_script_runs_cells_like_a_kernel(tmp_path):
    """benchmarks/notebook_as_script.py, the GPU machine's stand-in for Jupyter: magics dropped, cells in one
    namespace, a figure passed to display() saved, a last expression shown, a cell's source readable by inspect
    (as @triton.jit reads a kernel's); a cell that raises stops its notebook, named, and the run exits 1 while the
    other notebooks still run."""
    import nbformat

    def notebook(name, *sources):
        path = tmp_path / name
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# title")] + [
            nbformat.v4.new_code_cell(source) for source in sources]), path)
        return str(path)

    good = notebook("good.ipynb", "%matplotlib inline\nimport matplotlib.pyplot as plt\nvalue = 6",
                    "from IPython.display import display\nfig, ax = plt.subplots()\ndisplay(fig)", "value * 7",
                    "def kernel_like(x):\n    return x + 1", "import inspect\nprint(inspect.getsource(kernel_like))")
    bad = notebook("bad.ipynb", "x = 1", "x / 0", "print('not reached')")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "notebook_as_script.py"), str(out), bad, good],
                          capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    assert "bad.ipynb: cell 2 FAILED" in done.stdout and "ZeroDivisionError" in done.stderr
    assert "not reached" not in done.stdout and "bad.ipynb: cell 3" not in done.stdout
    assert "42" in done.stdout and "good.ipynb: cell 3 ran" in done.stdout
    assert "def kernel_like(x):\n    return x + 1\n" in done.stdout
    assert [p.name for p in out.iterdir()] == ["good_cell2_1.png"]
    assert done.stdout.splitlines()[-1] == f"failed: {bad}"
