"""The sparse benchmark (chapter 07, on a CUDA GPU): NSA's selected-blocks branch and MoBA, ours against
flash-linear-attention's (``fla-core``, where installed), with dense causal attention at the same shape.

Case ``nsa_select``: bf16, d = 128, batch 1, 64 query heads over 4 KV heads (a group of 16, the smallest
fla's NSA kernel takes), sequences of 16K, 32K and 64K tokens, each query attending to 16 blocks of 64
keys chosen per (query, KV head) as NSA chooses them (its own block, and the top-scoring past blocks of
random scores; fewer where the past is shorter), causally. Both impls get the same selection. Ours
(``triton``) is the autograd function behind :func:`fa_lab.kernels.triton_block_select_attention`, timed
without the selection checks that function runs first (they run once, before timing; fla checks none);
``fla_nsa`` is ``fla.ops.nsa.parallel.ParallelNSAFunction``; ``dense`` is ``fa_lab.attention(causal=True,
impl="triton_hopper")`` on the same q, k, v (grouped K/V). At 32K the sweep also runs ours with 2 to 128
selected blocks: the speed-up over dense attention against the share of the causal pairs kept.

Case ``nsa``: NSA end to end at the ``nsa_select`` shapes, ``fa_lab.sparse.nsa_attention(impl="triton")`` (the
compressed branch over mean keys of NSA_BLOCK_CMP tokens on the dense kernels, the importance kernel and top-k
choosing SELECTED blocks of BLOCK_K keys per query and KV head, the selected-blocks kernel, a window of
NSA_WINDOW keys, random gates), against ``dense`` at that shape. FLOPs count the three branches' visible pairs,
the selection as the importance kernel makes it.

Case ``moba``: bf16, d = 128, batch 1, 32 heads (MoBA gates per head, so K/V have 32 heads too), 32K and
64K tokens, blocks of 4096 keys, top-3 (the own block and two past ones). Ours is
``fa_lab.sparse.moba_attention(impl="triton")`` end to end (the gate, both passes and their merge,
:mod:`fa_lab.kernels.portable.moba`; on the H200 the passes run on the Gluon FA3 kernels); ``fla_moba`` is
``fla.ops.moba.parallel_moba``, which calls flash-attn 2's varlen kernels: where only flash-attn-4 is
installed, as on the device here, :mod:`.fa2_api` serves those calls with flash-attn-4's kernels (the file's
``fla_moba_attention`` says which ran); ``dense`` as above. The rows'
``block_k`` and ``selected`` are the block size and top-k.

TFLOP/s count 4 * d FLOPs per visible (query, key) pair per query head (2.5 times that for the
backward), the pairs of the selection (or of the causal mask for ``dense``). Times are medians of
``triton.testing.do_bench``. Rows follow :mod:`.schema` with its sparse keys.

The chapter's bars compare NSA's and MoBA's forward with dense attention's at the longest length. Each row is
timed once, minutes apart from its peer, and dense attention's forward alone has moved by up to 7% from run to
run; so the file's ``bars_in_turn`` also times each of those two pairs in turn, BAR_ROUNDS rounds
(:func:`bars_in_turn`).
"""
from __future__ import annotations

import sys

import torch

from ..block_info import BlockInfo
from ..iomodel import AttentionShape
from ..sparse import moba_gate
from .interfaces import time_forward_backward
from .schema import empty_row, environment, save_results

HEADS, HEADS_KV, HEAD_DIM, BLOCK_K, SELECTED = 64, 4, 128, 64, 16
SEQLENS = (16384, 32768, 65536)
IMPLS = ("triton", "fla_nsa", "dense")
SWEEP_SEQLEN, SWEEP_SELECTED = 32768, (2, 4, 8, 32, 64, 128)  # with SELECTED from the main sweep
NSA_BLOCK_CMP, NSA_WINDOW = 32, 512  # NSA's compression block and window (its paper's sizes, without the stride)
MOBA_HEADS, MOBA_BLOCK, MOBA_TOP_K = 32, 4096, 3
MOBA_SEQLENS = (32768, 65536)
MOBA_IMPLS = ("triton", "fla_moba", "dense")
BAR_ROUNDS = 3  # rounds of the bars' forward ratios timed in turn (bars_in_turn)


def nsa_selection(seqlen: int, generator: torch.Generator, device="cuda", selected: int = SELECTED) -> torch.Tensor:
    """(1, HEADS_KV, seqlen, selected) int32: per query and KV head, its own block and the top-scoring past
    blocks of uniform random scores, -1 where the past holds fewer blocks."""
    blocks = -(-seqlen // BLOCK_K)
    own = torch.arange(seqlen, device=device) // BLOCK_K
    scores = torch.rand(1, HEADS_KV, seqlen, blocks, generator=generator, device=device)
    future = torch.arange(blocks, device=device)[None, :] > own[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    scores.scatter_(-1, own.view(1, 1, -1, 1).expand(1, HEADS_KV, seqlen, 1), float("inf"))
    top, index = scores.topk(min(selected, blocks), dim=-1)
    return torch.where(top == float("-inf"), -1, index).to(torch.int32)


def selection_pairs(selection: torch.Tensor) -> int:
    """Visible (query, key) pairs per query head of a causal per-query selection (B, Hkv, N, S), summed
    over the KV heads (each KV head's selection serves HEADS // HEADS_KV query heads)."""
    queries = torch.arange(selection.shape[2], device=selection.device).view(1, 1, -1, 1)
    start = selection.long() * BLOCK_K
    visible = (queries - start + 1).clamp(0, BLOCK_K)
    return int(torch.where(selection >= 0, visible, 0).sum())


def nsa_pairs(selection: torch.Tensor, seqlen: int) -> int:
    """Visible (query, key) pairs of NSA end to end at the bench's sizes, summed over the query heads: the
    compressed branch's (query i sees (i + 1) // NSA_BLOCK_CMP mean keys), the selected branch's under
    ``selection`` (B, HEADS_KV, N, SELECTED) and the window's."""
    queries = torch.arange(seqlen, device=selection.device)
    per_head = int(((queries + 1) // NSA_BLOCK_CMP).sum()) + int((queries + 1).clamp(max=NSA_WINDOW).sum())
    return per_head * HEADS + selection_pairs(selection) * (HEADS // HEADS_KV)


def nsa_end_to_end_selection(q, k) -> torch.Tensor:
    """The selection nsa_attention(impl="triton") makes at the bench's sizes (what its FLOPs count)."""
    from ..sparse import nsa_compress, nsa_select

    with torch.no_grad():
        return nsa_select(q.detach(), nsa_compress(k.detach(), NSA_BLOCK_CMP), NSA_BLOCK_CMP, BLOCK_K, SELECTED,
                          HEAD_DIM ** -0.5, "triton")


def moba_pairs(selected: torch.Tensor, block: int) -> int:
    """Visible (query, key) pairs of a MoBA selection (B, H, N, top_k) (own block first), summed over the
    heads: the own block causally, every key of each selected past block."""
    queries = torch.arange(selected.shape[2], device=selected.device)
    own = int(((queries % block) + 1).sum()) * selected.shape[0] * selected.shape[1]
    return own + int((selected[..., 1:] >= 0).sum()) * block


def sparse_row(impl: str, seqlen: int, case: str = "nsa_select", selected: int = SELECTED) -> dict:
    """A row of ``case`` ("nsa_select", "nsa" or "moba"; impl "dense" makes it the "dense" case at that shape)."""
    heads, heads_kv, block_k = (MOBA_HEADS, MOBA_HEADS, MOBA_BLOCK) if case == "moba" else (HEADS, HEADS_KV, BLOCK_K)
    if case == "moba":
        selected = MOBA_TOP_K
    row = empty_row(impl, AttentionShape(1, heads, seqlen, HEAD_DIM, causal=True, dtype="bf16"))
    row.update(case="dense" if impl == "dense" else case, heads_kv=heads_kv, block_k=block_k, selected=selected)
    return row


def kernel_indices(selection: torch.Tensor, q, k) -> torch.Tensor:
    """The NSA case's selection (one query per row, blocks of BLOCK_K, causal) checked against q and k, as the
    kernels take it: int32, contiguous."""
    from ..sparse import check_key_tiles

    return check_key_tiles(selection, q, k, 1, BLOCK_K, True, name="selection").to(torch.int32).contiguous()


def nsa_backward_operands(seqlen: int, generator: torch.Generator) -> tuple:
    """The positional operands of ``block_select_backward`` for the NSA case at ``seqlen``: detached bf16
    q, k, v, the forward's out and lse, a random grad_out, the checked selection, block_q = 1, BLOCK_K,
    causal and the scale (what the scripts that time the backward alone share)."""
    from ..kernels.portable.sparse_select import block_select_forward

    q, k, v = (t.detach() for t in bf16_inputs(HEADS, HEADS_KV, seqlen, generator))
    indices = kernel_indices(nsa_selection(seqlen, generator), q, k)
    scale = HEAD_DIM ** -0.5
    out, lse = block_select_forward(q, k, v, indices, 1, BLOCK_K, True, scale)
    return q, k, v, out, lse, torch.randn_like(out), indices, 1, BLOCK_K, True, scale


def ours(q, k, v, selection):
    from ..kernels.portable.sparse_select import BlockSelectFunction

    indices = kernel_indices(selection, q, k)
    scale = HEAD_DIM ** -0.5
    return (lambda: BlockSelectFunction.apply(q, k, v, indices, 1, BLOCK_K, True, scale)[0]), (q, k, v)


def dense(q, k, v, _selection):
    import fa_lab

    return (lambda: fa_lab.attention(q, k, v, causal=True, impl="triton_hopper")), (q, k, v)


def fla_nsa(q, k, v, selection):
    """fla's selected-blocks attention, in its (B, T, H, d) layout, on the same selection."""
    from fla.ops.nsa.parallel import ParallelNSAFunction

    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    indices = selection.permute(0, 2, 1, 3).long().contiguous()  # (B, T, Hkv, S); -1 slots are skipped
    scale = HEAD_DIM ** -0.5
    return (lambda: ParallelNSAFunction.apply(qt, kt, vt, indices, SELECTED, BLOCK_K, scale, None)), (qt, kt, vt)


def ours_nsa(q, k, v, _selection):
    from ..sparse import nsa_attention

    generator = torch.Generator(device=q.device).manual_seed(q.shape[2])
    gates = torch.rand(*q.shape[:3], 3, device=q.device, generator=generator).to(q.dtype)
    return (lambda: nsa_attention(q, k, v, gates, NSA_BLOCK_CMP, BLOCK_K, SELECTED, NSA_WINDOW,
                                  impl="triton")[0]), (q, k, v)


def ours_moba(q, k, v, _selection):
    from ..sparse import moba_attention

    return (lambda: moba_attention(q, k, v, MOBA_BLOCK, MOBA_TOP_K, impl="triton")[0]), (q, k, v)


def fla_moba(q, k, v, _selection):
    """fla's MoBA (gate and both passes) in its (B, T, H, d) layout, one sequence; its flash-attn 2 calls
    served by flash-attn-4 where flash-attn 2 is absent (:func:`.fa2_api.install_fa2_varlen_api`)."""
    from .fa2_api import install_fa2_varlen_api

    install_fa2_varlen_api()
    from fla.ops.moba import parallel_moba

    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    cu_seqlens = torch.tensor([0, q.shape[2]], dtype=torch.long, device=q.device)
    return (lambda: parallel_moba(qt, kt, vt, cu_seqlens, q.shape[2], MOBA_BLOCK, MOBA_TOP_K)), (qt, kt, vt)


def measure(row: dict, make, tensors, selection, flops_fwd: float, timer) -> dict:
    """Fill ``row`` (``make(q, k, v, selection) -> (run, leaves)``); null figures when the impl is missing or
    refuses the case."""
    try:
        fwd_ms, bwd_ms = time_forward_backward(*make(*tensors, selection), timer)
    except Exception as exc:  # a peer that is not installed or refuses must not end the sweep
        print(f"{row['impl']} {row['case']} N={row['seqlen_q']}: {exc!r:.300}", file=sys.stderr)
        return row
    row.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_tflops=flops_fwd / (fwd_ms * 1e-3) / 1e12,
               bwd_tflops=2.5 * flops_fwd / (bwd_ms * 1e-3) / 1e12)
    return row


def log_by_length(path, measure, seqlens=SEQLENS) -> None:
    """The A/B scripts' run (benchmarks/nsa_*.py): ``measure(seqlen, generator) -> dict`` at each length, one CUDA
    generator seeded 0 for the run, each entry printed and the log so far (the schema's header and ``log``, one
    entry a length) written to ``path``."""
    from ..kernels import load_triton
    from .schema import write_log

    load_triton()
    generator = torch.Generator(device="cuda").manual_seed(0)
    log = []
    for seqlen in seqlens:
        log.append({"seqlen": seqlen, **measure(seqlen, generator)})
        print(log[-1], flush=True)
        write_log({**environment("cuda"), "log": log}, path)
        torch.cuda.empty_cache()


def dense_forward_ms(q, k, v) -> float:
    """The A/B scripts' peer: dense attention's forward (:func:`dense`) on q, k, v, its do_bench median in ms."""
    from triton.testing import do_bench

    return round(do_bench(dense(q, k, v, None)[0], return_mode="median"), 3)


def called_with(module, name: str, value, call):
    """call() with ``module.name`` set to ``value`` (an A/B script's switch), the module's own value restored
    after."""
    default = getattr(module, name)
    setattr(module, name, value)
    try:
        return call()
    finally:
        setattr(module, name, default)


def bf16_inputs(heads: int, heads_kv: int, seqlen: int, generator: torch.Generator):
    """q (1, heads, seqlen, d), k, v (1, heads_kv, seqlen, d), bf16 on the GPU, requiring grad."""
    def rand(h):
        return torch.randn(1, h, seqlen, HEAD_DIM, device="cuda", generator=generator).to(torch.bfloat16)

    return tuple(t.requires_grad_() for t in (rand(heads), rand(heads_kv), rand(heads_kv)))


def run_sparse(json_path=None, seqlens=SEQLENS, impls=IMPLS, timer=None, moba_seqlens=MOBA_SEQLENS,
               sweep_selected=SWEEP_SELECTED, progress=print, bars=True) -> dict:
    """The NSA selection at every length (and its sparsity sweep at SWEEP_SEQLEN), then MoBA at every
    length, then (``bars``) :func:`bars_in_turn` at the longest of ``seqlens``; saved to ``json_path`` after each
    length."""
    if timer is None:
        from triton.testing import do_bench as timer
    makers = {"triton": ours, "fla_nsa": fla_nsa, "dense": dense}
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = {**environment("cuda"), "rows": []}

    def add(row, make, tensors, selection, pairs):
        results["rows"].append(measure(row, make, tensors, selection, 4.0 * HEAD_DIM * pairs, timer))
        progress(f"{row['impl']} {row['case']} N={row['seqlen_q']} selected={row['selected']}: {row['fwd_ms']} / "
                 f"{row['bwd_ms']} ms")
        torch.cuda.empty_cache()

    for seqlen in seqlens:
        tensors = bf16_inputs(HEADS, HEADS_KV, seqlen, generator)
        selection = nsa_selection(seqlen, generator)
        group = HEADS // HEADS_KV
        pairs = {"dense": BlockInfo(seqlen, seqlen, True).visible_pairs() * HEADS}
        pairs["triton"] = pairs["fla_nsa"] = selection_pairs(selection) * group
        for impl in impls:
            add(sparse_row(impl, seqlen), makers[impl], tensors, selection, pairs[impl])
        if "triton" in impls:
            add(sparse_row("triton", seqlen, case="nsa"), ours_nsa, tensors, None,
                nsa_pairs(nsa_end_to_end_selection(*tensors[:2]), seqlen))
        if seqlen == SWEEP_SEQLEN and "triton" in impls:
            for count in sweep_selected:
                selection = nsa_selection(seqlen, generator, selected=count)
                add(sparse_row("triton", seqlen, selected=count), ours, tensors, selection,
                    selection_pairs(selection) * group)
        del tensors
        if json_path:
            save_results(results, json_path)
    moba_makers = {"triton": ours_moba, "fla_moba": fla_moba, "dense": dense}
    from .fa2_api import install_fa2_varlen_api
    results["fla_moba_attention"] = install_fa2_varlen_api()
    for seqlen in moba_seqlens:
        tensors = bf16_inputs(MOBA_HEADS, MOBA_HEADS, seqlen, generator)
        with torch.no_grad():
            kept = moba_pairs(moba_gate(tensors[0], tensors[1], MOBA_BLOCK, MOBA_TOP_K), MOBA_BLOCK)
        pairs = {"dense": BlockInfo(seqlen, seqlen, True).visible_pairs() * MOBA_HEADS, "triton": kept,
                 "fla_moba": kept}
        for impl in MOBA_IMPLS:
            add(sparse_row(impl, seqlen, case="moba"), moba_makers[impl], tensors, None, pairs[impl])
        del tensors
        if json_path:
            save_results(results, json_path)
    if bars and "triton" in impls:
        results["bars_in_turn"] = bars_in_turn(generator, max(seqlens), timer=timer)
        progress(f"in turn at {max(seqlens) // 1024}K: " + ", ".join(f"{what} {value:.3f}"
                                                                    for what, value in bar_ratios(results)))
        if json_path:
            save_results(results, json_path)
    return results


def bars_in_turn(generator: torch.Generator, seqlen: int, rounds: int = BAR_ROUNDS, timer=None) -> dict:
    """NSA end to end and MoBA, each beside dense attention at its shape, forward, timed in turn ``rounds`` times
    over (:func:`.in_turn.medians_in_turn`) after one timing of each call that is thrown away (as the rows' is):
    {"seqlen", "rounds", "nsa ms", "nsa dense ms", "moba ms", "moba dense ms" (one median a round), and
    "<case>: dense time / ours fwd" (the ratio of the rounds' medians)}."""
    from statistics import median

    from .in_turn import medians_in_turn

    if timer is None:
        from triton.testing import do_bench as timer
    entry = {"seqlen": seqlen, "rounds": rounds}
    for case, make, heads in (("nsa", ours_nsa, (HEADS, HEADS_KV)), ("moba", ours_moba, (MOBA_HEADS, MOBA_HEADS))):
        tensors = bf16_inputs(*heads, seqlen, generator)
        calls = {case: make(*tensors, None)[0], f"{case} dense": dense(*tensors, None)[0]}
        for call in calls.values():
            timer(call, return_mode="median")
        medians_in_turn(calls, entry, rounds, timer=timer)
        entry[f"{case}: dense time / ours fwd"] = round(median(entry[f"{case} dense ms"]) /
                                                        median(entry[f"{case} ms"]), 4)
        del tensors, calls
        torch.cuda.empty_cache()
    return entry


def bar_ratios(results: dict) -> list[tuple[str, float]]:
    """(what, value) of a results file's :func:`bars_in_turn` entry (none where the run had none)."""
    entry = results.get("bars_in_turn")
    if not entry:
        return []
    return [(f"{what}, {entry['seqlen'] // 1024}K, in turn ({entry['rounds']} rounds)", value)
            for what, value in entry.items() if what.endswith("/ ours fwd")]


def breakdowns(seqlen: int = 65536, progress=print) -> None:
    """Print our kernels' times, forward and backward, for the NSA selection, NSA end to end and MoBA at ``seqlen``
    (:mod:`.breakdown`): where the time of a multi-kernel op goes."""
    from .breakdown import format_breakdown, kernel_times, passes

    generator = torch.Generator(device="cuda").manual_seed(seqlen)
    cases = (("nsa_select", ours, (HEADS, HEADS_KV), lambda: nsa_selection(seqlen, generator)),
             ("nsa", ours_nsa, (HEADS, HEADS_KV), lambda: None),
             ("moba", ours_moba, (MOBA_HEADS, MOBA_HEADS), lambda: None))
    for case, make, heads, selection in cases:
        tensors = bf16_inputs(*heads, seqlen, generator)
        run, leaves = make(*tensors, selection())
        for what, call in passes(run, leaves):
            progress(format_breakdown(f"ours {case} N={seqlen} {what}", kernel_times(call)))
        del tensors
        torch.cuda.empty_cache()


def speedups(rows: list[dict]) -> list[tuple[str, float]]:
    """(what, value): ours over fla's kernel (fla_nsa, fla_moba: forward, backward) and over dense attention's
    time at the same shape, per case and length (the NSA case at SELECTED blocks)."""
    def find(impl, case, seqlen):
        heads = MOBA_HEADS if case == "moba" else HEADS
        return next((r for r in rows if r["impl"] == impl and r["case"] in (case, "dense") and r["heads"] == heads
                     and r["seqlen_q"] == seqlen and r["fwd_ms"]
                     and (case == "moba" or impl == "dense" or r["selected"] == SELECTED)), None)

    found = []
    for case, peer in (("nsa_select", "fla_nsa"), ("nsa", None), ("moba", "fla_moba")):
        for seqlen in sorted({r["seqlen_q"] for r in rows if r["case"] == case}):
            ours_row, peer_row, dense_row = find("triton", case, seqlen), find(peer, case, seqlen), \
                find("dense", case, seqlen)
            for metric in ("fwd_ms", "bwd_ms"):
                for name, other in ((peer, peer_row), ("dense", dense_row)) if peer else (("dense", dense_row),):
                    if ours_row and other and ours_row[metric] and other[metric]:
                        found.append((f"{case}: {name} time / ours {metric[:3]}, {seqlen // 1024}K",
                                      other[metric] / ours_row[metric]))
    return found


def sparsity_curve(rows: list[dict], seqlen: int = SWEEP_SEQLEN) -> list[tuple[float, float, float]]:
    """(share of the causal pairs kept, dense time / ours forward, backward) of our NSA-selection rows at
    ``seqlen``, by share: the speed-up a selection buys against what it keeps."""
    dense_row = next((r for r in rows if r["case"] == "dense" and r["heads"] == HEADS and r["seqlen_q"] == seqlen
                      and r["fwd_ms"]), None)
    if dense_row is None:
        return []
    curve = []
    for r in rows:
        if r["impl"] == "triton" and r["case"] == "nsa_select" and r["seqlen_q"] == seqlen and r["fwd_ms"]:
            kept = (r["fwd_tflops"] * r["fwd_ms"]) / (dense_row["fwd_tflops"] * dense_row["fwd_ms"])  # pairs ratio
            curve.append((kept, dense_row["fwd_ms"] / r["fwd_ms"],
                          dense_row["bwd_ms"] / r["bwd_ms"] if r["bwd_ms"] and dense_row["bwd_ms"] else None))
    return sorted(curve)


def plot_sparse(results: dict, dpi=90):
    """Three panels: NSA's selected branch (ours, fla's, dense) and NSA end to end (ours) against N; MoBA (same)
    against N; the speed-up over dense attention against the share of causal pairs a selection keeps, at
    SWEEP_SEQLEN."""
    from matplotlib.figure import Figure

    from ..memory import use_seqlen_ticks
    from .report import describe

    rows = results["rows"]
    fig = Figure(figsize=(13, 4), dpi=dpi)
    axes = fig.subplots(1, 3)
    styles = {"triton": ("ours", "C0"), "fla_nsa": ("fla", "C1"), "fla_moba": ("fla", "C1"), "dense": ("dense", "k")}
    for ax, case, heads, title in ((axes[0], "nsa_select", HEADS, f"NSA selected branch, {SELECTED} x {BLOCK_K} keys"),
                                   (axes[1], "moba", MOBA_HEADS, f"MoBA, top-{MOBA_TOP_K} of {MOBA_BLOCK}-key blocks")):
        for impl, (label, color) in styles.items():
            mine = sorted((r for r in rows if r["impl"] == impl and r["case"] in (case, "dense") and r["heads"] == heads
                           and (impl == "dense" or case == "moba" or r["selected"] == SELECTED) and r["fwd_ms"]),
                          key=lambda r: r["seqlen_q"])
            for metric, style in (("fwd_ms", "o-"), ("bwd_ms", "s--")):
                points = [(r["seqlen_q"], r[metric]) for r in mine if r[metric]]
                if points:
                    ax.plot(*zip(*points), style, color=color, label=f"{label} {metric[:3]}")
        if case == "nsa_select":  # NSA end to end beside its selected branch
            for metric, style in (("fwd_ms", "o-"), ("bwd_ms", "s--")):
                points = sorted((r["seqlen_q"], r[metric]) for r in rows if r["case"] == "nsa" and r[metric])
                if points:
                    ax.plot(*zip(*points), style, color="C2", label=f"ours NSA end to end {metric[:3]}")
        ax.set_yscale("log")
        use_seqlen_ticks(ax.xaxis, [r["seqlen_q"] for r in rows if r["case"] == case])
        ax.set(xlabel="sequence length N", ylabel="time (ms)", title=title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    curve = sparsity_curve(rows)
    if curve:
        kept, fwd, bwd = zip(*curve)
        axes[2].plot([100 * x for x in kept], fwd, "o-", color="C0", label="forward")
        if all(b is not None for b in bwd):
            axes[2].plot([100 * x for x in kept], bwd, "s--", color="C2", label="backward")
        axes[2].plot([100 * x for x in kept], [1 / x for x in kept], ":", color="gray", label="1 / share (ideal)")
        axes[2].set_xscale("log")
        axes[2].set_yscale("log")
    axes[2].set(xlabel="causal pairs kept (%)", ylabel="dense time / ours",
                title=f"NSA selection at {SWEEP_SEQLEN // 1024}K: speed-up vs sparsity")
    axes[2].grid(True, alpha=0.3)
    axes[2].legend(fontsize=7)
    fig.suptitle(describe(results) + f", bf16, d = {HEAD_DIM}, causal", fontsize=9)
    fig.tight_layout()
    return fig
