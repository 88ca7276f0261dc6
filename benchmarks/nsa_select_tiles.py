"""NSA's selected-blocks forward (fa_lab/kernels/portable/sparse_select.py) at other warps and stages: the sparse
benchmark's selection case (bf16, d = 128, 64 query heads over 4 KV heads, 16 selected blocks of 64, the own block
among them; 16 packed rows a program) at 16K and 64K. Every setting builds for sm_90 without spills; each is timed in
turn for two rounds (do_bench medians, ms), its output checked against the shipped setting's (the first).

On the device: ``PYTHONPATH=. python3 benchmarks/nsa_select_tiles.py $OUT`` writes $OUT/h200_nsa_select_tiles.json
(a log); ``... nsa_select_tiles.py $OUT 4x2 1x2 1x3`` times those (warps x stages) settings instead, the first
the reference, into $OUT/nsa_select_tiles.json.
"""
import functools
import os
import sys

SETTINGS = [(4, 2), (4, 3), (4, 4), (2, 2), (2, 3), (8, 2), (8, 3)]  # (warps, stages); the first is shipped
SEQLENS = (16384, 65536)


def settings(seqlen: int, generator, chosen=SETTINGS) -> dict:
    from fa_lab.bench import in_turn, sparse
    from fa_lab.kernels.portable.configs import TileConfig
    from fa_lab.kernels.portable.sparse_select import block_select_forward, tile_config

    q, k, v = (t.detach() for t in sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator))
    indices = sparse.kernel_indices(sparse.nsa_selection(seqlen, generator), q, k)
    shipped = tile_config(sparse.HEADS // sparse.HEADS_KV, sparse.BLOCK_K, q.shape[-1], backward=False)
    entry = {"shipped": [shipped.block_m, shipped.block_n, shipped.num_warps, shipped.num_stages]}
    calls = {f"{warps} warps, {stages} stages": functools.partial(
        block_select_forward, q, k, v, indices, 1, sparse.BLOCK_K, True, q.shape[-1] ** -0.5,
        config=TileConfig(shipped.block_m, shipped.block_n, warps, stages)) for warps, stages in chosen}
    in_turn.checked_in_turn(calls, entry, lambda result: result[0].float(), "largest output difference")
    return entry


def main(out_dir: str, chosen: list[str]) -> None:
    from fa_lab.bench import sparse

    if chosen:
        pairs = [tuple(int(n) for n in setting.split("x")) for setting in chosen]
        sparse.log_by_length(os.path.join(out_dir, "nsa_select_tiles.json"),
                             functools.partial(settings, chosen=pairs), SEQLENS)
    else:
        sparse.log_by_length(os.path.join(out_dir, "h200_nsa_select_tiles.json"), settings, SEQLENS)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
