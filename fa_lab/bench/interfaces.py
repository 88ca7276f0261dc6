"""The interfaces benchmark (chapter 05, on a CUDA GPU): GQA, varlen, a sliding window, softcap and
ALiBi, each next to the same kernel without the option and next to the upstream FlashAttention
CuTeDSL kernels (``fa4``, the flash-attn-4 package, whose SM90 path is FlashAttention-3's design)
measured in the same run wherever they take the case.

Cases (bf16, head_dim 128, 32 query heads; ``mha`` and ``gqa`` over 2K-16K with 16K tokens in all,
causal and not):

=====================  ===========================================================================
case                   what it measures
=====================  ===========================================================================
``mha``                32 key/value heads: the reference point of ``gqa``
``gqa``                8 key/value heads (groups of 4)
``varlen``             16K tokens in sequences of lengths drawn in [128, 4096] (seed 0), causal
``dense_same_tokens``  as many sequences as ``varlen``, of equal length, with as many tokens (rounded down)
``window``             window (1024, 0) at 16K: FLOPs counted inside the band
``softcap``            softcap 30 at 8K, against ``mha`` at 8K
``alibi``              ALiBi slopes at 8K, against ``mha`` at 8K (fa4 has no ALiBi argument)
=====================  ===========================================================================

TFLOP/s count 4 * heads * head_dim FLOPs per visible (query, key) pair
(:meth:`fa_lab.block_info.BlockInfo.visible_pairs`, per sequence), 2.5 times that for the backward.
Times are medians of ``triton.testing.do_bench``. Rows follow :mod:`.schema` with its interfaces keys.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

import torch

from ..block_info import BlockInfo
from ..iomodel import AttentionShape
from .schema import empty_row, environment, save_results

HEADS, GQA_HEADS_KV, HEAD_DIM, TOKENS = 32, 8, 128, 16384
SEQLENS = (2048, 4096, 8192, 16384)
VARLEN_LENGTHS, VARLEN_SEED = (128, 4096), 0
WINDOW, WINDOW_SEQLEN = (1024, 0), 16384
OPTION_SEQLEN, SOFTCAP = 8192, 30.0
IMPLS = ("triton", "triton_hopper", "fa4")


@dataclass(frozen=True)
class InterfaceCase:
    """One benchmark case: sequences of ``lengths`` tokens (seqlen_q = seqlen_k), packed when ``varlen``."""

    case: str
    lengths: tuple[int, ...]
    causal: bool = False
    heads_kv: int = HEADS
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    varlen: bool = False
    heads: int = HEADS
    head_dim: int = HEAD_DIM

    def pairs(self) -> int:
        """The (query, key) pairs the masks keep, summed over the sequences (one head)."""
        return sum(BlockInfo(n, n, self.causal, self.window).visible_pairs() for n in self.lengths)

    def flops(self, backward: bool = False) -> float:
        return 4.0 * self.heads * self.head_dim * self.pairs() * (2.5 if backward else 1.0)

    @property
    def shape(self) -> AttentionShape:
        return AttentionShape(len(self.lengths), self.heads, max(self.lengths), self.head_dim, causal=self.causal,
                              dtype="bf16")


def varlen_lengths(total: int = TOKENS, bounds=VARLEN_LENGTHS, seed: int = VARLEN_SEED) -> tuple[int, ...]:
    """Lengths drawn uniformly in ``bounds`` until they hold ``total`` tokens; the last one is cut to fit
    (and merged into the one before when that would leave it shorter than the lower bound)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(bounds[0], bounds[1] + 1, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - total
    if lengths[-1] < bounds[0] and len(lengths) > 1:
        lengths[-2] += lengths.pop()
    return tuple(lengths)


def interface_cases(seqlens=SEQLENS) -> list[InterfaceCase]:
    """Every case of the benchmark, in the order of the module docstring's table."""
    cases = []
    for causal in (False, True):
        for n in seqlens:
            dense = InterfaceCase("mha", (n,) * (TOKENS // n), causal)
            cases += [dense, replace(dense, case="gqa", heads_kv=GQA_HEADS_KV)]
    lengths = varlen_lengths()
    cases += [InterfaceCase("varlen", lengths, True, varlen=True),
              InterfaceCase("dense_same_tokens", (TOKENS // len(lengths),) * len(lengths), True),
              InterfaceCase("window", (WINDOW_SEQLEN,), window=WINDOW),
              InterfaceCase("softcap", (OPTION_SEQLEN,) * (TOKENS // OPTION_SEQLEN), softcap=SOFTCAP),
              InterfaceCase("alibi", (OPTION_SEQLEN,) * (TOKENS // OPTION_SEQLEN), alibi=True)]
    return cases


def alibi_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes for ``heads`` heads (a power of two): 2^(-8 (h + 1) / heads)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32)


def cu_seqlens(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# ---- the impls: fn(case) -> (run, leaves), run() -> out ------------------------------------------

def _tensors(case: InterfaceCase, token_major: bool):
    """Fresh bf16 CUDA leaves: packed (total, heads, d) when varlen, else (B, N, heads, d) if token_major,
    else (B, heads, N, d)."""
    def make(heads):
        if case.varlen:
            size = (sum(case.lengths), heads, case.head_dim)
        elif token_major:
            size = (len(case.lengths), case.lengths[0], heads, case.head_dim)
        else:
            size = (len(case.lengths), heads, case.lengths[0], case.head_dim)
        return torch.randn(size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return make(case.heads), make(case.heads_kv), make(case.heads_kv)


def fa_lab_impl(impl: str):
    """fa_lab.attention / fa_lab.attention_varlen with ``impl`` ("triton" or "triton_hopper")."""
    import fa_lab

    def prepare(case: InterfaceCase):
        q, k, v = _tensors(case, token_major=False)
        options = dict(causal=case.causal, impl=impl, window=case.window, softcap=case.softcap,
                       alibi_slopes=alibi_slopes(case.heads).cuda() if case.alibi else None)
        if case.varlen:
            cu = cu_seqlens(case.lengths).cuda()
            return (lambda: fa_lab.attention_varlen(q, k, v, cu, cu, **options)), (q, k, v)
        return (lambda: fa_lab.attention(q, k, v, **options)), (q, k, v)
    return prepare


def fa4_window(window, causal: bool):
    """flash-attn-4's window_size for the course's (left, right): None where a side is unbounded."""
    left, right = window
    return (None if left < 0 else left, 0 if causal else (None if right < 0 else right))


def fa4_output(result):
    """The output of a flash-attn-4 call, which returns it alone or as (out, lse)."""
    return result[0] if isinstance(result, tuple) else result


def fa4_impl():
    """The upstream CuTeDSL kernels (flash_attn.cute): (B, N, heads, d) tensors; refuses ALiBi."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    def prepare(case: InterfaceCase):
        if case.alibi:
            raise ValueError("flash-attn-4 takes no ALiBi slopes")
        q, k, v = _tensors(case, token_major=True)
        options = dict(causal=case.causal, window_size=fa4_window(case.window, case.causal), softcap=case.softcap)
        if case.varlen:
            cu, longest = cu_seqlens(case.lengths).cuda(), max(case.lengths)
            return (lambda: fa4_output(flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                         max_seqlen_q=longest, max_seqlen_k=longest,
                                                         **options))), (q, k, v)
        return (lambda: fa4_output(flash_attn_func(q, k, v, **options))), (q, k, v)
    return prepare


def make_impls(names=IMPLS) -> dict:
    unknown = sorted(set(names) - set(IMPLS))
    if unknown:
        raise ValueError(f"unknown impls {unknown}; the interfaces benchmark knows {list(IMPLS)}")
    return {name: fa4_impl() if name == "fa4" else fa_lab_impl(name) for name in names}


# ---- measuring ------------------------------------------------------------------------------------

def interface_row(impl: str, case: InterfaceCase) -> dict:
    """A schema row for ``impl`` at ``case``, every figure null."""
    row = empty_row(impl, case.shape)
    row.update(case=case.case, heads_kv=case.heads_kv, window=list(case.window), softcap=float(case.softcap),
               alibi=case.alibi, lengths=list(case.lengths) if case.varlen else None)
    return row


def time_backward(run, leaves, timer) -> float:
    """Backward ms: the median of ``timer`` (do_bench's interface) over the backward of one output of
    ``run()`` with a fixed random gradient, the leaves' gradients reset each time."""
    out = run()
    grad = torch.randn_like(out)
    return timer(lambda: out.backward(grad, retain_graph=True), grad_to_none=list(leaves), return_mode="median")


def time_forward_backward(run, leaves, timer) -> tuple[float, float]:
    """(forward ms, backward ms): medians of ``timer`` over ``run()`` and over its backward (:func:`time_backward`),
    after one timing of ``run()`` that is thrown away: the first timing of a shape on a persistent kernel measured
    10-13% low at three of seven shapes on the H200 (docs/experiments/interfaces.md, "The MHA forward's 8K causal
    point")."""
    timer(run, return_mode="median")
    return timer(run, return_mode="median"), time_backward(run, leaves, timer)


def measure(impl: str, prepare, case: InterfaceCase, timer=None) -> dict:
    """One row: forward and backward medians and TFLOP/s; null figures when the impl refuses the case."""
    if timer is None:
        from triton.testing import do_bench as timer
    row = interface_row(impl, case)
    try:
        fwd_ms, bwd_ms = time_forward_backward(*prepare(case), timer)
    except Exception as exc:  # a peer that does not take a case must not end the sweep
        print(f"{impl} {case.case} N={max(case.lengths)} causal={case.causal}: {exc!r:.300}", file=sys.stderr)
        return row
    row.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_tflops=case.flops() / (fwd_ms * 1e-3) / 1e12,
               bwd_tflops=case.flops(backward=True) / (bwd_ms * 1e-3) / 1e12)
    return row


def run_interfaces(impls: dict, cases=None, json_path=None, timer=None) -> dict:
    """Every impl on every case; the results are saved to ``json_path`` after each case (a crash keeps
    what was measured)."""
    results = {**environment("cuda"), "rows": []}
    for case in interface_cases() if cases is None else cases:
        for name, prepare in impls.items():
            results["rows"].append(measure(name, prepare, case, timer))
            torch.cuda.empty_cache()
        if json_path:
            save_results(results, json_path)
    return results


def ratios(rows: list[dict], ours=("triton", "triton_hopper")) -> list[tuple[str, float]]:
    """(what, value) for each comparison the chapter reports, from one run's rows: GQA over MHA and
    over fa4, varlen over dense_same_tokens and over fa4, the window over dense MHA at 16K (TFLOP/s
    counted inside the band) and over fa4, and what softcap and ALiBi add to the forward time at 8K."""
    def find(case, impl, causal=None, seqlen=None):
        return next((r for r in rows if r["case"] == case and r["impl"] == impl and r["fwd_ms"] is not None
                     and (causal is None or r["causal"] == causal) and (seqlen is None or r["seqlen_q"] == seqlen)),
                    None)

    found = []

    def add(what, num, den, metric):
        if num and den:
            found.append((what, num[metric] / den[metric]))

    for impl in ours:
        for causal in (False, True):
            for n in SEQLENS:
                tag = f"{impl}, {'causal' if causal else 'full'} {n // 1024}K"
                gqa = find("gqa", impl, causal, n)
                for metric in ("fwd_tflops", "bwd_tflops"):
                    add(f"gqa / mha {metric[:3]}, {tag}", gqa, find("mha", impl, causal, n), metric)
                    add(f"gqa / fa4 {metric[:3]}, {tag}", gqa, find("gqa", "fa4", causal, n), metric)
        for metric in ("fwd_tflops", "bwd_tflops"):
            varlen = find("varlen", impl)
            add(f"varlen / dense_same_tokens {metric[:3]}, {impl}", varlen, find("dense_same_tokens", impl), metric)
            add(f"varlen / fa4 {metric[:3]}, {impl}", varlen, find("varlen", "fa4"), metric)
            window = find("window", impl)
            add(f"window / dense 16K {metric[:3]}, {impl}", window, find("mha", impl, False, WINDOW_SEQLEN), metric)
            add(f"window / fa4 {metric[:3]}, {impl}", window, find("window", "fa4"), metric)
        for option in ("softcap", "alibi"):
            add(f"{option} forward time / none, {impl}", find(option, impl),
                find("mha", impl, False, OPTION_SEQLEN), "fwd_ms")
    return found


def plot_interfaces(results: dict):
    """Forward and backward TFLOP/s per case (bars per impl); returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["fwd_tflops"] is not None]
    labels = list(dict.fromkeys(f"{r['case']}\n{'causal ' if r['causal'] else ''}{r['seqlen_q'] // 1024}K"
                                for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.6 * len(labels)), 7), sharex=True)
    width = 0.8 / max(len(impls), 1)
    for ax, metric in zip(axes, ("fwd_tflops", "bwd_tflops")):
        for i, impl in enumerate(impls):
            values = {f"{r['case']}\n{'causal ' if r['causal'] else ''}{r['seqlen_q'] // 1024}K": r[metric]
                      for r in rows if r["impl"] == impl}
            xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(labels))]
            ax.bar(xs, [values.get(label) or math.nan for label in labels], width, label=impl)
        ax.set_ylabel(metric.replace("_tflops", " TFLOP/s"))
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=len(impls))
    axes[0].set_title(f"Interfaces, {results['device']}, {results['date']} (bf16, d={HEAD_DIM})")
    axes[1].set_xticks(range(len(labels)), labels, fontsize=7)
    fig.tight_layout()
    return fig
