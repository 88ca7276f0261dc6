"""The FP8 quantization pass of impl="triton_hopper_fp8" (fa_lab/kernels/hopper/fp8_quant.py) against a copy:
its GPU time in a CUDA graph and its eager time, as bytes moved per second (Q, K, V read in bf16, written in
e4m3) and as a fraction of a device-to-device copy's bandwidth in the same run, one program per tile at num_warps 4
and 8 and at 4 warps capped to 168 registers (three programs per SM, fp8_quant.quantize_fp8_operands says why),
and the persistent kernel at four launches (programs per SM as its registers allow); and the
FP8 forward end to end (quantization included) against the bf16 forward. FA3-paper protocol shapes, d = 128.

On the H200: ``PYTHONPATH=. python3 benchmarks/fp8_quant_bandwidth.py`` (prints, writes $OUT/fp8_quant.json).
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


def measure(seqlen: int) -> dict:
    """One protocol shape: the copy, the quantization at 4 and 8 warps, the two forwards."""
    from fa_lab.kernels.hopper.fp8_quant import quantize_fp8_operands

    batch = TOKENS // seqlen
    q, k, v = (torch.randn(batch, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    signs = rotation_signs(HEAD_DIM, q.device)
    moved = 3 * q.numel() * (2 + 1)  # bytes: bf16 in, e4m3 out
    target = torch.empty_like(q)
    copy_tbps = 2 * q.numel() * 2 / graph_ms(lambda: target.copy_(q)) / 1e9  # read + write
    row = {"seqlen": seqlen, "batch": batch, "copy_tbps": round(copy_tbps, 2)}
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    launches = {"warps4": dict(num_warps=4), "warps4_maxnreg168": dict(num_warps=4, maxnreg=168),
                "warps8": dict(num_warps=8),
                "persistent_warps8_stages2": dict(num_warps=8, programs=sms, stages=2),
                "persistent_warps8_stages3": dict(num_warps=8, programs=sms, stages=3),
                "persistent_warps8_maxnreg128_stages2": dict(num_warps=8, maxnreg=128, programs=2 * sms, stages=2),
                "persistent_warps4_stages2": dict(num_warps=4, programs=2 * sms, stages=2)}
    for name, launch in launches.items():
        def quantize(launch=launch):
            return quantize_fp8_operands(q, k, v, signs, 128, V_SCALE_FLOOR, **launch)
        gpu, eager = graph_ms(quantize), triton.testing.do_bench(quantize, warmup=25, rep=200)
        row[name] = {"graph_us": round(gpu * 1e3, 1), "eager_us": round(eager * 1e3, 1),
                                "tbps": round(moved / gpu / 1e9, 2), "of_copy": round(moved / gpu / 1e9 / copy_tbps, 3)}
    flops = 4 * batch * HEADS * seqlen ** 2 * HEAD_DIM
    bf16 = triton.testing.do_bench(lambda: triton_hopper_attention(q, k, v, False, None), warmup=25, rep=100)
    fp8 = triton.testing.do_bench(lambda: triton_hopper_fp8_attention(q, k, v, False, None), warmup=25, rep=100)
    row.update(bf16_tflops=round(flops / bf16 / 1e9, 1), fp8_end_to_end_tflops=round(flops / fp8 / 1e9, 1))
    return row


def main():
    from fa_lab.bench.schema import environment, write_log

    load_triton()
    # (not "rows": this file is not in the results schema); written after each shape, so a cut run keeps some
    results = {**environment("cuda"), "what": __doc__.split("\n\n")[0].replace("\n", " "), "shapes": []}
    for seqlen in (1024, 2048, 4096, 8192, 16384):
        results["shapes"].append(measure(seqlen))
        print(results["shapes"][-1], flush=True)
        write_log(results, os.path.join(os.environ.get("OUT", "."), "fp8_quant.json"))


if __name__ == "__main__":
    main()
