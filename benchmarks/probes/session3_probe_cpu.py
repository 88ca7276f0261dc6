import cProfile, pstats, torch, io
from fa_lab.bench_hopper import hopper_fn, fp8_kernel_fn
from fa_lab.kernels.hopper import HopperOptions
fn = hopper_fn(None, HopperOptions())
q, k, v = (torch.randn(1, 1, 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(5): fn(q, k, v, False)
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(200): fn(q, k, v, False)
torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30); print(s.getvalue()[:6000])
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15); print(s.getvalue()[:3000])
