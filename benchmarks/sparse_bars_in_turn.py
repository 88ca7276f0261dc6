"""The sparse benchmark's two bar ratios alone: NSA end to end and MoBA, each beside dense attention at its shape,
forward at 64K, timed in turn for three rounds (:func:`fa_lab.bench.sparse.bars_in_turn`, the same entry the full
``run_device.sh sparse`` run ends with), without the peers or the other rows: a few minutes of a device.

On the device: ``PYTHONPATH=. python3 benchmarks/sparse_bars_in_turn.py $OUT`` writes $OUT/sparse_bars_in_turn.json
(a log; committed as <h100|h200>_sparse_bars_in_turn.json; `run_device.sh sparse-bars`).
"""
import os
import sys


def main(out_dir: str) -> None:
    from fa_lab.bench import sparse

    sparse.log_by_length(os.path.join(out_dir, "sparse_bars_in_turn.json"),
                         lambda seqlen, generator: sparse.bars_in_turn(generator, seqlen),
                         seqlens=(max(sparse.SEQLENS),))


if __name__ == "__main__":
    main(sys.argv[1])
