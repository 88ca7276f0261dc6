"""The backward of a packed batch on the H200: the Gluon FA3 backward (every dQ scheme of DQ_MODES) against the portable
varlen backward and flash-attn-4's (where installed), on chapter 05's varlen lengths (16K tokens in sequences of
128-4096, benchmarks' ``varlen`` case), causal and not, 32 query heads over 32 or 8 K/V heads, bf16, d = 128.
What decides ``GLUON_VARLEN_BACKWARD_AUTO`` in fa_lab/kernels/hopper/attention.py.

Ours are timed as the backward launches alone on the forward's out and LSE; fa4's as ``out.backward(grad)`` on
its own forward's graph (fa_lab.bench.interfaces.time_backward). do_bench medians; TFLOP/s count the visible
pairs of each sequence, 2.5 times the forward's FLOPs.

On the H200: ``PYTHONPATH=. python3 benchmarks/varlen_backward_ab.py $OUT`` writes $OUT/h200_varlen_backward.json
(a log: one entry per case, ms and TFLOP/s per impl).
"""
import functools
import os
import sys
from dataclasses import replace


def main(out_dir: str) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench.interfaces import GQA_HEADS_KV, cu_seqlens, fa4_impl, interface_cases, time_backward
    from fa_lab.bench.schema import environment, write_log
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.attention import DQ_MODES, gluon_varlen_backward, gluon_varlen_forward
    from fa_lab.kernels.portable.attention import NO_OPTIONS, triton_varlen_backward

    load_triton()
    try:
        fa4 = fa4_impl()
    except ImportError:
        fa4 = None
    base = next(case for case in interface_cases() if case.case == "varlen")
    log = {**environment("cuda"), "lengths": list(base.lengths), "cases": []}
    for causal in (False, True):
        for heads_kv in (base.heads, GQA_HEADS_KV):
            case = replace(base, causal=causal, heads_kv=heads_kv)
            total = sum(case.lengths)
            q = torch.randn(total, case.heads, case.head_dim, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(total, heads_kv, case.head_dim, device="cuda", dtype=torch.bfloat16) for _ in "kv")
            grad = torch.randn_like(q)
            cu = cu_seqlens(case.lengths).cuda()
            bounds = (cu.tolist(), cu.tolist())
            scale = case.head_dim ** -0.5
            out, lse = gluon_varlen_forward(q, k, v, cu, cu, bounds, causal, scale, NO_OPTIONS)
            operands = (q, k, v, out, lse, grad, cu, cu, bounds, causal, scale)
            timed = {"portable": functools.partial(triton_varlen_backward, *operands, NO_OPTIONS)}
            timed.update({f"gluon_{mode}": functools.partial(gluon_varlen_backward, *operands, mode)
                          for mode in DQ_MODES})
            entry = {"causal": causal, "heads": case.heads, "heads_kv": heads_kv, "head_dim": case.head_dim,
                     "ms": {}, "bwd_tflops": {}}
            for name, fn in timed.items():
                entry["ms"][name] = do_bench(fn, return_mode="median")
            if fa4 is not None:
                entry["ms"]["fa4"] = time_backward(*fa4(case), do_bench)
            for name, ms in entry["ms"].items():
                entry["bwd_tflops"][name] = round(case.flops(backward=True) / (ms * 1e-3) / 1e12, 1)
            log["cases"].append(entry)
            print(f"causal={causal} heads_kv={heads_kv}: " + ", ".join(
                f"{name} {tflops} TFLOP/s" for name, tflops in entry["bwd_tflops"].items()), flush=True)
            torch.cuda.empty_cache()
    write_log(log, os.path.join(out_dir, "h200_varlen_backward.json"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
