"""The bf16 Gluon forward at d = 64 with two consumer warpgroups (128-row tiles) against three (192-row tiles), on
the FA3-paper shapes (16K tokens, hidden 2048) at 4K-16K keys, causal and not. Three interleaved rounds of do_bench
medians. Every variant's output is first compared with float32 SDPA on two heads (docs/experiments/hopper_forward.md,
"Three consumers at d = 64").

Variants (the names say P stays in registers: they date from an A/B against P through shared memory): "registers",
two consumers, persistent as :func:`persistent_by_default` picks for two; "registers_3wg", three consumers with that
same choice (one tile per CTA without a mask, persistent causal up to 8K keys); "registers_3wg_persistent", three
consumers, persistent.

On the H200: ``PYTHONPATH=. python3 benchmarks/three_consumers_ab.py $OUT`` writes $OUT/h200_three_consumers.json.
"""
import functools
import os
import statistics
import sys

ROUNDS = 3
TOKENS, HIDDEN, HEAD_DIM = 16384, 2048, 64
VARIANTS = ("registers", "registers_3wg", "registers_3wg_persistent")


def switches(variant: str, seqlen: int, causal: bool) -> dict:
    """The HopperOptions fields of ``variant`` at this shape."""
    from fa_lab.kernels.hopper.attention import persistent_by_default

    two_consumer_rule = persistent_by_default(HEAD_DIM, causal, seqlen, banded=False, consumers=2)
    return {"registers": dict(consumers=2, persistent=two_consumer_rule),
            "registers_3wg": dict(consumers=3, persistent=two_consumer_rule),
            "registers_3wg_persistent": dict(consumers=3, persistent=True)}[variant]


def cases():
    """(name, seqlen, causal) of every timed configuration."""
    for seqlen in (4096, 8192, 16384):
        for causal in (False, True):
            yield f"d{HEAD_DIM} {seqlen // 1024}K {'causal' if causal else 'full'}", seqlen, causal


def main(out_dir: str) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench.schema import environment, write_log
    from fa_lab.iomodel import AttentionShape, attention_flops
    from fa_lab.kernels import load_triton

    load_triton()
    from fa_lab.kernels.hopper.attention import HopperOptions, gluon_forward

    torch.manual_seed(0)
    path = os.path.join(out_dir, "h200_three_consumers.json")
    variants = {"registers": {"consumers": 2}, "registers_3wg": {"consumers": 3, "persistent": "as for two"},
                "registers_3wg_persistent": {"consumers": 3, "persistent": True}}
    result = {**environment("cuda"), "variants": variants, "max_error": {}, "tflops": {}}
    inputs = {}
    for name, seqlen, causal in cases():
        shape = AttentionShape(batch=TOKENS // seqlen, heads=HIDDEN // HEAD_DIM, seqlen_q=seqlen, head_dim=HEAD_DIM,
                               dtype="bf16", causal=causal)
        q, k, v = (torch.randn(shape.batch, shape.heads, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        inputs[name] = (q, k, v, seqlen, causal, attention_flops(shape))
        if seqlen == 4096:  # accuracy against float32 SDPA, two heads of the first sequence
            reference = torch.nn.functional.scaled_dot_product_attention(*(t[:1, :2].float() for t in (q, k, v)),
                                                                         is_causal=causal)
            for variant in VARIANTS:
                options = HopperOptions(**switches(variant, seqlen, causal))
                out, _ = gluon_forward(q, k, v, causal, HEAD_DIM ** -0.5, options)
                result["max_error"][f"{name} {variant}"] = (out[:1, :2].float() - reference).abs().max().item()
    print(result["max_error"], flush=True)
    for round_ in range(ROUNDS):
        for name, (q, k, v, seqlen, causal, flops) in inputs.items():
            for variant in VARIANTS:
                options = HopperOptions(**switches(variant, seqlen, causal))
                call = functools.partial(gluon_forward, q, k, v, causal, HEAD_DIM ** -0.5, options)
                ms = do_bench(call, return_mode="median")
                result["tflops"].setdefault(f"{name} {variant}", []).append(round(flops / ms * 1e-9, 1))
        print(f"round {round_ + 1} of {ROUNDS} done", flush=True)
        write_log(result, path)
    result["median_tflops"] = {key: statistics.median(values) for key, values in result["tflops"].items()}
    for name in inputs:
        print(name, *(result["median_tflops"][f"{name} {variant}"] for variant in VARIANTS), flush=True)
    write_log(result, path)


if __name__ == "__main__":
    main(sys.argv[1])
