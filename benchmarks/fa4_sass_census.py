"""The K/V loops of flash-attn-4's SM90 kernels beside ours, read from SASS built on a CPU: instructions by opcode,
WGMMAs, the warpgroup barriers (``BAR.SYNC ..., 0x80``) each loop waits on, and the exponentials placed before its
wait for every product in flight (:func:`fa_lab.kernels.hopper.sm90_offline.loop_census`).

flash-attn-4's CuTe DSL kernels cross-compile without a GPU (FLASH_ATTENTION_ARCH, CUTE_DSL_ARCH, fake tensors);
CUTE_DSL_KEEP keeps their cubin, and Triton's bundled cuobjdump (:mod:`fa_lab.kernels.hopper.sm90_offline`) reads
both theirs and ours. Each of their builds runs in a fresh process with its own dump folder. The shapes are the
FA3-paper protocol's at 8K (16K tokens, 2048 / head_dim heads), and chapter 05's window (1024, 0) at 16K and soft
cap 30 at 8K (forward, d = 128); ours are built with the launcher's choices for the same keys. A loop's counts are
its static code: both sides of a branch inside it count (our masked and unmasked score tiles, our backward's dQ
step).

Set-up (CPU, Python 3.11), then the run (about a minute on two cores with a warm Triton cache):

    pip download --no-deps --only-binary=:all: --python-version 3.11 -d WHEELS flash-attn-4==4.0.0b36 \\
        nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \\
        nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels apache-tvm-ffi torch-c-dlpack-ext cuda-bindings \\
        cuda-pathfinder einops
    .venv/bin/pip install --no-deps --target SITE WHEELS/*.whl
    PYTHONPATH=SITE/nvidia_cutlass_dsl/dsl_packages:SITE .venv/bin/python benchmarks/fa4_sass_census.py

It writes benchmarks/sass_census_fa4.json (not the results schema: one entry per kernel build under "builds";
docs/experiments/hopper_forward.md, "flash-attn-4's loops, read offline"). After a change of our kernels,
`.venv/bin/python benchmarks/fa4_sass_census.py --ours` rebuilds our half alone and keeps the file's flash-attn-4
builds (a CPU test holds the file's half to the current kernels).
"""
import glob
import json
import os
import subprocess
import sys
import tempfile

SEQLEN = 8192
WINDOW, WINDOW_SEQLEN, SOFTCAP = (1024, 0), 16384, 30.0  # chapter 05's window and soft-cap cases (issue bars)
# What is built: (kernel, head_dim, causal, case, seqlen), the dense FA3-paper shapes and chapter 05's cases.
SPECS = [(kernel, head_dim, causal, "dense", SEQLEN) for head_dim in (128, 64) for causal in (False, True)
         for kernel in ("forward", "backward")]
SPECS += [("forward", 128, False, "window", WINDOW_SEQLEN), ("forward", 128, False, "softcap", SEQLEN)]
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sass_census_fa4.json")
FA4_KERNELS = {"forward": "FlashAttentionForwardSm90", "backward": "FlashAttentionBackwardSm90"}


def fa4_build(kernel: str, head_dim: int, causal: bool, case: str, seqlen: int) -> None:
    """In this process: compile flash-attn-4's SM90 kernel with fake CUDA tensors (its cubin kept in the dump
    folder that :func:`fa4_row` sets). The window is flash-attn's (left, right) = WINDOW, the soft cap SOFTCAP."""
    import torch
    from flash_attn.cute import interface
    from torch._subclasses.fake_tensor import FakeTensorMode

    batch, heads = 16384 // seqlen, 2048 // head_dim
    options = {"window": dict(window_size_left=WINDOW[0], window_size_right=WINDOW[1]),
               "softcap": dict(softcap=SOFTCAP)}.get(case, {})
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, out, grad = (torch.empty(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                              for _ in range(5))
        if kernel == "forward":
            interface._flash_attn_fwd(q, k, v, causal=causal, **options)
        else:
            lse = torch.empty(batch, heads, seqlen, device="cuda", dtype=torch.float32)
            interface._flash_attn_bwd(q, k, v, out, grad, lse, causal=causal, **options)


def fa4_row(spec: tuple) -> dict:
    """flash-attn-4's kernel of ``spec`` (an entry of SPECS) built in a fresh process, then read."""
    from fa_lab.kernels.hopper.sm90_offline import _cuobjdump, _resource_usage, loop_census, wgmma_loop_bodies

    kernel, head_dim, causal, case, seqlen = spec
    with tempfile.TemporaryDirectory() as dump_dir:
        env = {**os.environ, "FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a",
               "FLASH_ATTENTION_NUM_SMS": "132", "CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": dump_dir}
        subprocess.run([sys.executable, __file__, "--fa4", json.dumps(spec)], env=env, check=True,
                       capture_output=True)
        cubin_path, = glob.glob(os.path.join(dump_dir, f"*{FA4_KERNELS[kernel]}*.cubin"))
        with open(cubin_path, "rb") as file:
            cubin = file.read()
    return {"impl": "fa4", **spec_fields(spec), "registers": _resource_usage(cubin)["REG"],
            "loops": loop_census(wgmma_loop_bodies(_cuobjdump(cubin, "-sass")))}


def spec_fields(spec: tuple) -> dict:
    return dict(zip(("kernel", "head_dim", "causal", "case", "seqlen"), spec))


def ours_rows() -> list[dict]:
    """Our Gluon forward (with the launcher's choices for each spec's keys) and backward, built in one batch."""
    from fa_lab.kernels.hopper.attention import (
        consumers_by_default,
        dq_mode_by_default,
        persistent_by_default,
        split_loops_by_default,
    )
    from fa_lab.kernels.hopper.sm90_offline import census_row_job, compile_all_for_sm90

    rows = []
    for spec in SPECS:
        row = spec_fields(spec)
        if row["kernel"] == "forward":
            banded = row["case"] == "window"
            consumers = consumers_by_default(row["head_dim"], row["causal"], row["seqlen"], banded=banded)
            row.update(consumers=consumers, persistent=persistent_by_default(
                row["head_dim"], row["causal"], row["seqlen"], banded=banded, consumers=consumers),
                split_loops=split_loops_by_default(row["head_dim"], row["causal"] and not banded, row["seqlen"]))
        else:
            row.update(dq_mode=dq_mode_by_default(row["head_dim"]))
        rows.append(row)
    return [{"impl": "triton_hopper", **row, "registers": build.registers, "loops": build.loop_census}
            for row, build in zip(rows, compile_all_for_sm90([census_row_job(row) for row in rows]))]


def main(ours_only: bool) -> None:
    """Build both sides and write OUT; ours_only: rebuild ours and keep the file's flash-attn-4 builds (after a
    change of our kernels, without flash-attn-4 installed)."""
    from importlib.metadata import version

    from fa_lab.bench.schema import environment

    rows = ours_rows()
    if ours_only:
        with open(OUT) as file:
            before = json.load(file)
        rows += [row for row in before["builds"] if row["impl"] == "fa4"]
        peer_versions = {key: before[key] for key in ("flash_attn_4", "cutlass_dsl")}
    else:
        for spec in SPECS:
            print("flash-attn-4", *spec, flush=True)
            rows.append(fa4_row(spec))
        peer_versions = {"flash_attn_4": version("flash-attn-4"), "cutlass_dsl": version("nvidia-cutlass-dsl")}
    result = {**environment("cpu"), **peer_versions, "window": list(WINDOW), "softcap": SOFTCAP, "builds": rows}
    with open(OUT, "w") as file:
        json.dump(result, file, indent=1)
        file.write("\n")
    for row in rows:
        loops = ", ".join(f"{loop['instructions']} ({loop['warpgroup_barriers']} bar)" for loop in row["loops"])
        print(f"{row['impl']:14s} {row['kernel']:8s} {row['case']:7s} d={row['head_dim']:3d} "
              f"causal={row['causal']!s:5s} regs {row['registers']}: {loops}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fa4"]:
        fa4_build(*json.loads(sys.argv[2]))
    else:
        main(ours_only=sys.argv[1:2] == ["--ours"])
