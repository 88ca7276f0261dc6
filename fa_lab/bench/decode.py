"""The decode benchmark (chapter 06, on a CUDA GPU): attention of one new query per sequence over a KV
cache, measured as bytes of K and V read per second next to the copy bandwidth of the same device.

Shapes: bf16, 32 query heads, 8 KV heads, head_dim 128, seqlen_q 1, batch 1/8/32 x cache 4K/16K/64K.
Rows: ``triton`` (fa_lab.attention_with_kvcache, impl="triton", check_values=False) over a dense cache
and paged caches of 256/64/16-token pages, with the split count it picks; ``triton_forced`` (the same call at
each forced count of :data:`SPLIT_SWEEP`, on the dense cache and 256-token pages: the heuristic's check);
``triton_checked`` (the same call with its default
check_values=True, dense); ``sdpa_gqa`` (SDPA with ``enable_gqa=True`` on the dense cache); ``fa4`` and
``fa4_paged`` (the upstream flash-attn-4 kernels, where installed and where they take the case); and the
chunked-prefill rows (``seqlen_q`` 512): 512 new queries appended to a 16K cache, in TFLOP/s, ``triton`` with
the default value check, which reads back once, ``triton_unchecked`` without it, and ``triton_varlen``
(``attention_varlen``'s forward on the same shapes).

Our rows with the chosen count (dense and paged) and SDPA's are timed in :data:`ROUNDS` interleaved rounds,
each keeping its median (:func:`interleaved`); the forced counts, the checked call and flash-attn-4 once.

How decode is timed. A decode step is a few microseconds of GPU work, so a timer that launches one
call at a time measures the host (Python, the launch, any read-back) as much as the GPU. Serving
systems capture their decode steps in CUDA graphs, and so does this benchmark (``timer:
"cuda_graph"``): one graph holds the same call over :func:`copies_for` different caches, so that
together they exceed the L2 cache and every call reads its K and V from HBM, as the layers of a model
do; the figure is the graph's time over the calls. A call that cannot be captured (a read-back inside)
is timed eagerly with ``triton.testing.do_bench`` (``timer: "eager"``), which empties the L2 between
calls; ``triton_checked`` is timed that way on purpose, to show what the check costs.
"""
from __future__ import annotations

import functools
import math
import statistics
import sys

import torch

from ..block_info import BlockInfo
from ..iomodel import AttentionShape
from .schema import empty_row, environment, save_results, write_log

HEADS, HEADS_KV, HEAD_DIM = 32, 8, 128
BATCHES, CACHES = (1, 8, 32), (4096, 16384, 65536)
PAGE_SIZES = (None, 256, 64, 16)
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128)
PREFILL_QUERIES, PREFILL_CACHE, PREFILL_BATCH = 512, 16384, 4
L2_SPAN = 256 << 20  # bytes the captured calls read together: five times an H200's 50 MB L2
GRAPH_REPEATS = 20
ROUNDS = 3  # interleaved rounds of the headline rows (ours dense and paged, SDPA): their median is kept


def kv_bytes(batch: int, seqlen_k: int, heads_kv: int = HEADS_KV, head_dim: int = HEAD_DIM, item: int = 2) -> int:
    """The bytes of K and V one decode step reads."""
    return 2 * batch * seqlen_k * heads_kv * head_dim * item


def copies_for(nbytes: int) -> int:
    """How many caches of ``nbytes`` one graph cycles through so that it reads :data:`L2_SPAN` bytes or more
    (at least 2, at most 32)."""
    return max(2, min(32, math.ceil(L2_SPAN / nbytes)))


def decode_row(impl: str, batch: int, seqlen_k: int, page_size, num_splits, seqlen_q: int = 1,
               timer: str = "cuda_graph") -> dict:
    """A schema row (decode keys) with every figure null."""
    row = empty_row(impl, AttentionShape(batch, HEADS, seqlen_q, HEAD_DIM, seqlen_k=seqlen_k, causal=True,
                                         dtype="bf16"))
    row.update(heads_kv=HEADS_KV, page_size=page_size, num_splits=num_splits, timer=timer)
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


def graph_ms(calls: list, repeats: int = GRAPH_REPEATS) -> float:
    """Median milliseconds per call of a CUDA graph that runs ``calls`` one after another (warmed up,
    compiled, then captured once and replayed ``repeats`` times)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


def ours(caches, num_splits, check_values: bool = False):
    """One call of fa_lab.attention_with_kvcache per cache of ``caches`` (make_cache's tuples)."""
    import fa_lab

    return [lambda c=c: fa_lab.attention_with_kvcache(c[0], c[1], c[2], c[4], block_table=c[3], num_splits=num_splits,
                                                      impl="triton", check_values=check_values) for c in caches]


def sdpa_gqa(caches):
    """SDPA with enable_gqa over the dense caches, in SDPA's (B, heads, N, d) layout."""
    import torch.nn.functional as F

    views = [(c[0].transpose(1, 2), c[1].transpose(1, 2), c[2].transpose(1, 2)) for c in caches]
    return [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for q, k, v in views]


def fa4(caches):
    """flash-attn-4: flash_attn_func on a dense cache, flash_attn_varlen_func with a page table when paged."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    calls = []
    for q, k, v, table, seqlens in caches:
        if table is None:
            calls.append(lambda q=q, k=k, v=v: flash_attn_func(q, k, v, causal=True))
            continue
        batch = q.shape[0]
        q_packed = q.reshape(batch, HEADS, HEAD_DIM)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        calls.append(lambda q=q_packed, k=k, v=v, cu=cu_q, t=table, n=seqlens: flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=n, page_table=t, causal=True))
    return calls


def copy_tbps(timer, nbytes: int) -> float:
    """Device-to-device copy bandwidth, read plus write, of a buffer of ``nbytes`` (at least L2_SPAN)."""
    nbytes = max(nbytes, L2_SPAN)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e12


def measure(row: dict, make, args: tuple, timer, copy: float, nbytes: int) -> dict:
    """Fill the row's time and bandwidth: ``make(*args)`` returns the calls, timed by graph_ms when the
    row's timer is "cuda_graph" (falling back to ``timer`` on the first call, marked "eager", when
    capture fails), else by ``timer``; null figures when the impl refuses the case."""
    try:
        calls = make(*args)
        if row["timer"] == "cuda_graph":
            try:
                ms = graph_ms(calls)
            except Exception as exc:  # not capturable: time it the other way, and say so
                print(f"{row['impl']}: not capturable ({exc!r:.200}); timed eagerly", file=sys.stderr)
                row["timer"] = "eager"
                torch.cuda.synchronize()
        if row["timer"] == "eager":
            ms = timer(calls[0], return_mode="median")
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
             "triton_unchecked": lambda: fa_lab.attention_with_kvcache(q, k, v, seqlens, k_new, v_new, impl="triton",
                                                                       check_values=False),
             "triton_varlen": lambda: fa_lab.attention_varlen(qp, kp, vp, cu_q, cu_k, causal=True, impl="triton")}
    rows = []
    for impl, run in cases.items():
        row = decode_row(impl, batch, cache + n_new, None, None, seqlen_q=n_new, timer="eager")
        try:
            ms = timer(run, return_mode="median")
            row.update(fwd_ms=ms, fwd_tflops=flops / (ms * 1e-3) / 1e12)
        except Exception as exc:
            print(f"chunked prefill {impl}: {exc!r:.300}", file=sys.stderr)
        rows.append(row)
    return rows


def run_decode(json_path=None, timer=None, with_fa4: bool = True, rounds: int = ROUNDS) -> dict:
    """Every row of the module docstring; saved to ``json_path`` after each shape."""
    if timer is None:
        from triton.testing import do_bench as timer
    from ..kvcache import choose_num_splits

    results = {**environment("cuda"), "rows": []}
    rows = results["rows"]
    for batch in BATCHES:
        for cache in CACHES:
            nbytes = kv_bytes(batch, cache)
            copy = copy_tbps(timer, nbytes)
            copies = copies_for(nbytes)
            layouts = {page_size: [make_cache(batch, cache, page_size) for _ in range(copies)]
                       for page_size in PAGE_SIZES}
            headline = []  # (row, make, args): the rows timed again in interleaved rounds
            for page_size, caches in layouts.items():
                chosen = choose_num_splits(batch, HEADS_KV, cache, page_size=page_size)
                headline.append((decode_row("triton", batch, cache, page_size, chosen), ours, (caches, 0)))
                if page_size in (None, 256):  # the heuristic's check: every forced count
                    for splits in SPLIT_SWEEP:
                        rows.append(measure(decode_row("triton_forced", batch, cache, page_size, splits), ours,
                                            (caches, splits), timer, copy, nbytes))
                if page_size is None:
                    rows.append(measure(decode_row("triton_checked", batch, cache, None, chosen, timer="eager"),
                                        ours, (caches, 0, True), timer, copy, nbytes))
                    headline.append((decode_row("sdpa_gqa", batch, cache, None, None), sdpa_gqa, (caches,)))
                if with_fa4 and page_size in (None, 256):
                    rows.append(measure(decode_row("fa4" if page_size is None else "fa4_paged", batch, cache,
                                                   page_size, None), fa4, (caches,), timer, copy, nbytes))
            rows += interleaved(headline, rounds, timer, copy, nbytes)
            del layouts
            torch.cuda.empty_cache()
            if json_path:
                save_results(results, json_path)
    rows += chunked_prefill_rows(timer)
    if json_path:
        save_results(results, json_path)
    return results


def interleaved(entries: list, rounds: int, timer, copy: float, nbytes: int) -> list[dict]:
    """The rows of ``entries`` ((row, make, args) as :func:`measure` takes them), each timed once per round,
    all of them in turn each round; each row keeps its median time. Drift of the GPU's speed over a shape's
    few seconds then shifts every impl alike, where timing one impl after another shifted one against the
    other by up to 2% (docs/experiments/interfaces.md, "Decode: pages of 64 keys read in the loop")."""
    times = [[] for _ in entries]
    for _ in range(rounds):
        for (row, make, args), kept in zip(entries, times):
            timed = measure(dict(row), make, args, timer, copy, nbytes)
            if timed["fwd_ms"] is not None:
                kept.append(timed["fwd_ms"])
                row["timer"] = timed["timer"]
    out = []
    for (row, _, _), kept in zip(entries, times):
        if kept:
            ms = statistics.median(kept)
            row.update(fwd_ms=ms, bytes=nbytes, tbps=nbytes / (ms * 1e-3) / 1e12, copy_tbps=copy)
        out.append(row)
    return out


TUNING_SHAPES = ((1, 4096), (1, 65536), (8, 4096), (32, 4096), (8, 16384), (32, 16384))


def tune_decode(json_path=None, shapes=TUNING_SHAPES, page_sizes=(None, 256, 64)) -> dict:
    """Time every candidate DecodeConfig of the decode kernel at every split count of SPLIT_SWEEP (up to
    16 programs per SM) on ``shapes`` (batch, cache) and page sizes, in CUDA graphs as run_decode does.

    Returns (and writes to ``json_path`` after each shape) ``{device, torch, triton, date, log}``, one log
    entry per timing:
    batch, seqlen_k, page_size, every DecodeConfig field, num_splits, us, tbps. The winners go into
    the decode kernel's table (``fa_lab.kernels.portable.decode``) by hand.
    """
    from ..kernels import load_triton
    from ..kvcache import H200_SMS, check_kvcache

    load_triton()
    from ..kernels.portable.decode import DECODE_CANDIDATES, triton_decode

    log = []
    for batch, cache in shapes:
        nbytes = kv_bytes(batch, cache)
        for page_size in page_sizes:
            caches = [make_cache(batch, cache, page_size) for _ in range(copies_for(nbytes))]
            layout = check_kvcache(*(caches[0][i] for i in (0, 1, 2, 4)), block_table=caches[0][3])
            for config in DECODE_CANDIDATES:
                for splits in (s for s in SPLIT_SWEEP if batch * HEADS_KV * s <= 16 * H200_SMS):
                    calls = [functools.partial(triton_decode, c[0], c[1], c[2], c[4], c[3], layout, True,
                                               HEAD_DIM ** -0.5, (-1, -1), 0.0, splits, config) for c in caches]
                    try:
                        ms = graph_ms(calls)
                    except Exception as exc:  # a config that does not fit
                        print(f"tune decode {config}: {exc!r:.200}", file=sys.stderr)
                        continue
                    log.append({"batch": batch, "seqlen_k": cache, "page_size": page_size, **vars(config),
                                "num_splits": splits, "us": ms * 1e3, "tbps": nbytes / (ms * 1e-3) / 1e12})
            best = max((e for e in log if (e["batch"], e["seqlen_k"], e["page_size"]) == (batch, cache, page_size)),
                       key=lambda e: e["tbps"], default=None)
            print(f"tune decode B={batch} N={cache} pages={page_size}: best {best}", file=sys.stderr)
            del caches
            torch.cuda.empty_cache()
            if json_path:  # after each shape, so that a run cut short keeps what it timed
                write_log({**environment("cuda"), "log": log}, json_path)
    return {**environment("cuda"), "log": log}


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

    rows = [r for r in results["rows"]
            if r["tbps"] is not None and r["impl"] not in ("triton_forced", "triton_checked")]
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
