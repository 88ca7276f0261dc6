"""The linear-attention benchmark (chapter 08, on a CUDA GPU): our chunkwise kernels against
flash-linear-attention's (``fla-core``, where installed) and softmax FlashAttention at the same shape.

Cases, bf16, batch 8, 16 heads, d_k = d_v = 128, causal, sequences of 4K to 64K tokens:

- ``simple_gla``: one log-decay per head and token (``g`` (B, H, N)); ours is
  :func:`fa_lab.kernels.triton_chunk_linear_attention`, fla's ``fla.ops.simple_gla.chunk_simple_gla``;
- ``gla``: one log-decay per key dimension (``g`` (B, H, N, d_k)); fla's ``fla.ops.gla.chunk_gla``;
- ``delta_rule``: DeltaNet with L2-normalized keys and beta in (0, 1); ours
  :func:`fa_lab.kernels.triton_chunk_delta_rule`, fla's ``fla.ops.delta_rule.chunk_delta_rule``;
- ``softmax``: ``fa_lab.attention(causal=True, impl="triton_hopper")`` on the same q, k, v, the line the
  linear kernels cross.

Every impl gets its own layout ready-made (ours and softmax SDPA's (B, H, N, d), fla's (B, N, H, d)),
chunks of 64 tokens, and the same values. Ours is timed at the kernels' entry point, without the public
API's value checks (fla checks none). Times are medians of ``triton.testing.do_bench``; the backward is
that of o with a fixed random gradient. Linear rows have no TFLOP/s (their work is not attention's
4 N^2 d): compare times, which is also what the crossover is about. Rows follow :mod:`.schema` with its
linear keys; :func:`agreement` checks, before timing, that ours and fla's compute the same outputs and
gradients.

fla 0.6 refuses simple GLA's backward on Hopper with Triton < 3.7.1 (its ``chunk_bwd_dqkwg`` guard: the
compiler miscompiled that kernel there, fla's issue 640). The sweep lifts the refusal
(:func:`allow_fla_gated_backward`) and keeps fla's backward time of a case only where its gradients agree
with ours (which the tests hold to float64) within :data:`GRADIENT_AGREEMENT`: a miscompiled kernel that
computes something else is not a peer.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from ..iomodel import AttentionShape
from .interfaces import time_backward
from .schema import empty_row, environment, save_results, write_log

BATCH, HEADS, HEAD_DIM, CHUNK = 8, 16, 128, 64
SEQLENS = (4096, 8192, 16384, 32768, 65536)
CASES = ("simple_gla", "gla", "delta_rule")
FLA = "fla_chunk"  # the impl name of fla's rows: its chunk kernels (fla_* as the sparse rows' fla_nsa)
IMPLS = ("triton", FLA)
GRADIENT_AGREEMENT = 0.05  # largest relative RMSE of fla's gradients against ours for its backward to count


def linear_inputs(case: str, seqlen: int, generator: torch.Generator, device="cuda") -> dict:
    """Leaf tensors of one case in SDPA's layout (B, H, N, d): q, k, v, and g (simple_gla: (B, H, N),
    gla: (B, H, N, d_k), log-decays in (-inf, 0)) or beta (delta_rule: (B, H, N) in (0, 1), keys
    L2-normalized), bf16, requiring grad."""
    def rand(*shape):
        return torch.randn(*shape, generator=generator, device=device)

    shape = (BATCH, HEADS, seqlen, HEAD_DIM)
    q, k, v = rand(*shape), rand(*shape), rand(*shape)
    tensors = {"q": q, "k": k, "v": v}
    if case == "simple_gla":
        tensors["g"] = F.logsigmoid(rand(*shape[:3]))
    elif case == "gla":
        tensors["g"] = F.logsigmoid(rand(*shape)) / 16
    else:
        tensors["k"] = F.normalize(k, dim=-1)
        tensors["beta"] = torch.sigmoid(rand(*shape[:3]))
    return {name: t.to(torch.bfloat16).requires_grad_() for name, t in tensors.items()}


def case_inputs(case: str, seqlen: int) -> dict:
    """:func:`linear_inputs` of a case (softmax: simple GLA's q, k, v) from a generator seeded by the case and
    length, so that every pass of a run, and the breakdown, sees the same values for them."""
    generator = torch.Generator(device="cuda").manual_seed(1_000_003 * (CASES + ("softmax",)).index(case) + seqlen)
    return linear_inputs("simple_gla" if case == "softmax" else case, seqlen, generator)


def ours(case: str, tensors: dict):
    from ..kernels import triton_chunk_delta_rule, triton_chunk_linear_attention

    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    scale = HEAD_DIM ** -0.5
    if case == "delta_rule":
        run = lambda: triton_chunk_delta_rule(q, k, v, tensors["beta"], None, None, scale, CHUNK)[0]
    else:
        run = lambda: triton_chunk_linear_attention(q, k, v, tensors["g"], None, scale, CHUNK)[0]
    return run, list(tensors.values())


def fla(case: str, tensors: dict):
    """fla's chunk kernel in its token-major layout (B, N, H, d); ``run`` returns o in SDPA's layout."""
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gla import chunk_gla
    from fla.ops.simple_gla import chunk_simple_gla

    native = {name: t.detach().transpose(1, 2).contiguous().requires_grad_() for name, t in tensors.items()}
    q, k, v = native["q"], native["k"], native["v"]
    scale = HEAD_DIM ** -0.5
    if case == "simple_gla":
        call = lambda: chunk_simple_gla(q, k, v, g=native["g"], scale=scale)
    elif case == "gla":
        call = lambda: chunk_gla(q, k, v, native["g"], scale=scale)
    else:
        call = lambda: chunk_delta_rule(q, k, v, native["beta"], scale=scale)
    return (lambda: call()[0].transpose(1, 2)), list(native.values())


def softmax(_case: str, tensors: dict):
    import fa_lab

    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    return (lambda: fa_lab.attention(q, k, v, causal=True, impl="triton_hopper")), [q, k, v]


MAKERS = {"triton": ours, FLA: fla}


def linear_row(impl: str, case: str, seqlen: int) -> dict:
    row = empty_row(impl, AttentionShape(BATCH, HEADS, seqlen, HEAD_DIM, causal=True, dtype="bf16"))
    row.update(case=case, chunk_size=None if case == "softmax" else CHUNK)
    return row


def allow_fla_gated_backward() -> bool | None:
    """Lift fla's refusal of the gated ``chunk_bwd_dqkwg`` on Hopper with Triton < 3.7.1 (module docstring);
    True if there was one to lift, None (and a line on stderr) if fla is not installed."""
    try:
        from fla.ops.common import chunk_o
    except ImportError as exc:
        print(f"fla: {exc!r:.300}", file=sys.stderr)
        return None
    refused = not chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return refused


def agreement(case: str, tensors: dict) -> dict:
    """Relative RMSE between ours and fla's on one case's inputs (:func:`linear_inputs`; fla's tests use the
    same measure): ``"o"`` for the output, and one entry per input for its gradient under the same random
    dO; the sweep prints them so that a table never compares two different computations."""
    def rel_rmse(mine, theirs):
        mine, theirs = mine.float(), theirs.float()
        return float((mine - theirs).pow(2).mean().sqrt() / theirs.pow(2).mean().sqrt())

    outputs = {}
    for name, make in (("ours", ours), ("fla", fla)):
        run, leaves = make(case, tensors)
        out = run()
        grad_out = torch.randn(out.shape, generator=torch.Generator(out.device).manual_seed(7), device=out.device)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
        if name == "fla":  # back to SDPA's layout, like ours
            grads = [g.transpose(1, 2) for g in grads]
        outputs[name] = (out.detach(), grads)
    found = {"o": rel_rmse(outputs["ours"][0], outputs["fla"][0])}
    for key, mine, theirs in zip(tensors, outputs["ours"][1], outputs["fla"][1]):
        found[f"d{key}"] = rel_rmse(mine, theirs)
    return found


def measure(impl: str, make, case: str, seqlen: int, tensors: dict, timer, backward: bool = True) -> dict:
    """One row; null figures where the impl is missing or fails (out of memory, or a peer that refuses its
    backward on this stack: the forward is still timed then), and a null backward unless ``backward``."""
    row = linear_row(impl, case, seqlen)
    try:
        run, leaves = make(case, tensors)
        row["fwd_ms"] = timer(run, return_mode="median")
        if backward:
            row["bwd_ms"] = time_backward(run, leaves, timer)
    except Exception as exc:  # a peer that is not installed or fails must not end the sweep
        print(f"{impl} {case} N={seqlen}: {exc!r:.300}", file=sys.stderr)
    return row


def run_linear(json_path=None, seqlens=SEQLENS, cases=CASES, impls=IMPLS, timer=None, progress=print) -> dict:
    """Our kernels and softmax attention at every length, then fla's kernels at every length (its first
    calls autotune for minutes, so a run that hits its time limit keeps ours); saved to ``json_path``
    after each length of each pass."""
    if timer is None:
        from triton.testing import do_bench as timer
    results = {**environment("cuda"), "rows": []}

    def sweep(impl_names, with_softmax, backward_cases=cases):
        for seqlen in seqlens:
            for case in cases:
                tensors = case_inputs(case, seqlen)
                for impl in impl_names:
                    row = measure(impl, MAKERS[impl], case, seqlen, tensors, timer, case in backward_cases)
                    results["rows"].append(row)
                    progress(f"{time.strftime('%H:%M:%S')} {impl} {case} N={seqlen}: {row['fwd_ms']} / "
                             f"{row['bwd_ms']} ms")
                    torch.cuda.empty_cache()
                del tensors
            if with_softmax:
                tensors = case_inputs("softmax", seqlen)
                results["rows"].append(measure("triton_hopper", softmax, "softmax", seqlen, tensors, timer))
                del tensors
                torch.cuda.empty_cache()
            if json_path:
                save_results(results, json_path)

    sweep([impl for impl in impls if impl != FLA], with_softmax=True)
    if FLA in impls:
        if allow_fla_gated_backward():
            progress("fla refuses simple GLA's backward on this stack (Triton < 3.7.1 on Hopper): lifted, "
                     "its backward counts where its gradients agree with ours")
        agreeing = []
        for case in cases:
            try:
                errors = agreement(case, case_inputs(case, 4096))
            except Exception as exc:
                print(f"agreement {case}: {exc!r:.300}", file=sys.stderr)
                continue
            progress(f"agreement {case}, 4K, relative RMSE ours vs fla: "
                     + ", ".join(f"{key} {value:.2e}" for key, value in errors.items()))
            if max(value for key, value in errors.items() if key != "o") <= GRADIENT_AGREEMENT:
                agreeing.append(case)
            else:
                progress(f"fla's {case} gradients disagree with ours beyond {GRADIENT_AGREEMENT}: its backward is "
                         "not timed")
        sweep([FLA], with_softmax=False, backward_cases=agreeing)
    return results


def breakdowns(seqlen: int = SEQLENS[0], cases=CASES, impls=IMPLS, progress=print) -> None:
    """Print each impl's kernels, forward and backward, per case at ``seqlen`` (:mod:`.breakdown`), fla's
    after our run at the same inputs (its refusal lifted as in the sweep)."""
    from .breakdown import format_breakdown, kernel_times, passes

    if FLA in impls and allow_fla_gated_backward() is None:
        impls = tuple(impl for impl in impls if impl != FLA)
    for case in cases:
        tensors = case_inputs(case, seqlen)
        for impl in impls:
            run, leaves = MAKERS[impl](case, tensors)
            for what, call in passes(run, leaves):
                progress(format_breakdown(f"{impl} {case} N={seqlen} {what}", kernel_times(call)))
        del tensors
        torch.cuda.empty_cache()


WARP_CANDIDATES = (2, 4, 8)


def tune_launches(path, seqlen: int = SEQLENS[0], candidates=WARP_CANDIDATES, cases=CASES, progress=print,
               knob: str = "num_warps") -> dict:
    """Time each of our kernels with every launch at each candidate num_warps (or, with knob "num_stages",
    num_stages at the committed warps), and write the log to ``path``.

    Per candidate, every entry of :data:`fa_lab.kernels.portable.linear_launch.LAUNCH_WARPS` takes it (or, for
    stages, every kernel of that table and every variant entry of ``LAUNCH_STAGES`` gets it there; the
    committed tables are restored after), and each kernel's time per call (:mod:`.breakdown`) is summed over
    the forward and backward of every case at ``seqlen``; a kernel's time does not depend on the others'
    settings, so one pass per candidate times them all. The log is ``{"device", "torch", "triton", "date",
    "seqlen", "knob", "winners", "log"}``: the fastest setting per kernel and one entry (``kernel``, the knob,
    ``ms``) per kernel and candidate. The winners go into the tables by hand, where the offline sm_90 build
    accepts them (tests/test_portable_sm90_builds.py). A candidate that fails in a case is logged and skipped.
    """
    from ..kernels.portable import linear_launch
    from .breakdown import kernel_times, passes

    if knob not in ("num_warps", "num_stages"):
        raise ValueError(f"knob must be 'num_warps' or 'num_stages', got {knob!r}")
    committed = dict(linear_launch.LAUNCH_WARPS)
    committed_stages = dict(linear_launch.LAUNCH_STAGES)
    log = []
    try:
        for value in candidates:
            if knob == "num_warps":
                linear_launch.LAUNCH_WARPS.update(dict.fromkeys(committed, value))
            else:
                linear_launch.LAUNCH_STAGES.update(dict.fromkeys([*committed, *committed_stages], value))
            totals: dict[str, float] = {}
            for case in cases:
                tensors = case_inputs(case, seqlen)
                try:
                    run, leaves = ours(case, tensors)
                    for _, call in passes(run, leaves):
                        for name, micros, _ in kernel_times(call):
                            if name in committed:
                                totals[name] = totals.get(name, 0.0) + micros / 1000
                except Exception as exc:  # a candidate that does not compile or run must not end the sweep
                    print(f"tune linear {case} {knob}={value}: {exc!r:.300}", file=sys.stderr)
                del tensors
                torch.cuda.empty_cache()
            log += [{"kernel": name, knob: value, "ms": ms} for name, ms in sorted(totals.items())]
            progress(f"{knob}={value}: " + ", ".join(f"{name} {ms:.3f}" for name, ms in sorted(totals.items())))
    finally:
        linear_launch.LAUNCH_WARPS.clear()
        linear_launch.LAUNCH_WARPS.update(committed)
        linear_launch.LAUNCH_STAGES.clear()
        linear_launch.LAUNCH_STAGES.update(committed_stages)
    winners = {}
    for entry in log:
        best = winners.get(entry["kernel"])
        if best is None or entry["ms"] < best["ms"]:
            winners[entry["kernel"]] = entry
    results = {**environment("cuda"), "seqlen": seqlen, "knob": knob,
               "winners": {name: entry[knob] for name, entry in sorted(winners.items())}, "log": log}
    write_log(results, path)
    progress("winners: " + ", ".join(f"{name} {value}" for name, value in results["winners"].items()))
    return results


def speed_ratios(rows: list[dict]) -> list[tuple[str, float]]:
    """(what, value): fla's time over ours (> 1: ours faster), forward and backward, per case and length."""
    def find(impl, case, seqlen):
        return next((r for r in rows if r["impl"] == impl and r["case"] == case and r["seqlen_q"] == seqlen), None)

    found = []
    for case in dict.fromkeys(r["case"] for r in rows if r["case"] != "softmax"):
        for seqlen in sorted({r["seqlen_q"] for r in rows}):
            mine, theirs = find("triton", case, seqlen), find(FLA, case, seqlen)
            for metric in ("fwd_ms", "bwd_ms"):
                if mine and theirs and mine[metric] and theirs[metric]:
                    found.append((f"{case} fla time / ours {metric[:3]}, {seqlen // 1024}K",
                                  theirs[metric] / mine[metric]))
    return found


def crossover(rows: list[dict], impl: str, case: str, metric: str = "fwd_ms") -> float | None:
    """The sequence length from which ``impl``'s ``case`` takes no longer than softmax attention, interpolated
    on log-log axes between the measured lengths; None if it never does in the range, the first length if
    it always does."""
    import math

    def times(impl_, case_):
        return {r["seqlen_q"]: r[metric] for r in rows if r["impl"] == impl_ and r["case"] == case_ and r[metric]}

    linear, soft = times(impl, case), times("triton_hopper", "softmax")
    lengths = sorted(set(linear) & set(soft))
    if not lengths:
        return None
    gaps = [math.log(linear[n] / soft[n]) for n in lengths]  # <= 0 where linear is as fast or faster
    if gaps[0] <= 0:
        return float(lengths[0])
    for (n0, g0), (n1, g1) in zip(zip(lengths, gaps), zip(lengths[1:], gaps[1:])):
        if g1 <= 0 < g0:
            t = g0 / (g0 - g1)
            return float(math.exp(math.log(n0) + t * (math.log(n1) - math.log(n0))))
    return None


def plot_linear(results: dict, dpi=90):
    """Forward and backward time against the sequence length on log-log axes: one line per (impl, case),
    softmax attention in black; where a linear line crosses softmax's, the linear form starts to win."""
    from matplotlib.figure import Figure

    from ..memory import use_seqlen_ticks
    from .plots import METRIC_LABELS
    from .report import describe

    rows = results["rows"]
    fig = Figure(figsize=(10, 4), dpi=dpi)
    styles = {"triton": ("o-", "ours"), FLA: ("s--", "fla")}
    cases = [c for c in dict.fromkeys(r["case"] for r in rows) if c != "softmax"]
    for ax, metric in zip(fig.subplots(1, 2), ("fwd_ms", "bwd_ms")):
        for index, case in enumerate(cases):
            for impl, (style, who) in styles.items():
                mine = sorted((r for r in rows if (r["impl"], r["case"]) == (impl, case) and r[metric]),
                              key=lambda r: r["seqlen_q"])
                if mine:
                    ax.plot([r["seqlen_q"] for r in mine], [r[metric] for r in mine], style, color=f"C{index}",
                            label=f"{who} {case}")
        soft = sorted((r for r in rows if r["case"] == "softmax" and r[metric]), key=lambda r: r["seqlen_q"])
        if soft:
            ax.plot([r["seqlen_q"] for r in soft], [r[metric] for r in soft], "k^-", label="softmax (triton_hopper)")
        ax.set_yscale("log")
        use_seqlen_ticks(ax.xaxis, [r["seqlen_q"] for r in rows])
        ax.set(xlabel="sequence length N", ylabel=METRIC_LABELS[metric], title=METRIC_LABELS[metric])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(describe(results) + f", batch {BATCH}, {HEADS} heads, d = {HEAD_DIM}, causal", fontsize=9)
    fig.tight_layout()
    return fig
