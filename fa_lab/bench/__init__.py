"""Benchmarks and their results files (``benchmarks/*.json``).

- :mod:`.schema`: the results schema (written down there), a row constructor, validate, load and save;
- :mod:`.report`: a results file in words (:func:`describe`) and as a text table;
- :mod:`.plots`: a metric against the sequence length;
- :mod:`.cpu`: the CPU benchmark; :mod:`.gpu`: the FA3-paper protocol with every peer;
  :mod:`.tuning`: tile tuning of the Triton kernels; :mod:`.hopper`: the Hopper kernels' ablation
  and protocol, :mod:`.hopper_report` its FP8 rows kernel only and with their quantization, and its plot;
  :mod:`.interfaces`: chapter 05's options (GQA, varlen, window, softcap, ALiBi) with
  the upstream FlashAttention kernels; :mod:`.decode`: decode over a (paged) KV cache against the
  copy bandwidth; :mod:`.sparse`: NSA's selected blocks with flash-linear-attention's kernel;
  :mod:`.linear`: chunkwise linear attention with fla's kernels and softmax attention; :mod:`.ring`:
  ring attention's steps on one GPU and the overlap they predict; :mod:`.host`: the host's time to issue a call;
- :mod:`.cli`: ``fa-lab bench cpu|gpu|hopper|interfaces|decode|sparse|linear|ring``.

Importing this package loads neither the runners nor matplotlib: notebooks read recorded results
through :func:`load_results`, :func:`describe` and :func:`plot_results`.
"""
from __future__ import annotations

from .plots import plot_results
from .report import describe, format_table
from .schema import load_results, save_results, validate_results

__all__ = ["describe", "format_table", "load_results", "main", "plot_results", "save_results", "validate_results"]


def main(argv: list[str] | None = None) -> int:
    """``fa-lab bench``: see :mod:`fa_lab.bench.cli` (imported on the call)."""
    from .cli import main as cli_main

    return cli_main(argv)
