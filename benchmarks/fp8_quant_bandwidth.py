"""The FP8 quantization pass of impl="triton_hopper_fp8" (fa_lab/kernels/hopper/fp8_quant.py) against a copy:
its GPU time in a CUDA graph and its eager time, as bytes moved per second (Q, K, V read in bf16, written in
e4m3) and as a fraction of a device-to-device copy's bandwidth in the same run: the Gluon pass (``gluon``, the
default on sm_90: Q's and K's next tile copied by TMA while this one finishes) and the plain-Triton pass (``triton``,
the threads' loads), both two programs per SM walking the tiles, and, given --before FILE (a copy of an earlier
fp8_quant.py with one program per tile), that kernel at 8 warps; and the FP8 forward end to end (quantization
included) against the bf16 forward. FA3-paper protocol shapes, d = 128.

On the H200: ``PYTHONPATH=. python3 benchmarks/fp8_quant_bandwidth.py [--before FILE]`` (prints, writes
$OUT/fp8_quant.json).
"""
import os

import torch
import triton

from fa_lab.kernels import load_triton
from fa_lab.kernels.hopper import V_SCALE_FLOOR, triton_hopper_attention, triton_hopper_fp8_attention
from fa_lab.kernels.hopper.fp8_attention import rotation_signs

TOKENS, HEADS, HEAD_DIM = 16384, 16, 128


def graph_ms(fn) -> float:
    """Median GPU time of fn replayed from a CUDA graph (no host work between replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200)


def measure(seqlen: int, before=None) -> dict:
    """One protocol shape: the copy, the quantization at each launch, the two forwards."""
    from fa_lab.kernels.hopper.fp8_quant import quantize_fp8_operands

    batch = TOKENS // seqlen
    q, k, v = (torch.randn(batch, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    signs = rotation_signs(HEAD_DIM, q.device)
    moved = 3 * q.numel() * (2 + 1)  # bytes: bf16 in, e4m3 out
    target = torch.empty_like(q)
    copy_tbps = 2 * q.numel() * 2 / graph_ms(lambda: target.copy_(q)) / 1e9  # read + write
    row = {"seqlen": seqlen, "batch": batch, "copy_tbps": round(copy_tbps, 2)}
    launches = {"gluon": (quantize_fp8_operands, dict(kernel="gluon")),
                "triton": (quantize_fp8_operands, dict(kernel="triton"))}
    if before is not None:
        launches["tile_per_program_before"] = (before.quantize_fp8_operands, dict(num_warps=8))
    for name, (function, launch) in launches.items():
        def quantize(function=function, launch=launch):
            return function(q, k, v, signs, 128, V_SCALE_FLOOR, **launch)
        gpu, eager = graph_ms(quantize), triton.testing.do_bench(quantize, warmup=25, rep=200)
        row[name] = {"graph_us": round(gpu * 1e3, 1), "eager_us": round(eager * 1e3, 1),
                     "tbps": round(moved / gpu / 1e9, 2), "of_copy": round(moved / gpu / 1e9 / copy_tbps, 3)}
    flops = 4 * batch * HEADS * seqlen ** 2 * HEAD_DIM
    bf16 = triton.testing.do_bench(lambda: triton_hopper_attention(q, k, v, False, None), warmup=25, rep=100)
    fp8 = triton.testing.do_bench(lambda: triton_hopper_fp8_attention(q, k, v, False, None), warmup=25, rep=100)
    row.update(bf16_tflops=round(flops / bf16 / 1e9, 1), fp8_end_to_end_tflops=round(flops / fp8 / 1e9, 1))
    return row


def load_before(path: str):
    """The module at path (an earlier fa_lab/kernels/hopper/fp8_quant.py), imported inside fa_lab.kernels.hopper."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fa_lab.kernels.hopper._fp8_quant_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    import argparse

    from fa_lab.bench.schema import environment, write_log

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="an earlier fp8_quant.py, timed beside the current kernel")
    args = parser.parse_args()
    load_triton()
    before = None if args.before is None else load_before(args.before)
    # (not "rows": this file is not in the results schema); written after each shape, so a cut run keeps some
    results = {**environment("cuda"), "what": __doc__.split("\n\n")[0].replace("\n", " "), "shapes": []}
    for seqlen in (1024, 2048, 4096, 8192, 16384):
        results["shapes"].append(measure(seqlen, before))
        print(results["shapes"][-1], flush=True)
        write_log(results, os.path.join(os.environ.get("OUT", "."), "fp8_quant.json"))


if __name__ == "__main__":
    main()
