"""NSA's gated sum in the selected-blocks kernel's epilogue (``fa_lab.sparse.NSA_MIX_IN_SELECTED``) against its own
pass after that kernel: the sparse benchmark's NSA case (bf16, d = 128, 64 query heads over 4 KV heads, compressed
blocks of 32, 16 selected blocks of 64, window 512) at 16K-64K, both settings in turn for two rounds (do_bench
medians, ms, of the forward and of the forward and backward), the outputs and gradients compared, and dense
attention's forward beside them.

On the device: ``PYTHONPATH=. python3 benchmarks/nsa_mix_ab.py $OUT`` (``run_device.sh nsa-mix``) writes
$OUT/h200_nsa_mix_ab.json (a log; committed as h100_* when the machine was an H100).
"""
import functools
import os
import sys


def both_ways(seqlen: int, generator) -> dict:
    import torch

    from fa_lab import sparse as nsa
    from fa_lab.bench import sparse

    q, k, v = sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator)
    forward = sparse.ours_nsa(q, k, v, None)[0]
    grad = torch.randn(q.shape, device="cuda", generator=generator).to(q.dtype)

    def forward_backward():
        out = forward()
        return out, *torch.autograd.grad(out, (q, k, v), grad)

    settings = (("in the selected kernel", True), ("in its own pass", False))
    results = {where: sparse.called_with(nsa, "NSA_MIX_IN_SELECTED", fused, forward_backward)
               for where, fused in settings}
    entry = {f"max difference, {name}": float((a.float() - b.float()).abs().max())
             for name, a, b in zip(("out", "dq", "dk", "dv"), *results.values())}
    del results
    for label, call in (("nsa forward", forward), ("nsa forward + backward", forward_backward)):
        sparse.medians_in_turn({f"{label}, mix {where}": functools.partial(sparse.called_with, nsa,
                                                                            "NSA_MIX_IN_SELECTED", fused, call)
                                for where, fused in settings}, entry)
    entry["dense forward ms"] = sparse.dense_forward_ms(q, k, v)
    return entry


def main(out_dir: str) -> None:
    from fa_lab.bench import sparse

    sparse.log_by_length(os.path.join(out_dir, "h200_nsa_mix_ab.json"), both_ways)


if __name__ == "__main__":
    main(sys.argv[1])
