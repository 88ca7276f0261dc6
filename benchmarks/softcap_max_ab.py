"""The Gluon forward with softcap 30 at d = 128: the running-max softmax against the fixed-max one
(:func:`fa_lab.kernels.hopper.fa3_config.softcap_form`), beside the same kernel without a soft cap. The interfaces
benchmark's shape (32 heads, 16K tokens per batch) at 4K, 8K and 16K, causal and not; three interleaved rounds of
do_bench medians. Each variant's output is first compared with a float32 soft-capped reference on two heads
(docs/experiments/interfaces.md, "The soft cap without a running max").

On the H200: ``PYTHONPATH=. python3 benchmarks/softcap_max_ab.py $OUT`` writes $OUT/h200_softcap_max.json.
"""
import functools
import os
import statistics
import sys

ROUNDS = 3
TOKENS, HEADS, HEAD_DIM, SOFTCAP = 16384, 32, 128, 30.0
VARIANTS = {"no_softcap": dict(softcap=0.0), "running_max": dict(softcap=SOFTCAP, form="running"),
            "fixed_max": dict(softcap=SOFTCAP), "fixed_zero": dict(softcap=SOFTCAP, form=3)}


def forward(q, k, v, causal, variant: str):
    """The Gluon forward of ``variant`` (the running-max form forced through fa3_config.softcap_form)."""
    from fa_lab.kernels.hopper import fa3_config
    from fa_lab.kernels.hopper.attention import HopperOptions, gluon_forward

    spec = VARIANTS[variant]
    options = HopperOptions()
    chosen = fa3_config.softcap_form
    if spec.get("form") == "running":
        fa3_config.softcap_form = lambda *_args: fa3_config.SOFTCAP_RUNNING_MAX.value
    if spec.get("form") == 3:
        fa3_config.softcap_form = lambda *_args: 3
    try:
        return gluon_forward(q, k, v, causal, HEAD_DIM ** -0.5, options, softcap=spec["softcap"])
    finally:
        fa3_config.softcap_form = chosen


def main(out_dir: str) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench.schema import environment, write_log
    from fa_lab.iomodel import AttentionShape, attention_flops
    from fa_lab.kernels import load_triton
    from fa_lab.reference import naive_attention

    load_triton()
    torch.manual_seed(0)
    path = os.path.join(out_dir, "h200_softcap_max.json")
    result = {**environment("cuda"), "variants": VARIANTS, "max_error": {}, "tflops": {}}
    inputs = {}
    for seqlen in (4096, 8192, 16384):
        for causal in (False, True):
            name = f"d{HEAD_DIM} {seqlen // 1024}K {'causal' if causal else 'full'}"
            shape = AttentionShape(batch=TOKENS // seqlen, heads=HEADS, seqlen_q=seqlen, head_dim=HEAD_DIM,
                                   dtype="bf16", causal=causal)
            q, k, v = (torch.randn(shape.batch, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            inputs[name] = (q, k, v, causal, attention_flops(shape))
            if seqlen == 4096:
                for variant, spec in VARIANTS.items():
                    reference, _ = naive_attention(*(t[:1, :2].float() for t in (q, k, v)), causal,
                                                   HEAD_DIM ** -0.5, softcap=spec["softcap"])
                    out, _ = forward(q, k, v, causal, variant)
                    result["max_error"][f"{name} {variant}"] = (out[:1, :2].float() - reference).abs().max().item()
    print(result["max_error"], flush=True)
    for round_ in range(ROUNDS):
        for name, (q, k, v, causal, flops) in inputs.items():
            for variant in VARIANTS:
                ms = do_bench(functools.partial(forward, q, k, v, causal, variant), return_mode="median")
                result["tflops"].setdefault(f"{name} {variant}", []).append(round(flops / ms * 1e-9, 1))
        print(f"round {round_ + 1} of {ROUNDS} done", flush=True)
        write_log(result, path)
    result["median_tflops"] = {key: statistics.median(values) for key, values in result["tflops"].items()}
    for name in inputs:
        print(name, *(f"{variant} {result['median_tflops'][f'{name} {variant}']}" for variant in VARIANTS),
              flush=True)
    write_log(result, path)


if __name__ == "__main__":
    main(sys.argv[1])
