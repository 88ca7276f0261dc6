"""Probe: the bf16 Gluon forward at 8K causal with 32 heads (the interfaces run's MHA point that measured 539 TFLOP/s
against 596 and 605 at 4K and 16K), one CTA per work tile against the persistent kernel, beside other head counts
and lengths; three rounds each. On the H200: ``PYTHONPATH=. OUT=dir python3 benchmarks/forward_dip_probe.py``
writes dir/dip_probe.json (committed as h200_forward_dip_probe.json with the environment's keys)."""
import functools
import json
import os

import torch
from triton.testing import do_bench

from fa_lab.kernels import load_triton
from fa_lab.kernels.hopper.attention import HopperOptions, triton_hopper_attention

SHAPES = [(2, 32, 32, 8192), (2, 16, 16, 8192), (2, 32, 8, 8192), (4, 32, 32, 4096), (1, 32, 32, 16384),
          (2, 24, 24, 8192), (2, 64, 64, 8192)]  # (batch, heads, K/V heads, seqlen)


def main():
    load_triton()
    log = []
    for batch, heads, heads_kv, seqlen in SHAPES:
        q = torch.randn(batch, heads, seqlen, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, heads_kv, seqlen, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        flops = 2 * batch * heads * seqlen * seqlen * 128  # causal: half of 4 B H N^2 d
        entry = {"shape": [batch, heads, heads_kv, seqlen]}
        with torch.no_grad():
            for _round in range(3):
                for name, options in (("one_tile", HopperOptions(persistent=False)),
                                      ("persistent", HopperOptions(persistent=True))):
                    call = functools.partial(triton_hopper_attention, q, k, v, True, None, options=options)
                    ms = do_bench(call, return_mode="median")
                    entry.setdefault(name, []).append(round(flops / ms * 1e-9, 1))
        print(entry, flush=True)
        log.append(entry)
    with open(os.path.join(os.environ["OUT"], "dip_probe.json"), "w") as file:
        json.dump(log, file, indent=1)


if __name__ == "__main__":
    main()
