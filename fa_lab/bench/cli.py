"""``fa-lab bench cpu|gpu|hopper|interfaces|decode|sparse|linear|ring``: parse the flags, run one benchmark,
print its table, write its files.

Every flag a subcommand accepts changes what it measures or writes. The GPU protocols fix batch
(16384 / seqlen), heads (2048 / head_dim) and bf16, so ``gpu`` and ``hopper`` reject ``--batch``,
``--heads`` and ``--dtype`` with that reason (``hopper`` takes ``--head-dims`` of its kernels, 64 and 128).
A mode that replaces the benchmark (``--tune``, ``--breakdown``) refuses, with exit code 2 and a message
naming them, the flags it would not honour, and a flag that only modifies such a mode (``--stages``)
refuses to come without it.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from ..argtypes import non_negative_int, output_file, plot_file, positive_int
from . import cpu, decode, gpu, hopper_report, interfaces, linear, ring, sparse
from .plots import plot_results
from .report import describe, format_table
from .schema import save_results

CAUSAL_CHOICES = {"no": (False,), "yes": (True,), "both": (False, True)}
PROTOCOL_FIXES = ("the FA3 protocol fixes batch = 16384 / seqlen, heads = 2048 / head_dim and bf16 "
                  "(`fa-lab bench cpu` takes other shapes)")


def _rejected(reason: str):
    """An argparse action that refuses its flag, saying why."""
    class Rejected(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{option_string} is not accepted: {reason}")
    return Rejected


def _reject(parser, flags, reason: str) -> None:
    for flag in flags:
        parser.add_argument(flag, nargs="*", action=_rejected(reason), help=argparse.SUPPRESS)


def _add_outputs(parser, plot_help: str) -> None:
    parser.add_argument("--json", metavar="FILE", type=output_file,
                        help="write the results here (schema: fa_lab.bench.schema)")
    parser.add_argument("--plot", metavar="FILE", type=plot_file, help=plot_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fa-lab bench", description="Benchmarks: cpu (this CPU), gpu (the "
                                     "FA3-paper protocol with every peer), hopper (the Hopper kernels), "
                                     "interfaces (GQA, varlen, window, softcap, ALiBi), decode (a KV cache), "
                                     "sparse (NSA's selected blocks), linear (chunkwise linear attention), "
                                     "ring (ring attention's steps on one GPU).")
    commands = parser.add_subparsers(dest="benchmark", required=True,
                                     metavar="{cpu,gpu,hopper,interfaces,decode,sparse,linear,ring}")

    full = cpu.FULL
    p = commands.add_parser("cpu", help="naive, torch and sdpa on this CPU: wall-clock time and peak memory")
    p.add_argument("--seqlens", type=positive_int, nargs="+", help=f"default {list(full.seqlens)}")
    p.add_argument("--batch", type=positive_int, help=f"default {full.batch}")
    p.add_argument("--heads", type=positive_int, help=f"default {full.heads}")
    p.add_argument("--head-dim", type=positive_int, help=f"default {full.head_dim}")
    p.add_argument("--dtype", choices=sorted(cpu.DTYPES), help=f"default {full.dtype}")
    p.add_argument("--causal", choices=CAUSAL_CHOICES, help="causal masking: no (default), yes or both")
    p.add_argument("--impls", nargs="+", choices=full.impls, metavar="IMPL",
                   help=f"any of {', '.join(full.impls)} (default: all)")
    p.add_argument("--repeats", type=positive_int, help=f"timed calls per point, default {full.repeats}")
    p.add_argument("--warmup", type=non_negative_int, help=f"untimed calls first, default {full.warmup}")
    p.add_argument("--naive-max-seqlen", type=non_negative_int,
                   help=f"longest seqlen naive runs at, modelled beyond (default {full.naive_max_seqlen})")
    p.add_argument("--quick", action="store_true", help="smoke run of tiny shapes (the flags above still apply)")
    _add_outputs(p, "save a PNG of time and memory vs seqlen")
    p.set_defaults(handler=_run_cpu)

    p = commands.add_parser("gpu", help="the FA3-paper protocol on a CUDA GPU, every peer in the same run",
                            description=f"The FA3-paper protocol with every peer: {PROTOCOL_FIXES}.")
    p.add_argument("--seqlens", type=positive_int, nargs="+", default=list(gpu.SEQLENS), help="default %(default)s")
    p.add_argument("--head-dims", type=positive_int, nargs="+", default=list(gpu.HEAD_DIMS),
                   help="default %(default)s")
    p.add_argument("--causal", choices=CAUSAL_CHOICES, default="both", help="causal masking: no, yes or both "
                   "(default)")
    p.add_argument("--impls", nargs="+", choices=gpu.GPU_IMPLS, default=list(gpu.GPU_IMPLS), metavar="IMPL",
                   help=f"any of {', '.join(gpu.GPU_IMPLS)} (default: all)")
    p.add_argument("--tune", metavar="FILE", type=output_file, help="first time candidate tiles of the Triton "
                   "kernels at 8K, both masks, for the --head-dims; measure with the fastest; write the tuning log "
                   "here")
    _add_outputs(p, "save a PNG of TFLOP/s vs seqlen")
    _reject(p, ("--batch", "--heads", "--dtype"), PROTOCOL_FIXES)
    p.set_defaults(handler=_run_gpu)

    p = commands.add_parser("hopper", help="the Hopper kernels (sm_90): ablation at 8K, then the protocol at d=128 "
                            "and 64 with the upstream FlashAttention kernels (fa4) where installed",
                            description=f"The Hopper kernels' ablation and protocol: {PROTOCOL_FIXES}.")
    p.add_argument("--log", metavar="FILE", type=output_file,
                   help="run the ablation first (variants, FP8 errors) and write it here")
    p.add_argument("--seqlens", type=positive_int, nargs="+", help="protocol lengths, default 1K to 16K (the ablation "
                   "runs at 8K)")
    p.add_argument("--head-dims", type=positive_int, nargs="+", choices=(64, 128),
                   help="protocol head dims, default 128 64")
    p.add_argument("--resume", action="store_true", help="keep the rows already in --json (same device and "
                   "versions) and measure only the shapes it lacks")
    p.add_argument("--causal", choices=CAUSAL_CHOICES, default="both", help="causal masking of the ablation and "
                   "the protocol: no, yes or both (default)")
    _add_outputs(p, "save a PNG of forward TFLOP/s vs seqlen (FP8: the kernel alone and with its quantization)")
    _reject(p, ("--batch", "--heads", "--dtype"), PROTOCOL_FIXES)
    _reject(p, ("--head-dim",), "the Hopper protocol takes --head-dims")
    p.set_defaults(handler=_run_hopper)

    p = commands.add_parser("interfaces", help="GQA, varlen, window, softcap and ALiBi on a CUDA GPU, with the "
                            "upstream FlashAttention kernels (fa4) where installed",
                            description="Chapter 05's interfaces: the cases of fa_lab.bench.interfaces.")
    p.add_argument("--impls", nargs="+", choices=interfaces.IMPLS, default=list(interfaces.IMPLS), metavar="IMPL",
                   help=f"any of {', '.join(interfaces.IMPLS)} (default: all)")
    _add_outputs(p, "save a PNG of forward and backward TFLOP/s per case")
    p.set_defaults(handler=_run_interfaces)

    p = commands.add_parser("decode", help="decode over a dense or paged KV cache on a CUDA GPU: TB/s next to "
                            "the copy bandwidth, SDPA and the upstream kernels (fa4) where installed",
                            description="Chapter 06's decode benchmark: the shapes of fa_lab.bench.decode.")
    p.add_argument("--no-fa4", action="store_true", help="leave out the upstream flash-attn-4 rows")
    p.add_argument("--tune", metavar="PATH", type=output_file, help="instead, time the decode kernel's candidate "
                   "configs and split counts and write the log to PATH (alone: no --json, --plot or --no-fa4)")
    _add_outputs(p, "save a PNG of TB/s against the cache length")
    p.set_defaults(handler=_run_decode)

    p = commands.add_parser("sparse", help="NSA's selected-blocks attention and MoBA on a CUDA GPU, next to "
                            "fla-core's where installed and to dense attention",
                            description="Chapter 07's benchmark: the cases of fa_lab.bench.sparse.")
    p.add_argument("--seqlens", type=positive_int, nargs="+",
                   help=f"NSA selection lengths, default {list(sparse.SEQLENS)}")
    p.add_argument("--breakdown", action="store_true", help="instead, print our kernels and their times, forward "
                   "and backward, for the NSA selection, NSA end to end and MoBA at 64K")
    _add_outputs(p, "save a PNG of the times, MoBA's and the speed-up against the pairs kept")
    p.set_defaults(handler=_run_sparse)

    p = commands.add_parser("linear", help="chunkwise linear attention (simple GLA, GLA, the delta rule) on a CUDA "
                            "GPU, next to fla-core's kernels where installed and to softmax attention",
                            description="Chapter 08's benchmark: the cases of fa_lab.bench.linear.")
    p.add_argument("--seqlens", type=positive_int, nargs="+", default=list(linear.SEQLENS), help="default %(default)s")
    p.add_argument("--cases", nargs="+", choices=linear.CASES, default=list(linear.CASES))
    p.add_argument("--breakdown", action="store_true", help="instead, print each impl's kernels and their times, "
                   "forward and backward, per case at the first --seqlens")
    p.add_argument("--tune", metavar="PATH", type=output_file, help="instead, time our kernels at each candidate "
                   "num_warps (at the first --seqlens, for the --cases) and write the log to PATH (no --json or "
                   "--plot)")
    p.add_argument("--stages", type=positive_int, nargs="+", metavar="S", help="with --tune: time these num_stages "
                   "(at the committed num_warps) instead")
    _add_outputs(p, "save a PNG of forward and backward time against the sequence length")
    p.set_defaults(handler=_run_linear)

    p = commands.add_parser("ring", help="ring attention's step compute and shard copies on one CUDA GPU, and "
                            "the overlap they predict for W GPUs", description="Chapter 09's one-GPU measurement: "
                            "fa_lab.bench.ring.")
    p.add_argument("--tokens", type=positive_int, nargs="+", default=list(ring.TOKENS_PER_GPU),
                   help="positions per GPU, default %(default)s")
    p.add_argument("--gpus", type=positive_int, metavar="W", help="instead, run the ring over W GPUs of this host "
                   "(fa_lab.bench.ring_gpus) at whole-sequence lengths of W x each --tokens")
    p.add_argument("--json", metavar="PATH", type=output_file,
                   help="write the log (JSON) to PATH, or with --gpus the results")
    p.set_defaults(handler=_run_ring)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark ``argv`` asks for; 0 on success, 2 on a usage error or a missing GPU."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return args.handler(args)


def cpu_sweep(args) -> cpu.CpuSweep:
    """The CpuSweep the ``cpu`` flags ask for: QUICK or FULL, with each given flag replacing its field."""
    given = {"seqlens": args.seqlens, "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim,
             "dtype": args.dtype, "impls": args.impls, "repeats": args.repeats, "warmup": args.warmup,
             "naive_max_seqlen": args.naive_max_seqlen,
             "causals": CAUSAL_CHOICES[args.causal] if args.causal else None}
    base = cpu.QUICK if args.quick else cpu.FULL
    return dataclasses.replace(base, **{name: tuple(value) if isinstance(value, list) else value
                                        for name, value in given.items() if value is not None})


def _finish(results: dict, args, metrics=(), impls=None, lines=(), plot=None) -> int:
    """Print the table and ``lines``; write the JSON and the plot the flags ask for (``plot(results)``
    makes the figure, by default :func:`plot_results` of ``metrics``)."""
    print(describe(results))
    print(format_table(results["rows"]))
    for line in lines:
        print(line)
    if args.json:
        save_results(results, args.json)
    if args.plot:
        figure = plot(results) if plot else plot_results(results, metrics=metrics, impls=impls)
        figure.savefig(args.plot)
    return 0


def _run_cpu(args) -> int:
    cpu.warn_if_busy()
    return _finish(cpu.run_cpu(cpu_sweep(args)), args, metrics=("fwd_ms", "fwd_peak_bytes"))


def _needs_cuda(command: str) -> bool:
    import torch

    if torch.cuda.is_available():
        return False
    print(f"fa-lab bench {command}: needs a CUDA GPU; on this machine run `fa-lab bench cpu`", file=sys.stderr)
    return True


def _run_gpu(args) -> int:
    if _needs_cuda("gpu"):
        return 2
    fwd_configs = bwd_configs = None
    if args.tune:
        from . import tuning

        fwd_configs, bwd_configs, log = tuning.tune(tuple(args.head_dims))
        tuning.save_tuning_log(args.tune, fwd_configs, bwd_configs, log)
    impls = gpu.make_impls(args.impls, fwd_configs, bwd_configs)
    shapes = gpu.protocol_shapes(tuple(args.seqlens), tuple(args.head_dims), CAUSAL_CHOICES[args.causal])
    results = gpu.run_protocol(impls, shapes, args.json)
    return _finish(results, args, metrics=("fwd_tflops", "bwd_tflops"), impls=list(impls))


def _run_hopper(args) -> int:
    if _needs_cuda("hopper"):
        return 2
    from . import hopper  # imports the Hopper kernels' launchers

    if args.resume and not args.json:
        print("--resume continues the file --json names: give --json", file=sys.stderr)
        return 2
    causals = CAUSAL_CHOICES[args.causal]
    if args.log:
        hopper.save_ablation_log(args.log, hopper.run_ablation(causals))
    seqlens = tuple(args.seqlens) if args.seqlens else hopper.HOPPER_SEQLENS
    head_dims = tuple(args.head_dims) if args.head_dims else hopper.HOPPER_HEAD_DIMS
    results = hopper.run_hopper_protocol(seqlens, causals, args.json, head_dims, args.resume)
    return _finish(results, args, plot=hopper_report.plot_hopper)


def _run_interfaces(args) -> int:
    if _needs_cuda("interfaces"):
        return 2
    results = interfaces.run_interfaces(interfaces.make_impls(args.impls), json_path=args.json)
    lines = [f"{what}: {value:.3f}" for what, value in interfaces.ratios(results["rows"])]
    return _finish(results, args, lines=lines, plot=interfaces.plot_interfaces)


def _refused(mode: str, reason: str, flags: dict) -> bool:
    """True, after saying why on stderr, when ``mode`` (a flag that replaces the benchmark) came with flags it
    would not honour; ``flags`` maps each such flag to its value (given when truthy)."""
    given = [flag for flag, value in flags.items() if value]
    if given:
        named = " and ".join([", ".join(given[:-1]), given[-1]] if len(given) > 1 else given)
        print(f"{mode} {reason}: drop {named}", file=sys.stderr)
    return bool(given)


def _run_decode(args) -> int:
    if args.tune and _refused("--tune", "writes only its tuning log",
                              {"--json": args.json, "--plot": args.plot, "--no-fa4": args.no_fa4}):
        return 2
    if _needs_cuda("decode"):
        return 2
    if args.tune:
        decode.tune_decode(args.tune)
        return 0
    results = decode.run_decode(args.json, with_fa4=not args.no_fa4)
    lines = [f"split heuristic, batch {batch}, cache {seqlen_k}, pages {page_size}: {ratio:.3f} of the best forced"
             for batch, seqlen_k, page_size, ratio in decode.heuristic_gaps(results["rows"])]
    return _finish(results, args, lines=lines, plot=decode.plot_decode)


def _run_sparse(args) -> int:
    if args.breakdown and _refused("--breakdown", "prints a profile of the NSA selection, NSA end to end and MoBA "
                                   "at 64K and writes no results",
                                   {"--seqlens": args.seqlens, "--json": args.json, "--plot": args.plot}):
        return 2
    if _needs_cuda("sparse"):
        return 2
    if args.breakdown:
        sparse.breakdowns()
        return 0
    results = sparse.run_sparse(args.json, seqlens=tuple(args.seqlens or sparse.SEQLENS))
    lines = [f"{what}: {value:.3f}" for what, value in sparse.speedups(results["rows"]) + sparse.bar_ratios(results)]
    lines += [f"NSA selection at {sparse.SWEEP_SEQLEN // 1024}K keeping {100 * kept:.2f}% of the causal pairs: "
              f"{fwd:.1f}x dense forward, " + (f"{bwd:.1f}x backward" if bwd else "backward not measured")
              for kept, fwd, bwd in sparse.sparsity_curve(results["rows"])]
    return _finish(results, args, lines=lines, plot=sparse.plot_sparse)


def _run_linear(args) -> int:
    if args.breakdown and args.tune:
        print("--breakdown and --tune are two different runs (a profile, a tuning log): give one of them",
              file=sys.stderr)
        return 2
    if args.stages and not args.tune:
        print("--stages sets what a --tune run times: give --tune PATH with it, or drop it", file=sys.stderr)
        return 2
    outputs = {"--json": args.json, "--plot": args.plot}
    if (args.breakdown and _refused("--breakdown", "prints a profile and writes no results", outputs)) or \
            (args.tune and _refused("--tune", "writes only its tuning log", outputs)):
        return 2
    if _needs_cuda("linear"):
        return 2
    if args.breakdown:
        linear.breakdowns(args.seqlens[0], cases=tuple(args.cases))
        return 0
    if args.tune:
        if args.stages:
            linear.tune_launches(args.tune, seqlen=args.seqlens[0], cases=tuple(args.cases), candidates=args.stages,
                                 knob="num_stages")
        else:
            linear.tune_launches(args.tune, seqlen=args.seqlens[0], cases=tuple(args.cases))
        return 0
    results = linear.run_linear(args.json, seqlens=tuple(args.seqlens), cases=tuple(args.cases))
    lines = [f"{what}: {value:.3f}" for what, value in linear.speed_ratios(results["rows"])]
    for impl in linear.IMPLS:
        for case in args.cases:
            for metric in ("fwd_ms", "bwd_ms"):
                length = linear.crossover(results["rows"], impl, case, metric)
                lines.append(f"{impl} {case} {metric[:3]} beats softmax from N = "
                             + (f"{length:.0f}" if length else "never, in this range"))
    return _finish(results, args, lines=lines, plot=linear.plot_linear)


def _run_ring(args) -> int:
    if _needs_cuda("ring"):
        return 2
    if args.gpus:
        import torch

        from . import ring_gpus

        if args.gpus > torch.cuda.device_count():
            print(f"fa-lab bench ring: --gpus {args.gpus}, but this machine has {torch.cuda.device_count()} GPUs",
                  file=sys.stderr)
            return 2
        results = ring_gpus.run_ring_gpus(args.gpus, [args.gpus * n for n in args.tokens], json_path=args.json)
        print(format_table(results["rows"]))
        return 0
    log = ring.run_ring(args.json, tokens=tuple(args.tokens))
    print("\n".join(ring.summary(log)))
    return 0
