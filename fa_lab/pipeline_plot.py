"""Timelines of :func:`fa_lab.pipeline_sim.simulate`: one lane per unit, one colour per task."""
from __future__ import annotations

from .pipeline_sim import Result

TASK_COLORS = {
    "load_q": "#8c8c8c", "load_k": "#b5b5b5", "load_v": "#d6d6d6", "store_o": "#8c8c8c",
    "gemm0": "tab:blue", "gemm1": "tab:green", "softmax": "tab:orange", "rescale": "tab:red",
    "finalize": "tab:purple", "wait": "black", "barrier": "tab:brown",
}
LANE_NAMES = {"tma": "TMA\n(loads)", "tensor": "tensor\ncores"}


def plot_timeline(result: Result, tiles: int = 4, figsize=(9.0, 3.2), dpi: int = 90):
    """Draw the first ``tiles`` K/V tiles of ``result``'s CTA; returns a matplotlib Figure.

    Lanes from the top: the TMA engine, the tensor cores, then each consumer
    warpgroup's own warps (MUFU/ALU). GEMMs of warpgroup 1, 2, ... are hatched on the
    tensor lane so the two warpgroups' turns stay visible; waits are thin black bars.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    events = result.events
    last_gemm1 = [e.end for e in events if e.task == "gemm1" and e.tile == tiles - 1]
    window_us = (max(last_gemm1) if last_gemm1 else result.cta_time_s) * 1e6
    lanes = ["tma", "tensor"] + sorted({e.unit for e in events if e.unit.startswith("wg")})
    fig = Figure(figsize=figsize, dpi=dpi)
    ax = fig.subplots()
    bars = {}  # (lane, task, wg) -> [(start_us, width_us)]
    for e in events:
        if e.start * 1e6 < window_us:
            bars.setdefault((e.unit, e.task, e.wg), []).append((e.start * 1e6, (e.end - e.start) * 1e6))
    for (unit, task, wg), spans in bars.items():
        row = len(lanes) - 1 - lanes.index(unit)
        thin = task == "wait"
        ax.broken_barh(spans, (row - (0.1 if thin else 0.35), 0.2 if thin else 0.7),
                       facecolors=TASK_COLORS[task], edgecolor="white", linewidth=0.3,
                       hatch="///" if unit == "tensor" and wg > 0 else None)
    ax.set_yticks(range(len(lanes)))
    names = [LANE_NAMES.get(lane, f"warpgroup {lane[2:]}\n(MUFU/ALU)") for lane in reversed(lanes)]
    ax.set_yticklabels(names, fontsize=8)
    ax.set_xlim(0, window_us)
    ax.set_xlabel("time (µs) within one CTA")
    shown = [task for task in TASK_COLORS if any(key[1] == task for key in bars)]
    handles = [Patch(facecolor=TASK_COLORS[task], label=task) for task in shown]
    if any(unit == "tensor" and wg > 0 for unit, _, wg in bars):
        handles.append(Patch(facecolor="white", edgecolor="gray", hatch="///", label="warpgroup 1's GEMM"))
    ax.legend(handles=handles, fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{result.schedule.name}: {result.tflops:.0f} TFLOP/s, tensor cores busy "
                 f"{result.utilisation['tensor']:.0%}", fontsize=9)
    fig.tight_layout()
    return fig
