"""The bf16 Gluon forward with P in registers (the default) against P through shared memory
(HopperOptions.p_smem) with two and three consumer warpgroups (128- and 192-row tiles), on the FA3-paper shapes
(16K tokens, hidden 2048) at d = 64 and 128, 4K-16K, causal and not. Three interleaved rounds of do_bench medians.
Every variant's output is first compared with float32 SDPA on two heads (docs/experiments/hopper_forward.md,
"P through shared memory, and 192-row tiles").

On the H200: ``PYTHONPATH=. python3 benchmarks/p_smem_ab.py $OUT`` writes $OUT/h200_p_smem.json.
"""
import functools
import os
import statistics
import sys

ROUNDS = 3
TOKENS, HIDDEN = 16384, 2048
VARIANTS = {"registers": {}, "smem": dict(p_smem=True), "smem_3wg": dict(p_smem=True, consumers=3),
            "smem_3wg_persistent": dict(p_smem=True, consumers=3, persistent=True)}
# With --keys256 (d = 64 only: 256-key K/V tiles fit shared memory there with P in it).
VARIANTS_256 = {"registers": {}, "smem": dict(p_smem=True), "smem_256": dict(p_smem=True, kv_block=256)}
# With --3wg-registers (d = 64): three consumers with P in registers (ptxas spills a few values in the loop).
VARIANTS_3WG = {"registers": {}, "registers_3wg": dict(consumers=3),
                "registers_3wg_persistent": dict(consumers=3, persistent=True)}
# With --3wg-64-keys: three consumers over 64-key K/V tiles (no spills at d = 64 or 128).
VARIANTS_3WG_64 = {"registers": {}, "3wg_128_persistent": dict(consumers=3, persistent=True),
                   "3wg_64": dict(consumers=3, kv_block=64), "3wg_64_persistent": dict(consumers=3, kv_block=64,
                                                                                       persistent=True),
                   "3wg_64_persistent_stages3": dict(consumers=3, kv_block=64, persistent=True, stages=3)}
HEAD_DIMS = (64, 128)
RESULT = "h200_p_smem.json"


def cases():
    """(name, head_dim, seqlen, causal) of every timed configuration."""
    for head_dim in HEAD_DIMS:
        for seqlen in (4096, 8192, 16384):
            for causal in (False, True):
                yield f"d{head_dim} {seqlen // 1024}K {'causal' if causal else 'full'}", head_dim, seqlen, causal


def main(out_dir: str) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench.schema import environment, write_log
    from fa_lab.iomodel import AttentionShape, attention_flops
    from fa_lab.kernels import load_triton

    load_triton()
    from fa_lab.kernels.hopper.attention import HopperOptions, gluon_forward

    torch.manual_seed(0)
    result = {**environment("cuda"), "variants": VARIANTS, "max_error": {}, "tflops": {}}
    inputs = {}
    for name, head_dim, seqlen, causal in cases():
        shape = AttentionShape(batch=TOKENS // seqlen, heads=HIDDEN // head_dim, seqlen_q=seqlen, head_dim=head_dim,
                               dtype="bf16", causal=causal)
        q, k, v = (torch.randn(shape.batch, shape.heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        inputs[name] = (q, k, v, causal, head_dim ** -0.5, attention_flops(shape))
        if seqlen == 4096:  # accuracy against float32 SDPA, two heads of the first sequence
            reference = torch.nn.functional.scaled_dot_product_attention(*(t[:1, :2].float() for t in (q, k, v)),
                                                                         is_causal=causal)
            for variant, switches in VARIANTS.items():
                out, _ = gluon_forward(q, k, v, causal, head_dim ** -0.5, HopperOptions(**switches))
                error = (out[:1, :2].float() - reference).abs().max().item()
                result["max_error"][f"{name} {variant}"] = error
    print(result["max_error"], flush=True)
    for _round in range(ROUNDS):
        for name, (q, k, v, causal, scale, flops) in inputs.items():
            for variant, switches in VARIANTS.items():
                call = functools.partial(gluon_forward, q, k, v, causal, scale, HopperOptions(**switches))
                ms = do_bench(call, return_mode="median")
                result["tflops"].setdefault(f"{name} {variant}", []).append(round(flops / ms * 1e-9, 1))
        print(f"round {_round + 1} of {ROUNDS} done", flush=True)
        write_log(result, os.path.join(out_dir, RESULT))
    result["median_tflops"] = {key: statistics.median(values) for key, values in result["tflops"].items()}
    for name in inputs:
        print(name, *(result["median_tflops"][f"{name} {variant}"] for variant in VARIANTS), flush=True)
    write_log(result, os.path.join(out_dir, RESULT))


if __name__ == "__main__":
    if "--keys256" in sys.argv:
        VARIANTS, HEAD_DIMS, RESULT = VARIANTS_256, (64,), "h200_p_smem_keys256.json"
    if "--3wg-64-keys" in sys.argv:
        VARIANTS, RESULT = VARIANTS_3WG_64, "h200_3wg_64_keys.json"
    if "--3wg-registers" in sys.argv:
        VARIANTS, HEAD_DIMS, RESULT = VARIANTS_3WG, (64,), "h200_3wg_registers.json"
    main(sys.argv[1])
