"""A switch of the Gluon FA3 forward off and on, timed in turn: ``split_loops`` (each consumer's K/V steps in one loop
against three, one per kind of mask, flash-attn-4's structure) or ``rescale_early`` (O rescaled just before the next
P V product against at the end of the step, flash-attn-4's place). On the FA3-paper shapes (16K tokens, hidden 2048,
bf16, d = 64 and 128, causal and not, 1K-16K) and chapter 05's window (1024, 0) at 16K (d = 128, TFLOP/s counted on
the pairs inside the band) and soft cap 30 at 8K (d = 128; h200_split_loops.json predates this case), the forward
alone, three rounds (do_bench medians, TFLOP/s). Each shape first checks that both give the same O and lse bit for
bit.

On the H200: ``PYTHONPATH=. python3 benchmarks/forward_switch_ab.py $OUT`` writes $OUT/h200_split_loops.json (a log);
``... forward_switch_ab.py $OUT --fp8`` times the FP8 kernel alone (its default, persistent, on operands quantized once)
the same way, d = 128 and 64, 4K-16K, into $OUT/h200_split_loops_fp8.json; ``--switch rescale_early`` times that
switch instead (h200_rescale_early.json, h200_rescale_early_fp8.json), the other switches at their defaults. On an
H100 the files are named h100_*.
"""
import argparse
import dataclasses
import functools
import os

ROUNDS = 3
WINDOW = (1024, 0)
SOFTCAP = 30.0  # chapter 05's soft-cap case (d = 128, 8K, no mask)
RUN_NAMES = {"split_loops": ("one_loop", "split_loops"), "rescale_early": ("rescale_late", "rescale_early")}  # off, on


def main(out_dir: str, fp8: bool = False, switch: str = "split_loops") -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench.gpu import protocol_shapes, random_inputs
    from fa_lab.bench.hopper import HOPPER_SEQLENS
    from fa_lab.bench.schema import device_prefix, environment, write_log
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
            return lambda q, k, v, causal, window, softcap: (kernel(q, k, v, causal),)

        base = FP8_OPTIONS
        cases = [(shape, (-1, -1), 0.0) for shape in protocol_shapes((4096, 8192, 16384), (128, 64))]
    else:
        def make_run(options):  # O and lse
            return lambda q, k, v, causal, window, softcap: triton_hopper_attention(
                q, k, v, causal, None, options=options, window=window, softcap=softcap)

        base = HopperOptions()
        cases = [(shape, (-1, -1), 0.0) for shape in protocol_shapes(HOPPER_SEQLENS, (64, 128))]
        cases.append((AttentionShape(1, 32, 16384, 128, causal=False, dtype="bf16"), WINDOW, 0.0))
        cases.append((AttentionShape(2, 16, 8192, 128, causal=False, dtype="bf16"), (-1, -1), SOFTCAP))
    runs = {name: make_run(dataclasses.replace(base, **{switch: flag}))
            for name, flag in zip(RUN_NAMES[switch], (False, True))}
    prefix = device_prefix(environment("cuda")["device"])
    out_path = os.path.join(out_dir, f"{prefix}_{switch}{'_fp8' if fp8 else ''}.json")
    log = []
    for shape, window, softcap in cases:
        q, k, v = random_inputs(shape, requires_grad=False)
        if window == (-1, -1):
            flops = attention_flops(shape, "fwd")
        else:
            visible = BlockInfo(shape.seqlen_q, shape.seqlen_k, shape.causal, window).visible_pairs()
            flops = 4.0 * shape.batch * shape.heads * shape.head_dim * visible
        entry = {"head_dim": shape.head_dim, "causal": shape.causal, "seqlen": shape.seqlen_q, "window": window,
                 "softcap": softcap}
        with torch.no_grad():
            calls = {name: functools.partial(run, q, k, v, shape.causal, window, softcap)
                     for name, run in runs.items()}
            off, on = (call() for call in calls.values())
            entry["same_bits"] = all(torch.equal(a, b) for a, b in zip(off, on))
            for _round in range(ROUNDS):
                for name, call in calls.items():
                    ms = do_bench(call, return_mode="median")
                    entry.setdefault(name, []).append(round(flops / ms * 1e-9, 1))
        log.append(entry)
        print(entry, flush=True)
        write_log({**environment("cuda"), "log": log}, out_path)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--fp8", action="store_true", help="the FP8 kernel alone, d = 128 and 64, 4K-16K")
    parser.add_argument("--switch", choices=sorted(RUN_NAMES), default="split_loops")
    args = parser.parse_args()
    main(args.out_dir, fp8=args.fp8, switch=args.switch)
