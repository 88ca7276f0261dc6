"""The Gluon forward with 0, 1 and 2 of every four exponentials taken off the MUFU (``HopperOptions.exp2_on_fma``:
a polynomial on the FMA units, :func:`fa_lab.kernels.hopper.fa3_softmax.exp2_mixed`), timed in turn.

The MUFU computes 16 results a clock an SM. At d = 128 in bf16 a K/V step's exponentials take it about half as long
as the step's two WGMMAs; a soft cap adds a tanh per score (as long again), d = 64 halves the WGMMAs and FP8 halves
them again: there the MUFU, not the tensor cores, sets the pace. Cases (bf16 unless said, batch x heads = 16K tokens
x 2048 / d, as the FA3 protocol): d = 128 at 8K and 16K, d = 64 at 8K, the soft cap 30 at 8K (chapter 05's case),
and the FP8 kernel alone at 16K (operands quantized once), causal and not. Each variant's O is compared with the
MUFU-only one's (largest difference) before three rounds of do_bench medians in turn (ms, and TFLOP/s of the
medians).

On the device: ``PYTHONPATH=. python3 benchmarks/exp2_on_fma_ab.py $OUT [--rounds N]`` writes
$OUT/<h100|h200>_exp2_on_fma.json.
"""
import argparse
import functools
import os
import statistics
from dataclasses import replace

ON_FMA = (0, 1, 2)
ROUNDS = 3
CASES = [  # (name, head_dim, seqlen, causal, softcap, fp8)
    ("d128 8K", 128, 8192, False, 0.0, False), ("d128 8K", 128, 8192, True, 0.0, False),
    ("d128 16K", 128, 16384, False, 0.0, False),
    ("d64 8K", 64, 8192, False, 0.0, False), ("d64 8K", 64, 8192, True, 0.0, False),
    ("softcap 30 d128 8K", 128, 8192, False, 30.0, False), ("softcap 30 d128 8K", 128, 8192, True, 30.0, False),
    ("fp8 kernel d128 16K", 128, 16384, False, 0.0, True), ("fp8 kernel d128 16K", 128, 16384, True, 0.0, True),
]


def calls_for(head_dim, seqlen, causal, softcap, fp8):
    """(name -> call of the forward at each ON_FMA, on fresh random bf16 inputs, FP8 quantized once; batch x heads)."""
    import torch

    from fa_lab.kernels.hopper import FP8_OPTIONS, GLUON_TILES, HopperOptions, triton_hopper_attention
    from fa_lab.kernels.hopper.fp8_attention import fp8_forward, quantize_for_kernel

    heads = 2048 // head_dim
    batch = 16384 // seqlen
    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if fp8:
        with torch.no_grad():
            operands = quantize_for_kernel(q, k, v, GLUON_TILES, True, gluon=True)
        return {f"on_fma{n}": functools.partial(fp8_forward, *operands, causal, head_dim ** -0.5, GLUON_TILES,
                                                torch.bfloat16, head_dim, replace(FP8_OPTIONS, exp2_on_fma=n))
                for n in ON_FMA}, batch * heads
    given = dict(softcap=softcap) if softcap else {}
    return {f"on_fma{n}": functools.partial(triton_hopper_attention, q, k, v, causal, None,
                                            options=HopperOptions(exp2_on_fma=n), **given)
            for n in ON_FMA}, batch * heads


def main(out_dir: str, rounds: int = ROUNDS) -> None:
    import torch

    from fa_lab.bench.in_turn import checked_in_turn
    from fa_lab.bench.schema import device_prefix, environment, write_log
    from fa_lab.kernels import load_triton

    load_triton()
    out_path = os.path.join(out_dir, f"{device_prefix(environment('cuda')['device'])}_exp2_on_fma.json")
    log = []
    torch.manual_seed(0)
    for name, head_dim, seqlen, causal, softcap, fp8 in CASES:
        calls, batch_heads = calls_for(head_dim, seqlen, causal, softcap, fp8)
        entry = {"case": name, "causal": causal, "head_dim": head_dim, "seqlen": seqlen, "softcap": softcap,
                 "fp8": fp8}
        with torch.no_grad():
            checked_in_turn(calls, entry, lambda result: result[0].float(), "largest |O - on_fma0's O|", rounds)
        flops = 4.0 * batch_heads * head_dim * seqlen * seqlen / (2 if causal else 1)
        entry["tflops"] = {call: round(flops / statistics.median(entry[f"{call} ms"]) * 1e-9, 1) for call in calls}
        log.append(entry)
        print(entry, flush=True)
        write_log({**environment("cuda"), "rounds": rounds, "log": log}, out_path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    main(args.out_dir, args.rounds)
