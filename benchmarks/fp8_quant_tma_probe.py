"""Probe: quantize_fp8_operands with Q and K by TMA against its default launch at 16K x 16 heads, d = 128 (CUDA
graph, us), each launch's bytes compared with the default's; writes $OUT/tma_probe2.json."""
import importlib.util
import json
import os

import torch

from fa_lab.kernels import load_triton

load_triton()
from fa_lab.kernels.hopper import V_SCALE_FLOOR  # noqa: E402
from fa_lab.kernels.hopper.fp8_attention import rotation_signs  # noqa: E402
from fa_lab.kernels.hopper.fp8_quant import quantize_fp8_operands  # noqa: E402

spec = importlib.util.spec_from_file_location("fqb", "benchmarks/fp8_quant_bandwidth.py")
fqb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fqb)
q, k, v = (torch.randn(1, 16, 16384, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
signs = rotation_signs(128, q.device)
target = torch.empty_like(q)
copy = 4 * q.numel() / fqb.graph_ms(lambda: target.copy_(q)) / 1e9
out = {"copy_tbps": copy}
reference = quantize_fp8_operands(q, k, v, signs, 128, V_SCALE_FLOOR)
launches = (("persistent", {}), ("tma", dict(tma=True)), ("tma_w4", dict(tma=True, num_warps=4, maxnreg=None)),
            ("tma_uncapped", dict(tma=True, maxnreg=None)), ("persistent", {}), ("tma", dict(tma=True)))
for name, launch in launches:
    got = quantize_fp8_operands(q, k, v, signs, 128, V_SCALE_FLOOR, **launch)
    same = (all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got[:3], reference[:3]))
            and all(torch.equal(a, b) for a, b in zip(got[3], reference[3])))
    ms = fqb.graph_ms(lambda launch=launch: quantize_fp8_operands(q, k, v, signs, 128, V_SCALE_FLOOR, **launch))
    out[name + ("" if name not in out else "_again")] = {"us": round(ms * 1e3, 1),
                                                         "of_copy": round(9 * q.numel() / ms / 1e9 / copy, 3),
                                                         "bytes_equal_default": same}
    print(name, out, flush=True)
json.dump(out, open(os.path.join(os.environ["OUT"], "tma_probe2.json"), "w"), indent=1)
