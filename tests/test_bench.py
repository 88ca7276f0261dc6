"""fa-lab bench: the quick CPU run writes schema-valid JSON; the schema helpers catch broken files."""
from __future__ import annotations

import copy
import datetime
import json

import pytest
import torch

from fa_lab import bench
from fa_lab.iomodel import AttentionShape
from fa_lab.memory import modelled_peak_bytes


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    json_path, png_path = folder / "results.json", folder / "results.png"
    code = bench.main(["--device", "cpu", "--quick", "--json", str(json_path), "--plot", str(png_path)])
    return code, json_path, png_path


def test_quick_run_writes_schema_valid_json(quick_run):
    code, json_path, png_path = quick_run
    assert code == 0
    with open(json_path) as source:
        raw = json.load(source)
    assert list(raw) == list(bench.TOP_KEYS)
    results = bench.load_results(json_path)
    assert results["device"].startswith("CPU")
    datetime.date.fromisoformat(results["date"])
    rows = results["rows"]
    assert [(r["impl"], r["seqlen"]) for r in rows] == [
        (impl, n) for n in bench.QUICK["seqlens"] for impl in ("naive", "torch", "sdpa")]
    for row in rows:
        assert list(row) == list(bench.ROW_KEYS)
        assert (row["dtype"], row["head_dim"], row["heads"], row["causal"]) == ("fp32", 32, 2, False)
        assert row["bwd_ms"] is None and row["bwd_tflops"] is None  # the CPU run times the forward only
        assert row["fwd_peak_bytes"] > 0
    assert png_path.stat().st_size > 1000


def test_naive_past_its_limit_is_modelled_not_run(quick_run):
    rows = bench.load_results(quick_run[1])["rows"]
    for row in rows:
        skipped = row["impl"] == "naive" and row["seqlen"] > bench.QUICK["naive_max_seqlen"]
        if skipped:
            shape = AttentionShape(row["batch"], row["heads"], row["seqlen"], row["head_dim"], dtype="fp32")
            assert row["fwd_ms"] is None and row["fwd_tflops"] is None
            assert row["fwd_peak_source"] == "model"
            assert row["fwd_peak_bytes"] == modelled_peak_bytes("naive", shape)
        else:
            assert row["fwd_peak_source"] == "measured"
            assert row["fwd_ms"] > 0 and row["fwd_tflops"] > 0
    assert any(row["fwd_peak_source"] == "model" for row in rows)


def test_table_marks_modelled_and_missing_figures(quick_run, capsys):
    results = bench.load_results(quick_run[1])
    table = bench.format_table(results["rows"]).splitlines()
    assert len(table) == 1 + len(results["rows"])
    assert "fwd peak memory" in table[0]
    naive_modelled = [line for line in table if line.split()[0] == "naive" and "(model)" in line]
    assert len(naive_modelled) == 1 and naive_modelled[0].split()[7] == "-"
    assert "recorded on CPU" in bench.describe(results)


@pytest.mark.parametrize("breakage, message", [
    (lambda r: r.pop("date"), "date"),
    (lambda r: r["rows"][0].pop("fwd_ms"), "keys"),
    (lambda r: r["rows"][0].update(extra=1), "keys"),
    (lambda r: r["rows"][1].update(seqlen="1K"), "seqlen"),
    (lambda r: r["rows"][1].update(fwd_ms="fast"), "fwd_ms"),
    (lambda r: r["rows"][2].update(causal=1), "causal"),
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_mode_without_cuda_says_what_it_needs(capsys):
    assert bench.main(["--device", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_gpu_mode_forwards_to_the_gpu_protocol(monkeypatch, tmp_path):
    import fa_lab.bench_gpu as bench_gpu

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_gpu, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert bench.main(["--device", "cuda", "--seqlens", "1024", "2048", "--json", str(tmp_path / "r.json")]) == 0
    assert seen["argv"] == ["--json", str(tmp_path / "r.json"), "--seqlens", "1024", "2048"]


def test_median_ms_runs_warmup_then_repeats():
    calls = []
    ms = bench.median_ms(lambda x: calls.append(x), 7, repeats=5, warmup=2)
    assert calls == [7] * 7
    assert ms >= 0


@pytest.mark.parametrize("load, warned", [(0.2, False), (7.5, True)])
def test_busy_machine_warning(monkeypatch, capsys, load, warned):
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (load, load, load), raising=False)
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    bench.warn_if_busy()
    assert ("load average 7.5 on 2 cores" in capsys.readouterr().err) == warned
