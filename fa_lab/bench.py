"""``fa-lab bench``: time and peak memory of attention implementations, and the results schema.

On a CPU (``--device cpu``) it times the forward of ``naive`` and ``torch``
(:func:`fa_lab.attention`) and of ``sdpa`` (PyTorch's
``scaled_dot_product_attention``) with a wall-clock median after warm-up, and
records their peak extra memory with :func:`fa_lab.memory.peak_memory`. Naive is
only run up to ``--naive-max-seqlen`` (it needs 4 GiB at 8K, 16 GiB at 16K for
B=1, H=8, d=64, fp32); beyond, its memory comes from the IO model and its time is
null. The GPU protocol (FA3-paper shapes, ``triton.testing.do_bench``, every SDPA
back end and FlexAttention) plugs in as another runner next to :func:`run_cpu`.

Every results file has one schema (DESIGN.md, Benchmarks)::

    {"device", "torch", "triton", "date", "rows": [{"impl", "dtype", "head_dim", "causal",
     "seqlen", "batch", "heads", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops",
     "fwd_peak_bytes", "fwd_peak_source"}]}

with null for a missing figure; ``fwd_peak_source`` says whether the peak was
"measured" or taken from the "model".
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

import torch

from .iomodel import AttentionShape, attention_flops, format_bytes, precision_name
from .memory import (
    IMPLS,
    attention_forward,
    modelled_peak_bytes,
    peak_memory,
    use_byte_ticks,
    use_seqlen_ticks,
)
from .testing import make_qkv

TOP_KEYS = ("device", "torch", "triton", "date", "rows")
# Each row key and the types its value may take (a figure is null when missing).
_FIGURE = (int, float, type(None))
ROW_TYPES = {"impl": str, "dtype": str, "head_dim": int, "causal": bool, "seqlen": int, "batch": int,
             "heads": int, "fwd_ms": _FIGURE, "bwd_ms": _FIGURE, "fwd_tflops": _FIGURE, "bwd_tflops": _FIGURE,
             "fwd_peak_bytes": _FIGURE, "fwd_peak_source": (str, type(None))}
ROW_KEYS = tuple(ROW_TYPES)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What each run measures unless a flag says otherwise: the full CPU sweep, or a smoke run in seconds.
FULL = {"seqlens": [1024, 2048, 4096, 8192, 16384], "batch": 1, "heads": 8, "head_dim": 64,
        "repeats": 3, "warmup": 1, "naive_max_seqlen": 8192}
QUICK = {"seqlens": [128, 256], "batch": 1, "heads": 2, "head_dim": 32,
         "repeats": 2, "warmup": 1, "naive_max_seqlen": 128}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="fa-lab bench", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seqlens", type=int, nargs="+", help=f"default {FULL['seqlens']}")
    parser.add_argument("--batch", type=int, help=f"default {FULL['batch']}")
    parser.add_argument("--heads", type=int, help=f"default {FULL['heads']}")
    parser.add_argument("--head-dim", type=int, help=f"default {FULL['head_dim']}")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--causal", action="store_true", help="causal attention (default: not)")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--repeats", type=int, help=f"timed calls per point, default {FULL['repeats']}")
    parser.add_argument("--warmup", type=int, help=f"untimed calls first, default {FULL['warmup']}")
    parser.add_argument("--naive-max-seqlen", type=int, help="longest seqlen naive runs at, modelled "
                        f"beyond (default {FULL['naive_max_seqlen']})")
    parser.add_argument("--quick", action="store_true", help=f"smoke run of tiny shapes: {QUICK}")
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    parser.add_argument("--plot", metavar="FILE", help="save a PNG of time and memory vs seqlen")
    args = parser.parse_args(argv)
    args.seqlens_given = args.seqlens
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark that ``argv`` asks for, print its table; 0 on success, 2 on a usage error."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda":
        return run_cuda(args)
    warn_if_busy()
    results = run_cpu(args)
    print(describe(results))
    print(format_table(results["rows"]))
    if args.json:
        save_results(results, args.json)
    if args.plot:
        plot_results(results, metrics=("fwd_ms", "fwd_peak_bytes")).savefig(args.plot)
    return 0


def warn_if_busy() -> None:
    """Warn on stderr when other processes already keep the CPU busy: wall-clock times would be inflated."""
    if not hasattr(os, "getloadavg"):  # Windows
        return
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cores:
        print(f"fa-lab bench: warning: load average {load:.1f} on {cores} cores before starting; other "
              "processes compete for the CPU, so times will be slower and noisier than on an idle machine",
              file=sys.stderr)


def run_cuda(args) -> int:
    """The GPU protocol (:mod:`fa_lab.bench_gpu`): FA3-paper shapes with every peer; 2 without CUDA."""
    if not torch.cuda.is_available():
        print("fa-lab bench: --device cuda needs a CUDA GPU; run `fa-lab bench --device cpu`", file=sys.stderr)
        return 2
    from .bench_gpu import SEQLENS
    from .bench_gpu import main as gpu_main

    gpu_argv = ["--json", args.json or "bench_gpu.json", "--seqlens", *map(str, args.seqlens_given or SEQLENS)]
    return gpu_main(gpu_argv + (["--plot", args.plot] if args.plot else []))


def median_ms(fn, *args, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall-clock time of ``fn(*args)`` in milliseconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_cpu(args) -> dict:
    """The CPU sweep: one row per (seqlen, impl), forward only (``bwd_*`` are null)."""
    from tqdm.auto import tqdm

    dtype = DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad(), tqdm(total=len(args.seqlens) * len(args.impls), desc="bench", unit="run") as bar:
        for seqlen in args.seqlens:
            shape = AttentionShape(args.batch, args.heads, seqlen, args.head_dim, causal=args.causal,
                                   dtype=dtype)
            q, k, v = make_qkv(args.batch, args.heads, seqlen, seqlen, args.head_dim, dtype,
                               generator=generator, requires_grad=False)
            for impl in args.impls:
                bar.set_postfix_str(f"{impl} N={seqlen}")
                fn = attention_forward(impl, args.causal)
                row = empty_row(impl, shape)
                if impl == "naive" and seqlen > args.naive_max_seqlen:
                    row.update(fwd_peak_bytes=modelled_peak_bytes(impl, shape), fwd_peak_source="model")
                else:
                    ms = median_ms(fn, q, k, v, repeats=args.repeats, warmup=args.warmup)
                    row.update(fwd_ms=ms, fwd_tflops=attention_flops(shape) / (ms * 1e-3) / 1e12,
                               fwd_peak_bytes=peak_memory(fn, q, k, v), fwd_peak_source="measured")
                rows.append(row)
                bar.update()
    return {**environment("cpu"), "rows": rows}


def empty_row(impl: str, shape: AttentionShape) -> dict:
    """A schema row for ``impl`` at ``shape``, every figure null."""
    row = dict.fromkeys(ROW_KEYS)
    row.update(impl=impl, dtype=precision_name(shape.dtype), head_dim=shape.head_dim, causal=shape.causal,
               seqlen=shape.seqlen_q, batch=shape.batch, heads=shape.heads)
    return row


def environment(device: str) -> dict:
    """The schema's header: device name, torch and triton versions (null when absent), today's date."""
    if device == "cpu":
        device_name = f"CPU: {_cpu_model()}, {torch.get_num_threads()} threads"
    else:
        device_name = torch.cuda.get_device_name()
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return {"device": device_name, "torch": torch.__version__, "triton": triton_version,
            "date": datetime.date.today().isoformat()}


def _cpu_model() -> str:
    """The CPU's model name: from /proc/cpuinfo on Linux, else whatever ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def validate_results(results: dict) -> dict:
    """Check ``results`` against the schema; return it, or raise ValueError naming what is wrong."""
    if not isinstance(results, dict):
        raise ValueError(f"results must be a JSON object, got {type(results).__name__}")
    missing = [key for key in TOP_KEYS if key not in results]
    if missing:
        raise ValueError(f"results lack the keys {missing}; the schema needs {list(TOP_KEYS)}")
    if not isinstance(results["rows"], list):
        raise ValueError("results['rows'] must be a list of rows")
    for index, row in enumerate(results["rows"]):
        if not isinstance(row, dict) or set(row) != set(ROW_KEYS):
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"row {index} has keys {got}; every row needs exactly {list(ROW_KEYS)}")
        for key, types in ROW_TYPES.items():
            if not isinstance(row[key], types) or (isinstance(row[key], bool) and types is not bool):
                raise ValueError(f"row {index}: {key} is {row[key]!r}, which is not a valid {key}")
    return results


def save_results(results: dict, path) -> None:
    """Write schema-valid ``results`` as indented JSON."""
    validate_results(results)
    with open(path, "w") as out:
        json.dump(results, out, indent=1)
        out.write("\n")


def load_results(path) -> dict:
    """Read and validate a results JSON file (``benchmarks/*.json``)."""
    with open(path) as source:
        return validate_results(json.load(source))


def describe(results: dict) -> str:
    """One line saying where and when results come from, as notebooks print it."""
    triton = f", triton {results['triton']}" if results["triton"] else ""
    return f"recorded on {results['device']}, torch {results['torch']}{triton}, {results['date']}"


def format_table(rows) -> str:
    """A plain-text table of schema rows; '-' for a null figure, '(model)' for a modelled peak."""
    header = ("impl", "dtype", "d", "causal", "N", "B", "H", "fwd ms", "bwd ms", "fwd TFLOP/s",
              "bwd TFLOP/s", "fwd peak memory")
    lines = [header]
    for row in rows:
        peak = "-" if row["fwd_peak_bytes"] is None else format_bytes(row["fwd_peak_bytes"])
        if row.get("fwd_peak_source") == "model":
            peak += " (model)"
        lines.append((row["impl"], row["dtype"], str(row["head_dim"]), str(row["causal"]), str(row["seqlen"]),
                      str(row["batch"]), str(row["heads"]), _number(row["fwd_ms"], ".1f"),
                      _number(row["bwd_ms"], ".1f"), _number(row["fwd_tflops"], ".3g"),
                      _number(row["bwd_tflops"], ".3g"), peak))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True))
                     for line in lines)


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


METRIC_LABELS = {"fwd_tflops": "forward TFLOP/s", "bwd_tflops": "backward TFLOP/s", "fwd_ms": "forward ms",
                 "bwd_ms": "backward ms", "fwd_peak_bytes": "forward peak extra memory"}


def plot_results(results: dict, metrics=("fwd_tflops", "bwd_tflops"), impls=None, panel_size=(4.2, 3.2),
                 dpi=90):
    """``metrics`` vs seqlen, one line per impl, one panel per (head_dim, causal, metric).

    Panels whose metric is null everywhere (e.g. backward on a CPU run) are left
    out; a peak taken from the model is drawn as a hollow marker. Panels wrap into
    rows of at most four. Returns a Figure.
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
    grid_rows = -(-len(panels) // columns)
    fig = Figure(figsize=(panel_size[0] * columns, panel_size[1] * grid_rows + 0.5), dpi=dpi)
    axes = fig.subplots(grid_rows, columns, squeeze=False).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (head_dim, causal, metric) in zip(axes, panels):
        for index, impl in enumerate(impls):
            mine = sorted((r for r in rows if r[metric] is not None
                           and (r["impl"], r["head_dim"], r["causal"]) == (impl, head_dim, causal)),
                          key=lambda r: r["seqlen"])
            if not mine:
                continue
            ax.plot([r["seqlen"] for r in mine], [r[metric] for r in mine], "o-", color=f"C{index}",
                    label=impl)
            modelled = [r for r in mine if metric == "fwd_peak_bytes" and r["fwd_peak_source"] == "model"]
            if modelled:  # hollow markers over the line: these points come from the IO model
                ax.plot([r["seqlen"] for r in modelled], [r[metric] for r in modelled], "o", ms=9,
                        mfc="white", color=f"C{index}", label=f"{impl} (model)")
        use_seqlen_ticks(ax.xaxis, [r["seqlen"] for r in rows])
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


if __name__ == "__main__":
    raise SystemExit(main())
