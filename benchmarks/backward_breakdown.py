"""Where the backward's time goes, kernel by kernel: ``triton_hopper`` (the Gluon FA3 backward with its zeroed
float32 dQ, its preprocess and dQ's cast) against flash-attn-4's, at the interfaces benchmark's MHA shapes (32
heads, d = 128, 16K tokens in all) without a mask and the grouped-query and MHA shapes at 16K causal, and at the
FA3-paper protocol's 16 heads at 16K. Each case: the backward's do_bench median (ms, and TFLOP/s), then every
kernel's time per call (``fa_lab.bench.breakdown.kernel_times``), so that the main kernel's time can be told
apart from the passes around it.

On the device: ``PYTHONPATH=. python3 benchmarks/backward_breakdown.py OUT [impl ...]`` writes
OUT/backward_breakdown.json (committed as <h100|h200>_backward_breakdown.json; `run_device.sh backward-breakdown`,
flash-attn-4 installed first as for interfaces). impls: triton_hopper and fa4 (the default, both).
"""
import json
import os
import sys


def cases():
    from fa_lab.bench.interfaces import GQA_HEADS_KV, TOKENS, InterfaceCase

    mha = [InterfaceCase("mha", (n,) * (TOKENS // n)) for n in (2048, 4096, 8192, 16384)]
    return mha + [InterfaceCase("gqa", (16384,), True, heads_kv=GQA_HEADS_KV),
                  InterfaceCase("mha", (16384,), True),
                  InterfaceCase("protocol", (16384,), heads=16, heads_kv=16)]


def main(out_dir: str, impl_names=("triton_hopper", "fa4")) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench.breakdown import backward_call, format_breakdown, kernel_times
    from fa_lab.bench.interfaces import make_impls, time_backward
    from fa_lab.bench.schema import environment

    impls = make_impls(impl_names)
    log = {**environment("cuda"), "cases": []}
    for case in cases():
        for name, prepare in impls.items():
            run, leaves = prepare(case)
            backward_ms = time_backward(run, leaves, do_bench)
            times = kernel_times(backward_call(run, leaves), repeats=10)
            entry = {"impl": name, "case": case.case, "seqlen": case.lengths[0], "batch": len(case.lengths),
                     "heads": case.heads, "heads_kv": case.heads_kv, "causal": case.causal,
                     "bwd_ms": backward_ms, "bwd_tflops": case.flops(backward=True) / (backward_ms * 1e-3) / 1e12,
                     "kernels": [{"name": kernel[:120], "ms": micros / 1000} for kernel, micros, _ in times]}
            log["cases"].append(entry)
            title = (f"{name} {case.case} N={case.lengths[0]} x{len(case.lengths)} heads {case.heads}/{case.heads_kv}"
                     f" causal={case.causal}: backward {backward_ms:.3f} ms ({entry['bwd_tflops']:.1f} TFLOP/s)")
            print(format_breakdown(title, times, top=6), flush=True)
            del run, leaves
            torch.cuda.empty_cache()
        with open(os.path.join(out_dir, "backward_breakdown.json"), "w") as f:
            json.dump(log, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2:]) or ("triton_hopper", "fa4"))
