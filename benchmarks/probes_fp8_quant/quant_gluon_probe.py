"""Probe: the Gluon quantization (Q/K prefetched through TMA slots) against the shipped Triton kernel."""
import json, os, importlib.util, traceback
import torch
from fa_lab.kernels import load_triton
load_triton()
spec = importlib.util.spec_from_file_location("fqb", "benchmarks/fp8_quant_bandwidth.py"); fqb = importlib.util.module_from_spec(spec); spec.loader.exec_module(fqb)
spec = importlib.util.spec_from_file_location("fa_lab.kernels.hopper._fp8_quant_gluon", ".device/fp8_quant_gluon.py")
gq = importlib.util.module_from_spec(spec); spec.loader.exec_module(gq)
from fa_lab.kernels.hopper import V_SCALE_FLOOR
from fa_lab.kernels.hopper.fp8_attention import rotation_signs
from fa_lab.kernels.hopper.fp8_quant import quantize_fp8_operands
sms = torch.cuda.get_device_properties(0).multi_processor_count
out = {}
for seqlen in (16384, 2048, 1000, 333):
    batch = max(1, 16384 // seqlen)
    q, k, v = (torch.randn(batch, 16, seqlen, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    signs = rotation_signs(128, q.device)
    t = torch.empty_like(q); copy = 4 * q.numel() / fqb.graph_ms(lambda: t.copy_(q)) / 1e9
    ref = quantize_fp8_operands(q, k, v, signs, 128, V_SCALE_FLOOR)
    variants = {"shipped": (quantize_fp8_operands, {}),
                "gluon_1slot": (gq.quantize_fp8_operands, dict(slots=1)),
                "all_mma": (gq.quantize_all_mma, {}),
                "all_mma_uncapped": (gq.quantize_all_mma, dict(maxnreg=None))}
    row = {"copy_tbps": round(copy, 2)}
    for name, (fn, kw) in variants.items():
        try:
            got = fn(q, k, v, signs, 128, V_SCALE_FLOOR, **kw)
            eq = [torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got[:3], ref[:3])] + [torch.equal(a, b) for a, b in zip(got[3], ref[3])]
            row[name] = {"equal_shipped": eq, "us": []}
            if "SKIP_V" in kw or "SKIP_QK" in kw:
                row[name].pop("equal_shipped")
            elif not all(eq):
                d = [(a.float() - b.float()).abs().max().item() for a, b in zip(got[:3], ref[:3])]
                row[name]["max_diff"] = d
        except Exception:
            row[name] = {"error": traceback.format_exc()[-1500:]}
            print(name, row[name]["error"], flush=True)
    if seqlen not in (1000, 333):
        for _ in range(3):
            for name, (fn, kw) in variants.items():
                if "error" in row[name]:
                    continue
                ms = fqb.graph_ms(lambda: fn(q, k, v, signs, 128, V_SCALE_FLOOR, **kw))
                row[name]["us"].append(round(ms * 1e3, 1))
        for name in variants:
            if row[name].get("us"):
                med = sorted(row[name]["us"])[1]
                row[name]["of_copy"] = round(9 * q.numel() / (med / 1e6) / 1e12 / copy, 3)
    out[seqlen] = row
    print(seqlen, json.dumps(row), flush=True)
json.dump(out, open(os.path.join(os.environ["OUT"], "quant_gluon.json"), "w"), indent=1)
