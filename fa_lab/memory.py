"""Peak memory of a call, on CPU and on CUDA.

On CUDA the caching allocator keeps the peak (``max_memory_allocated``). On CPU
there is no such counter, so the call runs under the PyTorch profiler with
``profile_memory=True``: every allocation and free of the CPU allocator is an
event (also the scratch buffers allocated inside a single op, such as SDPA's,
which a ``TorchDispatchMode`` would miss), and the peak is the largest running
sum of those events.
"""
from __future__ import annotations

import contextlib
import os

import torch


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
