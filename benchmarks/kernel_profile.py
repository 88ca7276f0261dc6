"""One call of a forward or backward, profiled by Nsight Compute: the interfaces benchmark's impls
(``triton_hopper`` and flash-attn-4's ``fa4``) on a named case, called a few times with the profiler started for
the last call only (``cudaProfilerStart``, for ``ncu --profile-from-start off``; an NVTX range would miss the
backward's kernels, which autograd launches from a thread of its own), so that ncu profiles that call's kernels:
warp states, pipes, issue and, per SASS instruction, where warps stall. The A/B timings name what changes a
kernel's time; this names where in its loop the time goes.

On the device: ``bash benchmarks/run_device.sh ncu-profile OUT [PROFILE ...]`` runs ncu on each profile (default:
all) and packs <profile>_raw.csv (one row per kernel of the call) and <profile>_sass.csv (the instructions of each
kernel with their stall samples) into OUT/ncu_profiles.tgz. ``python3 benchmarks/kernel_profile.py --list`` names
the profiles; fa4's need flash-attn-4 installed as for interfaces. Here: ``--summary`` and ``--hotspots`` read
the CSVs.
"""
import argparse

CALLS = 4  # the first calls compile and warm up; the last one is profiled

# profile name -> (impl, interfaces case, pass). The cases are the interfaces benchmark's (32 heads over 32 or 8
# K/V heads, d = 128, 16K tokens in all) and the FA3-paper protocol's 16 heads at 8K x 2.
PROFILES = {
    "fwd_plain": ("triton_hopper", "plain", "forward"),
    "fwd_softcap": ("triton_hopper", "softcap", "forward"),
    "fwd_window": ("triton_hopper", "window", "forward"),
    "bwd_protocol": ("triton_hopper", "protocol", "backward"),
    "bwd_gqa_causal": ("triton_hopper", "gqa_causal", "backward"),
    "fa4_fwd_plain": ("fa4", "plain", "forward"),
    "fa4_bwd_protocol": ("fa4", "protocol", "backward"),
    "fa4_bwd_gqa_causal": ("fa4", "gqa_causal", "backward"),
    # the Gluon backward launched directly with one dQ scheme (gluon_backward's dq_mode), forward done beforehand
    "bwd_protocol_turns": ("gluon_backward:turns", "protocol", "backward"),
    "bwd_protocol_split": ("gluon_backward:split", "protocol", "backward"),
    # NSA end to end as the sparse benchmark calls it (64 heads over 4 K/V heads, d = 128): every branch's kernels
    "nsa_fwd_64k": ("nsa", "nsa_64k", "forward"),
}


def make_case(name: str):
    from fa_lab.bench.interfaces import GQA_HEADS_KV, InterfaceCase

    return {
        "plain": InterfaceCase("mha", (8192, 8192)),
        "softcap": InterfaceCase("softcap", (8192, 8192), softcap=30.0),
        "window": InterfaceCase("window", (16384,), True, window=(1024, 0)),
        "protocol": InterfaceCase("protocol", (8192, 8192), heads=16, heads_kv=16),
        "gqa_causal": InterfaceCase("gqa", (16384,), True, heads_kv=GQA_HEADS_KV),
    }[name]


# What --summary prints from a raw page: (label, metric). Pipes in % of peak over the kernel's active cycles; the
# stall reasons in cycles per issued instruction (their sum is a warp's average cycles between issues).
SUMMARY_METRICS = (
    ("ms", "gpu__time_duration.sum"),
    ("tensor %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("mufu (xu) %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("fma %", "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"),
    ("alu %", "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active"),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("warps / scheduler", "smsp__warps_active.avg.per_cycle_active"),
)
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
OTHER_KERNEL_SHARE = 0.1  # --record keeps the regions of the kernels taking this share of a call's kernel time too
TO_MS = {"ms": 1.0, "msecond": 1.0, "us": 1e-3, "usecond": 1e-3, "ns": 1e-6, "nsecond": 1e-6}


def raw_kernels(raw_csv: str) -> list[dict]:
    """The kernels of one profile's raw page (``ncu --page raw --csv``), one dict each: name, grid, block,
    SUMMARY_METRICS (the duration in ms whatever unit ncu chose) and every stall reason per issue."""
    import csv

    with open(raw_csv) as f:
        header, units, *rows = list(csv.reader(f))
    unit = dict(zip(header, units))
    kernels = []
    for row in rows:
        value = dict(zip(header, row))
        summary = {label: float(value[m].replace(",", "")) * (TO_MS[unit[m]] if label == "ms" else 1.0)
                   for label, m in SUMMARY_METRICS if m in value}
        stalls = {k[len(STALL_PREFIX):-len(STALL_SUFFIX)]: float(v) for k, v in value.items()
                  if k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX)}
        kernels.append({"kernel": value["Kernel Name"], "grid": value["Grid Size"], "block": value["Block Size"],
                        **summary, "stalls_per_issue": stalls})
    return kernels


def summary(raw_csv: str) -> str:
    """The kernels of one profile's raw page, one block each: SUMMARY_METRICS, then the stall reasons above 0.05
    cycles per issue, largest first."""
    lines = []
    for kernel in raw_kernels(raw_csv):
        lines.append(f"{raw_csv}: {kernel['kernel'][:80]}  grid {kernel['grid']} block {kernel['block']}")
        lines += [f"  {label:18s} {kernel[label]:10.3f}" for label, _ in SUMMARY_METRICS if label in kernel]
        stalls = sorted(((v, k) for k, v in kernel["stalls_per_issue"].items()), reverse=True)
        lines += [f"  stall {reason:28s} {cycles:6.3f}" for cycles, reason in stalls if cycles >= 0.05]
    return "\n".join(lines)


def sass_kernels(sass_csv: str) -> dict:
    """{kernel name: [instruction dicts]} from a profile's source page (``ncu --page source --csv --print-source
    sass``): each dict has the page's columns (Source, Warp Stall Sampling (All Samples), stall_<reason>, ...)."""
    import csv

    kernels, name, header = {}, None, None
    with open(sass_csv) as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                name, header = row[1], None
                kernels[name] = []
            elif row and row[0] == "Address":
                header = row
            elif header and row:
                kernels[name].append(dict(zip(header, row)))
    return kernels


def _samples(row: dict) -> int:
    """An instruction's warp stall samples, all reasons (issued ones too)."""
    return int(row["Warp Stall Sampling (All Samples)"] or 0)


def _stall_counts(row: dict) -> dict:
    """An instruction's samples by stall reason ({"barrier": n, ...}; the "Not Issued" duplicates left out)."""
    return {k[len("stall_"):]: int(v or 0) for k, v in row.items() if k.startswith("stall_") and "Not Issued" not in k}


def hotspots(sass_csv: str, kernel: str, top: int = 30) -> str:
    """The ``top`` instructions of the kernel whose name contains ``kernel`` by warp stall samples, in program order,
    each with its position, its share of the kernel's samples and its three largest stall reasons."""
    name, rows = next((n, r) for n, r in sass_kernels(sass_csv).items() if kernel in n)
    samples = [_samples(r) for r in rows]
    total = sum(samples) or 1
    chosen = sorted(sorted(range(len(rows)), key=samples.__getitem__, reverse=True)[:top])
    lines = [f"{sass_csv}: {name[:90]}: {len(rows)} instructions, {total} samples"]
    for i in chosen:
        reasons = sorted(((count, reason) for reason, count in _stall_counts(rows[i]).items()), reverse=True)[:3]
        why = ", ".join(f"{reason} {count / total:.1%}" for count, reason in reasons if count)
        lines.append(f"  {i:5d} {samples[i] / total:6.1%}  {rows[i]['Source'].strip()[:60]:60s} {why}")
    return "\n".join(lines)


def regions(rows: list, min_share: float = 0.004) -> list[dict]:
    """A kernel's instructions (:func:`sass_kernels`) cut into runs executed equally often (a partition's loop, its
    prologue, an idle warp's wait), those holding at least ``min_share`` of the samples: first and last instruction,
    executions of each, share of the kernel's samples and each stall reason's share, largest first."""
    from collections import Counter

    samples = [_samples(r) for r in rows]
    total = sum(samples) or 1
    runs = []
    for i, row in enumerate(rows):
        executed = int(row["Instructions Executed"] or 0)
        if runs and runs[-1][2] == executed:
            runs[-1][1] = i
        else:
            runs.append([i, i, executed])
    found = []
    for first, last, executed in runs:
        share = sum(samples[first:last + 1]) / total
        if share >= min_share:
            reasons = Counter()
            for row in rows[first:last + 1]:
                reasons.update(_stall_counts(row))
            found.append({"first": first, "last": last, "executed": executed, "share": round(share, 4),
                          "stalls": {k: round(v / total, 4) for k, v in reasons.most_common() if v}})
    return found


def record(csv_dir: str, out_json: str, device: str, torch_version: str, triton_version: str, date: str) -> None:
    """Each profile's raw and source pages in csv_dir (<profile>_raw.csv, <profile>_sass.csv) as one JSON, headed by
    the device, versions and date of the run that made them: per profiled kernel, SUMMARY_METRICS and every stall
    reason per issue, for the profile's main kernel (the longest) its :func:`regions`, and those of any other kernel
    taking OTHER_KERNEL_SHARE of the call's kernel time or more (a multi-kernel call such as NSA's forward)."""
    import os

    from fa_lab.bench.schema import write_log

    profiles = {}
    for name in PROFILES:
        raw = os.path.join(csv_dir, f"{name}_raw.csv")
        if not os.path.exists(raw):
            continue
        kernels = raw_kernels(raw)
        main_kernel = max(kernels, key=lambda k: k["ms"])
        instructions = sass_kernels(os.path.join(csv_dir, f"{name}_sass.csv"))
        total_ms = sum(k["ms"] for k in kernels)
        long_names = {k["kernel"] for k in kernels if k["ms"] >= OTHER_KERNEL_SHARE * total_ms}
        others = {kernel: regions(instructions[kernel]) for kernel in sorted(long_names - {main_kernel["kernel"]})}
        profiles[name] = {"impl": PROFILES[name][0], "case": PROFILES[name][1], "pass": PROFILES[name][2],
                          "kernels": kernels, "main_kernel_regions": regions(instructions[main_kernel["kernel"]]),
                          **({"other_kernel_regions": others} if others else {})}
    write_log({"device": device, "torch": torch_version, "triton": triton_version, "date": date,
               "profiles": profiles}, out_json)


def gluon_backward_call(case, dq_mode: str):
    """A call of the Gluon backward alone (``gluon_backward`` with ``dq_mode``) on a dense case's random bf16
    operands, its forward's output and log-sum-exp made once beforehand."""
    import functools

    import torch

    from fa_lab.bench.interfaces import _tensors
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.attention import gluon_backward, gluon_forward

    load_triton()
    q, k, v = _tensors(case, token_major=False)
    grad = torch.randn_like(q)
    scale = case.head_dim ** -0.5
    out, lse = gluon_forward(q, k, v, case.causal, scale)
    return functools.partial(gluon_backward, q, k, v, out, lse, grad, case.causal, scale, dq_mode=dq_mode)


def nsa_call(seqlen: int = 65536):
    """NSA's forward and backward as the sparse benchmark times them, at ``seqlen`` tokens: (run, leaves)."""
    import torch

    from fa_lab.bench.sparse import HEADS, HEADS_KV, bf16_inputs, ours_nsa

    generator = torch.Generator(device="cuda").manual_seed(seqlen)
    return ours_nsa(*bf16_inputs(HEADS, HEADS_KV, seqlen, generator), None)


def main(profile: str) -> None:
    import torch

    from fa_lab.bench.breakdown import backward_call
    from fa_lab.bench.interfaces import make_impls

    impl, case_name, which = PROFILES[profile]
    torch.manual_seed(0)
    if impl == "nsa":
        run, leaves = nsa_call()
        call = run if which == "forward" else backward_call(run, leaves)
    elif impl.startswith("gluon_backward:"):
        call = gluon_backward_call(make_case(case_name), impl.split(":")[1])
    else:
        run, leaves = make_impls((impl,))[impl](make_case(case_name))
        call = run if which == "forward" else backward_call(run, leaves)
    with torch.no_grad() if which == "forward" else torch.enable_grad():
        for i in range(CALLS):
            if i == CALLS - 1:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
            call()
            if i == CALLS - 1:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", nargs="?", choices=sorted(PROFILES))
    parser.add_argument("--list", action="store_true", help="print the profiles' names and exit")
    parser.add_argument("--summary", nargs="+", metavar="RAW_CSV", help="summarize profiles' raw pages and exit")
    parser.add_argument("--hotspots", nargs=2, metavar=("SASS_CSV", "KERNEL"),
                        help="the instructions of a profiled kernel (name contains KERNEL) warps stall at most")
    parser.add_argument("--top", type=int, default=30, help="how many instructions --hotspots prints")
    parser.add_argument("--record", nargs=6, metavar=("CSV_DIR", "OUT_JSON", "DEVICE", "TORCH", "TRITON", "DATE"),
                        help="write the profiles' summaries and main-kernel regions as one JSON")
    args = parser.parse_args()
    if args.record:
        record(*args.record)
    elif args.summary:
        print("\n".join(summary(path) for path in args.summary))
    elif args.hotspots:
        print(hotspots(*args.hotspots, top=args.top))
    elif args.list or args.profile is None:
        print(" ".join(PROFILES))
    else:
        main(args.profile)
