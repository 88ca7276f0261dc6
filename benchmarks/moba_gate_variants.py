"""MoBA's gate on a CUDA GPU at the sparse benchmark's 64K shape (bf16, 32 heads, d = 128, blocks of 4096, top-3):
the PyTorch gate, fa_lab's kernel gate whole (mean keys, their bf16 pieces and the kernel), the mean keys and
pieces alone, a read of q (half a copy), and moba_gate_kernel alone at 64 and 128 rows a program and 4 and 8
warps, each with the number of picks that differ from the PyTorch gate's. The record is
docs/experiments/sparse_kernels.md ("MoBA's gate in one kernel").

Usage on the device, from the repository root: PYTHONPATH=. python3 benchmarks/moba_gate_variants.py OUT.json
"""
import sys

import torch
from triton.testing import do_bench

from fa_lab.bench.schema import environment, write_log
from fa_lab.kernels import load_triton

load_triton()
from fa_lab.kernels.portable.moba import mean_key_pieces, moba_gate_kernel  # noqa: E402  (after load_triton)
from fa_lab.sparse import moba_gate  # noqa: E402

HEADS, SEQLEN, HEAD_DIM, BLOCK, TOP_K = 32, 65536, 128, 4096, 3


def main(path):
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, HEADS, SEQLEN, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
            for _ in range(2))
    reference = moba_gate(q, k, BLOCK, TOP_K)

    def means():
        return k.view(1, HEADS, SEQLEN // BLOCK, BLOCK, HEAD_DIM).sum(3, dtype=torch.float32) / BLOCK

    pieces = mean_key_pieces(means(), torch.bfloat16)
    log = [dict(what="torch gate", ms=do_bench(lambda: moba_gate(q, k, BLOCK, TOP_K))),
           dict(what="fa_lab triton gate", ms=do_bench(lambda: moba_gate(q, k, BLOCK, TOP_K, impl="triton"))),
           dict(what="mean keys + pieces", ms=do_bench(lambda: mean_key_pieces(means(), torch.bfloat16))),
           dict(what="q read as a copy", ms=do_bench(lambda: q.clone()) / 2)]
    for rows in (64, 128):
        for warps in (4, 8):
            out = torch.empty(1, HEADS, SEQLEN, TOP_K, dtype=torch.int64, device="cuda")

            def gate(rows=rows, warps=warps, out=out):
                moba_gate_kernel[(SEQLEN // rows, HEADS)](
                    q, pieces, out, SEQLEN, HEADS, 1, SEQLEN // BLOCK, BLOCK, HEAD_DIM, pieces.stride(0),
                    q.stride(0), q.stride(1), q.stride(2), TOP_K=TOP_K, BLOCK_M=rows, BLOCKS=16, HEAD_DIM=HEAD_DIM,
                    num_warps=warps)
            gate()
            log.append(dict(what="kernel", block_m=rows, warps=warps, ms=do_bench(gate),
                            differing=int((out != reference).sum())))
    for entry in log:
        print(entry, file=sys.stderr)
    write_log({**environment("cuda"), "log": log}, path)


if __name__ == "__main__":
    main(sys.argv[1])
