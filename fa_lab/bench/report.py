"""Results in words: the line that says where they come from, and a plain-text table of rows."""
from __future__ import annotations

from ..iomodel import format_bytes


def describe(results: dict) -> str:
    """One line saying where and when ``results`` were recorded, as notebooks print it."""
    triton = f", triton {results['triton']}" if results["triton"] else ""
    return f"recorded on {results['device']}, torch {results['torch']}{triton}, {results['date']}"


def format_table(rows) -> str:
    """A plain-text table of schema rows: '-' for a null figure, '(model)' after a modelled peak.

    The bandwidth columns (GB moved, TB/s, copy TB/s) appear when some row has them.
    """
    header = ["impl", "dtype", "d", "causal", "Nq", "Nk", "B", "H", "fwd ms", "bwd ms", "fwd TFLOP/s",
              "bwd TFLOP/s", "fwd peak memory"]
    bandwidth = any(row["bytes"] is not None for row in rows)
    if bandwidth:
        header += ["GB", "TB/s", "copy TB/s"]
    lines = [header]
    for row in rows:
        peak = "-" if row["fwd_peak_bytes"] is None else format_bytes(row["fwd_peak_bytes"])
        if row["fwd_peak_source"] == "model":
            peak += " (model)"
        line = [row["impl"], row["dtype"], str(row["head_dim"]), str(row["causal"]), str(row["seqlen_q"]),
                str(row["seqlen_k"]), str(row["batch"]), str(row["heads"]), _number(row["fwd_ms"], ".1f"),
                _number(row["bwd_ms"], ".1f"), _number(row["fwd_tflops"], ".3g"), _number(row["bwd_tflops"], ".3g"),
                peak]
        if bandwidth:
            gigabytes = None if row["bytes"] is None else row["bytes"] / 1e9
            line += [_number(gigabytes, ".3g"), _number(row["tbps"], ".3g"), _number(row["copy_tbps"], ".3g")]
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True))
                     for line in lines)


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)
