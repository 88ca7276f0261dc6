"""NSA's gated sum written by its window branch's epilogue, or as a pass of its own
(fa_lab/kernels/hopper/nsa_window.py, GATED_WINDOW): the sparse benchmark's NSA case (bf16, d = 128, 64 query heads
over 4 KV heads, compressed blocks of 32, 16 selected blocks of 64, a window of 512) at 16K-64K, NSA's forward and its
forward and backward both ways in turn (two rounds, do_bench medians, ms, the outputs and dQ checked against the
first way's), beside dense attention's forward.

On the device: ``PYTHONPATH=. python3 benchmarks/nsa_gated_window_ab.py $OUT`` writes
$OUT/h200_nsa_gated_window.json (a log).
"""
import os
import sys


def gated_window(seqlen: int, generator) -> dict:
    from fa_lab.bench import sparse
    from fa_lab.kernels.hopper import nsa_window

    entry = {}
    sparse.nsa_forward_in_turn(entry, nsa_window, "GATED_WINDOW", "gated window", (True, False), seqlen, generator,
                               backward=True)
    return entry


def main(argv: list) -> None:
    from fa_lab.bench import sparse

    sparse.log_by_length(os.path.join(argv[-1], "h200_nsa_gated_window.json"), gated_window)


if __name__ == "__main__":
    main(sys.argv[1:])
