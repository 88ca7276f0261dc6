"""Ring attention measured on one GPU (chapter 09): every ring step's compute and one K/V shard's copy,
timed on one device, and the overlap a ring of W GPUs would get from those figures.

Shape: bf16, batch 1, 32 heads (query and KV), d = 128, ``tokens_per_gpu`` positions per rank. The
run records:

- ``nccl_world1_equal``: :func:`fa_lab.ring_attention` over a one-rank NCCL group returns exactly
  ``fa_lab.attention``'s output (zig-zag, causal, 8K tokens);
- ``calls``: every distinct attention call of :func:`fa_lab.context_parallel.ring_schedule` (the
  rank's queries ``rows`` against the visiting shard's keys ``keys``, causal or not), forward
  (``fa_lab.attention(impl="triton_hopper")``) and backward (:func:`fa_lab.context_parallel.step_backward`,
  the Triton kernel given the out and LSE) medians of ``triton.testing.do_bench``;
- ``copies``: one K/V shard (K and V, bf16) and one dK/dV accumulator (float32) copied device to
  device, ms and GB/s (bytes delivered per second);
- ``model``: per world size, layout and causal flag, each rank's ring time as the sum over its steps of
  max(compute, transfer) (the next shard's transfer is posted before the step's compute; the forward
  moves W - 1 shards, the backward also a dK/dV accumulator at every step), for two links: NVLink at
  450 GB/s one way (an assumption: the H200 SXM datasheet's 900 GB/s per GPU counts both directions),
  and the local copy rate measured here (a bound no link beats). ``efficiency`` is per GPU, the
  issue's measure: (visible pairs of the whole sequence / W / the slowest rank's ring time) over
  (visible pairs at ``tokens_per_gpu`` / the single-GPU call's time at that length, same causal flag).
  ``exposed_ms`` is the transfer time that compute did not hide on the slowest rank.

Nothing here crosses a link: the multi-GPU run measures that (``benchmarks/h200x{N}_ring.json``; none recorded yet).
"""
from __future__ import annotations

import os
import socket
import sys

import torch

from ..block_info import BlockInfo
from .schema import environment, write_log

HEADS, HEAD_DIM = 32, 128
TOKENS_PER_GPU = (32768, 65536, 131072)
WORLDS = (2, 4, 8)
NVLINK_BYTES_PER_S = 450e9  # one direction (module docstring)
CASES = (("zigzag", True), ("contiguous", True), ("contiguous", False))


NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def no_multicast() -> None:
    """Keep NVLink multicast off in NCCL, PyTorch and NVSHMEM for this process and those it starts (the
    device's rule: a program that uses it can take a shared host's GPUs out of service)."""
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)


def free_port() -> int:
    """A free TCP port on loopback, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_world1_equal(seqlen: int = 8192) -> bool:
    """ring_attention over a one-rank NCCL group equals fa_lab.attention exactly (bf16, causal, zig-zag)."""
    import torch.distributed as dist

    import fa_lab

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        q, k, v = (torch.randn(1, HEADS, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = fa_lab.ring_attention(q, k, v, causal=True, layout="zigzag", impl="triton_hopper")
        return bool(torch.equal(out, fa_lab.attention(q, k, v, causal=True, impl="triton_hopper")))
    finally:
        dist.destroy_process_group()


def distinct_calls(tokens_per_gpu: int) -> list[tuple[int, int, bool]]:
    """(query rows, keys, causal) of every distinct call in the schedules that :data:`CASES` and
    :data:`WORLDS` make, at ``tokens_per_gpu`` positions per rank."""
    from ..context_parallel import ring_schedule

    calls = set()
    for world in WORLDS:
        for layout, causal in CASES:
            for steps in ring_schedule(world, layout, causal, tokens_per_gpu):
                calls.update((c.rows[1] - c.rows[0], c.keys[1] - c.keys[0], c.causal) for c in steps if c)
    return sorted(calls)


def time_call(rows: int, keys: int, causal: bool, timer) -> tuple[float, float]:
    """(forward ms, backward ms) of one ring step's call on fresh bf16 inputs."""
    import fa_lab

    from ..context_parallel import step_backward

    q = torch.randn(1, HEADS, rows, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, HEADS, keys, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    forward = lambda: fa_lab.attention(q, k, v, causal, impl="triton_hopper", return_lse=True)
    fwd_ms = timer(forward, return_mode="median")
    out, lse = forward()
    grad = torch.randn_like(out)
    scale = HEAD_DIM ** -0.5
    bwd_ms = timer(lambda: step_backward(q, k, v, out, lse, grad, causal, scale, "triton_hopper"),
                   return_mode="median")
    return fwd_ms, bwd_ms


def time_copy(nbytes: int, timer) -> tuple[float, float]:
    """(ms, GB/s) of a device-to-device copy of ``nbytes``."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), return_mode="median")
    return ms, nbytes / (ms * 1e-3) / 1e9


def shard_bytes(tokens_per_gpu: int) -> tuple[int, int]:
    """(K/V shard bytes in bf16, dK/dV accumulator bytes in float32) of one rank."""
    elements = 2 * HEADS * tokens_per_gpu * HEAD_DIM
    return 2 * elements, 4 * elements


def model_ring(world: int, layout: str, causal: bool, tokens_per_gpu: int, call_ms: dict, link_bytes_per_s: float
               ) -> dict:
    """The modelled ring of one configuration: per-GPU efficiency and exposed transfer, forward and backward.

    call_ms maps (rows, keys, causal) to (fwd ms, bwd ms); the single-GPU reference is the call
    (tokens_per_gpu, tokens_per_gpu, causal)."""
    from ..context_parallel import ring_schedule

    kv_ms, dkv_ms = (nbytes / link_bytes_per_s * 1e3 for nbytes in shard_bytes(tokens_per_gpu))
    found = {}
    for index, name in enumerate(("fwd", "bwd")):
        ring_ms, exposed_ms = 0.0, 0.0
        for steps in ring_schedule(world, layout, causal, tokens_per_gpu):
            total = exposed = 0.0
            for step, call in enumerate(steps):
                compute = call_ms[(call.rows[1] - call.rows[0], call.keys[1] - call.keys[0], call.causal)][index] \
                    if call else 0.0
                # the next shard moves after every step but the last; the backward's accumulator after every one
                transfer = (kv_ms if step + 1 < world else 0.0) + (dkv_ms if name == "bwd" else 0.0)
                total += max(compute, transfer)
                exposed += max(0.0, transfer - compute)
            if total > ring_ms:
                ring_ms, exposed_ms = total, exposed
        single_ms = call_ms[(tokens_per_gpu, tokens_per_gpu, causal)][index]
        whole = BlockInfo(world * tokens_per_gpu, world * tokens_per_gpu, causal).visible_pairs()
        local = BlockInfo(tokens_per_gpu, tokens_per_gpu, causal).visible_pairs()
        found[f"{name}_ring_ms"] = ring_ms
        found[f"{name}_exposed_ms"] = exposed_ms
        found[f"{name}_efficiency"] = (whole / world / ring_ms) / (local / single_ms)
    return found


def run_ring(json_path=None, tokens=TOKENS_PER_GPU, timer=None, progress=print) -> dict:
    """The whole measurement; the log is written to ``json_path`` (JSON) at the end."""
    if timer is None:
        from triton.testing import do_bench as timer
    no_multicast()
    log = {**environment("cuda"), "heads": HEADS, "heads_kv": HEADS, "head_dim": HEAD_DIM, "dtype": "bf16",
           "nvlink_bytes_per_s": NVLINK_BYTES_PER_S, "calls": [], "copies": [], "model": []}
    try:
        log["nccl_world1_equal"] = nccl_world1_equal()
    except Exception as exc:  # recorded, not fatal: the timings below need no process group
        print(f"nccl world size 1: {exc!r:.300}", file=sys.stderr)
        log["nccl_world1_equal"] = None
    progress(f"NCCL, world size 1, ring_attention == attention: {log['nccl_world1_equal']}")
    for n in tokens:
        call_ms = {}
        for rows, keys, causal in distinct_calls(n):
            call_ms[(rows, keys, causal)] = time_call(rows, keys, causal, timer)
            log["calls"].append({"tokens_per_gpu": n, "rows": rows, "keys": keys, "causal": causal,
                                 "fwd_ms": call_ms[(rows, keys, causal)][0],
                                 "bwd_ms": call_ms[(rows, keys, causal)][1]})
            progress(f"n={n} call {rows} x {keys} causal={causal}: {call_ms[(rows, keys, causal)]}")
            torch.cuda.empty_cache()
        copy_rate = None
        for what, nbytes in zip(("kv_shard", "dkv_accumulator"), shard_bytes(n)):
            ms, gbps = time_copy(nbytes, timer)
            log["copies"].append({"tokens_per_gpu": n, "what": what, "bytes": nbytes, "ms": ms, "gbps": gbps})
            copy_rate = gbps * 1e9 if what == "kv_shard" else copy_rate
        for world in WORLDS:
            for layout, causal in CASES:
                for link, rate in (("nvlink_450", NVLINK_BYTES_PER_S), ("local_copy", copy_rate)):
                    log["model"].append({"world_size": world, "layout": layout, "causal": causal,
                                         "tokens_per_gpu": n, "seqlen": world * n, "link": link,
                                         **model_ring(world, layout, causal, n, call_ms, rate)})
        if json_path:
            write_log(log, json_path)
    return log


def summary(log: dict) -> list[str]:
    """One line per modelled configuration over NVLink."""
    return [f"W={m['world_size']} {m['layout']:>10} causal={m['causal']!s:5} n={m['tokens_per_gpu'] // 1024}K: "
            f"efficiency fwd {m['fwd_efficiency']:.3f} bwd {m['bwd_efficiency']:.3f}, exposed "
            f"{m['fwd_exposed_ms']:.2f} / {m['bwd_exposed_ms']:.2f} ms"
            for m in log["model"] if m["link"] == "nvlink_450"]
