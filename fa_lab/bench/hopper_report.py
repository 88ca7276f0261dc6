"""The Hopper protocol's FP8 figures as a caller sees them, and the protocol's plot.

A ``triton_hopper_fp8`` row times the FP8 kernel alone, on inputs quantized beforehand (kernel only); the
quantization it needs (the rotation, per-tile scales, V^T in the kernel's key order) is timed on its own,
as ``triton_hopper_fp8_quant``. A caller with bf16 Q, K and V pays both: :func:`fp8_end_to_end` divides the
attention's FLOPs by the sum of the two medians of a shape (two separate timings, not one call), and
:func:`plot_hopper` draws the kernel-only line, labelled so, beside that end-to-end line. Needs neither
Triton nor a GPU: notebook 04 reads the recorded results through it.
"""
from __future__ import annotations

from ..iomodel import AttentionShape, attention_flops
from .plots import plot_results

FP8_KERNEL = "triton_hopper_fp8 (kernel only)"
FP8_END_TO_END = "triton_hopper_fp8 + quantization"


def _fp8_pairs(rows: list[dict]) -> dict:
    """(head_dim, causal, seqlen_q) -> (kernel row, quantization row) for every shape whose two FP8 rows have a
    time."""
    by_shape = {(row["impl"], (row["head_dim"], row["causal"], row["seqlen_q"])): row for row in rows}
    return {shape: (kernel, by_shape[("triton_hopper_fp8_quant", shape)])
            for (impl, shape), kernel in by_shape.items()
            if impl == "triton_hopper_fp8" and kernel["fwd_ms"] is not None
            and by_shape.get(("triton_hopper_fp8_quant", shape), {}).get("fwd_ms") is not None}


def _end_to_end_tflops(kernel: dict, quant: dict) -> float:
    """Forward TFLOP/s of one shape's FP8 kernel row and quantization row, their medians summed."""
    shape = AttentionShape(kernel["batch"], kernel["heads"], kernel["seqlen_q"], kernel["head_dim"],
                           kernel["seqlen_k"], causal=kernel["causal"])
    return attention_flops(shape) / ((kernel["fwd_ms"] + quant["fwd_ms"]) * 1e-3) / 1e12


def fp8_end_to_end(rows: list[dict], head_dim: int = 128) -> dict:
    """(causal, seqlen_q) -> forward TFLOP/s of the FP8 quantization plus the FP8 kernel at ``head_dim``, for every
    shape whose ``triton_hopper_fp8`` and ``triton_hopper_fp8_quant`` rows both have a time."""
    return {(causal, seqlen): _end_to_end_tflops(kernel, quant)
            for (d, causal, seqlen), (kernel, quant) in _fp8_pairs(rows).items() if d == head_dim}


def with_end_to_end(results: dict) -> dict:
    """A copy of Hopper protocol ``results`` for plots and tables: the FP8 kernel's rows renamed
    :data:`FP8_KERNEL`, and one :data:`FP8_END_TO_END` row per shape (the kernel row with the two rows'
    summed time and the :func:`fp8_end_to_end` TFLOP/s). Never written to a results file."""
    rows = results["rows"]
    renamed = [{**row, "impl": FP8_KERNEL} if row["impl"] == "triton_hopper_fp8" else row for row in rows]
    added = [{**kernel, "impl": FP8_END_TO_END, "fwd_ms": kernel["fwd_ms"] + quant["fwd_ms"],
              "fwd_tflops": _end_to_end_tflops(kernel, quant)} for kernel, quant in _fp8_pairs(rows).values()]
    return {**results, "rows": renamed + added}


def plot_hopper(results: dict, impls=None, panel_size=(4.2, 3.8), **options):
    """Forward TFLOP/s against the sequence length, one panel per mask (:func:`fa_lab.bench.plot_results`), with
    the FP8 kernel alone and with its quantization as two lines, and one legend below the panels. ``impls``:
    the lines in order (default: triton_hopper, the two FP8 lines, then the peers as they come); ``options``
    go to plot_results. Returns a matplotlib Figure."""
    plotted = with_end_to_end(results)
    if impls is None:
        first = ["triton_hopper", FP8_KERNEL, FP8_END_TO_END]
        impls = first + [impl for impl in dict.fromkeys(row["impl"] for row in plotted["rows"])
                         if impl not in first and impl != "triton_hopper_fp8_quant"]
    fig = plot_results(plotted, metrics=("fwd_tflops",), impls=impls, panel_size=panel_size, **options)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    for ax in fig.axes:
        ax.get_legend().remove()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig
