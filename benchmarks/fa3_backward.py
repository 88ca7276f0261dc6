"""The Gluon FA3 backward (fa_lab/kernels/hopper/fa3_backward.py) against the portable two-kernel backward,
SDPA's cuDNN and FlashAttention-2 backwards and, where installed, the upstream flash-attn-4 (``fa4``, its
SM90 path FA3's design, installed as benchmarks/run_device.sh's ``interfaces`` step says), on the FA3-paper
shapes (16K tokens, hidden 2048, bf16, d = 64 and 128, causal and not, 1K-16K), one run; rows in the results
schema (bwd_ms, bwd_tflops; forward figures null).

Ours are timed as the backward launch alone (preprocess, kernels, the cast of dQ) on the forward's O and LSE;
SDPA's and fa4's as ``out.backward(grad)`` on their own forward's graph. do_bench medians; TFLOP/s by
``attention_flops(shape, "bwd")`` (2.5 times the forward's).

On the H200: ``PYTHONPATH=. python3 benchmarks/fa3_backward.py run $OUT`` writes $OUT/h200_backward.json;
anywhere: ``python3 benchmarks/fa3_backward.py plot benchmarks/h200_backward.json benchmarks/h200_backward.png``.
``... fa3_backward.py dq $OUT`` times the Gluon backward's dQ schemes (``dq_mode`` "turns", "partial", "named" and, at
d = 128, "split") against each other, alternating, two rounds, into $OUT/h200_backward_dq.json (a log, not results
rows); ``... fa3_backward.py rows $OUT`` its steps of 64 and 128 query rows at d = 64 the same way, into
$OUT/h200_backward_rows.json; ``... fa3_backward.py row-vectors $OUT`` the lse2 and D rows loaded by the consumers
or by the producer, into $OUT/h200_backward_row_vectors.json; ``... fa3_backward.py varlen-row-vectors $OUT`` the same
on a packed batch, into $OUT/h200_varlen_row_vectors.json; ``... fa3_backward.py head-groups $OUT`` the causal
launch's CTAs head by head against in groups of heads, key tile by key tile, into $OUT/h200_backward_head_groups.json;
``... fa3_backward.py rows-ahead $OUT`` the producer's loads of a step's rows one step ahead against after its wait
for the slot, into $OUT/h200_backward_rows_ahead.json; ``... fa3_backward.py kv-split $OUT`` a grouped-query call's
group split over 1, 2 and 4 CTAs, into $OUT/h200_backward_kv_split.json.
"""
import functools
import json
import os
import sys

IMPLS = ("triton_hopper", "triton", "sdpa_cudnn", "sdpa_flash", "fa4")
LABELS = {"triton_hopper": "ours, Gluon FA3 backward", "triton": "ours, portable two-kernel backward",
          "sdpa_cudnn": "SDPA cuDNN", "sdpa_flash": "SDPA FlashAttention-2", "fa4": "flash-attn-4 (upstream)"}


def fa4_backward(q, k, v, grad, causal: bool):
    """flash-attn-4's backward on its own forward's graph, in its (B, N, heads, d) layout, and the leaves to
    clear; None where the package is not installed."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    from fa_lab.bench.interfaces import fa4_output

    leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    out = fa4_output(flash_attn_func(*leaves, causal=causal))
    return functools.partial(out.backward, grad.transpose(1, 2).contiguous(), retain_graph=True), leaves


def run(out_dir: str) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from fa_lab.bench.gpu import HIDDEN, TOTAL_TOKENS
    from fa_lab.bench.schema import empty_row, environment
    from fa_lab.iomodel import AttentionShape, attention_flops
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.attention import gluon_backward, gluon_forward
    from fa_lab.kernels.portable.attention import triton_backward

    load_triton()
    backends = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}
    rows = []
    for head_dim in (64, 128):
        for causal in (False, True):
            for seqlen in (1024, 2048, 4096, 8192, 16384):
                shape = AttentionShape(TOTAL_TOKENS // seqlen, HIDDEN // head_dim, seqlen, head_dim, causal=causal)
                q, k, v, grad = (torch.randn(shape.batch, shape.heads, seqlen, head_dim, device="cuda",
                                             dtype=torch.bfloat16) for _ in range(4))
                scale = head_dim ** -0.5
                out, lse = gluon_forward(q, k, v, causal, scale)
                operands = (q, k, v, out, lse, grad, causal, scale)
                timed = {"triton_hopper": (functools.partial(gluon_backward, *operands), None),
                         "triton": (functools.partial(triton_backward, *operands), None)}
                for name, backend in backends.items():
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    with sdpa_kernel(backend):
                        sdpa_out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
                    timed[name] = (functools.partial(sdpa_out.backward, grad, retain_graph=True), leaves)
                upstream = fa4_backward(q, k, v, grad, causal)
                if upstream is not None:
                    timed["fa4"] = upstream
                line = []
                for impl in (name for name in IMPLS if name in timed):
                    row = empty_row(impl, shape)
                    fn, leaves = timed[impl]
                    ms = do_bench(fn, grad_to_none=leaves, return_mode="median")
                    row.update(bwd_ms=ms, bwd_tflops=attention_flops(shape, "bwd") / (ms * 1e-3) / 1e12)
                    rows.append(row)
                    line.append(f"{impl} {row['bwd_tflops']:.0f}")
                print(f"d={head_dim} causal={causal} N={seqlen}: " + ", ".join(line), flush=True)
                with open(os.path.join(out_dir, "h200_backward.json"), "w") as file:  # after every shape
                    json.dump({**environment("cuda"), "rows": rows}, file, indent=1)


def time_in_turn(entry: dict, backward, variants: dict, flops: float, rounds: int) -> None:
    """Time ``backward(**kwargs)`` for each name's kwargs in turn, ``rounds`` times; append each median's TFLOP/s
    to entry[name]."""
    from triton.testing import do_bench

    for _round in range(rounds):
        for name, kwargs in variants.items():
            ms = do_bench(functools.partial(backward, **kwargs), return_mode="median")
            entry.setdefault(name, []).append(round(flops / (ms * 1e-3) / 1e12, 1))


def alternating(out_dir: str, filename: str, head_dims, seqlens, variants, causals=(False, True),
                grouped_query=()) -> None:
    """A/B of gluon_backward's keyword arguments on the FA3-paper shapes (16K tokens, hidden 2048), and at the
    head_dims in ``grouped_query`` also on chapter 05's grouped-query shape (32 query heads over 8 K/V heads, 16K
    tokens): ``variants(head_dim)`` maps a name to the arguments; each shape's variants are timed in turn, twice,
    into a log of TFLOP/s per name."""
    import torch

    from fa_lab.bench.gpu import HIDDEN, TOTAL_TOKENS
    from fa_lab.bench.schema import environment, write_log
    from fa_lab.iomodel import AttentionShape, attention_flops
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.attention import gluon_backward, gluon_forward

    load_triton()
    layouts = [(head_dim, 32, 8) for head_dim in grouped_query]
    layouts += [(head_dim, HIDDEN // head_dim, HIDDEN // head_dim) for head_dim in head_dims]
    log = []
    for head_dim, heads, heads_kv in layouts:
        for causal in causals:
            for seqlen in seqlens:
                shape = AttentionShape(TOTAL_TOKENS // seqlen, heads, seqlen, head_dim, causal=causal)
                q, grad = (torch.randn(shape.batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(2))
                k, v = (torch.randn(shape.batch, heads_kv, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
                scale = head_dim ** -0.5
                out, lse = gluon_forward(q, k, v, causal, scale)
                entry = {"head_dim": head_dim, "heads": heads, "heads_kv": heads_kv, "causal": causal,
                         "seqlen": seqlen}
                time_in_turn(entry, functools.partial(gluon_backward, q, k, v, out, lse, grad, causal, scale),
                             variants(head_dim), attention_flops(shape, "bwd"), rounds=2)
                log.append(entry)
                print(entry, flush=True)
                write_log({**environment("cuda"), "log": log}, os.path.join(out_dir, filename))


def dq_modes(out_dir: str) -> None:
    """The dQ schemes (every DQ_MODES entry; "split" at d = 128 only) from 2K: h200_backward_dq.json."""
    from fa_lab.kernels.hopper.attention import DQ_MODES

    alternating(out_dir, "h200_backward_dq.json", (128, 64), (2048, 4096, 8192, 16384),
                lambda head_dim: {mode: {"dq_mode": mode} for mode in DQ_MODES if head_dim == 128 or mode != "split"})


def step_rows(out_dir: str) -> None:
    """Query rows per step at d = 64, 64 against 128, from 1K: h200_backward_rows.json."""
    alternating(out_dir, "h200_backward_rows.json", (64,), (1024, 2048, 4096, 8192, 16384),
                lambda head_dim: {f"{rows} rows": {"rows": rows} for rows in (64, 128)})


def row_vectors(out_dir: str) -> None:
    """lse2 and D loaded by each consumer from global memory, or by the producer into shared memory with Q
    (``rows_by_producer``), at 4K and 16K: h200_backward_row_vectors.json."""
    alternating(out_dir, "h200_backward_row_vectors.json", (128, 64), (4096, 16384),
                lambda head_dim: {"consumers": {}, "producer": {"rows_by_producer": True}})


def varlen_row_vectors(out_dir: str) -> None:
    """The packed batch of the interfaces benchmark (16K tokens of random lengths in [128, 4096], 32 heads, bf16),
    causal and not at d = 128, causal at d = 64: gluon_varlen_backward with lse2 and D loaded by each consumer or
    brought by the producer, alternating, three rounds: h200_varlen_row_vectors.json."""
    import torch

    from fa_lab.bench.interfaces import HEADS, cu_seqlens, varlen_lengths
    from fa_lab.bench.schema import environment, write_log
    from fa_lab.iomodel import AttentionShape, attention_flops
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.attention import gluon_varlen_backward, gluon_varlen_forward
    from fa_lab.kernels.portable.attention import ScoreOptions

    load_triton()
    lengths = varlen_lengths()
    cu = cu_seqlens(lengths).cuda()
    bounds = (cu.tolist(), cu.tolist())
    log = []
    for head_dim, causal in ((128, True), (128, False), (64, True)):
        q, k, v, grad = (torch.randn(sum(lengths), HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        scale = head_dim ** -0.5
        out, lse = gluon_varlen_forward(q, k, v, cu, cu, bounds, causal, scale, ScoreOptions())
        flops = sum(attention_flops(AttentionShape(1, HEADS, n, head_dim, causal=causal), "bwd") for n in lengths)
        entry = {"head_dim": head_dim, "causal": causal, "lengths": len(lengths)}
        backward = functools.partial(gluon_varlen_backward, q, k, v, out, lse, grad, cu, cu, bounds, causal, scale)
        variants = {"consumers": {"rows_by_producer": False}, "producer": {"rows_by_producer": True}}
        time_in_turn(entry, backward, variants, flops, rounds=3)
        log.append(entry)
        print(entry, flush=True)
        write_log({**environment("cuda"), "log": log}, os.path.join(out_dir, "h200_varlen_row_vectors.json"))


def head_groups(out_dir: str) -> None:
    """Causal, 2K-16K: the dense launch's CTAs head by head (head_group 1) against heads_per_group's groups run key
    tile by key tile, on chapter 05's grouped-query shape at d = 128 and the FA3-paper shapes at d = 128 and 64:
    h200_backward_head_groups.json."""
    alternating(out_dir, "h200_backward_head_groups.json", (128, 64), (2048, 4096, 8192, 16384),
                lambda head_dim: {"head by head": {"head_group": 1}, "grouped": {}}, causals=(True,),
                grouped_query=(128,))


def rows_ahead(out_dir: str) -> None:
    """The producer loading each step's lse2 and D rows one step ahead (``rows_ahead``) against after its wait for the
    slot, 1K-16K, causal and not, d = 128 and 64 and chapter 05's grouped-query shape at d = 128:
    h200_backward_rows_ahead.json."""
    alternating(out_dir, "h200_backward_rows_ahead.json", (128, 64), (1024, 2048, 4096, 8192, 16384),
                lambda head_dim: {"after the wait": {}, "a step ahead": {"rows_ahead": True}}, grouped_query=(128,))


def kv_split(out_dir: str) -> None:
    """Chapter 05's grouped-query shape (32 query heads over 8 K/V heads, d = 128), 2K-16K, causal and not: one CTA
    per (key tile, K/V head) walking the group's 4 query heads, against the group split over 2 and 4 CTAs
    (``kv_split``, float32 dK and dV partials summed after): h200_backward_kv_split.json."""
    alternating(out_dir, "h200_backward_kv_split.json", (), (2048, 4096, 8192, 16384),
                lambda head_dim: {"one CTA a group": {}, "split in 2": {"kv_split": 2}, "split in 4": {"kv_split": 4}},
                grouped_query=(128,))


def plot(results_path: str, png_path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(results_path) as file:
        results = json.load(file)
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6), sharey=True)
    panels = [(d, c) for d in (128, 64) for c in (False, True)]
    for ax, (head_dim, causal) in zip(axes, panels):
        for impl in IMPLS:
            points = sorted((r["seqlen_q"], r["bwd_tflops"]) for r in results["rows"]
                            if r["impl"] == impl and r["head_dim"] == head_dim and r["causal"] == causal)
            if points:
                ax.plot([n // 1024 for n, _ in points], [t for _, t in points], "o-", label=LABELS[impl])
        ax.set(title=f"d = {head_dim}, {'causal' if causal else 'not causal'}", xlabel="sequence length (K)",
               xscale="log", xticks=[1, 2, 4, 8, 16], xticklabels=["1", "2", "4", "8", "16"])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("backward TFLOP/s")
    axes[0].legend(frameon=False, fontsize=8)
    fig.suptitle(f"Backward, bf16, FA3-paper shapes: {results['device']}, {results['date']}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    steps = {"run": run, "dq": dq_modes, "rows": step_rows, "row-vectors": row_vectors,
             "varlen-row-vectors": varlen_row_vectors, "head-groups": head_groups, "rows-ahead": rows_ahead,
             "kv-split": kv_split}
    if sys.argv[1] in steps:
        steps[sys.argv[1]](sys.argv[2])
    else:
        plot(sys.argv[2], sys.argv[3])
