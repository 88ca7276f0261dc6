"""Persistent Gluon kernel probe: correctness against SDPA in float32, then interleaved timings.

Usage: PYTHONPATH=. python benchmarks/probes/session4_persistent_probe.py OUT.jsonl [variants...]
Prints and appends JSON lines. Variants: bf16, bf16_p, fp8, fp8_p (``_p``: HopperOptions(persistent=True)),
fp8_p_global (the LPT order over all heads at once), fp8_p_rr (a round robin in head order).
"""
import dataclasses
import json
import statistics
import sys

import torch

from fa_lab.bench_gpu import time_fwd_bwd
from fa_lab.bench_hopper import fp8_kernel_fn, hopper_fn
from fa_lab.iomodel import AttentionShape, attention_flops
from fa_lab.kernels import hopper, tile_schedule
from fa_lab.kernels.hopper import FP8_OPTIONS, HopperOptions

out_path = sys.argv[1]
wanted = sys.argv[2:] or ["bf16", "bf16_p", "fp8", "fp8_p"]
bf16_options, fp8_options = HopperOptions(), FP8_OPTIONS
variants = {
    "bf16": hopper_fn(None, bf16_options),
    "bf16_p": hopper_fn(None, dataclasses.replace(bf16_options, persistent=True)),
    "fp8": fp8_kernel_fn(None, fp8_options),
    "fp8_p": fp8_kernel_fn(None, dataclasses.replace(fp8_options, persistent=True)),
}

# Schedule policies, switched per call (each keeps its own cache of schedules).
policy = {"name": "grouped"}
schedules = {}


def scheduled(*args):
    key = (policy["name"],) + args
    if key not in schedules:
        batch_heads, seqlen_q, seqlen_k, block_m, block_n, causal, ctas, device = args
        if policy["name"] == "grouped":
            schedules[key] = tile_schedule.schedule_tensor(*args)
        elif policy["name"] == "global":
            groups = tile_schedule.head_groups
            tile_schedule.head_groups = lambda batch_heads, m_tiles, ctas: [range(batch_heads)]
            schedules[key] = tile_schedule.schedule_tensor.__wrapped__(*args)
            tile_schedule.head_groups = groups
        else:  # round robin in head order
            m_tiles = -(-seqlen_q // block_m)
            tiles = list(range(batch_heads * m_tiles))
            plan = [tiles[cta::ctas] for cta in range(ctas)]
            offsets = [0]
            for p in plan:
                offsets.append(offsets[-1] + len(p))
            schedules[key] = torch.tensor(offsets + [t for p in plan for t in p], dtype=torch.int32, device=device)
    return schedules[key]


hopper.schedule_tensor = scheduled


def with_policy(name, fn):
    def run(*args):
        policy["name"] = name
        return fn(*args)
    return run


variants["fp8_p_global"] = with_policy("global", variants["fp8_p"])
variants["fp8_p_rr"] = with_policy("rr", variants["fp8_p"])
variants["fp8_p"] = with_policy("grouped", variants["fp8_p"])
variants = {name: variants[name] for name in wanted}


def emit(**row):
    line = json.dumps(row)
    print(line, flush=True)
    with open(out_path, "a") as file:
        file.write(line + "\n")


# Correctness: shapes with more work tiles than SMs (so persistent CTAs loop), ragged lengths, d = 64.
checks = [(4, 16, 2000, 2000, 64), (2, 16, 4096, 4096, 128), (3, 5, 1000, 1500, 128), (1, 2, 300, 300, 128),
          (1, 3, 700, 300, 128)]
for batch, heads, nq, nk, d in checks:
    for causal in (False, True):
        q = torch.randn(batch, heads, nq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, heads, nk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        mask = None
        if causal:  # bottom-right alignment, as the kernel
            mask = torch.ones(nq, nk, dtype=torch.bool, device="cuda").tril(nk - nq)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        ref = torch.nan_to_num(ref)  # rows that see no key: SDPA gives NaN, the kernels 0
        for name, fn in variants.items():
            out = fn(q, k, v, causal).float()
            emit(check=[batch, heads, nq, nk, d], causal=causal, impl=name,
                 max_err=(out - ref).abs().max().item(), rmse=(out - ref).pow(2).mean().sqrt().item())
torch.cuda.synchronize()

for n, causal in [(4096, True), (8192, True), (4096, False), (8192, False), (2048, True), (16384, True)]:
    shape = AttentionShape(16384 // n, 16, n, 128, causal=causal, dtype="bf16")
    flops = attention_flops(shape)
    runs = {name: [] for name in variants}
    for _ in range(3):  # interleaved, so that clock drift hits every variant alike
        for name, fn in variants.items():
            runs[name].append(flops / time_fwd_bwd(fn, shape, backward=False)[0] / 1e9)
    for name, tflops in runs.items():
        emit(n=n, causal=causal, impl=name, tflops=statistics.median(tflops), runs=tflops)
