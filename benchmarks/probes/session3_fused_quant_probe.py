"""Device probe (session 3): the fused FP8 quantization (fa_lab.kernels.fp8_quant) on the H200.

Runs its gpu tests and the FP8 ones that go through it, then times, at the FA3 protocol's
shapes (16K tokens, 16 heads, d=128, bf16): the quantization in two Triton passes against
the PyTorch operations, and the end-to-end FP8 forward (quantization + kernel) against the
bf16 triton_hopper forward. Writes session3_fused_quant_probe.json under $OUT.
"""
import json, os, subprocess, sys
SEQLENS = [int(a) for a in sys.argv[1:]] or [1024, 4096, 8192, 16384]
out = os.environ.get("OUT", ".")
tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_hopper.py", "-k", "fused or fp8",
                        "-p", "no:cacheprovider"], capture_output=True, text=True)
print(tests.stdout[-800:], flush=True)
import torch
from triton.testing import do_bench
from fa_lab.bench_gpu import time_fwd_bwd
from fa_lab.bench_hopper import fp8_rmse, hopper_fn
from fa_lab.iomodel import AttentionShape, attention_flops
from fa_lab.kernels.hopper import GLUON_TILES, HopperOptions, quantize_for_kernel, triton_hopper_fp8_attention
result = {"gpu_tests": tests.stdout.strip().splitlines()[-1], "rmse_outliers_fused": fp8_rmse(None), "rows": []}
print(result, flush=True)
for n in SEQLENS:
    for causal in (False, True):
        shape = AttentionShape(16384 // n, 16, n, 128, causal=causal, dtype="bf16")
        q, k, v = (torch.randn(shape.batch, 16, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        row = dict(seqlen=n, causal=causal)
        if not causal:
            for fused in (True, False):
                row[f"quant_ms_{'fused' if fused else 'pytorch'}"] = do_bench(
                    lambda: quantize_for_kernel(q, k, v, GLUON_TILES, True, gluon=True, fused=fused), return_mode="median")
        fp8_end_to_end = lambda q, k, v, c: triton_hopper_fp8_attention(q, k, v, c, None)[0]
        for name, fn in (("fp8_end_to_end", fp8_end_to_end), ("bf16", hopper_fn(None, HopperOptions()))):
            ms = time_fwd_bwd(fn, shape, backward=False)[0]
            row[f"{name}_ms"], row[f"{name}_tflops"] = ms, attention_flops(shape) / (ms * 1e-3) / 1e12
        result["rows"].append(row)
        print(row, flush=True)
        json.dump(result, open(os.path.join(out, "session3_fused_quant_probe.json"), "w"), indent=1)
