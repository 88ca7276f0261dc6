"""Where a GPU call's time goes, kernel by kernel.

An op built from several kernels (the chunkwise linear attention's WY, h, o and backward passes) can be
slow because of one launch that its total hides. :func:`kernel_times` profiles a call with
``torch.profiler`` and returns each kernel's time per call, largest first; ``fa-lab bench linear
--breakdown`` prints it for ours and fla's forward and backward of every case, ``fa-lab bench sparse
--breakdown`` for our NSA selection, NSA end to end and MoBA (whose gate, gathers and merge run around its kernels).
"""
from __future__ import annotations

import torch


def aggregate(events, repeats: int) -> list[tuple[str, float, float]]:
    """(kernel name, microseconds per call, share of the total) from (name, microseconds) events of
    ``repeats`` calls, largest first."""
    totals: dict[str, float] = {}
    for name, micros in events:
        totals[name] = totals.get(name, 0.0) + micros
    total = sum(totals.values()) or 1.0
    return sorted(((name, micros / repeats, micros / total) for name, micros in totals.items()),
                  key=lambda item: -item[1])


def kernel_times(run, repeats: int = 10) -> list[tuple[str, float, float]]:
    """:func:`aggregate` of the CUDA kernels that ``repeats`` calls of ``run()`` launch (after one warm-up
    call, so compilation and autotuning stay out of the profile)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    events = [(event.name, event.time_range.elapsed_us()) for event in prof.events()
              if event.device_type == DeviceType.CUDA]
    return aggregate(events, repeats)


def backward_call(run, leaves):
    """A call that runs the backward of one output of ``run()`` with a fixed random gradient, the leaves'
    gradients reset first (what :func:`.interfaces.time_backward` times), for :func:`kernel_times`."""
    out = run()
    grad = torch.randn_like(out)

    def call():
        for leaf in leaves:
            leaf.grad = None
        out.backward(grad, retain_graph=True)
    return call


def passes(run, leaves):
    """(("forward", run), ("backward", :func:`backward_call`)): the two calls a breakdown profiles."""
    return ("forward", run), ("backward", backward_call(run, leaves))


def format_breakdown(title: str, times: list[tuple[str, float, float]], top: int = 8) -> str:
    """A few lines: the title with the total, then the ``top`` kernels with their time and share."""
    lines = [f"{title}: {sum(micros for _, micros, _ in times) / 1000:.3f} ms in {len(times)} kernels"]
    lines += [f"  {micros / 1000:8.3f} ms {100 * share:5.1f}%  {name[:90]}" for name, micros, share in times[:top]]
    return "\n".join(lines)
