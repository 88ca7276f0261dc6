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
compressed keys a step, warps, Triton's stages), in turn for two rounds, each one's choice checked against the
first's by the scores it selects: $OUT/h200_nsa_importance_tiles.json.
"""
import functools
import os
import sys

PACKINGS = {"one head a pass, 64 queries, 4 warps": dict(rows=64, members=1, num_warps=4),
            "group packed, 4 queries, 4 warps": dict(rows=64, members=None, num_warps=4),
            "group packed, 8 queries, 8 warps": dict(rows=128, members=None, num_warps=8)}
# The running top's tiles that build for sm_90 without spilling (64 queries, 128 keys a step, 8 warps: 225
# registers); 128 queries spill at 8 warps.
TOP_TILES = {"64 queries, 64 keys, 8 warps": dict(rows=64, keys=64, num_warps=8),
             "64 queries, 128 keys, 8 warps": dict(rows=64, keys=128, num_warps=8),
             "64 queries, 64 keys, 8 warps, 2 stages": dict(rows=64, keys=64, num_warps=8, num_stages=2),
             "64 queries, 128 keys, 8 warps, 2 stages": dict(rows=64, keys=128, num_warps=8, num_stages=2),
             "128 queries, 64 keys, 16 warps": dict(rows=128, keys=64, num_warps=16)}


def main(out_dir: str) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench import sparse
    from fa_lab.bench.schema import environment, write_log
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.portable.nsa_importance import triton_nsa_importance
    from fa_lab.sparse import nsa_compress, nsa_compressed_attention

    load_triton()
    generator = torch.Generator(device="cuda").manual_seed(0)
    log = []
    for seqlen in sparse.SEQLENS:
        entry = {"seqlen": seqlen}
        q, k, v = (t.detach() for t in sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator))
        scale, block_cmp = q.shape[-1] ** -0.5, sparse.NSA_BLOCK_CMP
        k_cmp, v_cmp = nsa_compress(k, block_cmp), nsa_compress(v, block_cmp)
        compressed = functools.partial(nsa_compressed_attention, q, k_cmp, v_cmp, block_cmp, scale, "triton")
        lse = compressed()[1]
        calls = {name: functools.partial(triton_nsa_importance, q, k_cmp, lse, block_cmp, sparse.BLOCK_K, scale,
                                         **packing) for name, packing in PACKINGS.items()}
        first = None
        for name, call in calls.items():
            scores = call()
            if first is None:
                first = scores
            else:
                finite = torch.isfinite(first)
                entry[f"{name} max difference"] = float((scores[finite] - first[finite]).abs().max())
                entry[f"{name} same barred blocks"] = bool(torch.equal(torch.isinf(scores), torch.isinf(first)))
        for _round in (1, 2):
            for name, call in calls.items():
                entry.setdefault(f"{name} ms", []).append(round(do_bench(call, return_mode="median"), 3))
        topk = functools.partial(first.topk, sparse.SELECTED, dim=-1)
        entry["topk ms"] = round(do_bench(topk, return_mode="median"), 3)
        fused = functools.partial(triton_nsa_importance, q, k_cmp, lse, block_cmp, sparse.BLOCK_K, scale,
                                  sparse.SELECTED)
        chosen, kept = fused(), topk()
        entry["running top: same selection"] = bool(torch.equal(chosen, torch.where(torch.isinf(kept.values), -1,
                                                                                      kept.indices)))
        chosen_sum = torch.where(chosen >= 0, first.gather(-1, chosen.clamp(min=0)), 0).sum(-1)
        kept_sum = torch.where(torch.isinf(kept.values), 0, kept.values).sum(-1)
        entry["running top: selected score sums' largest difference"] = float((chosen_sum - kept_sum).abs().max())
        entry["running top in the importance kernel ms"] = round(do_bench(fused, return_mode="median"), 3)
        entry["compressed branch ms"] = round(do_bench(compressed, return_mode="median"), 3)
        del first, scores, topk, chosen, kept, chosen_sum, kept_sum
        with torch.no_grad():
            for name, make in (("nsa forward ms", sparse.ours_nsa), ("dense forward ms", sparse.dense)):
                entry[name] = round(do_bench(make(q, k, v, None)[0], return_mode="median"), 3)
        entry["dense / nsa forward"] = round(entry["dense forward ms"] / entry["nsa forward ms"], 3)
        log.append(entry)
        print(entry, flush=True)
        write_log({**environment("cuda"), "log": log}, os.path.join(out_dir, "h200_nsa_importance.json"))
        del q, k, v
        torch.cuda.empty_cache()


def tiles(out_dir: str) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench import sparse
    from fa_lab.bench.schema import environment, write_log
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.portable.nsa_importance import triton_nsa_importance
    from fa_lab.sparse import nsa_compress, nsa_compressed_attention

    load_triton()
    generator = torch.Generator(device="cuda").manual_seed(0)
    log = []
    for seqlen in sparse.SEQLENS:
        entry = {"seqlen": seqlen}
        q, k, v = (t.detach() for t in sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator))
        scale, block_cmp = q.shape[-1] ** -0.5, sparse.NSA_BLOCK_CMP
        k_cmp = nsa_compress(k, block_cmp)
        lse = nsa_compressed_attention(q, k_cmp, nsa_compress(v, block_cmp), block_cmp, scale, "triton")[1]
        scores = triton_nsa_importance(q, k_cmp, lse, block_cmp, sparse.BLOCK_K, scale)
        calls = {name: functools.partial(triton_nsa_importance, q, k_cmp, lse, block_cmp, sparse.BLOCK_K, scale,
                                         sparse.SELECTED, **tile) for name, tile in TOP_TILES.items()}
        first_sum = None
        for name, call in calls.items():
            chosen = call()
            chosen_sum = torch.where(chosen >= 0, scores.gather(-1, chosen.clamp(min=0)), 0).sum(-1)
            first_sum = chosen_sum if first_sum is None else first_sum
            entry[f"{name}: selected score sums' largest difference"] = float((chosen_sum - first_sum).abs().max())
        for _round in (1, 2):
            for name, call in calls.items():
                entry.setdefault(f"{name} ms", []).append(round(do_bench(call, return_mode="median"), 3))
        log.append(entry)
        print(entry, flush=True)
        write_log({**environment("cuda"), "log": log}, os.path.join(out_dir, "h200_nsa_importance_tiles.json"))
        del q, k, v, scores, chosen, chosen_sum, first_sum
        torch.cuda.empty_cache()


if __name__ == "__main__":
    tiles(sys.argv[2]) if sys.argv[1] == "--tiles" else main(sys.argv[1])
