"""Where the default call's value check should wait: attention_with_kvcache(impl="triton") as committed (the
values read back before the append) against the same call with the verdict decided on the device and read
back only once every kernel is queued, and the unchecked call (check_values=False), on one H200, in three
interleaved rounds (docs/experiments/interfaces.md, "Decode: the values' check decided on the device").

``decided_on_device`` is that variant, kept here (not in fa_lab) because it lost: the verdict as a 0-d bool
tensor (cache_seqlens clamped into the capacity and compared, and the block table's verdict when paged), the
append's rows and values gated by it (a refused call writes the cache's first row onto itself), the kernel
given the clamped lengths (zero when paged and refused), and the verdict read back last.

On the H200: ``PYTHONPATH=. python3 benchmarks/decode_check_ab.py $OUT`` writes $OUT/h200_decode_check_ab.json
(a log: per call, wall microseconds with a synchronize after each call, and triton.testing.do_bench's).
"""
import functools
import os
import statistics
import sys
import time

ROUNDS = 3
CASES = (("prefill 4 x 512 on 16K", 4, 512, 16384, None), ("decode 1 x 4K", 1, 1, 4096, None),
         ("decode 32 x 64K", 32, 1, 65536, None), ("decode 8 x 16K, pages of 64", 8, 1, 16384, 64))


def decided_on_device(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=None):
    """attention_with_kvcache(impl="triton", causal=True) with the value check decided on the device."""
    import torch

    from fa_lab.kernels import triton_decode
    from fa_lab.kvcache import _block_table_is_bad, cache_rows, check_cache_values, check_kvcache, choose_num_splits

    layout = check_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
    limit = layout.capacity - layout.seqlen_new
    starts = cache_seqlens.clamp(0, max(limit, 0))
    fits = (starts == cache_seqlens).all()
    if layout.paged:
        fits = fits & (_block_table_is_bad(layout, cache_seqlens, block_table, k_cache.shape[0]) == 0)
    flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    positions = starts.long()[:, None] + torch.arange(layout.seqlen_new, device=q.device)
    rows = cache_rows(layout, block_table, torch.arange(layout.batch, device=q.device)[:, None], positions).flatten()
    rows = torch.where(fits, rows, 0)
    flat_k.index_copy_(0, rows, torch.where(fits, k_new.reshape(-1, *k_new.shape[2:]), flat_k[:1]))
    flat_v.index_copy_(0, rows, torch.where(fits, v_new.reshape(-1, *v_new.shape[2:]), flat_v[:1]))
    keys = (starts + layout.seqlen_new).contiguous()
    if layout.paged:
        keys = torch.where(fits, keys, 0)
    splits = choose_num_splits(layout.batch, layout.heads_kv, layout.capacity, row_tiles=layout.row_tiles,
                               page_size=layout.page_size if layout.paged else None)
    out, _ = triton_decode(q, k_cache, v_cache, keys, block_table, layout, True, q.shape[-1] ** -0.5, (-1, -1),
                           0.0, splits)
    if not bool(fits):
        check_cache_values(layout, cache_seqlens, block_table, k_cache.shape[0])
    return out


def main(out_dir: str) -> None:
    import torch
    from triton.testing import do_bench

    import fa_lab
    from fa_lab.bench.decode import HEAD_DIM, HEADS_KV, make_cache
    from fa_lab.bench.schema import environment, write_log

    torch.manual_seed(0)
    log = []
    for label, batch, n_new, cache, page_size in CASES:
        q, k, v, table, seqlens = make_cache(batch, cache + (n_new if page_size is None else 0), page_size, n_new)
        seqlens = seqlens - n_new
        k_new, v_new = (torch.randn(batch, n_new, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
        args = (q, k, v, seqlens, k_new, v_new)
        calls = {"read_back_first": functools.partial(fa_lab.attention_with_kvcache, *args, block_table=table,
                                                      impl="triton"),
                 "decided_on_device": functools.partial(decided_on_device, *args, table),
                 "unchecked": functools.partial(fa_lab.attention_with_kvcache, *args, block_table=table,
                                                impl="triton", check_values=False)}
        outputs = {name: call() for name, call in calls.items()}
        agree = all(torch.equal(out, outputs["read_back_first"]) for out in outputs.values())
        entry = {"case": label, "batch": batch, "seqlen_new": n_new, "cache": cache, "page_size": page_size,
                 "outputs_equal": agree}
        for _round in range(ROUNDS):
            for name, call in calls.items():
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                start, repeats = time.perf_counter(), 40
                for _ in range(repeats):
                    call()
                    torch.cuda.synchronize()
                wall = (time.perf_counter() - start) / repeats * 1e6
                entry.setdefault(f"{name}_wall_us", []).append(round(wall, 1))
                entry.setdefault(f"{name}_do_bench_us", []).append(round(do_bench(call, return_mode="median") * 1e3, 1))
        for key in [key for key in entry if key.endswith("_us")]:
            entry[key.replace("_us", "_median_us")] = statistics.median(entry[key])
        log.append(entry)
        print(entry, flush=True)
        write_log({**environment("cuda"), "log": log}, os.path.join(out_dir, "h200_decode_check_ab.json"))


if __name__ == "__main__":
    main(sys.argv[1])
