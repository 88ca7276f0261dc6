"""The Hopper benchmark: ``triton_hopper`` and ``triton_hopper_fp8`` against their peers on a GPU.

``python -m fa_lab.bench_hopper --json FILE --plot FILE --log FILE`` runs, in one call:

1. the variants of the Hopper kernel (GEMM-softmax pipelining and warp specialization
   on/off, tile shapes), each checked for correctness first and then timed at d=128,
   8K, causal and not: the ablation of the FA3 ideas, as measured (``--log``);
2. the FP8 kernel's RMSE on the FA3 paper's synthetic outlier data
   (:func:`fa_lab.fp8.outlier_qkv`) next to :func:`fa_lab.fp8.reproduce_error_table`'s
   ``flash_fp8`` row;
3. the protocol at d=128, seqlen 1K-16K, causal and not, with the fastest variants, the
   portable ``triton`` kernel, SDPA's FA2 and cuDNN back ends and FlexAttention, in the
   results schema. FP8 rows time the kernel alone; the quantization and rotation are
   timed separately as impl ``triton_hopper_fp8_quant``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from .bench import empty_row, environment, format_table, plot_results, save_results
from .bench_gpu import flex_impl, measure, protocol_shapes, sdpa_impl, time_fwd_bwd, triton_impl
from .iomodel import AttentionShape, attention_flops
from .kernels.configs import TileConfig
from .kernels.hopper import (
    HopperOptions,
    fp8_forward,
    quantize_for_kernel,
    triton_hopper_attention,
    triton_hopper_fp8_attention,
)
from .testing import check_attention, make_qkv

BF16_CONFIGS = [TileConfig(128, 128, 8, 3), TileConfig(128, 128, 8, 2), TileConfig(128, 64, 8, 3),
                TileConfig(128, 128, 4, 2)]
FP8_CONFIGS = [TileConfig(128, 128, 8, 3), TileConfig(128, 128, 8, 2), TileConfig(128, 64, 8, 3),
               TileConfig(128, 64, 4, 3)]


def hopper_fn(config, options):
    return lambda q, k, v, causal: triton_hopper_attention(q, k, v, causal, None, config=config,
                                                           options=options)[0]


def fp8_kernel_fn(config, rotate=True):
    """fn(q, k, v, causal) running only the FP8 kernel; the quantization happens once per input set."""
    cache = {}

    def run(q, k, v, causal):
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if key not in cache:
            cache.clear()
            with torch.no_grad():
                cache[key] = quantize_for_kernel(q, k, v, config, rotate)
        q8, k8, vt8, descales = cache[key]
        return fp8_forward(q8, k8, vt8, descales, k.shape[2], causal, q.shape[-1] ** -0.5, config,
                           q.dtype, q.shape[-1])[0]
    return run


def fp8_quant_fn(config, rotate=True):
    return lambda q, k, v, causal: quantize_for_kernel(q, k, v, config, rotate)


def fp8_rmse(config, rotate=True, seed=0) -> float:
    """RMSE of the FP8 kernel on the paper's outlier data, in ERROR_TABLE_SHAPE (fp16 inputs)."""
    from .fp8 import ERROR_TABLE_SHAPE, outlier_qkv, rmse
    from .reference import reference_attention

    shape = ERROR_TABLE_SHAPE
    q64, k64, v64 = outlier_qkv(shape["batch"], shape["heads"], shape["seqlen_q"], shape["seqlen_k"],
                                shape["head_dim"], torch.Generator().manual_seed(seed))
    reference = reference_attention(q64, k64, v64)[0]
    q, k, v = (t.to("cuda", torch.float16) for t in (q64, k64, v64))
    out = triton_hopper_fp8_attention(q, k, v, False, None, config=config, rotate=rotate)[0]
    return rmse(out.cpu(), reference)


def explore(log: list) -> dict:
    """Check and time every variant at d=128, 8K; return the fastest correct one per (kind, causal)."""
    best = {}
    generator = torch.Generator().manual_seed(0)
    variants = [("bf16", cfg, HopperOptions(kernel="triton", pipeline=p, warp_specialize=w)) for cfg in BF16_CONFIGS
                for p, w in itertools.product((True, False), (False, True))]
    variants += [("fp8", cfg, None) for cfg in FP8_CONFIGS]
    for (kind, config, options), causal in itertools.product(variants, (False, True)):
        entry = {"kind": kind, "causal": causal, "config": vars(config),
                 "options": vars(options) if options else None}
        try:
            if kind == "bf16":
                q, k, v = make_qkv(2, 4, 1000, 1100, 128, torch.bfloat16, "cuda", generator=generator)
                check_attention(lambda *a, c=config, o=options: triton_hopper_attention(*a, config=c, options=o),
                                q, k, v, causal, None, grads=False, generator=generator)
                fn = hopper_fn(config, options)
            else:
                entry["rmse_outliers"] = fp8_rmse(config)
                fn = fp8_kernel_fn(config)
            shape = AttentionShape(2, 16, 8192, 128, causal=causal, dtype="bf16")
            ms = time_fwd_bwd(fn, shape, backward=False)[0]
        except Exception as exc:  # a variant that does not compile, fit or pass is reported, not fatal
            entry["error"] = repr(exc)[:300]
            print(f"{kind} {config} {options} causal={causal}: {entry['error']}", file=sys.stderr)
            log.append(entry)
            continue
        entry.update(ms=ms, tflops=attention_flops(shape) / (ms * 1e-3) / 1e12)
        print(f"{kind} {config} {options} causal={causal}: {entry['tflops']:.0f} TFLOP/s", file=sys.stderr)
        log.append(entry)
        if (kind, causal) not in best or ms < best[kind, causal][0]:
            best[kind, causal] = (ms, config, options)
    return best


def quant_row(shape: AttentionShape, fn) -> dict:
    """The FP8 quantization (+ rotation) time as its own schema row (no TFLOP/s: it does no attention)."""
    from triton.testing import do_bench

    q, k, v = (torch.randn(shape.batch, shape.heads, shape.seqlen_q, shape.head_dim, device="cuda",
                           dtype=torch.bfloat16) for _ in range(3))
    row = empty_row("triton_hopper_fp8_quant", shape)
    row["fwd_ms"] = do_bench(lambda: fn(q, k, v, shape.causal), return_mode="median")
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa_lab.bench_hopper", description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot")
    parser.add_argument("--log", required=True, help="variants, their timings and the FP8 errors")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    args = parser.parse_args(argv)
    log = []
    best = explore(log)
    from .fp8 import reproduce_error_table
    summary = {"variants": log, "fp8_error_table_cpu": reproduce_error_table(),
               "best": {f"{kind},{causal}": {"config": vars(cfg), "options": vars(opt) if opt else None,
                                             "ms": ms} for (kind, causal), (ms, cfg, opt) in best.items()}}
    with open(args.log, "w") as out:
        json.dump(summary, out, indent=1)
    results = {**environment("cuda"), "rows": []}
    peers = {"triton": triton_impl(), "sdpa_flash": sdpa_impl("FLASH_ATTENTION"),
             "sdpa_cudnn": sdpa_impl("CUDNN_ATTENTION"), "flex": flex_impl()}
    for shape in protocol_shapes(tuple(args.seqlens), (128,)):
        impls = dict(peers)
        if ("bf16", shape.causal) in best:
            _, cfg, opt = best["bf16", shape.causal]
            impls["triton_hopper"] = hopper_fn(cfg, opt)
        for name, fn in impls.items():
            results["rows"].append(measure(name, fn, shape))
        if ("fp8", shape.causal) in best:
            _, cfg, _ = best["fp8", shape.causal]
            row = empty_row("triton_hopper_fp8", shape)
            ms = time_fwd_bwd(fp8_kernel_fn(cfg), shape, backward=False)[0]
            row.update(fwd_ms=ms, fwd_tflops=attention_flops(shape) / (ms * 1e-3) / 1e12)
            results["rows"] += [row, quant_row(shape, fp8_quant_fn(cfg))]
        save_results(results, args.json)
        print(f"done d={shape.head_dim} N={shape.seqlen_q} causal={shape.causal}", file=sys.stderr)
    print(format_table(results["rows"]))
    if args.plot:
        plot_results(results, metrics=("fwd_tflops",)).savefig(args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
