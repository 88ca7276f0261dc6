"""Probe: host time per call of the FP8 quantization (Gluon vs Triton pass) and of the FP8 call from bf16."""
import time, json, os
import torch
from fa_lab.kernels import load_triton
load_triton()
from fa_lab.kernels.hopper import V_SCALE_FLOOR, triton_hopper_fp8_attention
from fa_lab.kernels.hopper import fp8_quant
from fa_lab.kernels.hopper.fp8_attention import rotation_signs
q, k, v = (torch.randn(8, 16, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
signs = rotation_signs(128, q.device)
out = {}
def host_us(fn, n=200):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    # slow the GPU's queue down with a long kernel so that the host never waits: a big matmul queued first
    a = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(8): a @ a
    t = time.perf_counter()
    for _ in range(n): fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return round(host, 1)
for name, fn in {"quant_gluon": lambda: fp8_quant.quantize_fp8_operands(q, k, v, signs, 128, V_SCALE_FLOOR, kernel="gluon"),
                 "quant_triton": lambda: fp8_quant.quantize_fp8_operands(q, k, v, signs, 128, V_SCALE_FLOOR, kernel="triton"),
                 "fp8_call": lambda: triton_hopper_fp8_attention(q, k, v, False, None)}.items():
    out[name] = [host_us(fn) for _ in range(3)]
    print(name, out[name], flush=True)
import cProfile, pstats, io
pr = cProfile.Profile(); pr.enable()
for _ in range(100): fp8_quant.quantize_fp8_operands(q, k, v, signs, 128, V_SCALE_FLOOR, kernel="gluon")
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(25); print(s.getvalue()[:6000])
