"""The Python of one impl="triton_hopper" forward call, timed on a CPU: everything a call runs on the host up to
the compiled kernel's launcher, which is replaced by a no-op (as are the checks that need a GPU).

``fa_lab.kernels.launch.CachedLaunch`` runs as on the GPU (its launch key is built from every argument), with a
stand-in for the compiled kernel; the Gluon path is taken as on an H200 (``uses_gluon`` True, 132 SMs, Triton
not in its interpreter). What is not timed: Triton's launcher (the TMA descriptors' encoding, the driver's
launch), which benchmarks/launch_overhead.py times with the rest on the device.

Three calls on a (1, 1, 128, 128) bf16 causal input: ``triton_hopper_attention`` without and with inputs that
require grad, and ``fa_lab.attention(..., impl="triton_hopper")`` (the API's checks on top). For each, 7 rounds
of 2,000 calls after 200 warm-up calls; the median and the fastest round in microseconds per call.

``.venv/bin/python benchmarks/launch_path_cpu.py OUT.json LABEL`` prints one line per call kind and appends them,
labelled (the code timed: a commit, say), to the log OUT.json (created with the machine's header if absent), so
that two versions of the launch path run in turn land in one file (benchmarks/cpu_launch_path.json).
"""
import functools
import json
import os
import sys
import types

import torch

import fa_lab
import fa_lab.kernels as kernels
import fa_lab.kernels.hopper.attention as hopper
from fa_lab.bench.host import host_us
from fa_lab.kernels import launch


def launch_without_a_gpu() -> None:
    """Take the Gluon path with the GPU's parts replaced: the compiled kernel's run and the driver's device and
    stream queries by stand-ins, Triton's interpreter off, 132 SMs."""
    kernels.load_triton()
    kernels.interpreting = hopper.interpreting = lambda: False
    kernels.load_triton()  # (now kept as loaded for compiled kernels: the short path every launch takes)
    hopper.uses_gluon = lambda q, options: options.kernel == "gluon"
    hopper.sm_count = lambda device: 132
    hopper.check_triton_inputs = lambda q: None  # (its only other check asks for CUDA tensors)
    launch.driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_device=lambda: 0,
                                                                       get_current_stream=lambda device: 0))
    compiled = types.SimpleNamespace(function=None, packed_metadata=None, run=lambda *args: None)

    class FirstCallCompiled(dict):
        """CachedLaunch's cache of compiled kernels, which a first call fills with the stand-in."""

        def get(self, key, default=None):
            return self.setdefault(key, compiled)

    launches = {}

    def cached_launch(kernel):
        if kernel not in launches:
            launches[kernel] = launch.CachedLaunch(kernel)
            launches[kernel]._compiled = FirstCallCompiled()
        return launches[kernel]

    hopper.cached_launch = cached_launch


def main(out_path: str, label: str) -> None:
    from fa_lab.bench.schema import environment, write_log

    launch_without_a_gpu()
    torch.set_num_threads(1)
    calls = {}
    for grad in (False, True):
        q, k, v = (torch.randn(1, 1, 128, 128, dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
        calls[f"triton_hopper_attention grad={grad}"] = functools.partial(hopper.triton_hopper_attention, q, k, v,
                                                                          True, None)
    calls["fa_lab.attention grad=True"] = functools.partial(fa_lab.attention, q, k, v, causal=True,
                                                            impl="triton_hopper")
    log = json.load(open(out_path)) if os.path.exists(out_path) else {**environment("cpu"), "log": []}
    for name, call in calls.items():
        median, fastest = host_us(call, calls=2000, warmup=200)
        print(f"{label}: {name}: median {median:.1f} fastest {fastest:.1f} us/call", flush=True)
        log["log"].append({"code": label, "call": name, "median_us": round(median, 1), "fastest_us": round(fastest, 1)})
    write_log(log, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
