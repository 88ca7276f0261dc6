"""The sparse benchmark (chapter 07, on a CUDA GPU): NSA's selected-blocks branch, ours against
flash-linear-attention's (``fla-core``, ``fla_nsa``: ``fla.ops.nsa.parallel.ParallelNSAFunction``, where
installed), with dense causal attention at the same length for scale.

Case ``nsa_select``: bf16, d = 128, batch 1, 64 query heads over 4 KV heads (a group of 16, the smallest
fla's NSA kernel takes), sequences of 16K, 32K and 64K tokens, each query attending to 16 blocks of 64
keys chosen per (query, KV head) as NSA chooses them (its own block, and the top-scoring past blocks of
random scores; fewer where the past is shorter), causally. Both impls get the same selection. Ours
(``triton``) is :func:`fa_lab.kernels.triton_block_select_attention` (which checks the selection on
every call, as the public API does); ``dense`` is ``fa_lab.attention(causal=True, impl="triton_hopper")``
on the same q, k, v (grouped K/V).

TFLOP/s count 4 * d FLOPs per visible (query, key) pair per query head (2.5 times that for the
backward), the pairs of the selection (or of the causal mask for ``dense``). Times are medians of
``triton.testing.do_bench``. Rows follow :mod:`.schema` with its sparse keys.
"""
from __future__ import annotations

import sys

import torch

from ..block_info import BlockInfo
from ..iomodel import AttentionShape
from .interfaces import time_forward_backward
from .schema import empty_row, environment, save_results

HEADS, HEADS_KV, HEAD_DIM, BLOCK_K, SELECTED = 64, 4, 128, 64, 16
SEQLENS = (16384, 32768, 65536)
IMPLS = ("triton", "fla_nsa", "dense")


def nsa_selection(seqlen: int, generator: torch.Generator, device="cuda") -> torch.Tensor:
    """(1, HEADS_KV, seqlen, SELECTED) int32: per query and KV head, its own block and the top-scoring past
    blocks of uniform random scores, -1 where the past holds fewer blocks."""
    blocks = -(-seqlen // BLOCK_K)
    own = torch.arange(seqlen, device=device) // BLOCK_K
    scores = torch.rand(1, HEADS_KV, seqlen, blocks, generator=generator, device=device)
    future = torch.arange(blocks, device=device)[None, :] > own[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    scores.scatter_(-1, own.view(1, 1, -1, 1).expand(1, HEADS_KV, seqlen, 1), float("inf"))
    top, index = scores.topk(min(SELECTED, blocks), dim=-1)
    return torch.where(top == float("-inf"), -1, index).to(torch.int32)


def selection_pairs(selection: torch.Tensor) -> int:
    """Visible (query, key) pairs per query head of a causal per-query selection (B, Hkv, N, S), summed
    over the KV heads (each KV head's selection serves HEADS // HEADS_KV query heads)."""
    queries = torch.arange(selection.shape[2], device=selection.device).view(1, 1, -1, 1)
    start = selection.long() * BLOCK_K
    visible = (queries - start + 1).clamp(0, BLOCK_K)
    return int(torch.where(selection >= 0, visible, 0).sum())


def sparse_row(impl: str, seqlen: int) -> dict:
    row = empty_row(impl, AttentionShape(1, HEADS, seqlen, HEAD_DIM, causal=True, dtype="bf16"))
    row.update(case="nsa_select" if impl != "dense" else "dense", heads_kv=HEADS_KV, block_k=BLOCK_K,
               selected=SELECTED)
    return row


def ours(q, k, v, selection):
    from ..kernels import triton_block_select_attention

    return (lambda: triton_block_select_attention(q, k, v, selection, BLOCK_K, True)[0]), (q, k, v)


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


def measure(impl: str, make, seqlen: int, tensors, selection, flops_fwd: float, timer) -> dict:
    """One row (``make(q, k, v, selection) -> (run, leaves)``); null figures when the impl is missing or
    refuses the case."""
    row = sparse_row(impl, seqlen)
    try:
        fwd_ms, bwd_ms = time_forward_backward(*make(*tensors, selection), timer)
    except Exception as exc:  # a peer that is not installed or refuses must not end the sweep
        print(f"{impl} N={seqlen}: {exc!r:.300}", file=sys.stderr)
        return row
    row.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_tflops=flops_fwd / (fwd_ms * 1e-3) / 1e12,
               bwd_tflops=2.5 * flops_fwd / (bwd_ms * 1e-3) / 1e12)
    return row


def run_sparse(json_path=None, seqlens=SEQLENS, impls=IMPLS, timer=None) -> dict:
    """Every impl at every length; saved to ``json_path`` after each length."""
    if timer is None:
        from triton.testing import do_bench as timer
    makers = {"triton": ours, "fla_nsa": fla_nsa, "dense": dense}
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = {**environment("cuda"), "rows": []}
    for seqlen in seqlens:
        q = torch.randn(1, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, HEADS_KV, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        selection = nsa_selection(seqlen, generator)
        pairs = {"dense": BlockInfo(seqlen, seqlen, True).visible_pairs() * HEADS_KV}
        pairs["triton"] = pairs["fla_nsa"] = selection_pairs(selection)
        for impl in impls:
            flops = 4.0 * HEAD_DIM * (HEADS // HEADS_KV) * pairs[impl]
            results["rows"].append(measure(impl, makers[impl], seqlen, (q, k, v), selection, flops, timer))
            torch.cuda.empty_cache()
        if json_path:
            save_results(results, json_path)
    return results


def speedups(rows: list[dict]) -> list[tuple[str, float]]:
    """(what, value): ours over fla's NSA selection (forward, backward) and over dense attention's time."""
    def find(impl, seqlen):
        return next((r for r in rows if r["impl"] == impl and r["seqlen_q"] == seqlen and r["fwd_ms"]), None)

    found = []
    for seqlen in sorted({r["seqlen_q"] for r in rows}):
        ours_row, fla_row, dense_row = find("triton", seqlen), find("fla_nsa", seqlen), find("dense", seqlen)
        for metric in ("fwd_ms", "bwd_ms"):
            if ours_row and fla_row:
                found.append((f"fla_nsa time / ours {metric[:3]}, {seqlen // 1024}K",
                              fla_row[metric] / ours_row[metric]))
            if ours_row and dense_row:
                found.append((f"dense time / ours {metric[:3]}, {seqlen // 1024}K",
                              dense_row[metric] / ours_row[metric]))
    return found
