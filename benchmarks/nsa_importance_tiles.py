"""NSA's importance kernel (fa_lab/kernels/portable/nsa_importance.py) at three packings of its tile, and what the
rest of NSA's selection costs: the sparse benchmark's NSA case (bf16, d = 128, 64 query heads over 4 KV heads,
compressed blocks of 32, selection blocks of 64) at 16K-64K. Each packing is timed in turn, two rounds (do_bench
medians, ms), its scores checked against the first packing's; then torch.topk of 16 blocks over the scores against
the kernel keeping a running top 16 itself (nsa_select's path with fa_lab.sparse.NSA_TOP_IN_KERNEL; its choice
checked against topk's), the compressed branch (its folded dense call and lse), and nsa_attention's forward end to
end beside dense attention's (the sparse benchmark's ``dense``).

Packings (:func:`fa_lab.kernels.portable.nsa_importance.packed_tile`): one head of the group at a time over 64
queries (4 warps); the group's 16 heads packed with 4 queries (64 rows, 4 warps) or 8 queries (128 rows, 8 warps).

On the H200: ``PYTHONPATH=. python3 benchmarks/nsa_importance_tiles.py $OUT`` writes $OUT/h200_nsa_importance.json
(a log). With ``--tiles`` it times the kernel keeping its running top 16 instead, at the tiles of TOP_TILES (queries,
compressed keys a step, warps, Triton's stages, the top by a sort or a merge), in turn for two rounds, each one's
choice checked against the first's by the scores it selects, then NSA's forward with the top by a sort and by a
merge, in turn, beside dense attention's: $OUT/h200_nsa_importance_tiles.json. With ``--full-steps`` it times the
kernel keeping its top with the steps every row of a tile sees unmasked and masked (``unmasked_full_steps``), then NSA's
forward both ways, in turn: $OUT/h200_nsa_importance_full_steps.json. With ``--registers`` it times the kernel
keeping its top at the register budgets of REGISTER_SETTINGS (each pass summed per selection block first or last,
registers a thread, Triton's stages, Q's rows by pointers or a descriptor), in turn, then NSA's forward with
nsa_importance's settings for two programs an SM (its TWO_PROGRAMS) and for three (its defaults), in turn:
$OUT/h200_nsa_importance_registers.json; ``--registers-64k`` times only the first and last settings and NSA's
forward, at 64K: $OUT/h200_nsa_importance_registers_64k.json.
"""
import functools
import os
import sys

PACKINGS = {"one head a pass, 64 queries, 4 warps": dict(rows=64, members=1, num_warps=4),
            "group packed, 4 queries, 4 warps": dict(rows=64, members=None, num_warps=4),
            "group packed, 8 queries, 8 warps": dict(rows=128, members=None, num_warps=8)}
# The running top's tiles that build for sm_90 without spilling: sorting (running_top), 64 queries and 128 keys a
# step at 8 warps (225 registers); merging (merged_top: a top-k of the step, then a merge), 128 keys at 4 warps (255)
# or 256 keys at 8 (233).
TOP_TILES = {"64 queries, 128 keys, 8 warps, sort": dict(rows=64, keys=128, num_warps=8, merge=False),
             "64 queries, 128 keys, 4 warps, merge": dict(rows=64, keys=128, num_warps=4, merge=True),
             "64 queries, 256 keys, 8 warps, merge": dict(rows=64, keys=256, num_warps=8, merge=True),
             "64 queries, 64 keys, 4 warps, merge": dict(rows=64, keys=64, num_warps=4, merge=True)}
# The kernel keeping its top at the default tile (64 queries, 128 keys a step, 4 warps, the top by a merge): each pass
# summed per selection block first or last, the registers a thread, Triton's stages, and the unmasked steps' Q rows
# by pointer loads or a descriptor. 255 registers and 3 stages fit two programs an SM; 168 and 2 fit three.
REGISTER_SETTINGS = {
    "blocks last, 255 registers, 3 stages": dict(blocks_first=False, maxnreg=255, num_stages=3, q_by_descriptor=False),
    "blocks first, 168 registers, 2 stages": dict(blocks_first=True, maxnreg=168, num_stages=2, q_by_descriptor=False),
    "Q by descriptor, blocks first, 255 registers, 3 stages": dict(blocks_first=True, maxnreg=255, num_stages=3,
                                                                   q_by_descriptor=True),
    "Q by descriptor, blocks first, 168 registers, 2 stages": dict(blocks_first=True, maxnreg=168, num_stages=2,
                                                                   q_by_descriptor=True)}


def selection_case(seqlen: int, generator) -> tuple:
    """The sparse benchmark's NSA inputs at ``seqlen`` (q, k, v without grad), the compressed branch as a call (its
    output and lse) and the importance kernel as a partial awaiting top_n and its tile."""
    from fa_lab.bench import sparse
    from fa_lab.kernels.portable.nsa_importance import triton_nsa_importance
    from fa_lab.sparse import nsa_compress, nsa_compressed_attention

    q, k, v = (t.detach() for t in sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator))
    scale, block_cmp = q.shape[-1] ** -0.5, sparse.NSA_BLOCK_CMP
    k_cmp, v_cmp = nsa_compress(k, block_cmp), nsa_compress(v, block_cmp)
    compressed = functools.partial(nsa_compressed_attention, q, k_cmp, v_cmp, block_cmp, scale, "triton")
    importance = functools.partial(triton_nsa_importance, q, k_cmp, compressed()[1], block_cmp, sparse.BLOCK_K, scale)
    return (q, k, v), compressed, importance


def selected_sums(chosen, scores):
    """Per query, the scores (B, H_kv, N, blocks) of the blocks ``chosen`` (B, H_kv, N, top_n), -1 for none, summed."""
    import torch

    return torch.where(chosen >= 0, scores.gather(-1, chosen.clamp(min=0)), 0).sum(-1)


def packings(seqlen: int, generator) -> dict:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench import in_turn, sparse

    (q, k, v), compressed, importance = selection_case(seqlen, generator)
    entry, calls = {}, {name: functools.partial(importance, **packing) for name, packing in PACKINGS.items()}
    first = None
    for name, call in calls.items():
        scores = call()
        if first is None:
            first = scores
        else:
            finite = torch.isfinite(first)
            entry[f"{name} max difference"] = float((scores[finite] - first[finite]).abs().max())
            entry[f"{name} same barred blocks"] = bool(torch.equal(torch.isinf(scores), torch.isinf(first)))
    in_turn.medians_in_turn(calls, entry)
    topk = functools.partial(first.topk, sparse.SELECTED, dim=-1)
    entry["topk ms"] = round(do_bench(topk, return_mode="median"), 3)
    fused = functools.partial(importance, sparse.SELECTED)
    chosen, kept = fused(), topk()
    entry["running top: same selection"] = bool(torch.equal(chosen, torch.where(torch.isinf(kept.values), -1,
                                                                                  kept.indices)))
    kept_sum = torch.where(torch.isinf(kept.values), 0, kept.values).sum(-1)
    entry["running top: selected score sums' largest difference"] = float(
        (selected_sums(chosen, first) - kept_sum).abs().max())
    entry["running top in the importance kernel ms"] = round(do_bench(fused, return_mode="median"), 3)
    entry["compressed branch ms"] = round(do_bench(compressed, return_mode="median"), 3)
    del first, scores, topk, chosen, kept, kept_sum
    with torch.no_grad():
        for name, make in (("nsa forward ms", sparse.ours_nsa), ("dense forward ms", sparse.dense)):
            entry[name] = round(do_bench(make(q, k, v, None)[0], return_mode="median"), 3)
    entry["dense / nsa forward"] = round(entry["dense forward ms"] / entry["nsa forward ms"], 3)
    return entry


def top_tiles(seqlen: int, generator) -> dict:
    from fa_lab.bench import in_turn, sparse

    _, _, importance = selection_case(seqlen, generator)
    scores = importance()
    entry = {}
    calls = {name: functools.partial(importance, sparse.SELECTED, **tile) for name, tile in TOP_TILES.items()}
    in_turn.checked_in_turn(calls, entry, lambda chosen: selected_sums(chosen, scores),
                           "selected score sums' largest difference")
    nsa_forward_in_turn(entry, "TOP_BY_MERGE", "merge", (False, True), seqlen, generator)
    return entry


def nsa_forward_in_turn(entry: dict, switch: str, label: str, values: tuple, seqlen: int, generator) -> None:
    """NSA's forward on fresh inputs with nsa_importance's ``switch`` at each of ``values``, in turn, its outputs
    checked equal (entry keys "nsa forward, {label} {value} ..."), then dense attention's forward beside it."""
    import torch

    from fa_lab.bench import in_turn, sparse
    from fa_lab.kernels.portable import nsa_importance

    q, k, v = (t.detach() for t in sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator))
    with torch.no_grad():
        forward = sparse.ours_nsa(q, k, v, None)[0]
        calls = {f"nsa forward, {label} {value}": functools.partial(sparse.called_with, nsa_importance, switch, value,
                                                                     forward) for value in values}
        in_turn.checked_in_turn(calls, entry, lambda out: out.float(), "largest output difference")
        entry["dense forward ms"] = sparse.dense_forward_ms(q, k, v)


def full_steps(seqlen: int, generator) -> dict:
    """The kernel keeping its running top 16 with the steps every row of a tile sees unmasked and masked, in turn,
    the selections checked equal; then NSA's forward both ways, in turn, beside dense attention's."""
    from fa_lab.bench import in_turn, sparse

    _, _, importance = selection_case(seqlen, generator)
    entry = {}
    calls = {f"importance, unmasked full steps {unmasked}": functools.partial(importance, sparse.SELECTED,
                                                                              unmasked_full_steps=unmasked)
             for unmasked in (True, False)}
    in_turn.checked_in_turn(calls, entry, lambda chosen: chosen.float(), "largest selection difference")
    nsa_forward_in_turn(entry, "UNMASKED_FULL_STEPS", "unmasked full steps", (True, False), seqlen, generator)
    return entry


def registers(seqlen: int, generator, settings=None, nsa_forward: bool = True) -> dict:
    """The kernel keeping its running top 16 at REGISTER_SETTINGS, in turn, each choice checked against the first's
    by the scores it selects; then NSA's forward with nsa_importance's module settings as its TWO_PROGRAMS and as
    its defaults (three programs an SM), in turn, beside dense attention's. settings: the names of REGISTER_SETTINGS
    to time (all when None); nsa_forward: time NSA's forward too."""
    import torch

    from fa_lab.bench import in_turn, sparse
    from fa_lab.kernels.portable import nsa_importance

    _, _, importance = selection_case(seqlen, generator)
    scores = importance()
    entry = {}
    calls = {name: functools.partial(importance, sparse.SELECTED, **setting)
             for name, setting in REGISTER_SETTINGS.items() if settings is None or name in settings}
    in_turn.checked_in_turn(calls, entry, lambda chosen: selected_sums(chosen, scores),
                           "selected score sums' largest difference")
    if not nsa_forward:
        return entry
    q, k, v = (t.detach() for t in sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator))
    with torch.no_grad():
        forward = sparse.ours_nsa(q, k, v, None)[0]
        calls = {}
        for label, module_settings in (("two", nsa_importance.TWO_PROGRAMS), ("three", {})):  # {}: the defaults
            call = forward
            for name, value in module_settings.items():
                call = functools.partial(sparse.called_with, nsa_importance, name, value, call)
            calls[f"nsa forward, {label} programs an SM"] = call
        in_turn.checked_in_turn(calls, entry, lambda out: out.float(), "largest output difference")
        entry["dense forward ms"] = sparse.dense_forward_ms(q, k, v)
    return entry


# the first and last settings at 64K alone, then NSA's forward both ways: a short call
SHORT_REGISTERS = functools.partial(registers, settings=[*REGISTER_SETTINGS][::len(REGISTER_SETTINGS) - 1])
MODES = {"--tiles": (top_tiles, "h200_nsa_importance_tiles.json"),
         "--full-steps": (full_steps, "h200_nsa_importance_full_steps.json"),
         "--registers": (registers, "h200_nsa_importance_registers.json"),
         "--registers-64k": (SHORT_REGISTERS, "h200_nsa_importance_registers_64k.json", (65536,))}


def main(argv: list) -> None:
    from fa_lab.bench import sparse

    measure, name, *lengths = MODES.get(argv[0], (packings, "h200_nsa_importance.json"))
    sparse.log_by_length(os.path.join(argv[-1], name), measure, *lengths)


if __name__ == "__main__":
    main(sys.argv[1:])
