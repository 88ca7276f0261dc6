"""The fa-lab command refuses bad counts, limits and output files when it parses them, before any work."""
from __future__ import annotations

import argparse

import pytest

from fa_lab import cli
from fa_lab.argtypes import non_negative_int, output_file, plot_file, positive_float, positive_int
from fa_lab.bench import cli as bench_cli


@pytest.mark.parametrize("kind, good, bad", [
    (positive_int, {"1": 1, "4096": 4096}, ("0", "-3", "1.5", "x")),
    (non_negative_int, {"0": 0, "7": 7}, ("-1", "2.0", "")),
    (positive_float, {"0.5": 0.5, "60": 60.0}, ("0", "-1", "nan", "inf", "sixty")),
])
def test_numbers_are_taken_or_refused_with_what_they_need(kind, good, bad):
    for text, value in good.items():
        assert kind(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            kind(text)


def test_output_files_need_an_existing_folder_and_plots_a_known_format(tmp_path):
    assert output_file(str(tmp_path / "out.json")) == str(tmp_path / "out.json")
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        output_file(str(tmp_path / "missing" / "out.json"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder"):
        output_file(str(tmp_path))
    assert plot_file(str(tmp_path / "plot.png")) == str(tmp_path / "plot.png")
    with pytest.raises(argparse.ArgumentTypeError, match="png"):
        plot_file(str(tmp_path / "plot.txt"))


@pytest.mark.parametrize("argv, said", [
    (["grade", "x.ipynb", "--budget", "0"], "--budget"),
    (["grade", "x.ipynb", "--timeout", "-5"], "--timeout"),
    (["grade", "x.ipynb", "--memory", "-1"], "--memory"),
    (["grade", "x.ipynb", "--json", "no/such/folder/out.json"], "does not exist"),
])
def test_grade_refuses_bad_limits_and_outputs_before_grading(argv, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_grading_an_empty_folder_says_so_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "scores.csv"
    assert cli.main(["grade", str(tmp_path), "--csv", str(out)]) == cli.GRADING_FAILED
    assert "no .ipynb files under" in capsys.readouterr().err and not out.exists()


def test_ctrl_c_ends_a_command_with_a_line_not_a_traceback(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_doctor", interrupted)
    assert cli.main(["doctor"]) == cli.INTERRUPTED
    assert capsys.readouterr().err == "fa-lab doctor: interrupted\n"


@pytest.mark.parametrize("argv, said", [
    (["cpu", "--seqlens", "0"], "--seqlens"),
    (["cpu", "--batch", "-1"], "--batch"),
    (["cpu", "--repeats", "0"], "--repeats"),
    (["cpu", "--warmup", "-1"], "--warmup"),
    (["cpu", "--plot", "times.txt"], "not an image format"),
    (["cpu", "--json", "no/such/folder/cpu.json"], "does not exist"),
    (["ring", "--gpus", "0"], "--gpus"),
    (["gpu", "--seqlens", "0"], "--seqlens"),
])
def test_bench_refuses_bad_sizes_and_outputs_before_measuring(argv, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_cli.main(argv)
    assert exit_.value.code == 2 and said in capsys.readouterr().err
