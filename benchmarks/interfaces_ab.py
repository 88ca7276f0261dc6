"""Forward TFLOP/s of the interfaces cases (no_grad API calls, both Triton impls) and of the window case with the
persistent Gluon kernel: the A/B runs of docs/experiments/interfaces.md (benchmarks/h200_interfaces_ab.json).

On the H200: ``PYTHONPATH=. python3 benchmarks/interfaces_ab.py`` (prints, and writes $OUT/interfaces_ab.json).
"""
import json
import os

import torch
import triton

from fa_lab.bench.interfaces import fa_lab_impl, interface_cases
from fa_lab.kernels.hopper import HopperOptions, triton_hopper_attention

CASES = ("varlen", "dense_same_tokens", "softcap", "alibi")


def time_ms(fn) -> float:
    with torch.no_grad():
        return triton.testing.do_bench(fn, warmup=25, rep=100)


def main():
    results = {}
    for case in interface_cases():
        reference = case.case == "mha" and case.lengths[0] == 8192 and not case.causal
        if case.case not in CASES and not reference:
            continue
        for impl in ("triton", "triton_hopper"):
            run, _ = fa_lab_impl(impl)(case)  # the benchmark's own call, timed here without autograd
            ms = time_ms(run)
            results[f"{case.case}/{impl}"] = round(case.flops() / ms / 1e9, 1)
            print(case.case, impl, f"{ms:.3f} ms", results[f"{case.case}/{impl}"], "TFLOP/s", flush=True)
    window = next(case for case in interface_cases() if case.case == "window")
    _, (q, k, v) = fa_lab_impl("triton_hopper")(window)
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
