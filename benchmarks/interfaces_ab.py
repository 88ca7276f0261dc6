"""Forward TFLOP/s of the interfaces cases (no_grad API calls, both Triton impls) and of the window case with the
persistent Gluon kernel: the A/B runs of docs/experiments/interfaces.md (benchmarks/h200_interfaces_ab.json).

On the H200: ``PYTHONPATH=. python3 benchmarks/interfaces_ab.py`` (prints, and writes $OUT/interfaces_ab.json).
"""
import json
import os

import torch
import triton

import fa_lab
from fa_lab.bench.interfaces import HEAD_DIM, HEADS, alibi_slopes, cu_seqlens, interface_cases
from fa_lab.kernels.hopper import HopperOptions, triton_hopper_attention

CASES = ("varlen", "dense_same_tokens", "softcap", "alibi")


def time_ms(fn) -> float:
    with torch.no_grad():
        return triton.testing.do_bench(fn, warmup=25, rep=100)


def case_call(case, impl):
    """A no-argument call of the API on fresh inputs for one interfaces case."""
    if case.varlen:
        q = torch.randn(sum(case.lengths), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        cu = cu_seqlens(case.lengths).cuda()
        return lambda: fa_lab.attention_varlen(q, k, v, cu, cu, causal=case.causal, impl=impl)
    q = torch.randn(len(case.lengths), HEADS, case.lengths[0], HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    options = {"softcap": case.softcap} if case.softcap else {}
    if case.alibi:
        options["alibi_slopes"] = alibi_slopes(HEADS).cuda()
    return lambda: fa_lab.attention(q, k, v, causal=case.causal, impl=impl, **options)


def main():
    results = {}
    for case in interface_cases():
        reference = case.case == "mha" and case.lengths[0] == 8192 and not case.causal
        if case.case not in CASES and not reference:
            continue
        for impl in ("triton", "triton_hopper"):
            ms = time_ms(case_call(case, impl))
            results[f"{case.case}/{impl}"] = round(case.flops() / ms / 1e9, 1)
            print(case.case, impl, f"{ms:.3f} ms", results[f"{case.case}/{impl}"], "TFLOP/s", flush=True)
    window = next(case for case in interface_cases() if case.case == "window")
    q = torch.randn(1, HEADS, window.lengths[0], HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    for persistent in (False, True):
        options = HopperOptions(persistent=persistent)
        ms = time_ms(lambda o=options: triton_hopper_attention(q, k, v, window.causal, None, options=o,
                                                               window=window.window))
        results[f"window/{'persistent' if persistent else 'one tile per CTA'} ms"] = round(ms, 3)
        print("window", "persistent" if persistent else "one tile per CTA", f"{ms:.3f} ms", flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "interfaces_ab.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
