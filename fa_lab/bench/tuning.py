"""Tile tuning of the Triton kernels: candidate TileConfigs timed at 8K, the fastest per (head_dim, causal).

The winners go into the kernels' tile table (``fa_lab.kernels.portable.configs``) by hand. The log
(``benchmarks/h200_triton_tuning.json``) is ``{"device", "torch", "triton", "date", "best_fwd",
"best_bwd", "log"}``: the results schema's header, the best config per ``"head_dim,causal"`` for each
direction, and one entry per timed candidate (``kind``, ``head_dim``, ``causal``, ``seqlen``, ``config``,
``ms``, ``tflops``).
"""
from __future__ import annotations

import sys

from ..iomodel import attention_flops
from .gpu import HEAD_DIMS, protocol_shapes, time_fwd_bwd, triton_impl
from .schema import environment, write_log

TUNING_SEQLEN = 8192


def tune(head_dims=HEAD_DIMS, seqlen=TUNING_SEQLEN):
    """(best_fwd, best_bwd, log): the fastest TileConfig per (head_dim, causal) for each direction.

    The candidates are the kernels' own (padded head_dim -> list of TileConfig).
    """
    from ..kernels.portable.configs import TUNING_CANDIDATES_BWD as candidates_bwd
    from ..kernels.portable.configs import TUNING_CANDIDATES_FWD as candidates_fwd

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
                tflops = attention_flops(shape, kind) / (ms * 1e-3) / 1e12
                timings.append((ms, config))
                log.append({"kind": kind, "head_dim": shape.head_dim, "causal": shape.causal, "seqlen": seqlen,
                            "config": vars(config), "ms": ms, "tflops": tflops})
                print(f"tune {kind} d={shape.head_dim} causal={shape.causal} {config}: {tflops:.0f} TFLOP/s",
                      file=sys.stderr)
            if timings:
                best[key] = min(timings, key=lambda item: item[0])[1]
    return best_fwd, best_bwd, log


def save_tuning_log(path, best_fwd: dict, best_bwd: dict, log: list) -> None:
    """Write the tuning log described in the module docstring."""
    write_log({**environment("cuda"),
               "best_fwd": {f"{d},{c}": vars(cfg) for (d, c), cfg in best_fwd.items()},
               "best_bwd": {f"{d},{c}": vars(cfg) for (d, c), cfg in best_bwd.items()},
               "log": log}, path)
