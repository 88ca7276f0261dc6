"""Where MoBA's forward time goes beyond its kernels', with the gate and packing beside pass 1 and without.

The sparse benchmark's MoBA case at 64K (bf16, d = 128, 32 heads, blocks of 4096, top-3, inputs requiring grad
as in the benchmark), in three arrangements of the same kernels:

- ``side_stream``: what the forward does (:class:`fa_lab.kernels.common.SideWork`): pass 1 queued first, the
  gate and the packing on a high-priority second stream beside it;
- ``one_stream``: the same calls in the same order on one stream (SideWork made a no-op);
- ``side work precomputed``: the gate's selection and pass 2's packing made once, outside the timing, so that a
  call runs pass 1, pass 2 and the merge alone (what the forward would take if its side work were free);

and, beside the stream, pass 1 (causal blocks as heads; ``MOBA_PASS_OPTIONS`` in
fa_lab/kernels/hopper/attention.py has it one tile per CTA) on the persistent kernel, on every SM and with
SPARE_SMS of them left without a CTA for the side work (``HopperOptions.spare_sms``).

Each is timed as the sparse benchmark times it (``triton.testing.do_bench``, median, L2 flushed before each call;
1 s of calls rather than its 0.1 s) in ROUNDS interleaved rounds beside dense causal attention (the benchmark's
``dense``), and profiled: each call's span on the GPU (from the end of its flush to the end of its last kernel),
the sum of its kernels' times, and every idle stretch longer than 5 microseconds (no kernel of either stream
running) with the kernel after it, and the kernels of one call in the order they started (pass 1's and pass 2's
times apart). Every variant's output is compared to ``side_stream``'s to the bit.

On the H200: ``PYTHONPATH=. python3 benchmarks/moba_forward_gaps.py $OUT`` writes $OUT/h200_moba_forward_gaps.json.
"""
import contextlib
import os
import statistics
import sys
from dataclasses import replace

SEQLEN, CALLS, ROUNDS, MIN_GAP_US = 65536, 5, 3, 5.0
SPARE_SMS = (8, 16, 24, 32, 48)


class InOrder:
    """SideWork's interface with the body queued on the current stream."""

    def __init__(self, device):
        pass

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

    def join(self, *tensors):
        pass


def profile_calls(run, flush) -> dict:
    """Span, kernel sum and idle gaps of CALLS flushed calls of ``run`` under torch.profiler."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            flush.zero_()
            run()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
    calls, current = [], None
    for kernel in kernels:  # a call's kernels: those after a flush fill (the only int8 fill) up to the next one
        if "FillFunctor<signed char>" in kernel[2] or "FillFunctor<char>" in kernel[2]:
            current = [(kernel[1], kernel[1], "the flush")]  # the call starts where its flush ends
            calls.append(current)
        elif current is not None:
            current.append(kernel)
    calls = [call for call in calls if len(call) > 1]
    first_call = [{"kernel": name[:60], "ms": round((end - start) / 1000, 3)} for start, end, name in calls[0][1:]]
    gaps, spans, sums = [], [], []
    for call in calls:
        ends = [call[0][1]]  # streams overlap: a gap is time after every earlier kernel has ended
        for start, end, name in call[1:]:
            if start - max(ends) > MIN_GAP_US:
                gaps.append({"us": round(start - max(ends), 1), "before": name[:70]})
            ends.append(end)
        spans.append((max(ends) - call[0][0]) / 1000)
        sums.append(sum(end - start for start, end, _ in call[1:]) / 1000)
    return {"profiled_calls": len(spans), "kernels_per_call": [len(call) - 1 for call in calls],
            "span_ms": [round(s, 3) for s in spans], "kernel_sum_ms": [round(s, 3) for s in sums],
            "idle_ms_per_call": round(sum(g["us"] for g in gaps) / 1000 / max(len(spans), 1), 3),
            "gaps": sorted(gaps, key=lambda g: -g["us"])[:10], "first_call_kernels": first_call}


def main(out_dir: str) -> None:
    import torch
    from triton.testing import do_bench

    from fa_lab import sparse
    from fa_lab.bench.schema import environment, write_log
    from fa_lab.bench.sparse import MOBA_BLOCK, MOBA_HEADS, MOBA_TOP_K, bf16_inputs, dense, ours_moba
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.portable import moba

    load_triton()
    generator = torch.Generator(device="cuda").manual_seed(1)
    tensors = bf16_inputs(MOBA_HEADS, MOBA_HEADS, SEQLEN, generator)
    run_moba, _ = ours_moba(*tensors, None)
    run_dense, _ = dense(*tensors, None)
    from fa_lab.kernels.hopper import attention as hopper

    side_work, pass_options = moba.SideWork, hopper.MOBA_PASS_OPTIONS
    own, past = pass_options
    spare_variants = {f"side_stream, pass 1 persistent, {spare} SMs spare":
                      (side_work, (replace(own, persistent=True, spare_sms=spare), past)) for spare in SPARE_SMS}
    variants = {"side_stream": (side_work, pass_options), "one_stream": (InOrder, pass_options),
                "side work precomputed": (side_work, pass_options),
                "side_stream, pass 1 persistent": (side_work, (replace(own, persistent=True), past)), **spare_variants}
    gate, packer = sparse.moba_gate, moba.past_block_sequences
    with torch.no_grad():
        selected = gate(tensors[0], tensors[1], MOBA_BLOCK, MOBA_TOP_K, "triton")
        packing = packer(selected, MOBA_BLOCK, moba.kernel_operand(tensors[0].detach().contiguous()))

    @contextlib.contextmanager
    def arrangement(name):
        moba.SideWork, hopper.MOBA_PASS_OPTIONS = variants.get(name, (side_work, pass_options))
        if name == "side work precomputed":
            sparse.moba_gate = lambda *args, **kwargs: selected
            moba.past_block_sequences = lambda *args: dict(packing)  # the forward drops its "q" from the dict
        try:
            yield
        finally:
            moba.SideWork, hopper.MOBA_PASS_OPTIONS = side_work, pass_options
            sparse.moba_gate, moba.past_block_sequences = gate, packer

    log = [{"variants": {name: [work.__name__, [vars(o) for o in options]]
                         for name, (work, options) in variants.items()}}]
    with torch.no_grad():
        with arrangement("side_stream"):
            expected = run_moba()
        for name in variants:
            with arrangement(name):
                log.append({"check": f"{name}: output equal to side_stream's to the bit",
                            "equal": bool(torch.equal(run_moba(), expected))})
    del expected
    times = {name: [] for name in (*variants, "dense")}
    for _ in range(ROUNDS):
        for name in times:
            with arrangement(name):
                times[name].append(round(do_bench(run_dense if name == "dense" else run_moba,
                                                  return_mode="median", rep=1000), 3))
        print(times, flush=True)
    log.append({"seqlen": SEQLEN, "forward_ms_per_round": times,
                "dense_over_moba": {name: round(statistics.median(times["dense"]) / statistics.median(times[name]), 3)
                                    for name in variants}})
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device="cuda")
    for name in ("side_stream", "side work precomputed", *spare_variants):
        with arrangement(name):
            log.append({"arrangement": name, **profile_calls(run_moba, flush)})
        print(log[-1], flush=True)
    write_log({**environment("cuda"), "log": log}, os.path.join(out_dir, "h200_moba_forward_gaps.json"))


if __name__ == "__main__":
    main(sys.argv[1])
