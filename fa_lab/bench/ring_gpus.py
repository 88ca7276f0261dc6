"""Ring attention across the GPUs of one host (chapter 09): forward and backward of
:func:`fa_lab.ring_attention` over W ranks, per-GPU throughput against one GPU at the same tokens per GPU.

``fa-lab bench ring --gpus W`` spawns W processes (``torch.multiprocessing``, one GPU each, NCCL over
loopback rendezvous, NVLink multicast off: ``NCCL_NVLS_ENABLE=0`` and its siblings, as the device's rules
require). Each case (layout, causal flag, whole sequence length N) runs bf16, batch 1, 32 heads, d = 128,
``impl="triton_hopper"``, every rank holding N / W positions:

- ``fwd_ms``, ``bwd_ms``: medians over the repeats of the slowest rank's time (an all-reduce MAX of each
  rank's wall time between barriers, CUDA synchronized), the backward timed on its own;
- ``fwd_tflops_per_gpu``, ``bwd_tflops_per_gpu``: the whole sequence's causal-or-not FLOPs (the backward
  2.5 times the forward) over W and over that time;
- ``efficiency_per_gpu``: the forward-plus-backward throughput per GPU over one GPU's
  ``fa_lab.attention`` forward-plus-backward on N / W positions with the same mask (the ring's ideal: a
  causal zig-zag ring does W times the pairs of one rank's causal block, in W steps of half a block);
- ``fwd_peak_bytes``: the largest rank's peak allocation during a forward and backward (``peak_bytes``).

Rows follow :mod:`.schema` with its ring keys. On a machine without GPUs the same code runs with gloo on
CPU processes (``impl="torch"``, float32, small N): what the tests check, not a measurement.
"""
from __future__ import annotations

import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..block_info import BlockInfo
from ..iomodel import AttentionShape
from .ring import NO_MULTICAST, free_port, no_multicast
from .schema import empty_row, environment, save_results

HEADS, HEAD_DIM = 32, 128
CASES = (("zigzag", True), ("contiguous", True), ("zigzag", False))
def ring_row(world: int, layout: str, causal: bool, seqlen: int, heads: int, head_dim: int, dtype: str) -> dict:
    """An empty row: seqlen_q/k are the positions per rank, ``seqlen`` the whole sequence."""
    row = empty_row("ring_" + layout, AttentionShape(1, heads, seqlen // world, head_dim, causal=causal, dtype=dtype))
    row.update(world_size=world, layout=layout, seqlen=seqlen, fwd_tflops_per_gpu=None, bwd_tflops_per_gpu=None,
               efficiency_per_gpu=None)
    return row


def fill_row(row: dict, fwd_ms: float, bwd_ms: float, single_ms: float, peak: int) -> dict:
    """The figures of a row from the ring's times, one GPU's forward-plus-backward time on the rank's
    positions, and the peak bytes."""
    world, seqlen, causal = row["world_size"], row["seqlen"], row["causal"]
    flops = 4.0 * row["heads"] * row["head_dim"] * BlockInfo(seqlen, seqlen, causal).visible_pairs()
    local = 4.0 * row["heads"] * row["head_dim"] * BlockInfo(seqlen // world, seqlen // world, causal).visible_pairs()
    row.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_tflops=flops / world / (fwd_ms * 1e-3) / 1e12,
               bwd_tflops=2.5 * flops / world / (bwd_ms * 1e-3) / 1e12, fwd_peak_bytes=peak,
               fwd_peak_source="measured")
    # forward plus backward is 3.5 times the forward's FLOPs on both sides, so the pair counts decide
    row.update(fwd_tflops_per_gpu=row["fwd_tflops"], bwd_tflops_per_gpu=row["bwd_tflops"],
               efficiency_per_gpu=(flops / world / (fwd_ms + bwd_ms)) / (local / single_ms))
    return row


def _timed(fn, device, repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's ms for ``fn()`` (after one warm-up call)."""
    def once():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed) * 1e3

    once()
    return statistics.median(once() for _ in range(repeats))


def _measure_case(world, layout, causal, seqlen, repeats, heads, head_dim, device, generator) -> dict:
    """One case on this rank (every rank calls it together): the row, filled."""
    import fa_lab

    impl, dtype = ("triton_hopper", torch.bfloat16) if device.type == "cuda" else ("torch", torch.float32)
    local = seqlen // world
    q, k, v = (torch.randn(1, heads, local, head_dim, device=device, dtype=dtype, generator=generator)
               .requires_grad_() for _ in range(3))
    grad = torch.randn(1, heads, local, head_dim, device=device, dtype=dtype, generator=generator)
    ring = lambda: fa_lab.ring_attention(q, k, v, causal, layout=layout, impl=impl)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    fwd_ms = _timed(ring, device, repeats)
    out = ring()
    bwd_ms = _timed(lambda: out.backward(grad, retain_graph=True), device, repeats)
    single_ms = _timed(lambda: fa_lab.attention(q, k, v, causal, impl=impl).backward(grad), device, repeats)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    row = ring_row(world, layout, causal, seqlen, heads, head_dim, "bf16" if dtype == torch.bfloat16 else "fp32")
    return fill_row(row, fwd_ms, bwd_ms, single_ms, int(peak))


def _rank_main(rank, world, port, backend, seqlens, cases, repeats, heads, head_dim, results_path):
    os.environ.update(NO_MULTICAST, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    generator = torch.Generator(device=device).manual_seed(rank)
    rows = []
    try:
        for layout, causal in cases:
            for seqlen in seqlens:
                rows.append(_measure_case(world, layout, causal, seqlen, repeats, heads, head_dim, device, generator))
                if rank == 0:
                    print(f"W={world} {layout} causal={causal} N={seqlen}: fwd {rows[-1]['fwd_ms']:.1f} ms, bwd "
                          f"{rows[-1]['bwd_ms']:.1f} ms, efficiency per GPU {rows[-1]['efficiency_per_gpu']:.3f}",
                          flush=True)
                    torch.save(rows, results_path)
    finally:
        dist.destroy_process_group()


def run_ring_gpus(world: int, seqlens, cases=CASES, repeats: int = 3, json_path=None, backend="nccl",
                  heads: int = HEADS, head_dim: int = HEAD_DIM, deadline_s: float = 540.0) -> dict:
    """Every case at every whole-sequence length over ``world`` spawned ranks; returns (and saves) the results.

    A case that has not finished by ``deadline_s`` ends the run; what finished is kept (rank 0 saves
    its rows after each case)."""
    import tempfile

    no_multicast()
    for seqlen in seqlens:
        if seqlen % (2 * world):
            raise ValueError(f"seqlen {seqlen} must be a multiple of 2 * world = {2 * world} (zig-zag chunks)")
    device = "cuda" if backend == "nccl" else "cpu"
    results = {**environment(device), "rows": []}
    with tempfile.TemporaryDirectory(prefix="ring_gpus_") as folder:
        path = os.path.join(folder, "rows.pt")
        context = mp.start_processes(_rank_main, args=(world, free_port(), backend, tuple(seqlens), tuple(cases),
                                                       repeats, heads, head_dim, path),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    print(f"ring over {world} ranks: stopped at the {deadline_s:.0f} s deadline")
                    break
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        if os.path.exists(path):
            results["rows"] = torch.load(path)
    if json_path:
        save_results(results, json_path)
    return results
