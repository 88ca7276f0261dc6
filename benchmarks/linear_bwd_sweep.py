"""The linear kernels' launches that the backward spends its time in, timed over tile widths, warps and
pipeline stages on a CUDA GPU (bf16, B = 8, H = 16, N = 4096, d = 128, chunks of 64), each setting checked
against the committed one (relative error of its output): simple GLA's h pass (as its backward recomputes it,
float32 states), dh, dv and dq/dk passes, and the delta rule's h pass (forward and backward), dh pass, dq/dk/dw
pass and recomputation of the WY factors from the forward's T, ungated as the benchmark's delta rule is. What
chose their entries in linear_launch's LAUNCH_WARPS and LAUNCH_STAGES and their tiles (linear_launch.h_pass_tiles,
DV_BLOCK_V, DQK_BLOCK_V and STATE_SLICE); log: benchmarks/h200_linear_bwd_sweep.json.
Usage on the device, from the repository root:
    PYTHONPATH=. python3 benchmarks/linear_bwd_sweep.py OUT.json [SECONDS [NAME ...]]
(SECONDS: stop starting new settings after that long, default 240, the log says which sweeps were not reached;
NAME: the sweeps to run in that order, default all of SWEEPS).
"""
import itertools
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from fa_lab.bench.schema import environment, write_log
from fa_lab.kernels.portable import linear_chunk as lc
from fa_lab.kernels.portable import linear_chunk_bwd as lb
from fa_lab.kernels.portable import linear_delta as ld
from fa_lab.kernels.portable.linear_gate import log2_cumulated_gate

B, H, N, D, C = 8, 16, 4096, 128, 64
CHUNKS = N // C
BF16, F32 = torch.bfloat16, torch.float32


def empty(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def simple_gla_h(t, bk, bv, warps, stages):
    """Simple GLA's h pass as its backward launches it (float32 states); output: the states."""
    h, final = empty(B * H, CHUNKS, D, D, dtype=F32), empty(B, H, D, D, dtype=F32)
    return (lambda: lc.chunk_fwd_h_kernel[(D // bk, D // bv, B * H)](
        t["k"], t["v"], t["cum"], t["k"], h, final, N, CHUNKS, D, D, CHUNK=C, BLOCK_K=bk, BLOCK_V=bv, GATE=1,
        HAS_H0=False, PRECISION="tf32", num_warps=warps, num_stages=stages)), h


def simple_gla_dh(t, bk, bv, warps, stages):
    """Simple GLA's dh pass; output: the states' gradients."""
    dh, dh0 = empty(B * H, CHUNKS, D, D, dtype=F32), empty(B * H, D, D, dtype=F32)
    return (lambda: lb.chunk_bwd_dh_kernel[(D // bk, D // bv, B * H)](
        t["q"], t["do"], t["cum"], t["k"], dh, dh0, N, CHUNKS, D, D, D ** -0.5, CHUNK=C, BLOCK_K=bk, BLOCK_V=bv,
        GATE=1, HAS_DHT=False, PRECISION="tf32", num_warps=warps, num_stages=stages)), dh


def delta_h(t, bk, bv, warps, stages):
    """The delta rule's h pass (whole d_k per program); output: the corrected values."""
    h, v_new, final = empty(B * H, CHUNKS, D, D), empty(B, H, N, D), empty(B, H, D, D, dtype=F32)
    return (lambda: ld.chunk_delta_fwd_h_kernel[(D // bv, B * H)](
        t["k"], t["w"], t["u"], t["k"], t["k"], h, v_new, final, N, CHUNKS, D, D, CHUNK=C, BLOCK_K=bk,
        BLOCK_V=bv, GATED=False, HAS_H0=False, PRECISION="tf32", num_warps=warps, num_stages=stages)), v_new


def delta_dh(t, bk, bv, warps, stages):
    """The delta rule's dh pass; output: dV_new."""
    dh, dv_new, dh0 = empty(B * H, CHUNKS, D, D), empty(B, H, N, D), empty(B * H, D, D, dtype=F32)
    return (lambda: ld.chunk_delta_bwd_dh_kernel[(D // bv, B * H)](
        t["q"], t["k"], t["w"], t["do"], t["dv_local"], t["k"], dh, dv_new, dh0, t["k"], t["k"], t["k"], t["k"],
        N, CHUNKS, D, D, D ** -0.5, CHUNK=C, BLOCK_K=bk, BLOCK_V=bv, HAS_DHT=False, GATED=False, PRECISION="tf32",
        num_warps=warps, num_stages=stages)), dv_new


def delta_wy(t, bk, bv, warps, stages):
    """The backward's recomputation of the WY factors from the forward's T; output: w."""
    w, u = torch.empty_like(t["k"]), torch.empty_like(t["v"])
    return (lambda: ld.chunk_wy_kernel[(CHUNKS, B * H)](
        t["k"], t["v"], t["beta"], t["k"], t["inverse"], w, u, N, CHUNKS, D, D, CHUNK=C, BLOCK_K=bk, BLOCK_V=bv,
        GATED=False, PRECISION="tf32", INVERSE=2, num_warps=warps, num_stages=stages)), w


def delta_dqk(t, bk, bv, warps, stages):
    """The delta rule's dq/dk/dw pass (states and dV_new in bf16); output: dq."""
    dq, dk, dw = (empty(B, H, N, D) for _ in range(3))
    return (lambda: lb.chunk_bwd_dqk_kernel[(CHUNKS, B * H, D // bk)](
        t["q"], t["k"], t["v"], t["do"], t["k"], t["h16"], t["dh16"], dq, dk, t["k"], t["dv_local"], dw, N, CHUNKS,
        D, D, D ** -0.5, CHUNK=C, BLOCK_K=bk, BLOCK_V=bv, GATE=0, PRECISION="tf32", DELTA=True, num_warps=warps,
        num_stages=stages)), dq


def simple_gla_dqk(t, bk, bv, warps, stages):
    """Simple GLA's dq/dk pass (float32 states); output: dq."""
    dq, dk = empty(B, H, N, D), empty(B, H, N, D)
    dgate = empty(D // bk, B * H, N, dtype=F32)
    return (lambda: lb.chunk_bwd_dqk_kernel[(CHUNKS, B * H, D // bk)](
        t["q"], t["k"], t["v"], t["do"], t["cum"], t["h32"], t["dh32"], dq, dk, dgate, t["k"], t["k"], N, CHUNKS,
        D, D, D ** -0.5, CHUNK=C, BLOCK_K=bk, BLOCK_V=bv, GATE=1, PRECISION="tf32", num_warps=warps,
        num_stages=stages)), dq


def simple_gla_dv(t, bk, bv, warps, stages):
    """Simple GLA's dv pass (float32 state gradients); output: dv."""
    dv = empty(B, H, N, D)
    return (lambda: lb.chunk_bwd_dv_kernel[(CHUNKS, B * H, D // bv)](
        t["q"], t["k"], t["do"], t["cum"], t["dh32"], dv, N, CHUNKS, D, D, D ** -0.5, CHUNK=C, BLOCK_K=bk,
        BLOCK_V=bv, GATE=1, PRECISION="tf32", num_warps=warps, num_stages=stages)), dv


# (name, launch, committed (BLOCK_K, BLOCK_V, warps, stages), candidate tiles, warps, stages)
SWEEPS = [
    ("delta_dh", delta_dh, (128, 32, 2, 1), [(128, 16), (128, 32), (128, 64)], (2, 4, 8), (1, 2, 3)),
    ("delta_h", delta_h, (128, 32, 4, 3), [(128, 16), (128, 32), (128, 64)], (2, 4, 8), (1, 2, 3)),
    ("simple_gla_dh", simple_gla_dh, (64, 64, 4, 3), [(64, 64), (128, 32), (128, 64), (64, 128), (32, 64)],
     (2, 4, 8), (1, 2, 3)),
    ("simple_gla_h", simple_gla_h, (64, 64, 4, 3), [(64, 64), (128, 32), (128, 64), (64, 128), (32, 64)],
     (2, 4, 8), (1, 2, 3)),
    ("delta_wy", delta_wy, (64, 64, 4, 3), [(32, 32), (64, 64), (128, 128)], (2, 4, 8), (1, 2, 3)),
    ("delta_dqk", delta_dqk, (64, 64, 4, 2), [(64, 64), (32, 64), (64, 32), (128, 64), (128, 32), (32, 32)], (4, 8),
     (1, 2, 3)),
    ("simple_gla_dv", simple_gla_dv, (64, 64, 4, 3), [(64, 64), (32, 64), (64, 32), (128, 64), (64, 128)], (2, 4, 8),
     (1, 2, 3)),
    ("simple_gla_dqk", simple_gla_dqk, (64, 64, 4, 3), [(64, 64), (32, 64), (64, 32), (128, 64), (128, 32), (32, 32)],
     (2, 4, 8), (1, 2, 3)),
]


def inputs() -> dict:
    torch.manual_seed(0)
    rand = lambda: torch.randn(B, H, N, D, device="cuda")
    t = {name: rand().to(BF16) for name in ("q", "v", "do", "dv_local")}
    t["k"] = F.normalize(rand(), dim=-1).to(BF16)
    t["cum"] = log2_cumulated_gate(F.logsigmoid(torch.randn(B, H, N, device="cuda")), C)
    beta = torch.sigmoid(torch.randn(B, H, N, device="cuda")).to(BF16)
    t["w"], t["u"] = torch.empty_like(t["k"]), torch.empty_like(t["v"])  # the WY factors, as the forward makes them
    t["beta"], t["inverse"] = beta, empty(B * H, N, C, dtype=F32)  # T kept as the forward keeps it
    ld.chunk_wy_kernel[(CHUNKS, B * H)](t["k"], t["v"], beta, t["k"], t["inverse"], t["w"], t["u"], N, CHUNKS, D, D,
                                        CHUNK=C, BLOCK_K=64, BLOCK_V=64, GATED=False, PRECISION="tf32", INVERSE=1)
    states = lambda: torch.randn(B * H, CHUNKS, D, D, device="cuda")  # state tiles, for the chunk-parallel passes
    t["h32"], t["dh32"] = states(), states()
    t["h16"], t["dh16"] = t["h32"].to(BF16), t["dh32"].to(BF16)
    return t


def relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(path, budget_s=240.0, names=()):
    t = inputs()
    log = {**environment("cuda"), "shape": dict(batch=B, heads=H, seqlen=N, head_dim=D, chunk=C), "budget_s": budget_s}
    start = time.time()
    chosen = [sweep for name in names for sweep in SWEEPS if sweep[0] == name] if names else SWEEPS
    for name, launch, committed, tiles, warp_choices, stage_choices in chosen:
        base_call, base = launch(t, *committed)
        base_call()
        torch.cuda.synchronize()
        base = base.clone()
        rows = log.setdefault(name, [])
        for (bk, bv), warps, stages in itertools.product(tiles, warp_choices, stage_choices):
            if time.time() - start > budget_s:
                log.setdefault("not_reached", []).append(name)
                break
            row = dict(bk=bk, bv=bv, warps=warps, stages=stages, committed=(bk, bv, warps, stages) == committed)
            try:
                call, out = launch(t, bk, bv, warps, stages)
                call()
                torch.cuda.synchronize()
                row.update(err=relative(out, base), ms=do_bench(call, warmup=10, rep=40))
            except Exception as exc:  # out of resources: shared memory, registers
                row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            rows.append(row)
            print(name, row, flush=True)
        timed = [r for r in rows if "ms" in r and r["err"] < 1e-2]
        if timed:
            best = min(timed, key=lambda r: r["ms"])
            ours = next((r["ms"] for r in rows if r["committed"] and "ms" in r), None)
            print(f"== {name}: best {best} against the committed {ours} ms", flush=True)
        write_log(log, path)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 240.0, tuple(sys.argv[3:]))
