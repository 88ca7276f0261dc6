"""The decode kernel's tile configs against split counts over chapter 06's grid, on a CUDA GPU (bf16,
32/8 heads, d = 128, one query, CUDA graphs as `fa-lab bench decode` times them, SDPA in the same run):
what chose ``decode_config``'s SMALL_TILE rule and ``kvcache.MAX_PAGES_AHEAD``; the record is
docs/experiments/interfaces.md ("Decode: one split writes the output, and 64-key tiles past one wave").

- ``variants``: batch 32 with one split over five configs; batch 8 with paged caches at forced split
  counts, each split's pages read ahead (up to 256 entries) or read in the loop.
- ``grid``: batch 1, 8 and 32 at 4K, 16K and 64K: the dense cache at the chosen count with four configs,
  and pages of 256, 64 and 16 with 128- and 64-key tiles at forced counts.
- ``one_split``: batch 32 at 4K and 16K, one split, dense: SDPA and eight configs in turn, three rounds.
- ``page64``: pages of 64 keys where a split spans more entries than it reads ahead (8 x 64K, 32 x 16K and
  64K; 8 x 16K and 32 x 4K, which read them ahead, beside them): decode_config's choice against 64-key tiles
  that load each tile's page in the loop at 1 to 8 splits, next to the dense cache and SDPA, three rounds.

Usage on the device, from the repository root:
PYTHONPATH=. python3 benchmarks/decode_config_sweep.py OUT.json [PART ...]  (every part when none is named)
"""
import sys

import torch

import fa_lab.kvcache as kvcache
from fa_lab.bench import decode as bench
from fa_lab.bench.schema import environment, write_log
from fa_lab.kernels import load_triton

load_triton()
from fa_lab.kernels.portable import decode  # noqa: E402  (after load_triton)

C = decode.DecodeConfig


def timed(log, part, caches, batch, seqlen, page_size, splits, config=None, max_ahead=None, repeats=2):
    """Time ours (the best of ``repeats`` graph medians) with ``config`` in place of decode_config's choice and
    ``max_ahead`` as MAX_PAGES_AHEAD, and append the entry."""
    chosen, limit = decode.decode_config, kvcache.MAX_PAGES_AHEAD
    if config is not None:
        decode.decode_config = lambda layout, s: config
    kvcache.MAX_PAGES_AHEAD = max_ahead or limit
    try:
        ms = min(bench.graph_ms(bench.ours(caches, splits)) for _ in range(repeats))
    finally:
        decode.decode_config, kvcache.MAX_PAGES_AHEAD = chosen, limit
    entry = dict(part=part, batch=batch, seqlen_k=seqlen, page_size=page_size, num_splits=splits,
                 config=None if config is None else [config.block_n, config.num_warps, config.num_stages,
                                                     config.pages_ahead],
                 max_pages_ahead=max_ahead, us=ms * 1e3, tbps=bench.kv_bytes(batch, seqlen) / (ms * 1e-3) / 1e12)
    print(entry, file=sys.stderr)
    log.append(entry)


def sdpa(log, part, caches, batch, seqlen, repeats=2):
    ms = min(bench.graph_ms(bench.sdpa_gqa(caches)) for _ in range(repeats))
    log.append(dict(part=part, impl="sdpa_gqa", batch=batch, seqlen_k=seqlen, page_size=None, us=ms * 1e3,
                    tbps=bench.kv_bytes(batch, seqlen) / (ms * 1e-3) / 1e12))


def caches_for(batch, seqlen, page_size):
    return [bench.make_cache(batch, seqlen, page_size) for _ in range(bench.copies_for(bench.kv_bytes(batch, seqlen)))]


def variants(log):
    for batch, seqlen in ((32, 4096), (32, 16384), (32, 65536), (8, 4096), (8, 16384)):
        sdpa(log, "variants", caches_for(batch, seqlen, None), batch, seqlen)
    for seqlen in (4096, 16384, 65536):
        caches = caches_for(32, seqlen, None)
        for config in (C(128, 4, 3), C(64, 4, 3), C(64, 4, 4), C(64, 8, 3), C(128, 8, 2)):
            timed(log, "variants", caches, 32, seqlen, None, 1, config)
    for batch, seqlen in ((8, 4096), (8, 16384)):
        timed(log, "variants", caches_for(batch, seqlen, None), batch, seqlen, None, 0)
        for page_size in (256, 64, 16):
            caches = caches_for(batch, seqlen, page_size)
            timed(log, "variants", caches, batch, seqlen, page_size, 0)
            for splits in (2, 4, 8):
                timed(log, "variants", caches, batch, seqlen, page_size, splits, C(128, 4, 3), max_ahead=256)
                timed(log, "variants", caches, batch, seqlen, page_size, splits, C(128, 4, 3, pages_ahead=False))
            timed(log, "variants", caches, batch, seqlen, page_size, 4, C(64, 4, 3), max_ahead=256)
        torch.cuda.empty_cache()


def grid(log):
    for batch in (1, 8, 32):
        for seqlen in (4096, 16384, 65536):
            caches = caches_for(batch, seqlen, None)
            sdpa(log, "grid", caches, batch, seqlen)
            chosen = kvcache.choose_num_splits(batch, bench.HEADS_KV, seqlen)
            for config in (None, C(128, 4, 3), C(64, 8, 3), C(64, 4, 3)):
                timed(log, "grid", caches, batch, seqlen, None, chosen, config)
            for page_size in (256, 64, 16):
                caches = caches_for(batch, seqlen, page_size)
                forced = {1: (8, 16, 32), 8: (1, 2, 4, 8), 32: (1, 2)}[batch]
                for splits in forced:
                    for config in (C(128, 4, 3), C(64, 4, 3)):
                        timed(log, "grid", caches, batch, seqlen, page_size, splits, config, max_ahead=256)
                if page_size == 16:
                    for splits in forced:
                        timed(log, "grid", caches, batch, seqlen, page_size, splits, C(64, 4, 3), max_ahead=64)
            del caches
            torch.cuda.empty_cache()


def one_split(log):
    configs = (C(64, 4, 3), C(64, 8, 3), C(64, 4, 2), C(64, 2, 3), C(32, 4, 3), C(128, 8, 2), C(64, 8, 4),
               C(128, 4, 3))
    for seqlen in (4096, 16384):
        caches = caches_for(32, seqlen, None)
        for _ in range(3):
            sdpa(log, "one_split", caches, 32, seqlen, repeats=1)
            for config in configs:
                timed(log, "one_split", caches, 32, seqlen, None, 1, config, repeats=1)
        del caches
        torch.cuda.empty_cache()


def page64(log):
    for batch, seqlen in ((8, 16384), (8, 65536), (32, 4096), (32, 16384), (32, 65536)):
        dense, paged = caches_for(batch, seqlen, None), caches_for(batch, seqlen, 64)
        for _ in range(3):
            sdpa(log, "page64", dense, batch, seqlen, repeats=1)
            timed(log, "page64", dense, batch, seqlen, None, 0, repeats=1)
            timed(log, "page64", paged, batch, seqlen, 64, 0, repeats=1)
            for splits in (1, 2, 4, 8):
                timed(log, "page64", paged, batch, seqlen, 64, splits, decode.SMALL_TILE, repeats=1)
        del dense, paged
        torch.cuda.empty_cache()


PARTS = {"variants": variants, "grid": grid, "one_split": one_split, "page64": page64}


def main(path, parts):
    log = []
    for part in parts or PARTS:
        PARTS[part](log)
    write_log({**environment("cuda"), "log": log}, path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
