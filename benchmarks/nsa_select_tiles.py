"""NSA's selected-blocks forward (fa_lab/kernels/portable/sparse_select.py) at other warps and stages: the sparse
benchmark's selection case (bf16, d = 128, 64 query heads over 4 KV heads, 16 selected blocks of 64, the own block
among them; 16 packed rows a program) at 16K and 64K. Every setting builds for sm_90 without spills; each is timed in
turn for two rounds (do_bench medians, ms), its output checked against the shipped setting's (the first).

On the device: ``PYTHONPATH=. python3 benchmarks/nsa_select_tiles.py $OUT`` writes $OUT/h200_nsa_select_tiles.json
(a log); ``... nsa_select_tiles.py $OUT 4x2 1x2 p8x2`` times those (warps x stages) settings instead, "p" for two
selected blocks a step (``block_select_forward(paired=True)``), the first the reference, into
$OUT/nsa_select_tiles.json; ``... nsa_select_tiles.py $OUT --nsa 4x2 p4x2 p8x2`` times those at 64K and NSA's
forward with the fastest paired setting against one block a step, into $OUT/nsa_select_paired.json.
"""
import functools
import os
import sys

SETTINGS = [(False, 4, 2), (False, 4, 3), (False, 4, 4), (False, 2, 2), (False, 2, 3), (False, 8, 2),
            (False, 8, 3)]  # (two blocks a step, warps, stages); the first is shipped
SEQLENS = (16384, 65536)


def settings(seqlen: int, generator, chosen=SETTINGS) -> dict:
    from fa_lab.bench import in_turn, sparse
    from fa_lab.kernels.portable.configs import TileConfig
    from fa_lab.kernels.portable.sparse_select import block_select_forward, tile_config

    q, k, v = (t.detach() for t in sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator))
    indices = sparse.kernel_indices(sparse.nsa_selection(seqlen, generator), q, k)
    shipped = tile_config(sparse.HEADS // sparse.HEADS_KV, sparse.BLOCK_K, q.shape[-1], backward=False)
    entry = {"shipped": [shipped.block_m, shipped.block_n, shipped.num_warps, shipped.num_stages]}
    calls = {f"{'two blocks a step, ' if paired else ''}{warps} warps, {stages} stages": functools.partial(
        block_select_forward, q, k, v, indices, 1, sparse.BLOCK_K, True, q.shape[-1] ** -0.5,
        config=TileConfig(shipped.block_m, shipped.block_n, warps, stages), paired=paired)
        for paired, warps, stages in chosen}
    in_turn.checked_in_turn(calls, entry, lambda result: result[0].float(), "largest output difference")
    return entry


def nsa_forward(seqlen: int, generator, chosen) -> dict:
    """The paired settings of ``chosen`` timed at ``seqlen`` (:func:`settings`), then NSA's forward end to end with
    the fastest of them (sparse_select.PAIRED_BLOCKS on, at its warps and stages) against one block a step, in turn,
    two rounds, outputs checked equal; dense attention's forward beside them."""
    import torch

    from fa_lab.bench import in_turn, sparse
    from fa_lab.kernels.portable import sparse_select

    entry = settings(seqlen, generator, chosen)
    timed = {name: min(times) for name, times in entry.items() if name.startswith("two blocks") and
             isinstance(times, list)}
    best = min(timed, key=timed.get)
    warps, stages = (int(word) for word in best.replace(",", "").split() if word.isdigit())
    sparse_select.PAIRED_WARPS, sparse_select.PAIRED_STAGES = warps, stages
    entry["nsa paired setting"] = best
    q, k, v = (t.detach() for t in sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator))
    with torch.no_grad():
        forward = sparse.ours_nsa(q, k, v, None)[0]
        calls = {f"nsa forward, paired {value}": functools.partial(sparse.called_with, sparse_select,
                                                                   "PAIRED_BLOCKS", value, forward)
                 for value in (False, True)}
        in_turn.checked_in_turn(calls, entry, lambda out: out.float(), "largest nsa output difference")
        entry["dense forward ms"] = sparse.dense_forward_ms(q, k, v)
    return entry


def main(out_dir: str, chosen: list[str]) -> None:
    from fa_lab.bench import sparse

    if chosen and chosen[0] == "--nsa":
        pairs = [(setting.startswith("p"), *(int(n) for n in setting.lstrip("p").split("x"))) for setting in chosen[1:]]
        sparse.log_by_length(os.path.join(out_dir, "nsa_select_paired.json"),
                             functools.partial(nsa_forward, chosen=pairs), (65536,))
    elif chosen:
        pairs = [(setting.startswith("p"), *(int(n) for n in setting.lstrip("p").split("x"))) for setting in chosen]
        sparse.log_by_length(os.path.join(out_dir, "nsa_select_tiles.json"),
                             functools.partial(settings, chosen=pairs), SEQLENS)
    else:
        sparse.log_by_length(os.path.join(out_dir, "h200_nsa_select_tiles.json"), settings, SEQLENS)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
