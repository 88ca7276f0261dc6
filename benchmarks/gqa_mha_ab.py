"""Grouped-query attention (32 query heads over 8 K/V heads) against MHA (32 heads), ``triton_hopper`` forward and
backward, the interfaces benchmark's own calls (fa_lab.bench.interfaces) at its 8 shapes, the two layouts timed in
turn for three rounds; medians and the GQA / MHA ratio of the medians per shape (docs/experiments/interfaces.md).

On the H200: ``PYTHONPATH=. python3 benchmarks/gqa_mha_ab.py`` (prints, and writes $OUT/gqa_mha_ab.json).
"""
import os
import statistics

import torch
from triton.testing import do_bench

from fa_lab.bench.interfaces import fa_lab_impl, interface_cases, time_forward_backward
from fa_lab.bench.schema import environment, write_log

ROUNDS = 3


def main():
    cases = [case for case in interface_cases() if case.case in ("mha", "gqa")]
    results = {**environment("cuda"), "what": __doc__.split("\n\n")[0].replace("\n", " "), "shapes": []}
    for seqlen, causal in sorted({(case.lengths[0], case.causal) for case in cases}):
        pair = {case.case: case for case in cases if case.lengths[0] == seqlen and case.causal == causal}
        prepared = {name: fa_lab_impl("triton_hopper")(case) for name, case in pair.items()}
        times = {name: {"fwd_ms": [], "bwd_ms": []} for name in pair}
        for _ in range(ROUNDS):
            for name, (run, leaves) in prepared.items():
                fwd, bwd = time_forward_backward(run, leaves, do_bench)
                times[name]["fwd_ms"].append(round(fwd, 4))
                times[name]["bwd_ms"].append(round(bwd, 4))
        row = {"seqlen": seqlen, "causal": causal}
        for name, case in pair.items():
            fwd, bwd = (statistics.median(times[name][key]) for key in ("fwd_ms", "bwd_ms"))
            row[name] = {**times[name], "fwd_tflops": round(case.flops() / fwd / 1e9, 1),
                         "bwd_tflops": round(case.flops(backward=True) / bwd / 1e9, 1)}
        row["gqa_over_mha"] = {key: round(row["gqa"][key] / row["mha"][key], 3) for key in ("fwd_tflops", "bwd_tflops")}
        results["shapes"].append(row)
        print(seqlen, causal, row["mha"]["fwd_tflops"], row["gqa"]["fwd_tflops"], row["gqa_over_mha"], flush=True)
        del prepared
        torch.cuda.empty_cache()
    write_log(results, os.path.join(os.environ.get("OUT", "."), "gqa_mha_ab.json"))


if __name__ == "__main__":
    main()
