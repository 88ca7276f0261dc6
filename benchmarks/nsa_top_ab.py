"""NSA's forward with its selection's top kept in the importance kernel (``fa_lab.sparse.NSA_TOP_IN_KERNEL``) against
torch.topk over the stored scores: the sparse benchmark's NSA case (bf16, d = 128, 64 query heads over 4 KV heads,
compressed blocks of 32, 16 selected blocks of 64, window 512) at 16K-64K, both settings in turn for two rounds
(do_bench medians, ms), dense attention's forward beside them.

On the device: ``PYTHONPATH=. python3 benchmarks/nsa_top_ab.py $OUT`` writes $OUT/h200_nsa_top_ab.json (a log;
committed as h100_* when the machine was an H100).
"""
import os
import sys


def main(out_dir: str) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab import sparse as nsa
    from fa_lab.bench import sparse
    from fa_lab.bench.schema import environment, write_log
    from fa_lab.kernels import load_triton

    load_triton()
    generator = torch.Generator(device="cuda").manual_seed(0)
    default, log = nsa.NSA_TOP_IN_KERNEL, []
    try:
        for seqlen in sparse.SEQLENS:
            q, k, v = (t.detach() for t in sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator))
            entry = {"seqlen": seqlen}
            for _round in (1, 2):
                for top_in_kernel in (False, True):
                    nsa.NSA_TOP_IN_KERNEL = top_in_kernel
                    with torch.no_grad():
                        entry.setdefault(f"nsa forward ms, top in kernel {top_in_kernel}", []).append(
                            round(do_bench(sparse.ours_nsa(q, k, v, None)[0], return_mode="median"), 3))
            with torch.no_grad():
                entry["dense forward ms"] = round(do_bench(sparse.dense(q, k, v, None)[0], return_mode="median"), 3)
            print(entry, flush=True)
            log.append(entry)
            del q, k, v
            torch.cuda.empty_cache()
    finally:
        nsa.NSA_TOP_IN_KERNEL = default
    write_log({**environment("cuda"), "log": log}, os.path.join(out_dir, "h200_nsa_top_ab.json"))


if __name__ == "__main__":
    main(sys.argv[1])
