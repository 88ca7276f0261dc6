"""GLA's forward h pass and intra-chunk score kernel timed over tile widths, warps and pipeline stages on a
CUDA GPU (bf16, B = 8, H = 16, N = 4096, d = 128, chunks of 64), each setting checked against the committed
one (relative error of the final state / the scores). What chose linear_launch.h_pass_tiles, SCORE_BLOCK_K
and the score kernel's entries in LAUNCH_WARPS and LAUNCH_STAGES.
Usage on the device, from the repository root: PYTHONPATH=. python3 benchmarks/gla_tile_sweep.py OUT.json
"""
import itertools
import sys

import torch
from triton.testing import do_bench

from fa_lab.bench.schema import environment, write_log
from fa_lab.kernels.portable import linear_chunk as lc
from fa_lab.kernels.portable.linear_gate import log2_cumulated_gate

B, H, N, D, C = 8, 16, 4096, 128, 64
CHUNKS = N // C


def h_pass(k, v, cum, block_k, block_v, warps, stages):
    """A launch of the per-dim-gated h pass and its outputs (states, final state)."""
    h = torch.empty(B * H, CHUNKS, D, D, dtype=torch.bfloat16, device="cuda")
    final = torch.empty(B, H, D, D, dtype=torch.float32, device="cuda")

    def call():
        lc.chunk_fwd_h_kernel[(D // block_k, D // block_v, B * H)](
            k, v, cum, k, h, final, N, CHUNKS, D, D, CHUNK=C, BLOCK_K=block_k, BLOCK_V=block_v, GATE=2,
            HAS_H0=False, PRECISION="tf32", num_warps=warps, num_stages=stages)
    call()
    torch.cuda.synchronize()
    return call, final


def scores(q, k, cum, block_k, warps, stages):
    """A launch of GLA's score kernel and its output."""
    a = torch.empty(B * H, CHUNKS * C, C, dtype=torch.bfloat16, device="cuda")

    def call():
        lc.chunk_gla_fwd_a_kernel[(CHUNKS * (C // lc.SUB_CHUNK), B * H)](
            q, k, cum, a, N, CHUNKS, D, CHUNK=C, SUB=lc.SUB_CHUNK, BLOCK_K=block_k, PRECISION="tf32",
            num_warps=warps, num_stages=stages)
    call()
    torch.cuda.synchronize()
    return call, a.float()


def relative(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def main(path):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cum = log2_cumulated_gate(torch.nn.functional.logsigmoid(torch.randn(B, H, N, D, device="cuda")) / 16, C)
    log = {**environment("cuda"), "shape": dict(batch=B, heads=H, seqlen=N, head_dim=D, chunk=C), "h": [], "a": []}
    _, base = h_pass(k, v, cum, 64, 64, 4, 3)
    for block_k, block_v, warps, stages in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (1, 2, 3, 4)):
        if block_k * block_v > 128 * 64:
            continue
        call, final = h_pass(k, v, cum, block_k, block_v, warps, stages)
        row = dict(bk=block_k, bv=block_v, warps=warps, stages=stages, ms=do_bench(call, warmup=10, rep=40),
                   err=relative(final, base))
        log["h"].append(row)
        print("h", row, flush=True)
    _, base = scores(q, k, cum, 32, 2, 3)
    for block_k, warps, stages in itertools.product((16, 32, 64, 128), (1, 2, 4), (1, 2, 3, 4)):
        call, a = scores(q, k, cum, block_k, warps, stages)
        row = dict(bk=block_k, warps=warps, stages=stages, ms=do_bench(call, warmup=10, rep=40), err=relative(a, base))
        log["a"].append(row)
        print("a", row, flush=True)
    write_log(log, path)


if __name__ == "__main__":
    main(sys.argv[1])
