"""Plots of a results file: a metric against the sequence length, one line per impl."""
from __future__ import annotations

from ..block_info import cdiv
from ..memory import use_byte_ticks, use_seqlen_ticks
from .report import describe

METRIC_LABELS = {"fwd_tflops": "forward TFLOP/s", "bwd_tflops": "backward TFLOP/s", "fwd_ms": "forward ms",
                 "bwd_ms": "backward ms", "fwd_peak_bytes": "forward peak extra memory", "tbps": "achieved TB/s"}


def plot_results(results: dict, metrics=("fwd_tflops", "bwd_tflops"), impls=None, panel_size=(4.2, 3.2),
                 dpi=90):
    """``metrics`` against seqlen_k, one line per impl, one panel per (head_dim, causal, metric).

    Panels whose metric is null everywhere (e.g. backward on a CPU run) are left
    out; a peak taken from the model is drawn as a hollow marker. Panels wrap into
    rows of at most four. Returns a matplotlib Figure.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    rows = results["rows"]
    impls = impls or list(dict.fromkeys(row["impl"] for row in rows))
    panels = [(d, causal, metric) for d in sorted({r["head_dim"] for r in rows})
              for causal in sorted({r["causal"] for r in rows}) for metric in metrics
              if any(r[metric] is not None for r in rows if (r["head_dim"], r["causal"]) == (d, causal))]
    if not panels:
        raise ValueError(f"no row has any of the metrics {list(metrics)}")
    columns = min(4, len(panels))
    grid_rows = cdiv(len(panels), columns)
    fig = Figure(figsize=(panel_size[0] * columns, panel_size[1] * grid_rows + 0.5), dpi=dpi)
    axes = fig.subplots(grid_rows, columns, squeeze=False).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (head_dim, causal, metric) in zip(axes, panels):
        for index, impl in enumerate(impls):
            mine = sorted((r for r in rows if r[metric] is not None
                           and (r["impl"], r["head_dim"], r["causal"]) == (impl, head_dim, causal)),
                          key=lambda r: r["seqlen_k"])
            if not mine:
                continue
            ax.plot([r["seqlen_k"] for r in mine], [r[metric] for r in mine], "o-", color=f"C{index}",
                    label=impl)
            modelled = [r for r in mine if metric == "fwd_peak_bytes" and r["fwd_peak_source"] == "model"]
            if modelled:  # hollow markers over the line: these points come from the IO model
                ax.plot([r["seqlen_k"] for r in modelled], [r[metric] for r in modelled], "o", ms=9,
                        mfc="white", color=f"C{index}", label=f"{impl} (model)")
        use_seqlen_ticks(ax.xaxis, [r["seqlen_k"] for r in rows])
        if metric.endswith("_bytes"):
            use_byte_ticks(ax.yaxis)
        elif metric.endswith("_ms"):
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set(xlabel="sequence length N", ylabel=METRIC_LABELS.get(metric, metric),
               title=f"d={head_dim}, {'causal' if causal else 'not causal'}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(describe(results), fontsize=9)
    fig.tight_layout()
    return fig
