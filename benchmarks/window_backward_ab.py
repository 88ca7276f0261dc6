"""A sliding window's backward on the Gluon FA3 kernel against the portable one it used to fall back to
(``HopperOptions(backward="gluon")`` against ``backward="triton"``, impl="triton_hopper"): the interfaces benchmark's
window (1024, 0) at 16K (32 heads, d = 128) and NSA's window branch (511, 0), causal, at 64K (64 query heads over 4
K/V heads, d = 128), both in turn for two rounds (do_bench medians of the backward alone, ms, and TFLOP/s counted
inside the band), with the two backwards' largest gradient difference.

On the device: ``PYTHONPATH=. python3 benchmarks/window_backward_ab.py $OUT`` writes $OUT/window_backward_ab.json
(a log; committed as <h100|h200>_window_backward_ab.json; `run_device.sh window-backward`).
"""
import os
import sys


def cases():
    from fa_lab.bench.interfaces import WINDOW, WINDOW_SEQLEN, InterfaceCase

    return [InterfaceCase("window", (WINDOW_SEQLEN,), window=WINDOW),
            InterfaceCase("nsa_window", (65536,), causal=True, heads=64, heads_kv=4, window=(511, 0))]


def both_ways(case) -> dict:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench.interfaces import _tensors, time_backward
    from fa_lab.kernels.hopper.attention import HopperOptions, triton_hopper_attention

    leaves = _tensors(case, token_major=False)  # (1, heads, N, d) bf16 leaves, as the interfaces benchmark's
    grad = torch.randn(leaves[0].shape, device="cuda", dtype=torch.bfloat16)
    entry = {"case": case.case, "seqlen": case.lengths[0], "heads": case.heads, "heads_kv": case.heads_kv,
             "causal": case.causal, "window": list(case.window)}
    runs, grads = {}, {}
    for backward in ("gluon", "triton"):
        options = HopperOptions(backward=backward)
        runs[backward] = (lambda options=options: triton_hopper_attention(*leaves, case.causal, None, options=options,
                                                                         window=case.window)[0])
        grads[backward] = torch.autograd.grad(runs[backward](), leaves, grad)
    entry["largest gradient difference"] = max(float((a.float() - b.float()).abs().max())
                                               for a, b in zip(grads["gluon"], grads["triton"]))
    flops = case.flops(backward=True)
    for _round in (1, 2):
        for backward, run in runs.items():
            ms = time_backward(run, leaves, do_bench)
            entry.setdefault(f"{backward} backward ms", []).append(round(ms, 3))
            entry.setdefault(f"{backward} backward TFLOP/s", []).append(round(flops / (ms * 1e-3) / 1e12, 1))
    return entry


def main(out_dir: str) -> None:
    import torch

    from fa_lab.bench.schema import environment, write_log
    from fa_lab.kernels import load_triton

    load_triton()
    log = []
    for case in cases():
        log.append(both_ways(case))
        print(log[-1], flush=True)
        write_log({**environment("cuda"), "log": log}, os.path.join(out_dir, "window_backward_ab.json"))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
