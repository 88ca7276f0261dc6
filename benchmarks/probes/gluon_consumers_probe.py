"""Device probe (session 2): Gluon variants incl. 3 consumer warpgroups, bf16 and FP8, at d=128 8K/16K.

Run on the device with PYTHONPATH=. ; wrote gluon_consumers_probe.json (commit 3d96ef4, before the FP8 key order)."""
import json, os, torch
import fa_lab
from fa_lab.bench_gpu import time_fwd_bwd
from fa_lab.iomodel import AttentionShape, attention_flops
from fa_lab.kernels.hopper import HopperOptions, triton_hopper_attention, quantize_for_kernel, fp8_forward, GLUON_TILES, triton_hopper_fp8_attention
from fa_lab.testing import check_attention, make_qkv
from fa_lab.fp8 import rmse
from fa_lab.reference import reference_attention
g = torch.Generator().manual_seed(1)
def fp8_fn(opt):
    cache = {}
    def run(q, k, v, causal):
        key = tuple((t.data_ptr(), t.shape) for t in (q, k, v))
        if key not in cache:
            cache.clear(); cache[key] = quantize_for_kernel(q, k, v, GLUON_TILES, True)
        q8, k8, vt8, ds = cache[key]
        return fp8_forward(q8, k8, vt8, ds, k.shape[2], causal, q.shape[-1] ** -0.5, GLUON_TILES, q.dtype, q.shape[-1], opt)[0]
    return run
def bf(opt):
    return lambda q, k, v, c: triton_hopper_attention(q, k, v, c, None, options=opt)[0]
variants = {"s2": HopperOptions(stages=2), "s3": HopperOptions(stages=3), "s2_pp": HopperOptions(stages=2, pingpong=True),
            "c3_s2": HopperOptions(consumers=3, stages=2), "c3_s2_pp": HopperOptions(consumers=3, stages=2, pingpong=True)}
res = []
for d, causal, n in [(128, False, 8192), (128, True, 8192), (128, False, 16384)]:
    shape = AttentionShape(16384 // n, 2048 // d, n, d, causal=causal, dtype="bf16")
    for vname, opt in variants.items():
        for kind, fn in (("bf16", bf(opt)), ("fp8", fp8_fn(opt))):
            if kind == "bf16" and opt.consumers == 3 and opt.stages > 2: continue
            try:
                ms = time_fwd_bwd(fn, shape, backward=False)[0]; tf = attention_flops(shape) / (ms * 1e-3) / 1e12
            except Exception as e:
                tf = None; print(kind, vname, repr(e)[:300])
            print(f"d={d} causal={causal} N={n} {kind} {vname}: {tf}", flush=True)
            res.append(dict(d=d, causal=causal, n=n, kind=kind, variant=vname, fwd_tflops=tf))
            json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe4.json"), "w"), indent=1)
