"""Probe: where the persistent FP8 quantization's time goes at 16K x 16 heads, d = 128 (CUDA graph, us)."""
import json
import os

import torch
import triton

from fa_lab.kernels import load_triton
from fa_lab.kernels.hopper import V_SCALE_FLOOR
from fa_lab.fp8 import hadamard_transform
from fa_lab.kernels.hopper.fp8_attention import rotation_signs

load_triton()
from fa_lab.kernels.hopper.fp8_quant import quantize_fp8_operands  # noqa: E402
import importlib.util, sys  # noqa: E402
spec = importlib.util.spec_from_file_location("fqb", "benchmarks/fp8_quant_bandwidth.py")
fqb = importlib.util.module_from_spec(spec); spec.loader.exec_module(fqb)

q, k, v = (torch.randn(1, 16, 16384, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
signs = rotation_signs(128, q.device)
sms = torch.cuda.get_device_properties(0).multi_processor_count
moved = 3 * q.numel() * 3
target = torch.empty_like(q)
out = {"copy_tbps": 2 * q.numel() * 2 / fqb.graph_ms(lambda: target.copy_(q)) / 1e9}
H = hadamard_transform(torch.eye(128, dtype=torch.float64, device="cuda")) * 128 ** 0.5
matrix = (signs.double()[:, None] * H).to(torch.bfloat16)
cases = {
    "tile_w8": dict(num_warps=8),
    "tile_w8_norotate": dict(num_warps=8, signs=None),
    **{f"p2_w8_r128_s1_order{order}": dict(num_warps=8, maxnreg=128, programs=2 * sms, stages=1, order=order)
       for order in range(4)},
    "p2_w8_r128_s2_order2": dict(num_warps=8, maxnreg=128, programs=2 * sms, stages=2, order=2),
    "p2_w8_r168_s1_order2": dict(num_warps=8, maxnreg=168, programs=2 * sms, stages=1, order=2),
    "p1_w8_s1_order2": dict(num_warps=8, programs=sms, stages=1, order=2),
    "p2_w8_r128_s1_order3_matrix": dict(num_warps=8, maxnreg=128, programs=2 * sms, stages=1, order=3, signs=matrix),
}
for name, c in cases.items():
    c = dict(c)
    s = c.pop("signs", signs)
    try:
        ms = fqb.graph_ms(lambda: quantize_fp8_operands(q, k, v, s, 128, V_SCALE_FLOOR, **c))
        out[name] = {"us": round(ms * 1e3, 1), "of_copy": round(moved / ms / 1e9 / out["copy_tbps"], 3)}
    except Exception as e:  # noqa: BLE001
        out[name] = repr(e)[:300]
    print(name, out[name], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "fp8_quant_probe.json"), "w"), indent=1)
