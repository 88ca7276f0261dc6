"""The decode benchmark (chapter 06, on a CUDA GPU): attention of one new query per sequence over a KV
cache, measured as bytes of K and V read per second next to the copy bandwidth of the same device.

Shapes: bf16, 32 query heads, 8 KV heads, head_dim 128, seqlen_q 1, batch 1/8/32 x cache 4K/16K/64K.
Rows: ``triton`` (fa_lab.attention_with_kvcache, impl="triton") over a dense cache and paged caches of
256/64/16-token pages, with the split count it picks and with each forced count of :data:`SPLIT_SWEEP`
(the heuristic's check); ``sdpa_gqa`` (SDPA with ``enable_gqa=True`` on the dense cache); ``fa4``
and ``fa4_paged`` (the upstream flash-attn-4 kernels, where installed and where they take the case);
and ``chunked_prefill`` rows: 512 new queries appended to a 16K cache, in TFLOP/s next to
``attention_varlen``'s forward on the same shapes. Times are medians of ``triton.testing.do_bench``.
"""
from __future__ import annotations

import sys

import torch

from ..block_info import BlockInfo
from ..iomodel import AttentionShape
from .schema import empty_row, environment, save_results

HEADS, HEADS_KV, HEAD_DIM = 32, 8, 128
BATCHES, CACHES = (1, 8, 32), (4096, 16384, 65536)
PAGE_SIZES = (None, 256, 64, 16)
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64)
PREFILL_QUERIES, PREFILL_CACHE, PREFILL_BATCH = 512, 16384, 4


def kv_bytes(batch: int, seqlen_k: int, heads_kv: int = HEADS_KV, head_dim: int = HEAD_DIM, item: int = 2) -> int:
    """The bytes of K and V one decode step reads."""
    return 2 * batch * seqlen_k * heads_kv * head_dim * item


def decode_row(impl: str, batch: int, seqlen_k: int, page_size, num_splits, seqlen_q: int = 1) -> dict:
    """A schema row (decode keys) with every figure null."""
    row = empty_row(impl, AttentionShape(batch, HEADS, seqlen_q, HEAD_DIM, seqlen_k=seqlen_k, causal=True,
                                         dtype="bf16"))
    row.update(heads_kv=HEADS_KV, page_size=page_size, num_splits=num_splits)
    return row


def make_cache(batch: int, seqlen_k: int, page_size, seqlen_q: int = 1):
    """q (B, seqlen_q, 32, 128), the cache (dense (B, N, 8, 128) or a shuffled pool of pages), its
    block table (None when dense) and cache_seqlens (every sequence full), on the GPU in bf16."""
    q = torch.randn(batch, seqlen_q, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    if page_size is None:
        k, v = (torch.randn(batch, seqlen_k, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        table = None
    else:
        pages = batch * (seqlen_k // page_size)
        k, v = (torch.randn(pages, page_size, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        table = torch.randperm(pages, device="cuda").to(torch.int32).reshape(batch, seqlen_k // page_size)
    seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
    return q, k, v, table, seqlens


def ours(batch, seqlen_k, page_size, num_splits):
    import fa_lab

    q, k, v, table, seqlens = make_cache(batch, seqlen_k, page_size)
    return lambda: fa_lab.attention_with_kvcache(q, k, v, seqlens, block_table=table, num_splits=num_splits,
                                                 impl="triton")


def sdpa_gqa(batch, seqlen_k):
    import torch.nn.functional as F

    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, HEADS_KV, seqlen_k, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def fa4(batch, seqlen_k, page_size):
    """flash-attn-4: flash_attn_func on a dense cache, flash_attn_varlen_func with a page table when paged."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    q, k, v, table, seqlens = make_cache(batch, seqlen_k, page_size)
    if table is None:
        return lambda: flash_attn_func(q, k, v, causal=True)
    q_packed = q.reshape(batch, HEADS, HEAD_DIM)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return lambda: flash_attn_varlen_func(q_packed, k, v, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=seqlens,
                                          page_table=table, causal=True)


def copy_tbps(timer, nbytes: int) -> float:
    """Device-to-device copy bandwidth, read plus write, of a buffer of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e12


def measure(row: dict, make, args: tuple, timer, copy: float, nbytes: int) -> dict:
    """Fill the row's time and bandwidth from ``make(*args)``'s call; null figures when the impl refuses
    the case."""
    try:
        run = make(*args)
        ms = timer(run, return_mode="median")
    except Exception as exc:  # a peer that does not take a case must not end the sweep
        print(f"{row['impl']} B={row['batch']} N={row['seqlen_k']} page={row['page_size']}: {exc!r:.300}",
              file=sys.stderr)
        return row
    row.update(fwd_ms=ms, bytes=nbytes, tbps=nbytes / (ms * 1e-3) / 1e12, copy_tbps=copy)
    return row


def chunked_prefill_rows(timer) -> list[dict]:
    """512 new queries appended to a 16K cache (ours), next to attention_varlen on the same shapes."""
    import fa_lab

    batch, n_new, cache = PREFILL_BATCH, PREFILL_QUERIES, PREFILL_CACHE
    q, k, v, _, seqlens = make_cache(batch, cache + n_new, None, seqlen_q=n_new)
    seqlens = seqlens - n_new
    k_new, v_new = (torch.randn(batch, n_new, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
    flops = 4.0 * batch * HEADS * HEAD_DIM * BlockInfo(n_new, cache + n_new, True).visible_pairs()
    qp = q.reshape(batch * n_new, HEADS, HEAD_DIM)
    kp, vp = (t.reshape(batch * (cache + n_new), HEADS_KV, HEAD_DIM) for t in (k, v))
    cu_q = torch.arange(0, batch * n_new + 1, n_new, dtype=torch.int32, device="cuda")
    cu_k = torch.arange(0, batch * (cache + n_new) + 1, cache + n_new, dtype=torch.int32, device="cuda")
    cases = {"triton": lambda: fa_lab.attention_with_kvcache(q, k, v, seqlens, k_new, v_new, impl="triton"),
             "triton_varlen": lambda: fa_lab.attention_varlen(qp, kp, vp, cu_q, cu_k, causal=True, impl="triton")}
    rows = []
    for impl, run in cases.items():
        row = decode_row(impl, batch, cache + n_new, None, None, seqlen_q=n_new)
        try:
            ms = timer(run, return_mode="median")
            row.update(fwd_ms=ms, fwd_tflops=flops / (ms * 1e-3) / 1e12)
        except Exception as exc:
            print(f"chunked prefill {impl}: {exc!r:.300}", file=sys.stderr)
        rows.append(row)
    return rows


def run_decode(json_path=None, timer=None, with_fa4: bool = True) -> dict:
    """Every row of the module docstring; saved to ``json_path`` after each shape."""
    if timer is None:
        from triton.testing import do_bench as timer
    from ..kvcache import choose_num_splits

    results = {**environment("cuda"), "rows": []}
    for batch in BATCHES:
        for cache in CACHES:
            nbytes = kv_bytes(batch, cache)
            copy = copy_tbps(timer, nbytes)
            rows = results["rows"]
            for page_size in PAGE_SIZES:
                chosen = choose_num_splits(batch, HEADS_KV, cache)
                rows.append(measure(decode_row("triton", batch, cache, page_size, chosen), ours,
                                    (batch, cache, page_size, 0), timer, copy, nbytes))
                if page_size in (None, 256):  # the heuristic's check: every forced count
                    for splits in SPLIT_SWEEP:
                        rows.append(measure(decode_row("triton_forced", batch, cache, page_size, splits), ours,
                                            (batch, cache, page_size, splits), timer, copy, nbytes))
            rows.append(measure(decode_row("sdpa_gqa", batch, cache, None, None), sdpa_gqa, (batch, cache),
                                timer, copy, nbytes))
            if with_fa4:
                rows.append(measure(decode_row("fa4", batch, cache, None, None), fa4, (batch, cache, None),
                                    timer, copy, nbytes))
                rows.append(measure(decode_row("fa4_paged", batch, cache, 256, None), fa4, (batch, cache, 256),
                                    timer, copy, nbytes))
            torch.cuda.empty_cache()
            if json_path:
                save_results(results, json_path)
    results["rows"] += chunked_prefill_rows(timer)
    if json_path:
        save_results(results, json_path)
    return results


def heuristic_gaps(rows: list[dict]) -> list[tuple[int, int, object, float]]:
    """(batch, seqlen_k, page_size, chosen / best forced bandwidth) per shape that has both."""
    gaps = []
    for row in rows:
        if row["impl"] != "triton" or row["tbps"] is None:
            continue
        forced = [r["tbps"] for r in rows if r["impl"] == "triton_forced" and r["tbps"] is not None
                  and (r["batch"], r["seqlen_k"], r["page_size"]) == (row["batch"], row["seqlen_k"], row["page_size"])]
        if forced:
            gaps.append((row["batch"], row["seqlen_k"], row["page_size"], row["tbps"] / max(forced)))
    return gaps


def plot_decode(results: dict):
    """Achieved TB/s against the cache length, one panel per batch, with the copy bandwidth."""
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["tbps"] is not None and r["impl"] != "triton_forced"]
    fig, axes = plt.subplots(1, len(BATCHES), figsize=(4.2 * len(BATCHES), 3.6), sharey=True)
    for ax, batch in zip(axes, BATCHES):
        mine = [r for r in rows if r["batch"] == batch]
        for label in dict.fromkeys((r["impl"], r["page_size"]) for r in mine):
            points = sorted((r["seqlen_k"], r["tbps"]) for r in mine if (r["impl"], r["page_size"]) == label)
            name = label[0] + ("" if label[1] is None or label[0].startswith("fa4") else f", pages of {label[1]}")
            ax.plot(*zip(*points), marker="o", label=name)
        copies = sorted({(r["seqlen_k"], r["copy_tbps"]) for r in mine})
        if copies:
            ax.plot(*zip(*copies), "k--", label="copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("cache length (tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("K and V read, TB/s")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"Decode, {results['device']}, {results['date']} (bf16, 32/8 heads, d={HEAD_DIM})")
    fig.tight_layout()
    return fig
