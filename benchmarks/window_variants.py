"""The window (1024, 0) at 16K through the bf16 Gluon forward with each of its switches (HopperOptions: one tile
per CTA, persistent, ping-pong, three K/V stages, persistent with ping-pong), and the dense forward at 16K, in
three interleaved rounds (do_bench medians; TFLOP/s counted on the pairs inside the band for the window).
Every variant's output is first compared with float32 SDPA under the band's mask on two heads
(docs/experiments/interfaces.md, "Window: one tile per CTA or persistent").

On the H200: ``PYTHONPATH=. python3 benchmarks/window_variants.py $OUT`` writes $OUT/h200_window_variants.json.
"""
import functools
import os
import statistics
import sys

ROUNDS = 3
BATCH, HEADS, SEQLEN, HEAD_DIM, WINDOW = 1, 32, 16384, 128, (1024, 0)


def main(out_dir: str) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench.schema import environment, write_log
    from fa_lab.block_info import BlockInfo
    from fa_lab.kernels import load_triton

    load_triton()
    from fa_lab.kernels.hopper.attention import HopperOptions, gluon_forward

    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, SEQLEN, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = HEAD_DIM ** -0.5
    variants = {"one_tile": HopperOptions(persistent=False), "persistent": HopperOptions(persistent=True),
                "pingpong": HopperOptions(pingpong=True), "stages3": HopperOptions(stages=3),
                "persistent_pingpong": HopperOptions(persistent=True, pingpong=True)}
    i = torch.arange(SEQLEN, device="cuda")
    band = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - WINDOW[0])
    reference = torch.nn.functional.scaled_dot_product_attention(*(t[:, :2].float() for t in (q, k, v)),
                                                                 attn_mask=band)
    result = {**environment("cuda"), "window": list(WINDOW), "seqlen": SEQLEN, "heads": HEADS, "max_error": {},
              "tflops": {}}
    for name, options in variants.items():
        out, _ = gluon_forward(q, k, v, False, scale, options, window=WINDOW)
        result["max_error"][name] = (out[:, :2].float() - reference).abs().max().item()
    flops = {"window": 4.0 * BATCH * HEADS * HEAD_DIM * BlockInfo(SEQLEN, SEQLEN, False, WINDOW).visible_pairs(),
             "dense": 4.0 * BATCH * HEADS * HEAD_DIM * SEQLEN * SEQLEN}
    for _round in range(ROUNDS):
        for name, options in variants.items():
            for case, window in (("window", WINDOW), ("dense", (-1, -1))):
                if case == "dense" and name not in ("one_tile", "persistent"):
                    continue
                ms = do_bench(functools.partial(gluon_forward, q, k, v, False, scale, options, window=window),
                              return_mode="median")
                result["tflops"].setdefault(f"{name} {case}", []).append(round(flops[case] / ms * 1e-9, 1))
    result["median_tflops"] = {key: statistics.median(values) for key, values in result["tflops"].items()}
    print(result["max_error"], result["median_tflops"], flush=True)
    write_log(result, os.path.join(out_dir, "h200_window_variants.json"))


if __name__ == "__main__":
    main(sys.argv[1])
