"""Ring attention (fa_lab.context_parallel): the layouts and the zig-zag cases on their own, then the ring
on 1 to 4 CPU processes over gloo against single-process attention under the tolerance rule, and the
errors that keep a failing, absent or mismatched rank from hanging the others.

Each world size runs in one spawn (a process costs a few seconds of importing torch), which checks every
case of :data:`CASES` and the world's own extra checks; the parent compares the gathered results.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fa_lab
from fa_lab.block_info import BlockInfo
from fa_lab.context_parallel import (
    LAYOUTS,
    StepCall,
    chunk_cases,
    local_chunks,
    ring_attention,
    ring_schedule,
    ring_step,
    shard,
    step_backward,
    step_call,
    unshard,
)
from fa_lab.reference import naive_attention, reference_attention
from fa_lab.testing import LSE_FLOOR, check_attention, compare, make_qkv

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")

# ---- layouts and cases, no processes ----------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_unshard_inverts_shard(layout, world):
    x = torch.randn(1, 2, 4 * world, 3)
    shards = [shard(x, rank, world, layout) for rank in range(world)]
    assert torch.equal(unshard(shards, layout), x)
    assert torch.equal(unshard([shard(x, r, world, layout, dim=-2) for r in range(world)], layout, dim=-2), x)
    positions = torch.arange(4 * world)
    held = torch.cat([shard(positions, rank, world, layout, dim=0) for rank in range(world)])
    assert sorted(held.tolist()) == positions.tolist()  # every position on exactly one rank


def test_zigzag_holds_chunks_r_and_2w_minus_1_minus_r():
    positions = torch.arange(16)  # 4 ranks, 8 chunks of 2
    assert shard(positions, 1, 4, "zigzag", dim=0).tolist() == [2, 3, 12, 13]
    assert shard(positions, 3, 4, "zigzag", dim=0).tolist() == [6, 7, 8, 9]
    assert shard(positions, 1, 4, "contiguous", dim=0).tolist() == [4, 5, 6, 7]
    assert local_chunks(0, 4, "zigzag") == (0, 7) and local_chunks(2, 4) == (2,)


def test_shard_and_unshard_refuse_what_does_not_cut_evenly():
    with pytest.raises(ValueError, match="multiple of 6"):
        shard(torch.zeros(1, 1, 9, 2), 0, 3, "zigzag")
    with pytest.raises(ValueError, match="must be even"):
        unshard([torch.zeros(1, 1, 3, 2)] * 2, "zigzag")
    with pytest.raises(ValueError, match="same shape"):
        unshard([torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 6, 2)])
    with pytest.raises(ValueError, match="layout must be"):
        shard(torch.zeros(1, 1, 4, 2), 0, 2, "striped")
    with pytest.raises(ValueError, match="rank < world"):
        shard(torch.zeros(1, 1, 4, 2), 2, 2)


def test_the_zigzag_case_table():
    # Rank 2 of 4 holds chunks 2 and 5; the visiting shard of rank s holds chunks s and 7 - s.
    assert chunk_cases(2, 2, 4) == (("diagonal", "skip"), ("full", "diagonal"))
    assert chunk_cases(2, 0, 4) == (("full", "skip"), ("full", "skip"))
    assert chunk_cases(2, 3, 4) == (("skip", "skip"), ("full", "full"))
    assert chunk_cases(2, 3, 4, causal=False) == (("full", "full"), ("full", "full"))
    assert ring_step(2, 2, 4, "zigzag", True, 8) == StepCall((0, 8), (0, 8), True)
    assert ring_step(2, 0, 4, "zigzag", True, 8) == StepCall((0, 8), (0, 4), False)
    assert ring_step(2, 3, 4, "zigzag", True, 8) == StepCall((4, 8), (0, 8), False)
    for world in range(1, 6):  # the same three patterns on every rank of every ring
        for rank in range(world):
            for source in range(world):
                want = {True: (("diagonal", "skip"), ("full", "diagonal")),
                        False: (("full", "skip"), ("full", "skip")) if source < rank else
                        (("skip", "skip"), ("full", "full"))}[source == rank]
                assert chunk_cases(rank, source, world) == want
                contiguous = "full" if source < rank else "diagonal" if source == rank else "skip"
                assert chunk_cases(rank, source, world, "contiguous") == ((contiguous,),)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_each_step_computes_exactly_the_pairs_that_the_global_mask_shows(layout, causal):
    for world in range(1, 6):
        for seqlen_local in ((2, 6) if layout == "zigzag" else (1, 5, 6)):
            n = seqlen_local * world
            positions, visible = torch.arange(n), BlockInfo(n, n, causal).mask()
            seen = torch.zeros(n, n, dtype=torch.int64)
            for rank in range(world):
                rows = shard(positions, rank, world, layout, dim=0)
                for step in range(world):
                    source = (rank - step) % world
                    keys = shard(positions, source, world, layout, dim=0)
                    call = ring_step(rank, source, world, layout, causal, seqlen_local)
                    computed = torch.zeros(seqlen_local, seqlen_local, dtype=torch.bool)
                    if call is not None:
                        (r0, r1), (j0, j1) = call.rows, call.keys
                        computed[r0:r1, j0:j1] = BlockInfo(r1 - r0, j1 - j0, call.causal).mask()
                    assert torch.equal(computed, visible[rows][:, keys]), (world, rank, source, seqlen_local)
                    seen[rows[:, None], keys[None, :]] += computed
            assert torch.equal(seen, visible.long())  # every visible pair once over the whole ring


def test_zigzag_gives_every_rank_the_same_causal_work():
    n = 8
    work = {layout: [sum(call.pairs() for call in row if call is not None) for row in ring_schedule(4, layout, True, n)]
            for layout in LAYOUTS}
    assert work["zigzag"] == [n * (n + 1) // 2 + 3 * n * n // 2] * 4
    assert work["contiguous"] == [n * (n + 1) // 2 + r * n * n for r in range(4)]
    for row in ring_schedule(4, "zigzag", True, n):
        assert all(call.pairs() == n * n // 2 for call in row[1:])  # every step after the diagonal: half a block


def test_step_call_refuses_a_table_that_is_not_one_call():
    with pytest.raises(ValueError, match="no single attention call"):
        step_call((("full", "skip"), ("skip", "full")), 4)
    assert step_call((("skip", "skip"), ("skip", "skip")), 4) is None
    with pytest.raises(ValueError, match="multiple of 2"):
        ring_step(0, 0, 2, "zigzag", True, 5)


def test_without_a_process_group_ring_attention_says_so():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    q, k, v = make_qkv(1, 2, 8, head_dim=16, requires_grad=False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, k, v)


# ---- processes: the harness ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, worker, world, port, backend, group_timeout_s, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if sys.platform.startswith("linux") else "lo0")
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=group_timeout_s))
    try:
        worker(rank, world, *args)
        # Every rank done before any tears the group down: a rank that left first closed its sockets under a
        # peer's last transfers, and gloo's thread in that peer aborted the process (SIGABRT, "terminate called
        # without an active exception"), once in a few runs.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank that succeeded leaves without the interpreter's finalization: gloo's threads can still hold tensors
    # then, and one that takes the GIL while Python shuts down is unwound through C++ that cannot unwind, which
    # aborts the process with the same message (this happened after the barrier above, once in many CI runs).
    # The results are in files already; nothing is left to flush but the standard streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker, world, *args, backend="gloo", group_timeout_s=30, deadline_s=60):
    """Run ``worker(rank, world, *args)`` in ``world`` fresh processes of one process group (loopback only).

    A rank that raises makes the join raise ProcessRaisedException (the others are terminated); the
    group's timeout bounds every wait of a rank whose peer is gone, and ``deadline_s`` the whole run.
    """
    context = mp.start_processes(_rank_main, args=(worker, world, _free_port(), backend, group_timeout_s, args),
                                 nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks were still running after {deadline_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


# ---- processes: the ring against single-process attention -----------------------------------------------

CASES = {  # name: (dtype, causal, layout, heads_kv, seqlen_local or None for 48 / world, impl, scale)
    "f32-causal-contiguous": (torch.float32, True, "contiguous", 2, None, "torch", None),
    "f32-causal-zigzag": (torch.float32, True, "zigzag", 2, None, "torch", None),
    "f32-full-contiguous-odd": (torch.float32, False, "contiguous", 2, 7, "torch", None),
    "f32-full-zigzag": (torch.float32, False, "zigzag", 2, None, "torch", None),
    "f32-causal-zigzag-gqa": (torch.float32, True, "zigzag", 1, None, "torch", None),
    "f32-causal-zigzag-naive-scale": (torch.float32, True, "zigzag", 2, None, "naive", 0.3),
    "f32-causal-contiguous-one-each": (torch.float32, True, "contiguous", 2, 1, "torch", None),
    "f32-causal-zigzag-two-each": (torch.float32, True, "zigzag", 1, 2, "torch", None),
    "bf16-causal-zigzag": (torch.bfloat16, True, "zigzag", 2, None, "torch", None),
    "bf16-full-contiguous": (torch.bfloat16, False, "contiguous", 2, None, "torch", None),
}


def _make_cases(world, generator):
    cases = {}
    for name, (dtype, causal, layout, heads_kv, seqlen_local, impl, scale) in CASES.items():
        n = 48 if seqlen_local is None else seqlen_local * world
        q, k, v = make_qkv(1, 2, n, head_dim=16, dtype=dtype, generator=generator, heads_kv=heads_kv,
                           requires_grad=False)
        dout = torch.randn(q.shape, generator=generator).to(dtype)
        cases[name] = {"q": q, "k": k, "v": v, "dout": dout, "causal": causal, "layout": layout, "impl": impl,
                       "scale": scale}
    return cases


def _ring_worker(rank, world, folder):
    cases = torch.load(Path(folder) / "cases.pt", weights_only=True)
    results = {}
    for name, case in cases.items():
        layout = case["layout"]
        q, k, v = (shard(case[x], rank, world, layout).clone().requires_grad_() for x in "qkv")
        out, lse = ring_attention(q, k, v, case["causal"], case["scale"], layout=layout, impl=case["impl"],
                                  return_lse=True)
        out.backward(shard(case["dout"], rank, world, layout))
        results[name] = {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    torch.save(results, Path(folder) / f"rank{rank}.pt")
    EXTRA_CHECKS.get(world, lambda rank, world: None)(rank, world)


def _judge(case, got):
    """The tolerance rule on every tensor, as fa_lab.testing.check_attention applies it."""
    dtype, causal, scale = case["q"].dtype, case["causal"], case["scale"]
    ref = [case[x].double().requires_grad_() for x in "qkv"]
    ref_out, ref_lse = reference_attention(*ref, causal, scale)
    ref_out.backward(case["dout"].double())
    base = [case[x].clone().requires_grad_() for x in "qkv"]
    base_out, base_lse = naive_attention(*base, causal, scale)
    base_out.backward(case["dout"])
    results = [compare("out", got["out"], ref_out, base_out, dtype),
               compare("lse", got["lse"], ref_lse, base_lse, floor=LSE_FLOOR)]
    results += [compare(name, got[name], r.grad, b.grad, dtype) for name, r, b in zip(("dq", "dk", "dv"), ref, base)]
    assert got["out"].dtype == dtype and got["lse"].dtype == torch.float32
    return [str(r) for r in results if not r.ok]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_ring_matches_single_process_attention(world, tmp_path, generator):
    cases = _make_cases(world, generator)
    torch.save(cases, tmp_path / "cases.pt")
    run_ranks(_ring_worker, world, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(world)]
    failures = []
    for name, case in cases.items():
        got = {key: unshard([r[name][key] for r in ranks], case["layout"]) for key in ranks[0][name]}
        failures += [f"{name}: {failure}" for failure in _judge(case, got)]
    assert not failures, "\n".join(failures)


def _one_rank_checks(rank, world):
    """A group of one rank is fa_lab.attention; bad input gets the API's errors."""
    q, k, v = make_qkv(1, 2, 12, head_dim=16, generator=torch.Generator().manual_seed(1), requires_grad=False)
    for layout in LAYOUTS:
        for causal in (False, True):
            out, lse = ring_attention(q, k, v, causal, layout=layout, return_lse=True)
            want, want_lse = fa_lab.attention(q, k, v, causal, return_lse=True)
            assert torch.equal(out, want) and torch.equal(lse, want_lse)
    with pytest.raises(ValueError, match="layout must be 'contiguous' or 'zigzag'"):
        ring_attention(q, k, v, layout="bshd")
    with pytest.raises(ValueError, match="seqlen_local must be even"):
        ring_attention(q[:, :, :11], k[:, :, :11], v[:, :, :11], layout="zigzag")
    with pytest.raises(TypeError, match="float64"):
        ring_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="4 dimensions"):
        ring_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="same positions"):
        ring_attention(q, k[:, :, :6], v[:, :, :6])
    with pytest.raises(ValueError, match="impl must be"):
        ring_attention(q, k, v, impl="cuda")
    with pytest.raises(TypeError, match="ProcessGroup"):
        ring_attention(q, k, v, group="world")


def _disagreement_checks(rank, world):
    """Ranks that disagree all raise, together, instead of waiting for each other."""
    generator = torch.Generator().manual_seed(2)
    q, k, v = make_qkv(1, 2, 8 + 2 * rank, head_dim=16, generator=generator, requires_grad=False)
    with pytest.raises(ValueError, match=r"ranks disagree(.|\n)*rank 1: q \(1, 2, 10, 16\)"):
        ring_attention(q, k, v)
    q, k, v = make_qkv(1, 2, 8, head_dim=16, generator=generator, requires_grad=False)
    with pytest.raises(ValueError, match="ranks disagree(.|\n)*causal=True"):
        ring_attention(q, k, v, causal=rank == 1)
    if rank == 1:
        with pytest.raises(TypeError, match="float64"):
            ring_attention(q.double(), k.double(), v.double())
    else:
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] of the group refused their inputs"):
            ring_attention(q, k, v)
    ring_attention(q, k, v, causal=True)  # the group is still in step after all of that


def _subgroup_checks(rank, world):
    """A ring over ranks 1 and 3 of 4: group ranks are not global ranks."""
    group = dist.new_group([1, 3])
    if rank not in (1, 3):
        return
    member = dist.get_rank(group)
    q, k, v = make_qkv(1, 2, 16, head_dim=16, generator=torch.Generator().manual_seed(3))
    want = fa_lab.attention(q, k, v, True)
    want.sum().backward()
    local = [shard(t.detach(), member, 2, "zigzag").clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, True, group=group, layout="zigzag")
    out.sum().backward()
    torch.testing.assert_close(out, shard(want.detach(), member, 2, "zigzag"), atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(local, (q, k, v)):
        torch.testing.assert_close(mine.grad, shard(theirs.grad, member, 2, "zigzag"), atol=1e-5, rtol=1e-5)


EXTRA_CHECKS = {1: _one_rank_checks, 2: _disagreement_checks, 4: _subgroup_checks}


# ---- processes: a failing or absent rank ends the run --------------------------------------------------


def _failing_worker(rank, world, how):
    q, k, v = make_qkv(1, 2, 8, head_dim=16, generator=torch.Generator().manual_seed(4))
    if rank == 1 and how == "raises":
        raise RuntimeError("rank 1 fails on purpose")
    if rank == 1 and how == "absent":
        time.sleep(60)  # never joins; terminated once rank 0 has given up
    out = ring_attention(q, k, v, True)
    if rank == 1 and how == "absent_in_backward":
        time.sleep(60)
    out.sum().backward()


FAILURES = {  # how rank 1 fails: what the run must end with
    # rank 1's own error, or rank 0's when it sees the connection close first: either ends the run
    "raises": "rank 1 fails on purpose|rank 0 of 2 gave up waiting",
    "absent": "rank 0 of 2 gave up waiting for the other ranks' shapes",
    "absent_in_backward": "rank 0 of 2 gave up waiting for .* at ring step 0",
}


@pytest.mark.parametrize("how", sorted(FAILURES))
def test_a_failing_or_absent_rank_ends_the_run_with_a_clear_error(how):
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match=FAILURES[how]):
        run_ranks(_failing_worker, 2, how, group_timeout_s=3, deadline_s=40)
    assert time.monotonic() - start < 40


# ---- the GPU: NCCL --------------------------------------------------------------------------------------


def _nccl_worker(rank, world):
    torch.cuda.set_device(0)
    q, k, v = make_qkv(1, 2, 64, head_dim=16, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    for impl in ("torch", "triton"):
        out = ring_attention(q, k, v, True, layout="zigzag", impl=impl)
        assert torch.equal(out, fa_lab.attention(q, k, v, True, impl=impl))


@pytest.mark.gpu
def test_one_rank_over_nccl_is_attention():
    run_ranks(_nccl_worker, 1, backend="nccl")


# ---- one process plays every rank: the backward's steps -----------------------------------------------

class _SimulatedRingBackward(torch.autograd.Function):
    """The global (out, lse) from fa_lab.attention; a backward made of ring steps: every rank's step_backward
    over every shard that visits it, summed where the ring's accumulators would sum them."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, world, layout, impl):
        out, lse = fa_lab.attention(q, k, v, causal, scale, impl=impl, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = causal, scale, world, layout, impl
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, world, layout, impl = ctx.args
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        part = {name: [shard(t, r, world, layout) for r in range(world)]
                for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("do", grad_out))}
        lse_part = [shard(lse, r, world, layout) for r in range(world)]
        dq = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in part["q"]]
        dk = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in part["k"]]
        dv = [torch.zeros_like(t) for t in dk]
        for rank, steps in enumerate(ring_schedule(world, layout, causal, q.shape[2] // world)):
            for step, call in enumerate(steps):
                if call is None:
                    continue
                source, rows, keys = (rank - step) % world, slice(*call.rows), slice(*call.keys)
                grads = step_backward(part["q"][rank][:, :, rows], part["k"][source][:, :, keys],
                                      part["v"][source][:, :, keys], part["out"][rank][:, :, rows],
                                      lse_part[rank][:, :, rows], part["do"][rank][:, :, rows], call.causal,
                                      scale, impl)
                assert all(g.dtype == torch.float32 for g in grads)
                dq[rank][:, :, rows] += grads[0]
                dk[source][:, :, keys] += grads[1]
                dv[source][:, :, keys] += grads[2]
        return (*(unshard(g, layout).to(t.dtype) for g, t in zip((dq, dk, dv), (q, k, v))),
                None, None, None, None, None)


def _check_simulated_ring(impl, dtype, device, world, layout, causal, heads_kv):
    generator = torch.Generator().manual_seed(world * 10 + causal)
    q, k, v = make_qkv(1, 4, 96 * world, head_dim=64, dtype=dtype, device=device, generator=generator,
                       heads_kv=heads_kv)
    run = lambda q, k, v, causal, scale: _SimulatedRingBackward.apply(q, k, v, causal, scale, world, layout, impl)
    check_attention(run, q, k, v, causal, generator=generator)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_the_ring_steps_backward_sums_to_the_gradients_of_attention(layout, causal):
    """Every step's share (the torch path) summed as the ring sums it: dq, dk, dv of attention."""
    _check_simulated_ring("torch", torch.float32, "cpu", 3, layout, causal, heads_kv=2)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "triton_hopper"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_the_ring_steps_backward_kernel_sums_to_the_gradients_of_attention(impl, layout, causal):
    """The same with the Triton backward kernel in each step (bf16 on the GPU), 4 ranks, GQA."""
    _check_simulated_ring(impl, torch.bfloat16, "cuda", 4, layout, causal, heads_kv=2)


# ---- the multi-GPU benchmark's code path, on CPU processes -------------------------------------------

def test_the_multi_gpu_ring_benchmark_runs_on_cpu_processes_and_fills_valid_rows():
    """fa_lab.bench.ring_gpus over 2 gloo ranks at tiny sizes: every case gives a schema-valid row whose
    per-GPU figures follow from its times (the GPU run is `bench ring --gpus W` on a multi-GPU host)."""
    from fa_lab.bench import ring_gpus
    from fa_lab.bench.schema import validate_results

    results = ring_gpus.run_ring_gpus(2, [32, 64], repeats=1, backend="gloo", heads=2, head_dim=16, deadline_s=120)
    validate_results(results)
    assert [(r["layout"], r["causal"], r["seqlen"]) for r in results["rows"]] == [
        (layout, causal, n) for layout, causal in ring_gpus.CASES for n in (32, 64)]
    for row in results["rows"]:
        assert row["world_size"] == 2 and row["seqlen_q"] == row["seqlen"] // 2
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and row["efficiency_per_gpu"] > 0
        pairs = BlockInfo(row["seqlen"], row["seqlen"], row["causal"]).visible_pairs()
        expected = 4 * 2 * 16 * pairs / 2 / (row["fwd_ms"] * 1e-3) / 1e12
        assert row["fwd_tflops_per_gpu"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="multiple of 2 \\* world"):
        ring_gpus.run_ring_gpus(2, [30], backend="gloo")
