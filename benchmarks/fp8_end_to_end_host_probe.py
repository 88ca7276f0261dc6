# ruff: noqa
"""Probe (run once on the H200 with PYTHONPATH=. OUT=dir): see docs/experiments/hopper_forward.md, "FP8 end to end as one call"."""
import time, json, os, torch
from triton.testing import do_bench
from fa_lab.kernels import load_triton
from fa_lab.kernels.hopper import triton_hopper_attention, triton_hopper_fp8_attention
load_triton()
out = []
for n, causal in ((2048, True), (4096, True), (2048, False), (16384, True)):
    b = 16384 // n
    q, k, v = (torch.randn(b, 16, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    f = lambda: triton_hopper_fp8_attention(q, k, v, causal, None)
    g = lambda: triton_hopper_attention(q, k, v, causal, None)
    f(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50): f()
    host = (time.perf_counter() - t) / 50 * 1e3
    torch.cuda.synchronize()
    e = {"n": n, "causal": causal, "e2e_ms": [do_bench(f, return_mode="median") for _ in range(3)],
         "bf16_ms": [do_bench(g, return_mode="median") for _ in range(2)], "host_issue_ms": host}
    print(e, flush=True); out.append(e)
json.dump(out, open(os.path.join(os.environ["OUT"], "e2e_probe.json"), "w"), indent=1)
