"""The bf16 Gluon FA3 forward with each consumer's K/V steps in one loop (the default) against three loops, one per
kind of mask (``HopperOptions(split_loops=True)``, flash-attn-4's structure), on the FA3-paper shapes (16K tokens,
hidden 2048, bf16, d = 64 and 128, causal and not, 1K-16K) and chapter 05's window (1024, 0) at 16K (d = 128,
TFLOP/s counted on the pairs inside the band), the forward alone, the two timed in turn, three rounds (do_bench
medians, TFLOP/s). Each shape first checks that both give the same O and lse bit for bit.

On the H200: ``PYTHONPATH=. python3 benchmarks/split_loops_ab.py $OUT`` writes $OUT/h200_split_loops.json (a log);
``... split_loops_ab.py $OUT --fp8`` times the FP8 kernel alone (its default, persistent, on operands quantized once)
the same way, d = 128 and 64, 4K-16K, into $OUT/h200_split_loops_fp8.json.
"""
import dataclasses
import functools
import os
import sys

ROUNDS = 3
WINDOW = (1024, 0)


def main(out_dir: str, fp8: bool = False) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench.gpu import protocol_shapes, random_inputs
    from fa_lab.bench.hopper import HOPPER_SEQLENS
    from fa_lab.bench.schema import environment, write_log
    from fa_lab.block_info import BlockInfo
    from fa_lab.iomodel import AttentionShape, attention_flops
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.attention import HopperOptions, triton_hopper_attention

    load_triton()
    if fp8:
        from fa_lab.bench.hopper import fp8_kernel_fn
        from fa_lab.kernels.hopper.attention import FP8_OPTIONS

        def make_run(options):  # the kernel's O alone, on operands quantized once
            kernel = fp8_kernel_fn(None, options)
            return lambda q, k, v, causal, window: (kernel(q, k, v, causal),)

        base = FP8_OPTIONS
        cases = [(shape, (-1, -1)) for shape in protocol_shapes((4096, 8192, 16384), (128, 64))]
    else:
        def make_run(options):  # O and lse
            return lambda q, k, v, causal, window: triton_hopper_attention(q, k, v, causal, None, options=options,
                                                                           window=window)

        base = HopperOptions()
        cases = [(shape, (-1, -1)) for shape in protocol_shapes(HOPPER_SEQLENS, (64, 128))]
        cases.append((AttentionShape(1, 32, 16384, 128, causal=False, dtype="bf16"), WINDOW))
    runs = {name: make_run(dataclasses.replace(base, split_loops=flag))
            for name, flag in (("one_loop", False), ("split_loops", True))}
    out_path = os.path.join(out_dir, "h200_split_loops_fp8.json" if fp8 else "h200_split_loops.json")
    log = []
    for shape, window in cases:
        q, k, v = random_inputs(shape, requires_grad=False)
        if window == (-1, -1):
            flops = attention_flops(shape, "fwd")
        else:
            visible = BlockInfo(shape.seqlen_q, shape.seqlen_k, shape.causal, window).visible_pairs()
            flops = 4.0 * shape.batch * shape.heads * shape.head_dim * visible
        entry = {"head_dim": shape.head_dim, "causal": shape.causal, "seqlen": shape.seqlen_q, "window": window}
        with torch.no_grad():
            calls = {name: functools.partial(run, q, k, v, shape.causal, window) for name, run in runs.items()}
            one, split = (call() for call in calls.values())
            entry["same_bits"] = all(torch.equal(a, b) for a, b in zip(one, split))
            for _round in range(ROUNDS):
                for name, call in calls.items():
                    ms = do_bench(call, return_mode="median")
                    entry.setdefault(name, []).append(round(flops / ms * 1e-9, 1))
        log.append(entry)
        print(entry, flush=True)
        write_log({**environment("cuda"), "log": log}, out_path)

if __name__ == "__main__":
    main(sys.argv[1], fp8=sys.argv[2:] == ["--fp8"])
