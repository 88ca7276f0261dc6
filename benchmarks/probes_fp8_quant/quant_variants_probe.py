"""Probe: FP8 quantization variants (TMA store vs threads' store for Q/K; V by a 5-D TMA view) against the shipped
kernel, CUDA-graph GPU time, three interleaved rounds, bytes compared with the shipped kernel's."""
import json, os, importlib.util
import torch
from fa_lab.kernels import load_triton
load_triton()
spec = importlib.util.spec_from_file_location("fqb", "benchmarks/fp8_quant_bandwidth.py"); fqb = importlib.util.module_from_spec(spec); spec.loader.exec_module(fqb)
spec = importlib.util.spec_from_file_location("fa_lab.kernels.hopper._fp8_quant_variants", ".device/fp8_quant_variants.py")
var = importlib.util.module_from_spec(spec); spec.loader.exec_module(var)
from fa_lab.kernels.hopper import V_SCALE_FLOOR
from fa_lab.kernels.hopper.fp8_attention import rotation_signs
from fa_lab.kernels.hopper.fp8_quant import quantize_fp8_operands
out = {}
sms = torch.cuda.get_device_properties(0).multi_processor_count
for seqlen in (16384,):
    batch = 16384 // seqlen
    q, k, v = (torch.randn(batch, 16, seqlen, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    signs = rotation_signs(128, q.device)
    t = torch.empty_like(q); copy = 4 * q.numel() / fqb.graph_ms(lambda: t.copy_(q)) / 1e9
    ref = quantize_fp8_operands(q, k, v, signs, 128, V_SCALE_FLOOR)
    variants = {"shipped": (quantize_fp8_operands, {}),
                "thread_store": (var.quantize_fp8_operands, dict(tma_store=False)),
                "thread_store_2stages": (var.quantize_fp8_operands, dict(tma_store=False, stages=2)),
                "thread_store_2stages_1_per_sm": (var.quantize_fp8_operands, dict(tma_store=False, stages=2, programs=sms)),
                "thread_store_1stage_1_per_sm": (var.quantize_fp8_operands, dict(tma_store=False, programs=sms)),
                "tma_store_2stages": (var.quantize_fp8_operands, dict(stages=2)),
                "thread_store_2stages_3_per_sm": (var.quantize_fp8_operands, dict(tma_store=False, stages=2, programs=3 * sms))}
    row = {"copy_tbps": round(copy, 2)}
    for name, (fn, kw) in variants.items():
        try:
            got = fn(q, k, v, signs, 128, V_SCALE_FLOOR, **kw)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got[:3], ref[:3])) and all(torch.equal(a, b) for a, b in zip(got[3], ref[3]))
            row[name] = {"bytes_equal_shipped": same, "us": []}
        except Exception as e:
            row[name] = {"error": repr(e)[:500]}
            print(name, "ERROR", repr(e)[:2000], flush=True)
    for _ in range(3):
        for name, (fn, kw) in variants.items():
            if "error" in row[name]:
                continue
            ms = fqb.graph_ms(lambda: fn(q, k, v, signs, 128, V_SCALE_FLOOR, **kw))
            row[name]["us"].append(round(ms * 1e3, 1))
    for name in variants:
        if "us" in row[name]:
            med = sorted(row[name]["us"])[1]
            row[name]["of_copy"] = round(9 * q.numel() / (med / 1e6) / 1e12 / copy, 3)
    out[seqlen] = row
    print(seqlen, json.dumps(row), flush=True)
json.dump(out, open(os.path.join(os.environ["OUT"], "quant_variants.json"), "w"), indent=1)
