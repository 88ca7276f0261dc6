"""The Gluon forward's soft cap in its forms and under the forward's switches, timed in turn beside the same forward
without a cap: the cap before the row max (shipped), the row max over the raw scores capped once a row
(``HopperOptions.softcap_max_first``), Q multiplied by scale / softcap before the kernel so that a score needs no
multiply before its tanh (``softcap_q_scaled``), both, one exponential in four on the FMA units (``exp2_on_fma``),
the consumers taking turns at the tensor cores (``pingpong``), three K/V stages, both, and one K/V loop instead of
three. Chapter 05's soft-cap case: softcap 30, d = 128, 8K, batch 2 x 16 heads, bf16, causal and not; three rounds
of do_bench medians in turn (ms, and each variant's time over the uncapped forward's). Each variant's O is first
compared with the shipped variant's (largest difference) and with the float64 reference on the first batch and head.

On the device: ``PYTHONPATH=. python3 benchmarks/softcap_variants_ab.py $OUT`` writes
$OUT/<h100|h200>_softcap_variants.json.
"""
import argparse
import functools
import os

ROUNDS = 3
SOFTCAP = 30.0
VARIANTS = {"cap_first": {}, "max_first": dict(softcap_max_first=True), "q_scaled": dict(softcap_q_scaled=True),
            "max_first_q_scaled": dict(softcap_max_first=True, softcap_q_scaled=True),
            "exp2_on_fma1": dict(exp2_on_fma=1), "pingpong": dict(pingpong=True), "stages3": dict(stages=3),
            "pingpong_stages3": dict(pingpong=True, stages=3), "one_loop": dict(split_loops=False)}


def main(out_dir: str, causals=(False, True), rounds: int = ROUNDS) -> None:
    import torch

    from fa_lab.bench.gpu import random_inputs
    from fa_lab.bench.in_turn import medians_in_turn
    from fa_lab.bench.schema import device_prefix, environment, write_log
    from fa_lab.iomodel import AttentionShape
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.attention import HopperOptions, triton_hopper_attention
    from fa_lab.reference import reference_attention

    load_triton()
    out_path = os.path.join(out_dir, f"{device_prefix(environment('cuda')['device'])}_softcap_variants.json")
    log = []
    for causal in causals:
        shape = AttentionShape(2, 16, 8192, 128, causal=causal, dtype="bf16")
        q, k, v = random_inputs(shape, requires_grad=False)
        calls = {"no_cap": functools.partial(triton_hopper_attention, q, k, v, causal, None, options=HopperOptions())}
        calls.update({name: functools.partial(triton_hopper_attention, q, k, v, causal, None, softcap=SOFTCAP,
                                              options=HopperOptions(**switches))
                      for name, switches in VARIANTS.items()})
        entry = {"causal": causal, "seqlen": shape.seqlen_q, "softcap": SOFTCAP}
        with torch.no_grad():
            reference, _ = reference_attention(*(t[:1, :1] for t in (q, k, v)), causal, None, softcap=SOFTCAP)
            shipped = calls["cap_first"]()[0]
            for name in VARIANTS:
                out = calls[name]()[0]
                entry[f"{name} vs cap_first"] = (out.float() - shipped.float()).abs().max().item()
                entry[f"{name} vs float64"] = (out[:1, :1].double() - reference).abs().max().item()
            print(entry, flush=True)
            for _round in range(rounds):  # one round at a time, printed as it ends
                medians_in_turn(calls, entry, rounds=1)
                print({name: entry[f"{name} ms"] for name in calls}, flush=True)
        for name in VARIANTS:
            entry[f"{name} over no_cap"] = [round(a / b, 4) for a, b in zip(entry[f"{name} ms"], entry["no_cap ms"])]
        log.append(entry)
        print(entry, flush=True)
        write_log({**environment("cuda"), "log": log}, out_path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    main(args.out_dir, {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal], args.rounds)
