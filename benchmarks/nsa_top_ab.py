"""NSA's forward with its selection's top kept in the importance kernel (``fa_lab.sparse.NSA_TOP_IN_KERNEL``) against
torch.topk over the stored scores: the sparse benchmark's NSA case (bf16, d = 128, 64 query heads over 4 KV heads,
compressed blocks of 32, 16 selected blocks of 64, window 512) at 16K-64K, both settings in turn for two rounds
(do_bench medians, ms), dense attention's forward beside them.

On the device: ``PYTHONPATH=. python3 benchmarks/nsa_top_ab.py $OUT`` writes $OUT/h200_nsa_top_ab.json (a log;
committed as h100_* when the machine was an H100).
"""
import functools
import os
import sys


def both_ways(seqlen: int, generator) -> dict:
    import torch
    from triton.testing import do_bench

    from fa_lab import sparse as nsa
    from fa_lab.bench import sparse

    q, k, v = (t.detach() for t in sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator))
    entry, forward = {}, sparse.ours_nsa(q, k, v, None)[0]
    with torch.no_grad():
        for _round in (1, 2):
            for top_in_kernel in (False, True):
                call = functools.partial(sparse.called_with, nsa, "NSA_TOP_IN_KERNEL", top_in_kernel, forward)
                entry.setdefault(f"nsa forward ms, top in kernel {top_in_kernel}", []).append(
                    round(do_bench(call, return_mode="median"), 3))
        entry["dense forward ms"] = sparse.dense_forward_ms(q, k, v)
    return entry


def main(out_dir: str) -> None:
    from fa_lab.bench import sparse

    sparse.log_by_length(os.path.join(out_dir, "h200_nsa_top_ab.json"), both_ways)


if __name__ == "__main__":
    main(sys.argv[1])
