"""The CPU benchmark: forward time and peak memory of ``naive``, ``torch`` and ``sdpa``.

Each time is a wall-clock median after warm-up (:func:`median_ms`), each peak the
extra memory :func:`fa_lab.memory.peak_memory` records. Naive runs only up to
``naive_max_seqlen`` (it peaks at about 6 GiB at 8K and 24 GiB at 16K for B=1, H=8,
d=64, fp32: three (N, N) float32 matrices); beyond, its peak comes from the IO model and its time is null.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from ..iomodel import AttentionShape, attention_flops
from ..memory import IMPLS, attention_forward, modelled_peak_bytes, peak_memory
from ..testing import make_qkv
from .schema import empty_row, environment

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class CpuSweep:
    """What one CPU run measures: every (seqlen, causal, impl) at q, k, v of (batch, heads, seqlen, head_dim)."""

    seqlens: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    dtype: str = "fp32"  # a key of DTYPES
    causals: tuple[bool, ...] = (False,)
    impls: tuple[str, ...] = IMPLS
    repeats: int = 3  # timed calls per point
    warmup: int = 1  # untimed calls first
    naive_max_seqlen: int = 8192  # naive's peak is modelled beyond


FULL = CpuSweep()
QUICK = CpuSweep(seqlens=(128, 256), heads=2, head_dim=32, repeats=2, naive_max_seqlen=128)  # seconds


def warn_if_busy() -> None:
    """Warn on stderr when other processes already keep the CPU busy: wall-clock times would be inflated."""
    if not hasattr(os, "getloadavg"):  # Windows
        return
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cores:
        print(f"fa-lab bench: warning: load average {load:.1f} on {cores} cores before starting; other "
              "processes compete for the CPU, so times will be slower and noisier than on an idle machine",
              file=sys.stderr)


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


def run_cpu(sweep: CpuSweep) -> dict:
    """The results of ``sweep``: one row per (seqlen, causal, impl), forward only (``bwd_*`` are null)."""
    from tqdm.auto import tqdm

    dtype = DTYPES[sweep.dtype]
    generator = torch.Generator().manual_seed(0)
    rows = []
    points = [(seqlen, causal) for seqlen in sweep.seqlens for causal in sweep.causals]
    with torch.no_grad(), tqdm(total=len(points) * len(sweep.impls), desc="bench", unit="run") as bar:
        for seqlen, causal in points:
            shape = AttentionShape(sweep.batch, sweep.heads, seqlen, sweep.head_dim, causal=causal, dtype=dtype)
            q, k, v = make_qkv(sweep.batch, sweep.heads, seqlen, seqlen, sweep.head_dim, dtype,
                               generator=generator, requires_grad=False)
            for impl in sweep.impls:
                bar.set_postfix_str(f"{impl} N={seqlen}{' causal' if causal else ''}")
                fn = attention_forward(impl, causal)
                row = empty_row(impl, shape)
                if impl == "naive" and seqlen > sweep.naive_max_seqlen:
                    row.update(fwd_peak_bytes=modelled_peak_bytes(impl, shape), fwd_peak_source="model")
                else:
                    ms = median_ms(fn, q, k, v, repeats=sweep.repeats, warmup=sweep.warmup)
                    row.update(fwd_ms=ms, fwd_tflops=attention_flops(shape) / (ms * 1e-3) / 1e12,
                               fwd_peak_bytes=peak_memory(fn, q, k, v), fwd_peak_source="measured")
                rows.append(row)
                bar.update()
    return {**environment("cpu"), "rows": rows}
