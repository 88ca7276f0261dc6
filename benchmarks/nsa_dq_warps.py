"""NSA's selected-blocks backward (fa_lab/kernels/portable/sparse_select.py) with its dQ kernel at 8, 4 and 2
warps: the sparse benchmark's NSA case (bf16, d = 128, 64 query heads over 4 KV heads, 16 selected blocks of 64
keys per query, causal) at 16K-64K, the backward alone (both kernels and the preprocess) on the forward's O and
LSE, each setting timed in turn, two rounds (do_bench medians, ms). tile_config gives the dQ kernel 8 warps at
d = 128; flash-linear-attention's NSA dQ kernel autotunes over 1, 2 and 4.

On the H200: ``PYTHONPATH=. python3 benchmarks/nsa_dq_warps.py $OUT`` writes $OUT/h200_nsa_dq_warps.json (a log).
"""
import functools
import os
import sys

WARPS = (8, 4, 2)


def main(out_dir: str) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench.schema import environment, write_log
    from fa_lab.bench.sparse import SEQLENS, nsa_backward_operands
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.portable.sparse_select import block_select_backward

    load_triton()
    generator = torch.Generator(device="cuda").manual_seed(0)
    log = []
    for seqlen in SEQLENS:
        entry = {"seqlen": seqlen}
        operands = nsa_backward_operands(seqlen, generator)
        for _round in (1, 2):
            for warps in WARPS:
                ms = do_bench(functools.partial(block_select_backward, *operands, dq_warps=warps),
                              return_mode="median")
                entry.setdefault(f"warps{warps}_ms", []).append(round(ms, 3))
        log.append(entry)
        print(entry, flush=True)
        write_log({**environment("cuda"), "log": log}, os.path.join(out_dir, "h200_nsa_dq_warps.json"))


if __name__ == "__main__":
    main(sys.argv[1])
