"""The Hopper benchmark: ``triton_hopper`` and ``triton_hopper_fp8`` and their ablation, on an sm_90 GPU.

1. The ablation (:func:`run_ablation`): each variant of the Hopper kernels (the Gluon FA3
   kernel with 2 or 3 K/V stages, ping-pong, persistent or one tile per CTA; the plain-Triton
   kernel with and without its pipelined loop) is checked for correctness, then timed at
   d=128, 8K. Its log (``benchmarks/h200_hopper_variants.json``, :func:`save_ablation_log`) is
   ``{"device", "torch", "triton", "date", "variants", "fp8_error_table_cpu", "defaults"}``: the
   results schema's header; one entry per variant and mask (``kind`` bf16 or fp8, ``variant``,
   ``causal``, ``config``, ``options``, then ``ms`` and ``tflops``, or ``error``; FP8 entries
   without masking add ``rmse_outliers``, the RMSE on the FA3 paper's outlier data next to
   :func:`fa_lab.fp8.reproduce_error_table`, which is ``fp8_error_table_cpu``); and the
   HopperOptions each impl runs by default.
2. The protocol at d = 128 and 64 (:func:`run_hopper_protocol`): what ``impl="triton_hopper"`` and
   ``"triton_hopper_fp8"`` run by default, next to the portable ``triton`` kernel, SDPA's FA2
   and cuDNN back ends, FlexAttention and, where installed, the upstream flash-attn-4 kernels
   (``fa4``, whose SM90 path is FA3's design), in the results schema. FP8 rows time the kernel
   alone on inputs quantized beforehand; the quantization and rotation are timed as impl
   ``triton_hopper_fp8_quant``, and the whole call from bf16 inputs (quantization, kernel, bf16 output) as
   ``triton_hopper_fp8_end_to_end``.
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path

import torch

from ..iomodel import AttentionShape, attention_flops
from ..kernels.hopper import (
    FP8_OPTIONS,
    GLUON_TILES,
    HopperOptions,
    fp8_forward,
    quantize_for_kernel,
    triton_hopper_attention,
    triton_hopper_fp8_attention,
    uses_gluon,
)
from ..kernels.portable.configs import TileConfig
from ..testing import check_attention, make_qkv
from .gpu import make_impls, measure, protocol_shapes, random_inputs, time_fwd_bwd
from .schema import empty_row, environment, load_results, save_results, write_log

HOPPER_SEQLENS = (1024, 2048, 4096, 8192, 16384)
HOPPER_HEAD_DIMS = (128, 64)
HOPPER_PEERS = ("triton", "sdpa_flash", "sdpa_cudnn", "flex")
ABLATION_SHAPE = {"batch": 2, "heads": 16, "seqlen": 8192, "head_dim": 128}  # the protocol's 8K shape
# The variants of the ablation, (label, tiles, options): the Gluon FA3 kernel with its switches,
# and the plain-Triton kernel (tiles matter there only) with and without its pipelined loop.
BF16_ONE_TILE = HopperOptions(stages=2, persistent=False, split_loops=False)
BF16_VARIANTS = [  # each Gluon variant changes one switch of one tile per CTA in one loop (the default picks)
    ("gluon", None, BF16_ONE_TILE),
    ("gluon 3 stages", None, dataclasses.replace(BF16_ONE_TILE, stages=3)),
    ("gluon ping-pong", None, dataclasses.replace(BF16_ONE_TILE, pingpong=True)),
    ("gluon split loops", None, dataclasses.replace(BF16_ONE_TILE, split_loops=True)),
    ("gluon persistent", None, dataclasses.replace(BF16_ONE_TILE, persistent=True)),
    ("triton", TileConfig(128, 128, 8, 3), HopperOptions(kernel="triton")),
    ("triton pipelined", TileConfig(128, 128, 8, 2), HopperOptions(kernel="triton", pipeline=True)),
]
FP8_VARIANTS = [  # the default is persistent: each Gluon variant changes one switch
    ("gluon", None, FP8_OPTIONS),
    ("gluon 3 stages", None, dataclasses.replace(FP8_OPTIONS, stages=3)),
    ("gluon ping-pong", None, dataclasses.replace(FP8_OPTIONS, pingpong=True)),
    ("gluon split loops", None, dataclasses.replace(FP8_OPTIONS, split_loops=True)),
    ("gluon one tile per CTA", None, dataclasses.replace(FP8_OPTIONS, persistent=False)),
    ("triton", TileConfig(128, 128, 8, 3), HopperOptions(kernel="triton")),
]


def hopper_fn(config, options):
    """fn(q, k, v, causal) -> out of the bf16 Hopper forward with these tiles and options."""
    return lambda q, k, v, causal: triton_hopper_attention(q, k, v, causal, None, config=config,
                                                           options=options)[0]


def fp8_tiles(config, options) -> TileConfig:
    """The quantization blocks: the Gluon kernel's own tiles, or the Triton kernel's ``config``."""
    return GLUON_TILES if options.kernel == "gluon" else config


def fp8_kernel_fn(config, options=FP8_OPTIONS, rotate=True):
    """fn(q, k, v, causal) running only the FP8 kernel; the quantization happens once per input set."""
    cache = {}
    tiles = fp8_tiles(config, options)

    def run(q, k, v, causal):
        # (a freed tensor's address is reused by the next shape's: the key needs the shapes too)
        key = tuple((t.data_ptr(), t.shape) for t in (q, k, v))
        if key not in cache:
            cache.clear()
            with torch.no_grad():
                cache[key] = quantize_for_kernel(q, k, v, tiles, rotate, gluon=uses_gluon(q, options))
        q8, k8, vt8, descales = cache[key]
        return fp8_forward(q8, k8, vt8, descales, causal, q.shape[-1] ** -0.5, tiles,
                           q.dtype, q.shape[-1], options)[0]
    return run


def fp8_quant_fn(config, options=FP8_OPTIONS, rotate=True):
    """fn(q, k, v, causal) running only the FP8 quantization (and rotation) the kernel needs."""
    tiles = fp8_tiles(config, options)
    return lambda q, k, v, causal: quantize_for_kernel(q, k, v, tiles, rotate, gluon=uses_gluon(q, options))


def fp8_rmse(config, options=FP8_OPTIONS, rotate=True, seed=0) -> float:
    """RMSE of the FP8 kernel on the paper's outlier data, in ERROR_TABLE_SHAPE (fp16 inputs)."""
    from ..fp8 import ERROR_TABLE_SHAPE, outlier_qkv, rmse
    from ..reference import reference_attention

    shape = ERROR_TABLE_SHAPE
    q64, k64, v64 = outlier_qkv(shape["batch"], shape["heads"], shape["seqlen_q"], shape["seqlen_k"],
                                shape["head_dim"], torch.Generator().manual_seed(seed))
    reference = reference_attention(q64, k64, v64)[0]
    q, k, v = (t.to("cuda", torch.float16) for t in (q64, k64, v64))
    out = triton_hopper_fp8_attention(q, k, v, False, None, config=config, rotate=rotate, options=options)[0]
    return rmse(out.cpu(), reference)


def run_ablation(causals=(False, True)) -> list:
    """Check, then time every variant at ABLATION_SHAPE with each mask; one log entry each.

    A variant that does not compile, fit or pass gets an ``error`` entry instead of timings.
    """
    generator = torch.Generator().manual_seed(0)
    variants = [("bf16", *v) for v in BF16_VARIANTS] + [("fp8", *v) for v in FP8_VARIANTS]
    shape = ABLATION_SHAPE
    entries = []
    for (kind, label, config, options), causal in itertools.product(variants, causals):
        entry = {"kind": kind, "variant": label, "causal": causal, "config": vars(config) if config else None,
                 "options": vars(options)}
        try:
            if kind == "bf16":
                q, k, v = make_qkv(2, 4, 1000, 1100, 128, torch.bfloat16, "cuda", generator=generator)
                check_attention(lambda *a, c=config, o=options: triton_hopper_attention(*a, config=c, options=o),
                                q, k, v, causal, None, grads=False, generator=generator)
                fn = hopper_fn(config, options)
            else:
                if not causal:  # the paper's outlier data is non-causal
                    entry["rmse_outliers"] = fp8_rmse(config, options)
                fn = fp8_kernel_fn(config, options)
            timed = AttentionShape(shape["batch"], shape["heads"], shape["seqlen"], shape["head_dim"],
                                   causal=causal, dtype="bf16")
            ms = time_fwd_bwd(fn, timed, backward=False)[0]
        except Exception as exc:
            entry["error"] = repr(exc)[:300]
            print(f"{kind} {label} causal={causal}: {entry['error']}", file=sys.stderr)
            entries.append(entry)
            continue
        entry.update(ms=ms, tflops=attention_flops(timed) / (ms * 1e-3) / 1e12)
        print(f"{kind} {label} causal={causal}: {entry['tflops']:.0f} TFLOP/s", file=sys.stderr)
        entries.append(entry)
    return entries


def save_ablation_log(path, entries: list) -> None:
    """Write the ablation log described in the module docstring (the CPU error table is computed here)."""
    from ..fp8 import reproduce_error_table

    log = {**environment("cuda"), "variants": entries, "fp8_error_table_cpu": reproduce_error_table(),
           "defaults": {"bf16": vars(HopperOptions()), "fp8": vars(FP8_OPTIONS)}}
    write_log(log, path)


def quant_row(shape: AttentionShape, fn) -> dict:
    """The FP8 quantization (+ rotation) time as its own schema row (no TFLOP/s: it does no attention)."""
    from triton.testing import do_bench

    q, k, v = random_inputs(shape, requires_grad=False)
    row = empty_row("triton_hopper_fp8_quant", shape)
    row["fwd_ms"] = do_bench(lambda: fn(q, k, v, shape.causal), return_mode="median")
    return row


def forward_row(impl: str, fn, shape: AttentionShape) -> dict:
    """A schema row of ``fn(q, k, v, causal)``'s forward alone (median and TFLOP/s), as impl."""
    row = empty_row(impl, shape)
    ms = time_fwd_bwd(fn, shape, backward=False)[0]
    row.update(fwd_ms=ms, fwd_tflops=attention_flops(shape) / (ms * 1e-3) / 1e12)
    return row


def end_to_end_row(shape: AttentionShape) -> dict:
    """The FP8 forward as a caller with bf16 Q, K and V runs it (quantization, kernel, bf16 output: one call of
    ``triton_hopper_fp8_attention``) as a schema row, ``triton_hopper_fp8_end_to_end``."""
    return forward_row("triton_hopper_fp8_end_to_end",
                       lambda q, k, v, causal: triton_hopper_fp8_attention(q, k, v, causal, None)[0], shape)


def fa4_fn():
    """fn(q, k, v, causal) -> out of flash-attn-4 on the protocol's (B, heads, N, d) tensors, passed as (B, N, heads,
    d) views (the package takes any strides with a unit last one, so nothing is copied); None where the package
    is not installed."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    from .interfaces import fa4_output

    def run(q, k, v, causal):
        views = (t.transpose(1, 2) for t in (q, k, v))
        return fa4_output(flash_attn_func(*views, causal=causal)).transpose(1, 2)
    return run


def protocol_impls() -> dict:
    """name -> fn(q, k, v, causal) of the protocol's bf16 rows: the peers, fa4 where installed, triton_hopper."""
    upstream = fa4_fn()
    return {**make_impls(HOPPER_PEERS), **({"fa4": upstream} if upstream else {}),
            "triton_hopper": hopper_fn(None, HopperOptions())}


def run_hopper_protocol(seqlens=HOPPER_SEQLENS, causals=(False, True), json_path=None,
                        head_dims=HOPPER_HEAD_DIMS, resume: bool = False) -> dict:
    """The protocol for the peers, ``triton_hopper``, ``triton_hopper_fp8`` and its quantization.

    With ``json_path`` the results so far are saved after every shape; with ``resume`` too, the rows already in
    that file (of the same device and versions) are kept and their shapes not measured again, so that a run cut
    short by a time limit can be finished by a second one.
    """
    results = {**environment("cuda"), "rows": []}
    if resume and json_path and Path(json_path).exists():
        kept = load_results(json_path)
        versions = ("device", "torch", "triton")
        if any(kept.get(key) != results[key] for key in versions):
            raise ValueError(f"--resume: {json_path} was measured on {[kept.get(key) for key in versions]}, "
                             f"this run is on {[results[key] for key in versions]}")
        results["rows"] = kept["rows"]
    done = {(row["head_dim"], row["causal"], row["seqlen_q"]) for row in results["rows"]}
    impls = protocol_impls()
    for shape in protocol_shapes(tuple(seqlens), tuple(head_dims), tuple(causals)):
        if (shape.head_dim, shape.causal, shape.seqlen_q) in done:
            continue
        for name, fn in impls.items():
            results["rows"].append(measure(name, fn, shape))
        results["rows"] += [forward_row("triton_hopper_fp8", fp8_kernel_fn(None, FP8_OPTIONS), shape),
                            quant_row(shape, fp8_quant_fn(None, FP8_OPTIONS)), end_to_end_row(shape)]
        if json_path:
            save_results(results, json_path)
        print(f"done d={shape.head_dim} N={shape.seqlen_q} causal={shape.causal}", file=sys.stderr)
    return results
