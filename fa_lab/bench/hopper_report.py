"""The Hopper protocol's FP8 figures as a caller sees them, and the protocol's plot.

A ``triton_hopper_fp8`` row times the FP8 kernel alone, on inputs quantized beforehand (kernel only); the
quantization it needs (the rotation, per-tile scales, V^T in the kernel's key order) is timed on its own,
as ``triton_hopper_fp8_quant``, and a ``triton_hopper_fp8_end_to_end`` row times what a caller with bf16 Q, K
and V pays: one call from bf16 inputs to bf16 output, quantization included. :func:`fp8_end_to_end` reads that
row; results files from before it existed get the attention's FLOPs over the sum of the two other rows' medians
(two separate timings, not one call, and the quantization's eager median is as noisy as a call that short is).
:func:`plot_hopper` draws the kernel-only line, labelled so, beside the end-to-end line. Needs neither Triton nor
a GPU: notebook 04 reads the recorded results through it.
"""
from __future__ import annotations

from ..iomodel import AttentionShape, attention_flops
from .plots import plot_results

FP8_KERNEL = "triton_hopper_fp8 (kernel only)"
FP8_END_TO_END = "triton_hopper_fp8 + quantization"
CALLER_ROWS = ("triton_hopper_fp8_quant", "triton_hopper_fp8_end_to_end")  # read into FP8_END_TO_END, not drawn


def _end_to_end_rows(rows: list[dict]) -> dict:
    """(head_dim, causal, seqlen_q) -> the FP8 kernel row with the end-to-end fwd_ms and fwd_tflops, for every shape
    with a timed ``triton_hopper_fp8_end_to_end`` row or, failing that, timed kernel and quantization rows."""
    by_shape = {(row["impl"], (row["head_dim"], row["causal"], row["seqlen_q"])): row for row in rows}
    found = {}
    for (impl, shape), kernel in by_shape.items():
        if impl != "triton_hopper_fp8" or kernel["fwd_ms"] is None:
            continue
        measured = by_shape.get(("triton_hopper_fp8_end_to_end", shape), {})
        quant = by_shape.get(("triton_hopper_fp8_quant", shape), {})
        if measured.get("fwd_ms") is not None:
            found[shape] = {**kernel, "fwd_ms": measured["fwd_ms"], "fwd_tflops": measured["fwd_tflops"]}
        elif quant.get("fwd_ms") is not None:
            ms = kernel["fwd_ms"] + quant["fwd_ms"]
            flops = attention_flops(AttentionShape(kernel["batch"], kernel["heads"], kernel["seqlen_q"],
                                                   kernel["head_dim"], kernel["seqlen_k"], causal=kernel["causal"]))
            found[shape] = {**kernel, "fwd_ms": ms, "fwd_tflops": flops / (ms * 1e-3) / 1e12}
    return found


def fp8_end_to_end(rows: list[dict], head_dim: int = 128) -> dict:
    """(causal, seqlen_q) -> forward TFLOP/s of the FP8 forward from bf16 inputs, quantization included, at
    ``head_dim`` (the module docstring says from which rows)."""
    return {(causal, seqlen): row["fwd_tflops"]
            for (d, causal, seqlen), row in _end_to_end_rows(rows).items() if d == head_dim}


def with_end_to_end(results: dict) -> dict:
    """A copy of Hopper protocol ``results`` for plots and tables: the FP8 kernel's rows renamed
    :data:`FP8_KERNEL`, one :data:`FP8_END_TO_END` row per shape (the kernel row with the end-to-end time and
    TFLOP/s of :func:`fp8_end_to_end`), and no quantization or end-to-end rows. Never written to a results file."""
    rows = results["rows"]
    renamed = [{**row, "impl": FP8_KERNEL} if row["impl"] == "triton_hopper_fp8" else row for row in rows
               if row["impl"] not in CALLER_ROWS]
    added = [{**row, "impl": FP8_END_TO_END} for row in _end_to_end_rows(rows).values()]
    return {**results, "rows": renamed + added}


def plot_hopper(results: dict, impls=None, panel_size=(4.2, 3.8), **options):
    """Forward TFLOP/s against the sequence length, one panel per (head_dim, mask)
    (:func:`fa_lab.bench.plot_results`), with the FP8 kernel alone and with its quantization as two lines, and
    one legend below the panels. ``impls``: the lines in order (default: triton_hopper, the two FP8 lines, then
    the peers as they come); ``options`` go to plot_results. Returns a matplotlib Figure."""
    plotted = with_end_to_end(results)
    if impls is None:
        first = ["triton_hopper", FP8_KERNEL, FP8_END_TO_END]
        impls = first + [impl for impl in dict.fromkeys(row["impl"] for row in plotted["rows"]) if impl not in first]
    fig = plot_results(plotted, metrics=("fwd_tflops",), impls=impls, panel_size=panel_size, **options)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    for ax in fig.axes:
        ax.get_legend().remove()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig
