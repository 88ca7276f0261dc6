"""NSA's selected-blocks backward (fa_lab/kernels/portable/sparse_select.py) with its dK/dV gather at other
tiles, warps and stages, beside flash-linear-attention's backward kernel by kernel; and MoBA's forward, its
wall time against the sum of its kernels' (the GPU's idle time), with the varlen schedule cached and built anew.

The NSA case is the sparse benchmark's (bf16, d = 128, 64 query heads over 4 KV heads, 16 selected blocks of 64
keys per query, causal), at 16K and 64K: the backward alone on the forward's O and LSE, each gather setting
(rows a tile, keys a tile, warps, stages) timed in turn, two rounds (do_bench medians over 500 ms, ms), its dK
and dV compared with the default's. The committed setting is the first. Offline sm_90 builds of these settings
(registers a thread, spilled bytes) are printed by ``--offline`` on any machine.

On the H200, after fla-core is on PYTHONPATH (the device README):
``PYTHONPATH=. python3 benchmarks/nsa_dkdv_variants.py $OUT`` writes $OUT/h200_nsa_dkdv_variants.json (a log); the
sweep's programs run one head row's blocks after another's, the order of that run. ``... --order $OUT`` writes
$OUT/h200_nsa_gather_order.json: the committed tile with the programs heads innermost against that order.
"""
import functools
import os
import sys

# (block_m, block_n, num_warps, num_stages): the committed gather first
SETTINGS = ((64, 64, 8, 2), (64, 64, 8, 3), (32, 64, 8, 2), (32, 64, 4, 2), (16, 64, 4, 2), (128, 32, 8, 2),
            (64, 32, 8, 2), (64, 32, 4, 2))
# The gather's program order at the committed tile: heads innermost (block_select_bwd_dkdv_kernel's HEADS_INNER),
# then one head row's blocks after another's, two rounds each (``--order``).
ORDER_SETTING = (32, 64, 4, 2)
SEQLENS = (16384, 65536)


def label(setting) -> str:
    return "rows{}_keys{}_warps{}_stages{}".format(*setting)


def nsa_part(log: list, out_path: str) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab.bench.schema import environment, write_log
    from fa_lab.bench.sparse import nsa_backward_operands
    from fa_lab.kernels.portable.configs import TileConfig
    from fa_lab.kernels.portable.sparse_select import block_select_backward

    generator = torch.Generator(device="cuda").manual_seed(0)
    for seqlen in SEQLENS:
        operands = nsa_backward_operands(seqlen, generator)
        entry = {"seqlen": seqlen, "ms": {}, "max_diff_vs_first": {}}
        _, dk0, dv0 = block_select_backward(*operands, gather=TileConfig(*SETTINGS[0]), heads_inner=False)
        for setting in SETTINGS:
            try:
                _, dk, dv = block_select_backward(*operands, gather=TileConfig(*setting), heads_inner=False)
                entry["max_diff_vs_first"][label(setting)] = max(
                    float((dk.float() - dk0.float()).abs().max()), float((dv.float() - dv0.float()).abs().max()))
            except Exception as exc:  # a setting the compiler refuses
                entry["max_diff_vs_first"][label(setting)] = repr(exc)[:200]
        for _round in (1, 2):
            for setting in SETTINGS:
                if isinstance(entry["max_diff_vs_first"][label(setting)], str):
                    continue
                ms = do_bench(functools.partial(block_select_backward, *operands, gather=TileConfig(*setting),
                                                heads_inner=False), rep=500, return_mode="median")
                entry["ms"].setdefault(label(setting), []).append(round(ms, 3))
        log.append(entry)
        print(entry, flush=True)
        write_log({**environment("cuda"), "log": log}, out_path)
        del operands
        torch.cuda.empty_cache()


def order_part(out_dir: str) -> None:
    """The gather at ORDER_SETTING with its programs heads innermost and head row by head row, at SEQLENS, two
    interleaved rounds, and the two dK, dV compared (the order changes no sum: they must be equal)."""
    import torch
    from triton.testing import do_bench

    from fa_lab.bench.schema import environment, write_log
    from fa_lab.bench.sparse import nsa_backward_operands
    from fa_lab.kernels.portable.configs import TileConfig
    from fa_lab.kernels.portable.sparse_select import block_select_backward

    generator = torch.Generator(device="cuda").manual_seed(0)
    log = []
    for seqlen in SEQLENS:
        operands = nsa_backward_operands(seqlen, generator)
        calls = {f"heads_inner_{inner}": functools.partial(block_select_backward, *operands,
                                                           gather=TileConfig(*ORDER_SETTING), heads_inner=inner)
                 for inner in (True, False)}
        grads = [call() for call in calls.values()]
        entry = {"seqlen": seqlen, "setting": label(ORDER_SETTING), "ms": {},
                 "equal": all(torch.equal(a, b) for a, b in zip(*grads))}
        for _round in (1, 2):
            for name, call in calls.items():
                entry["ms"].setdefault(name, []).append(round(do_bench(call, rep=500, return_mode="median"), 3))
        log.append(entry)
        print(entry, flush=True)
        write_log({**environment("cuda"), "log": log}, os.path.join(out_dir, "h200_nsa_gather_order.json"))
        del operands, grads
        torch.cuda.empty_cache()


def fla_part(log: list, out_path: str) -> None:
    """fla's NSA backward at 64K kernel by kernel, and the configs its autotuner chose."""
    import torch

    from fa_lab.bench.breakdown import kernel_times, passes
    from fa_lab.bench.schema import environment, write_log
    from fa_lab.bench.sparse import HEADS, HEADS_KV, bf16_inputs, fla_nsa, nsa_selection, ours

    generator = torch.Generator(device="cuda").manual_seed(0)
    seqlen = SEQLENS[-1]
    tensors = bf16_inputs(HEADS, HEADS_KV, seqlen, generator)
    selection = nsa_selection(seqlen, generator)
    entry = {"seqlen": seqlen}
    for name, make in (("fla_nsa", fla_nsa), ("ours", ours)):
        run, leaves = make(*tensors, selection)
        for what, call in passes(run, leaves):
            entry[f"{name}_{what}_kernels_ms"] = {kernel[:60]: round(micros / 1000, 3)
                                                  for kernel, micros, _ in kernel_times(call)[:6]}
    from fla.ops.nsa import parallel as fla_parallel
    for kernel in ("parallel_nsa_bwd_kernel_dkv", "parallel_nsa_bwd_kernel_dq", "parallel_nsa_fwd_kernel"):
        tuner = getattr(fla_parallel, kernel, None)
        entry[f"{kernel}_config"] = str(getattr(tuner, "best_config", None))
    log.append(entry)
    print(entry, flush=True)
    write_log({**environment("cuda"), "log": log}, out_path)


def moba_part(log: list, out_path: str) -> None:
    """MoBA's forward at 64K: do_bench median, the mean of host-synced calls, and the sum of its kernels;
    then the same wall times with the varlen schedule's cache cleared before each call (a new selection every
    call, as in training, builds its schedules anew)."""
    import time

    import torch
    from triton.testing import do_bench

    from fa_lab.bench.breakdown import kernel_times
    from fa_lab.bench.schema import environment, write_log
    from fa_lab.bench.sparse import MOBA_HEADS, bf16_inputs, ours_moba
    from fa_lab.kernels.portable import attention as portable

    generator = torch.Generator(device="cuda").manual_seed(1)
    tensors = [t.detach() for t in bf16_inputs(MOBA_HEADS, MOBA_HEADS, 65536, generator)]
    run, _ = ours_moba(*tensors, None)

    def uncached():
        portable._cached_schedule.cache_clear()
        return run()

    def synced_ms(call, calls=10):
        call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000 / calls

    entry = {"seqlen": 65536, "case": "moba forward, no grad"}
    with torch.no_grad():
        entry["kernels_ms"] = round(sum(micros for _, micros, _ in kernel_times(run)) / 1000, 3)
        for name, call in (("cached", run), ("uncached", uncached)):
            entry[f"{name}_do_bench_ms"] = [round(do_bench(call, rep=1000, return_mode="median"), 3)
                                            for _ in range(2)]
            entry[f"{name}_synced_ms"] = round(synced_ms(call), 3)
    log.append(entry)
    print(entry, flush=True)
    write_log({**environment("cuda"), "log": log}, out_path)


def offline() -> None:
    """Registers, spilled bytes and shared memory of each setting, compiled for sm_90 without a GPU."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import test_portable_sm90_builds as builds

    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90
    from fa_lab.kernels.portable import sparse_select

    signature = {**builds._pointers("q_ptr k_ptr v_ptr do_ptr"), **builds._pointers("lse2_ptr delta_ptr", builds.F32),
                 **builds._pointers("offsets_ptr selectors_ptr", builds.INT_PTR), **builds._pointers("dk_ptr dv_ptr"),
                 **builds._ints("group seqlen_q seqlen_k head_dim block_q block_k"), "qk_scale": "fp32",
                 "scale": "fp32"}
    jobs = [{**builds._job(sparse_select.block_select_bwd_dkdv_kernel, signature,
                           dict(BLOCK_M=m, BLOCK_N=n, HEAD_DIM=128, CAUSAL=True, STACK=m // 16, HEADS_INNER=False),
                           warps),
             "num_stages": stages} for m, n, warps, stages in SETTINGS]
    for setting, build in zip(SETTINGS, compile_all_for_sm90(jobs)):
        print(label(setting), f"registers {build.registers}, stack {build.stack_bytes} B, "
              f"local {build.local_bytes} B, shared {build.shared_bytes} B")


def main(out_dir: str) -> None:
    from fa_lab.kernels import load_triton

    load_triton()
    out_path = os.path.join(out_dir, "h200_nsa_dkdv_variants.json")
    log: list = []
    moba_part(log, out_path)
    nsa_part(log, out_path)
    fla_part(log, out_path)


if __name__ == "__main__":
    if sys.argv[1] == "--offline":
        offline()
    elif sys.argv[1] == "--order":
        from fa_lab.kernels import load_triton

        load_triton()
        order_part(sys.argv[2])
    else:
        main(sys.argv[1])
