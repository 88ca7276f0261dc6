"""A/B on the device of the FP8 Gluon forward alone (operands quantized once, FP8_OPTIONS: persistent): one K/V
loop (the default) against three (``split_loops``), each with the switches that reorder a step without changing its
bits (``convert_p_late``: P packed to e4m3 after S_j's issue; ``rescale_early``: O rescaled at the step's end), and
with "v_next": V_{j-1} freed at step j+1's top instead of after P V_{j-1}'s wait, an edit of the consumer's source
written into sibling modules for the run (offline, ptxas then keeps every exponential before that wait).

d = 128 (more head dims as arguments), 4K-16K, causal and not, three interleaved rounds of do_bench medians
(TFLOP/s); every variant's output compared bit for bit with the default's first. Writes
``$OUT/<h100|h200>_fp8_loop_variants.json``; the record is docs/experiments/hopper_forward.md, "FP8's loop
variants".

Run: ``timeout 540 env PYTHONPATH=. python3 benchmarks/fp8_loop_variants_ab.py $OUT [head_dim ...]``
"""
import functools
import importlib
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

from fa_lab.bench.schema import device_prefix, environment, write_log
from fa_lab.kernels import load_triton

load_triton()
from triton.testing import do_bench  # noqa: E402

import fa_lab.kernels.hopper.fa3_kernel as base  # noqa: E402
from fa_lab.kernels.hopper import FP8_OPTIONS, GLUON_TILES  # noqa: E402
from fa_lab.kernels.hopper.fp8_attention import fp8_forward, quantize_for_kernel  # noqa: E402

ROUNDS = 3
PACKAGE = Path(base.__file__).parent
MODULES = ("fa3_state", "fa3_softmax", "fa3_consumer", "fa3_producer", "fa3_kernel")
V_NEXT = [("""            o = _rescaled(o, alpha, o_layout)
        v_tile.release()
        p = carried_p(""", """            o = _rescaled(o, alpha, o_layout)
        p = carried_p("""), ("""        k_tile.wait_ready()
        v_tile.wait_ready()
""", """        if j > 1:
            state.v.at(kv_count + j - 2).release()
        k_tile.wait_ready()
        v_tile.wait_ready()
"""), ("""    v_last = state.v.at(kv_count + tile.n_iter - 1)
""", """    if tile.n_iter > 1:
        state.v.at(kv_count + tile.n_iter - 2).release()
    v_last = state.v.at(kv_count + tile.n_iter - 1)
""")]


def v_next_paths() -> list[Path]:
    return [PACKAGE / f"_v_next_{module}.py" for module in MODULES]


def write_v_next_kernel():
    """The kernel with the v_next edit, from sibling copies of the package's modules (removed by the caller)."""
    for module, path in zip(MODULES, v_next_paths()):
        source = (PACKAGE / f"{module}.py").read_text()
        for old, new in V_NEXT if module == "fa3_consumer" else []:
            assert old in source, old[:60]
            source = source.replace(old, new, 1)
        for other in MODULES:
            source = source.replace(f"from .{other} import", f"from ._v_next_{other} import")
        path.write_text(source)
    return importlib.import_module("fa_lab.kernels.hopper._v_next_fa3_kernel").attention_fwd_fa3_kernel


def main(out_dir: str, head_dims: list[int]) -> None:
    default_kernel = base.attention_fwd_fa3_kernel
    v_next = write_v_next_kernel()
    one = replace(FP8_OPTIONS, split_loops=False)
    split = replace(FP8_OPTIONS, split_loops=True)
    variants = {"one": (default_kernel, one),
                "split": (default_kernel, split),
                "split_v_next": (v_next, split),
                "split_late_p": (default_kernel, replace(split, convert_p_late=True)),
                "split_late_p_v_next": (v_next, replace(split, convert_p_late=True)),
                "one_rescale_early": (default_kernel, replace(one, rescale_early=True)),
                "split_rescale_early": (default_kernel, replace(split, rescale_early=True)),
                "split_late_p_rescale_early": (default_kernel, replace(split, convert_p_late=True, rescale_early=True)),
                "split_late_p_rescale_early_v_next": (v_next, replace(split, convert_p_late=True,
                                                                      rescale_early=True))}

    def forward(name, operands, causal, head_dim):
        kernel, options = variants[name]
        base.attention_fwd_fa3_kernel = kernel
        try:
            return fp8_forward(*operands, causal, head_dim ** -0.5, GLUON_TILES, torch.bfloat16, head_dim, options)[0]
        finally:
            base.attention_fwd_fa3_kernel = default_kernel

    result = {**environment("cuda"), "rounds": ROUNDS, "tflops": {}, "same_bits": {}}
    prefix = device_prefix(result["device"])
    torch.manual_seed(0)
    for head_dim in head_dims:
        heads = 2048 // head_dim
        for seqlen in (4096, 8192, 16384):
            batch = 16384 // seqlen
            q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            with torch.no_grad():
                operands = quantize_for_kernel(q, k, v, GLUON_TILES, True, gluon=True)
            for causal in (False, True):
                key = f"d{head_dim} {'causal' if causal else 'full'} {seqlen}"
                ref = forward("one", operands, causal, head_dim)
                result["same_bits"][key] = {name: bool(torch.equal(forward(name, operands, causal, head_dim), ref))
                                            for name in variants}
                flops = 4.0 * batch * heads * head_dim * seqlen * seqlen / (2 if causal else 1)
                for _ in range(ROUNDS):
                    for name in variants:
                        ms = do_bench(functools.partial(forward, name, operands, causal, head_dim),
                                      return_mode="median")
                        result["tflops"].setdefault(f"{key} {name}", []).append(round(flops / ms * 1e-9, 1))
                print(key, result["same_bits"][key],
                      {n: statistics.median(result["tflops"][f"{key} {n}"]) for n in variants}, flush=True)
                result["median_tflops"] = {k: statistics.median(v) for k, v in result["tflops"].items()}
                write_log(result, os.path.join(out_dir, f"{prefix}_fp8_loop_variants.json"))


if __name__ == "__main__":
    try:
        main(sys.argv[1], [int(a) for a in sys.argv[2:]] or [128])
    finally:
        for path in v_next_paths():
            path.unlink(missing_ok=True)
