"""A/B probe: run in one process per variant (PYTHONPATH picks the fa_lab copy). Prints JSON lines."""
import json, os, sys, time, torch
from triton.testing import do_bench
import fa_lab
from fa_lab.bench_gpu import time_fwd_bwd
from fa_lab.bench_hopper import fp8_kernel_fn, hopper_fn
from fa_lab.iomodel import AttentionShape, attention_flops
from fa_lab.kernels.hopper import HopperOptions
tag = sys.argv[1]
impls = {"bf16": hopper_fn(None, HopperOptions()), "fp8": fp8_kernel_fn(None, HopperOptions()),
         }
def gpu_ms(fn, shape, reps=20):
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.seqlen_q, shape.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3): fn(q, k, v, shape.causal)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): fn(q, k, v, shape.causal)
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps
def cpu_us(fn, reps=200):
    q, k, v = (torch.randn(1, 1, 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(5): fn(q, k, v, False)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(reps): fn(q, k, v, False)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6
for causal in (False, True):
    q, k, v = (torch.randn(2, 4, 2000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    for name, fn in impls.items():
        err = (fn(q, k, v, causal).float() - ref).abs().max().item()
        print(json.dumps(dict(tag=tag, impl=name, causal=causal, max_err=err)), flush=True)
for n, causal in [(8192, False), (8192, True), (4096, False), (4096, True)]:
    shape = AttentionShape(16384 // n, 16, n, 128, causal=causal, dtype="bf16")
    fl = attention_flops(shape)
    for name, fn in impls.items():
        if name == "fp8_pp" and n != 8192: continue
        ms = time_fwd_bwd(fn, shape, backward=False)[0]
        g = gpu_ms(fn, shape)
        print(json.dumps(dict(tag=tag, impl=name, n=n, causal=causal, bench_tflops=fl / ms / 1e9, backtoback_tflops=fl / g / 1e9)), flush=True)
