"""Peak memory of a call, on CPU and on CUDA.

On CUDA the caching allocator keeps the peak (``max_memory_allocated``). On CPU
there is no such counter, so the call runs under the PyTorch profiler with
``profile_memory=True``: every allocation and free of the CPU allocator is an
event (also the scratch buffers allocated inside a single op, such as SDPA's,
which a ``TorchDispatchMode`` would miss), and the peak is the largest running
sum of those events.

The rest of the module puts measurements next to the IO model
(:mod:`fa_lab.iomodel`): peak memory of naive, tiled and SDPA attention vs
sequence length, measured where it fits in RAM and modelled beyond.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from .flash_torch import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from .iomodel import AttentionShape, dtype_bytes, flash_extra_bytes, format_bytes, naive_extra_bytes
from .testing import make_qkv


@contextlib.contextmanager
def _quiet_stderr():
    """Silence the profiler's native start/stop lines, which go straight to file descriptor 2."""
    try:
        saved = os.dup(2)
    except OSError:  # no real stderr (some embedded interpreters)
        yield
        return
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _uses_cuda(args, kwargs) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values()))


def _cuda_peak(fn, args, kwargs) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn(*args, **kwargs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return int(peak)


def _cpu_peak(fn, args, kwargs) -> int:
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    del result
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:  # nbytes > 0 for an allocation, < 0 for a free
        current += event.nbytes()
        peak = max(peak, current)
    return int(peak)


def peak_memory(fn, *args, **kwargs) -> int:
    """Peak extra bytes allocated while ``fn(*args, **kwargs)`` runs, its output included.

    Runs on CUDA (``max_memory_allocated``) when any tensor argument is on a CUDA
    device, else on CPU through the profiler's allocation events.
    """
    if _uses_cuda(args, kwargs):
        return _cuda_peak(fn, args, kwargs)
    return _cpu_peak(fn, args, kwargs)


# ---------------------------------------------------------------- memory vs seqlen: measured and modelled

# fa_lab's naive_attention holds three (Nq, Nk) matrices at its peak: S, exp(S - m) and
# P = exp(S - m) / l, allocated before the temporary is freed (the textbook counts S and P).
NAIVE_LIVE_MATRICES = 3
IMPLS = ("naive", "torch", "sdpa")


def attention_forward(impl: str, causal: bool = False):
    """The forward call ``fn(q, k, v) -> out`` measured for ``impl``: "naive" or "torch"
    (:func:`fa_lab.attention`), or "sdpa" (``torch.nn.functional.scaled_dot_product_attention``)."""
    import fa_lab

    if impl == "sdpa":
        return functools.partial(torch.nn.functional.scaled_dot_product_attention, is_causal=causal)
    if impl in ("naive", "torch"):
        return functools.partial(fa_lab.attention, impl=impl, causal=causal)
    raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}; got {impl!r}")


def torch_workspace_bytes(shape: AttentionShape, block_q: int = DEFAULT_BLOCK_Q,
                          block_k: int = DEFAULT_BLOCK_K) -> int:
    """RAM that :func:`fa_lab.flash_torch.flash_forward` keeps for its tiles (a GPU keeps them in SRAM).

    Per head, in float32: a (block_q, block_k) score tile and its probabilities, the
    scaled Q tile and the (block_q, d) accumulator; inputs that are not float32 also
    get float32 copies of K and V.
    """
    rows, cols, d = min(block_q, shape.seqlen_q), min(block_k, shape.seqlen_k), shape.head_dim
    per_head = 2 * rows * cols + 2 * rows * d
    if dtype_bytes(shape.dtype) != 4:
        per_head += 2 * shape.seqlen_k * d
    return 4 * per_head * shape.heads_total


def modelled_peak_bytes(impl: str, shape: AttentionShape) -> int:
    """The IO model's peak extra bytes of ``impl``'s forward (see :func:`attention_forward`).

    naive: ``NAIVE_LIVE_MATRICES`` (Nq, Nk) matrices and O; torch: O, LSE and its
    tiles; sdpa: O and LSE, a lower bound (its per-thread scratch, about a MiB in
    float32 and more for half-precision inputs, is left out).
    """
    if impl == "naive":
        return naive_extra_bytes(shape, NAIVE_LIVE_MATRICES)
    if impl == "torch":
        return flash_extra_bytes(shape, torch_workspace_bytes(shape))
    if impl == "sdpa":
        return flash_extra_bytes(shape)
    raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}; got {impl!r}")


def memory_sweep(impls=IMPLS, seqlens=(512, 1024, 2048, 4096, 8192, 16384), batch=1, heads=8,
                 head_dim=64, dtype=torch.float32, measure_up_to=4096, seed=0) -> list[dict]:
    """Peak extra memory of each impl's forward vs seqlen: measured up to ``measure_up_to``, modelled always.

    Inputs q, k, v: (batch, heads, seqlen, head_dim) from N(0, 1), fresh per seqlen.
    Returns rows {"impl", "seqlen", "measured_bytes" (None past measure_up_to), "modelled_bytes"}.
    """
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for seqlen in seqlens:
        shape = AttentionShape(batch, heads, seqlen, head_dim, dtype=dtype)
        qkv = make_qkv(batch, heads, seqlen, seqlen, head_dim, dtype, generator=generator,
                       requires_grad=False) if seqlen <= measure_up_to else None
        for impl in impls:
            measured = peak_memory(attention_forward(impl), *qkv) if qkv is not None else None
            rows.append({"impl": impl, "seqlen": seqlen, "measured_bytes": measured,
                         "modelled_bytes": modelled_peak_bytes(impl, shape)})
    return rows


def seqlen_label(seqlen: int) -> str:
    """16384 -> '16K', 1536 -> '1536'."""
    return f"{seqlen // 1024}K" if seqlen >= 1024 and seqlen % 1024 == 0 else str(seqlen)


def use_seqlen_ticks(axis, seqlens) -> None:
    """A log2 seqlen axis (``ax.xaxis``) with a tick labelled '1K', '2K', ... at each of ``seqlens``."""
    from matplotlib.ticker import NullLocator

    axis.axes.set_xscale("log", base=2)
    axis.set_ticks(sorted(set(seqlens)), [seqlen_label(n) for n in sorted(set(seqlens))])
    axis.set_minor_locator(NullLocator())


def use_byte_ticks(axis) -> None:
    """A log bytes axis (``ax.yaxis``) with ticks at powers of 16 labelled '1 MiB', '16 MiB', ..."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    axis.axes.set_yscale("log", base=2)
    axis.set_major_locator(LogLocator(base=16))
    axis.set_major_formatter(FuncFormatter(lambda value, _: format_bytes(value)))
    axis.set_minor_locator(NullLocator())


def plot_memory_vs_seqlen(rows, limits: dict[str, int] | None = None, title=None, figsize=(8.5, 4.2),
                          dpi=90):
    """Peak extra memory vs seqlen: measured points (markers) next to modelled curves (dashed).

    rows: as :func:`memory_sweep` returns (rows of any impl name may be added; a
    ``measured_bytes`` of None draws the model only). ``limits`` draws horizontal
    lines, e.g. ``{"16 GiB of RAM": 16 * 2**30}``. Returns a matplotlib Figure.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    ax = fig.subplots()
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    for index, impl in enumerate(impls):
        color = f"C{index}"
        mine = sorted((row for row in rows if row["impl"] == impl), key=lambda row: row["seqlen"])
        ax.plot([r["seqlen"] for r in mine], [r["modelled_bytes"] for r in mine], "--", color=color,
                label=f"{impl}: model")
        measured = [r for r in mine if r["measured_bytes"] is not None]
        if measured:
            ax.plot([r["seqlen"] for r in measured], [r["measured_bytes"] for r in measured], "o",
                    color=color, label=f"{impl}: measured")
    for label, nbytes in (limits or {}).items():
        ax.axhline(nbytes, color="gray", lw=1)
        ax.text(min(r["seqlen"] for r in rows), nbytes, f" {label}", va="bottom", fontsize=8, color="gray")
    use_seqlen_ticks(ax.xaxis, [row["seqlen"] for row in rows])
    use_byte_ticks(ax.yaxis)
    ax.set(xlabel="sequence length N", ylabel="peak extra memory", title=title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: the data fill the axes
    fig.tight_layout()
    return fig
