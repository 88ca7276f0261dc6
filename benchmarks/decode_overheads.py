"""Where a split decode step's time goes, on a CUDA GPU: the split kernel alone, with its merge launched
plainly, with the merge as a programmatic dependent launch (PDL, sm_90), and on a paged cache with each
split's block-table entries read ahead of its key loop, next to SDPA in the same run (bf16, 32/8 heads,
d = 128, seqlen_q 1, CUDA graphs as `fa-lab bench decode` times them, DECODE_CUDA's tiles). Each
variant's output is checked against the plain call's before it is timed. What chose ``DecodeConfig.pdl``
and ``DecodeConfig.pages_ahead``; the record is docs/experiments/interfaces.md.
Usage on the device, from the repository root: PYTHONPATH=. python3 benchmarks/decode_overheads.py OUT.json
"""
import dataclasses
import sys

import torch

from fa_lab.bench.decode import HEAD_DIM, HEADS_KV, copies_for, graph_ms, kv_bytes, make_cache, sdpa_gqa
from fa_lab.bench.schema import environment, write_log
from fa_lab.kernels import load_triton
from fa_lab.kvcache import check_kvcache, choose_num_splits

load_triton()
from fa_lab.kernels.portable import decode  # noqa: E402  (after load_triton)

SHAPES = ((1, 4096, None), (1, 16384, None), (1, 65536, None), (1, 4096, 256), (1, 16384, 256), (8, 4096, None),
          (8, 4096, 256), (8, 16384, 256), (32, 4096, 256), (32, 16384, 256))
SPLITS = (4, 8, 16, 32)


def split_only(out, lse, dtype, pdl=False):
    """The merge left out: split 0's rows, so that the split kernel's own time shows."""
    return out[0].transpose(1, 2).to(dtype), lse[0]


def calls_for(caches, layout, splits, config):
    return [lambda c=c: decode.triton_decode(c[0], c[1], c[2], c[4], c[3], layout, True, HEAD_DIM ** -0.5,
                                             (-1, -1), 0.0, splits, config) for c in caches]


def main(path):
    base = decode.DECODE_CUDA
    plain = dataclasses.replace(base, pdl=False, pages_ahead=False)
    variants = {"pdl": dataclasses.replace(plain, pdl=True), "plain": plain,
                "pages_ahead": dataclasses.replace(plain, pages_ahead=True)}
    log = []
    for batch, cache, page_size in SHAPES:
        nbytes = kv_bytes(batch, cache)
        caches = [make_cache(batch, cache, page_size) for _ in range(copies_for(nbytes))]
        layout = check_kvcache(*(caches[0][i] for i in (0, 1, 2, 4)), block_table=caches[0][3])
        chosen = choose_num_splits(batch, HEADS_KV, cache, page_size=page_size)
        entry = {"batch": batch, "seqlen_k": cache, "page_size": page_size}
        if page_size is None:
            ms = graph_ms(sdpa_gqa(caches))
            log.append({**entry, "variant": "sdpa_gqa", "num_splits": None, "us": ms * 1e3,
                        "tbps": nbytes / (ms * 1e-3) / 1e12})
        for splits in sorted({chosen, *(SPLITS if batch == 1 else (1, 2, 4, 8))}):
            want = decode.triton_decode(*(caches[0][i] for i in (0, 1, 2, 4, 3)), layout, True, HEAD_DIM ** -0.5,
                                        (-1, -1), 0.0, splits, plain)[0].float()
            for name, config in variants.items():
                if name == "pages_ahead" and page_size is None:
                    continue
                got = calls_for(caches[:1], layout, splits, config)[0]()[0].float()
                error = ((got - want).abs().max() / want.abs().max()).item()
                ms = graph_ms(calls_for(caches, layout, splits, config))
                log.append({**entry, "variant": name, "num_splits": splits, "us": ms * 1e3,
                            "tbps": nbytes / (ms * 1e-3) / 1e12, "max_rel_diff": error})
            merge = decode.merge_split_results
            decode.merge_split_results = split_only
            try:
                ms = graph_ms(calls_for(caches, layout, splits, plain))
            finally:
                decode.merge_split_results = merge
            log.append({**entry, "variant": "split_kernel_only", "num_splits": splits, "us": ms * 1e3})
            print(batch, cache, page_size, splits, [f"{e['variant']} {e['us']:.2f}" for e in log[-4:]],
                  file=sys.stderr)
        del caches
        torch.cuda.empty_cache()
        write_log({**environment("cuda"), "log": log}, path)


if __name__ == "__main__":
    main(sys.argv[1])
