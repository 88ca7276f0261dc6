"""The varlen forward of impl="triton_hopper" through the API against its Gluon launcher fed cu_seqlens as Python
lists (no read of a GPU tensor): how much of a call the host path costs (benchmarks/h200_interfaces_ab.json).

On the H200: ``PYTHONPATH=. python3 benchmarks/varlen_host.py``.
"""
import torch
import triton

from fa_lab.bench.interfaces import HEAD_DIM, cu_seqlens, fa_lab_impl, interface_cases
from fa_lab.kernels.hopper.attention import gluon_varlen_forward
from fa_lab.kernels.portable.attention import NO_OPTIONS

case = next(c for c in interface_cases() if c.case == "varlen")
api_call, (q, k, v) = fa_lab_impl("triton_hopper")(case)  # the benchmark's own call
cu = cu_seqlens(case.lengths).cuda()
bounds = (cu.tolist(), cu.tolist())
with torch.no_grad():
    api = triton.testing.do_bench(api_call)
    launcher = triton.testing.do_bench(lambda: gluon_varlen_forward(q, k, v, cu, cu, bounds, True, HEAD_DIM ** -0.5,
                                                                    NO_OPTIONS))
print(f"varlen api {api:.3f} ms {case.flops() / api / 1e9:.1f} TFLOP/s; launcher on host lists {launcher:.3f} ms "
      f"{case.flops() / launcher / 1e9:.1f} TFLOP/s", flush=True)
