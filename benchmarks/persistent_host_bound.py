"""Why the FA3-paper protocol cannot see the persistent bf16 kernel's gain at 1K-2K causal: it times our host.

The protocol (``fa_lab.bench.gpu.time_fwd_bwd``) times each forward with ``triton.testing.do_bench``, which
clears the L2 between calls, so the GPU waits for the next call's launch whenever the host takes longer to
issue it than the flush takes to run. For the Gluon forward at the protocol's shapes (16K tokens, hidden 2048,
d = 128), one tile per CTA and persistent, with and without inputs requiring grad, this prints do_bench's median,
the median kernel time under torch.profiler (the GPU's own time) and the host's time per call (50 calls issued
back to back), each in ms and TFLOP/s.

On the H200: ``PYTHONPATH=. python3 benchmarks/persistent_host_bound.py`` (its output is
benchmarks/h200_persistent_host_bound.log).
"""
import functools
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from fa_lab.bench.gpu import random_inputs
from fa_lab.iomodel import AttentionShape, attention_flops
from fa_lab.kernels.hopper import HopperOptions, triton_hopper_attention

CASES = ((2048, True), (1024, True), (4096, True), (2048, False))


def timings(call) -> tuple[float, float, float]:
    """(do_bench median, median kernel time under torch.profiler, host time per call), ms, of ``call()``."""
    call()
    torch.cuda.synchronize()
    bench_ms = do_bench(call, return_mode="median")
    start = time.perf_counter()
    for _ in range(50):
        call()
    host_ms = (time.perf_counter() - start) / 50 * 1e3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    kernels = sorted(e.self_device_time_total for e in prof.events()
                     if e.device_type == DeviceType.CUDA and "fa3" in e.name)
    return bench_ms, kernels[len(kernels) // 2] / 1e3, host_ms


def main() -> None:
    for seqlen, causal in CASES:
        shape = AttentionShape(batch=16384 // seqlen, heads=16, seqlen_q=seqlen, seqlen_k=seqlen, head_dim=128,
                               causal=causal)
        flops = attention_flops(shape)
        for grad in (True, False):
            q, k, v = random_inputs(shape, requires_grad=grad)
            for persistent in (False, True):
                call = functools.partial(triton_hopper_attention, q, k, v, causal, None,
                                         options=HopperOptions(persistent=persistent))
                bench_ms, kernel_ms, host_ms = timings(call)
                print(f"N={seqlen} causal={causal} grad={grad} persistent={persistent}: do_bench {bench_ms:.3f} ms = "
                      f"{flops / bench_ms / 1e9:.0f} TF; kernel {kernel_ms:.3f} ms = {flops / kernel_ms / 1e9:.0f} TF; "
                      f"host {host_ms:.3f} ms/call", flush=True)


if __name__ == "__main__":
    main()
