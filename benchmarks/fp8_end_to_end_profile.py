# ruff: noqa
"""Probe (run once on the H200 with PYTHONPATH=. OUT=dir): see docs/experiments/hopper_forward.md, "FP8 end to end as one call"."""
import cProfile, pstats, io, os, torch
from fa_lab.kernels import load_triton
from fa_lab.kernels.hopper import triton_hopper_fp8_attention
load_triton()
q, k, v = (torch.randn(8, 16, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(5): triton_hopper_fp8_attention(q, k, v, True, None)
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(200): triton_hopper_fp8_attention(q, k, v, True, None)
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
s2 = io.StringIO(); pstats.Stats(pr, stream=s2).sort_stats("tottime").print_stats(25)
open(os.path.join(os.environ["OUT"], "e2e_profile.txt"), "w").write(s.getvalue() + "\n\n" + s2.getvalue())
print(s2.getvalue()[-6000:])
