"""The GPU benchmark: the FA3-paper protocol with every peer measured in the same run.

Protocol (DESIGN.md, Benchmarks): 16K tokens in total (batch = 16384 / seqlen),
hidden 2048 (heads = 2048 / head_dim), head_dim 64 and 128, seqlen 512 to 16K,
causal and not, bf16. Forward FLOPs 4·B·H·N²·d (halved for causal), backward 2.5x
that; each time is the median of ``triton.testing.do_bench``. The peers: SDPA's
FLASH_ATTENTION (FlashAttention-2), CUDNN_ATTENTION, EFFICIENT_ATTENTION and MATH
back ends (MATH only up to 4K), and FlexAttention under ``torch.compile``.

``python -m fa_lab.bench_gpu --json FILE --plot FILE [--tune FILE]`` runs it; ``--tune``
first times candidate tile configurations of the Triton kernels at 8K and uses the
fastest (written to FILE so that ``fa_lab/kernels/configs.py`` can record them).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from .bench import empty_row, environment, format_table, plot_results, save_results
from .iomodel import AttentionShape, attention_flops
from .memory import peak_memory

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOTAL_TOKENS, HIDDEN = 16384, 2048
MATH_MAX_SEQLEN = 4096
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}


def protocol_shapes(seqlens=SEQLENS, head_dims=HEAD_DIMS, causals=(False, True)):
    """The FA3-paper shapes as AttentionShapes (bf16)."""
    return [AttentionShape(TOTAL_TOKENS // n, HIDDEN // d, n, d, causal=c, dtype="bf16")
            for d in head_dims for c in causals for n in seqlens]


def sdpa_impl(backend_name: str):
    """SDPA restricted to one back end: fn(q, k, v, causal) -> out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def flex_impl():
    """FlexAttention under torch.compile, with a causal BlockMask per shape.

    Compiled for static shapes (one compile per shape): a first run with
    ``dynamic=True`` (one compile per head_dim) was about 20% slower at d=128, 8K,
    which would flatter every kernel compared with it.
    """
    import torch._dynamo
    import torch._functorch.config
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.cache_size_limit = 64  # many shapes in one sweep
    torch._functorch.config.donated_buffer = False  # lets the backward be timed with retain_graph
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run(q, k, v, causal):
        mask = None
        if causal:
            key = (q.shape[2], k.shape[2])
            if key not in masks:
                masks[key] = create_block_mask(causal_mod, None, None, *key, device=q.device)
            mask = masks[key]
        return compiled(q, k, v, block_mask=mask)
    return run


def triton_impl(fwd_configs=None, bwd_configs=None):
    """fa_lab's Triton kernels, optionally with tile configurations per (head_dim, causal)."""
    from .kernels.flash_triton import triton_attention

    def run(q, k, v, causal):
        key = (q.shape[-1], causal)
        return triton_attention(q, k, v, causal, None, fwd_config=(fwd_configs or {}).get(key),
                                bwd_config=(bwd_configs or {}).get(key))[0]
    return run


def time_fwd_bwd(fn, shape: AttentionShape, backward=True):
    """(fwd_ms, bwd_ms) medians of do_bench on fresh random bf16 inputs; bwd_ms None if not asked."""
    from triton.testing import do_bench

    q, k, v = (torch.randn(shape.batch, shape.heads, shape.seqlen_q, shape.head_dim, device="cuda",
                           dtype=torch.bfloat16, requires_grad=backward) for _ in range(3))
    # Forward timed with grad enabled, as in training (and one compiled graph for FlexAttention).
    fwd_ms = do_bench(lambda: fn(q, k, v, shape.causal), return_mode="median")
    bwd_ms = None
    if backward:
        out = fn(q, k, v, shape.causal)
        grad = torch.randn_like(out)
        bwd_ms = do_bench(lambda: out.backward(grad, retain_graph=True), grad_to_none=[q, k, v],
                          return_mode="median")
    return fwd_ms, bwd_ms


def measure(impl: str, fn, shape: AttentionShape) -> dict:
    """One schema row; figures stay null when the impl refuses the shape (reported on stderr)."""
    row = empty_row(impl, shape)
    try:
        fwd_ms, bwd_ms = time_fwd_bwd(fn, shape)
        q = torch.randn(shape.batch, shape.heads, shape.seqlen_q, shape.head_dim, device="cuda",
                        dtype=torch.bfloat16, requires_grad=True)
        peak = peak_memory(fn, q, q, q, shape.causal)
    except Exception as exc:  # a peer that does not support a shape must not end the sweep
        print(f"{impl} d={shape.head_dim} N={shape.seqlen_q} causal={shape.causal}: {exc!r:.200}",
              file=sys.stderr)
        return row
    row.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_peak_bytes=peak, fwd_peak_source="measured",
               fwd_tflops=attention_flops(shape) / (fwd_ms * 1e-3) / 1e12,
               bwd_tflops=attention_flops(shape, "bwd") / (bwd_ms * 1e-3) / 1e12)
    return row


def run_protocol(impls: dict, shapes, json_path=None) -> dict:
    """Every impl on every shape, with a progress bar. impls: name -> fn(q, k, v, causal).

    With ``json_path`` the results so far are saved after every shape, so a run cut
    short still leaves what it measured.
    """
    from tqdm.auto import tqdm

    results = {**environment("cuda"), "rows": []}
    with tqdm(total=len(shapes) * len(impls), desc="bench", unit="run", file=sys.stderr) as bar:
        for shape in shapes:
            for name, fn in impls.items():
                bar.set_postfix_str(f"{name} d={shape.head_dim} N={shape.seqlen_q}")
                if not (name == "sdpa_math" and shape.seqlen_q > MATH_MAX_SEQLEN):
                    results["rows"].append(measure(name, fn, shape))
                bar.update()
            if json_path:
                save_results(results, json_path)
    return results


def tune(candidates_fwd, candidates_bwd, head_dims=HEAD_DIMS, seqlen=8192):
    """Fastest forward and backward TileConfig per (head_dim, causal) at ``seqlen``, and the timings."""
    log, best_fwd, best_bwd = [], {}, {}
    for shape in protocol_shapes((seqlen,), head_dims):
        key = (shape.head_dim, shape.causal)
        for kind, candidates, best in (("fwd", candidates_fwd, best_fwd), ("bwd", candidates_bwd, best_bwd)):
            timings = []
            for config in candidates[shape.head_dim]:
                fn = triton_impl({key: config} if kind == "fwd" else None, {key: config} if kind == "bwd" else None)
                try:
                    fwd_ms, bwd_ms = time_fwd_bwd(fn, shape, backward=kind == "bwd")
                except Exception as exc:  # a config that does not fit (shared memory, registers)
                    print(f"tune {kind} {key} {config}: {exc!r:.200}", file=sys.stderr)
                    continue
                ms = fwd_ms if kind == "fwd" else bwd_ms
                flops = attention_flops(shape, kind)
                timings.append((ms, config))
                log.append({"kind": kind, "head_dim": shape.head_dim, "causal": shape.causal, "seqlen": seqlen,
                            "config": vars(config), "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12})
                print(f"tune {kind} d={shape.head_dim} causal={shape.causal} {config}: "
                      f"{flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s", file=sys.stderr)
            if timings:
                best[key] = min(timings, key=lambda item: item[0])[1]
    return best_fwd, best_bwd, log


def main(argv=None) -> int:
    from .kernels.configs import TUNING_CANDIDATES_BWD, TUNING_CANDIDATES_FWD

    parser = argparse.ArgumentParser(prog="python -m fa_lab.bench_gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True, help="results file (DESIGN.md schema)")
    parser.add_argument("--plot", help="PNG of TFLOP/s vs seqlen")
    parser.add_argument("--tune", metavar="FILE", help="tune the Triton tiles first; write the log here")
    parser.add_argument("--seqlens", type=int, nargs="+", default=list(SEQLENS))
    parser.add_argument("--impls", nargs="+", default=["triton", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient",
                                                        "sdpa_math", "flex"])
    args = parser.parse_args(argv)
    fwd_configs = bwd_configs = None
    if args.tune:
        fwd_configs, bwd_configs, log = tune(TUNING_CANDIDATES_FWD, TUNING_CANDIDATES_BWD)
        with open(args.tune, "w") as out:
            json.dump({"best_fwd": {f"{d},{c}": vars(cfg) for (d, c), cfg in fwd_configs.items()},
                       "best_bwd": {f"{d},{c}": vars(cfg) for (d, c), cfg in bwd_configs.items()},
                       "log": log}, out, indent=1)
    makers = {"triton": lambda: triton_impl(fwd_configs, bwd_configs), "flex": flex_impl,
              **{name: (lambda b=backend: sdpa_impl(b)) for name, backend in SDPA_BACKENDS.items()}}
    impls = {name: makers[name]() for name in args.impls}
    results = run_protocol(impls, protocol_shapes(tuple(args.seqlens)), args.json)
    print(format_table(results["rows"]))
    if args.plot:
        plot_results(results, impls=list(impls)).savefig(args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
