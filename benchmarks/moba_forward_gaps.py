"""Where MoBA's forward time goes beyond its kernels': the sparse benchmark's MoBA case at 64K (bf16, d = 128,
32 heads, blocks of 4096, top-3, inputs requiring grad as in the benchmark), timed the way triton's do_bench
times it (L2 flushed by a 256 MB fill, then events around the call), and the same loop under torch.profiler.

From the profile: each call's span on the GPU (from the end of its flush to the end of its last kernel), the sum
of its kernels' times, and every idle stretch longer than 5 microseconds with the kernels on either side. The
event-timed medians, with and without the flush, go beside them.

On the H200: ``PYTHONPATH=. python3 benchmarks/moba_forward_gaps.py $OUT`` writes $OUT/h200_moba_forward_gaps.json.
"""
import os
import statistics
import sys

SEQLEN, CALLS, MIN_GAP_US = 65536, 5, 5.0


def main(out_dir: str) -> None:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from fa_lab.bench.schema import environment, write_log
    from fa_lab.bench.sparse import MOBA_HEADS, bf16_inputs, ours_moba
    from fa_lab.kernels import load_triton

    load_triton()
    generator = torch.Generator(device="cuda").manual_seed(1)
    run, _ = ours_moba(*bf16_inputs(MOBA_HEADS, MOBA_HEADS, SEQLEN, generator), None)
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device="cuda")

    def timed_loop(flushed: bool) -> list[float]:
        starts, ends = ([torch.cuda.Event(enable_timing=True) for _ in range(CALLS)] for _ in range(2))
        for start, end in zip(starts, ends):
            if flushed:
                flush.zero_()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in zip(starts, ends)]

    for _ in range(2):
        timed_loop(True)
    entry = {"seqlen": SEQLEN, "calls": CALLS,
             "event_median_ms_flushed": round(statistics.median(timed_loop(True)), 3),
             "event_median_ms_unflushed": round(statistics.median(timed_loop(False)), 3)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_loop(True)
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
    # a call's kernels: those after a flush fill (the only int8 fill of the loop) up to the next one
    is_flush = ["FillFunctor<signed char>" in name or "FillFunctor<char>" in name for _, _, name in kernels]
    calls, current = [], None
    for kernel, flushing in zip(kernels, is_flush):
        if flushing:
            current = [(kernel[1], kernel[1], "the flush")]  # the call starts where its flush ends
            calls.append(current)
        elif current is not None:
            current.append(kernel)
    calls = [call for call in calls if len(call) > 1]
    gaps = []
    for call in calls:
        gaps += [{"us": round(b[0] - a[1], 1), "after": a[2][:70], "before": b[2][:70]}
                 for a, b in zip(call, call[1:]) if b[0] - a[1] > MIN_GAP_US]
    spans = [(call[-1][1] - call[0][0]) / 1000 for call in calls]
    sums = [sum(end - start for start, end, _ in call) / 1000 for call in calls]
    entry.update(profiled_calls=len(spans), kernels_per_call=[len(call) - 1 for call in calls],
                 span_ms=[round(s, 3) for s in spans], kernel_sum_ms=[round(s, 3) for s in sums],
                 idle_ms_per_call=round(sum(g["us"] for g in gaps) / 1000 / len(spans), 3),
                 gaps=sorted(gaps, key=lambda g: -g["us"])[:20])
    print(entry, flush=True)
    write_log({**environment("cuda"), "log": [entry]}, os.path.join(out_dir, "h200_moba_forward_gaps.json"))


if __name__ == "__main__":
    main(sys.argv[1])
