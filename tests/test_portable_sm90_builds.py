"""The plain-Triton kernels of chapters 07 and 08 compiled for sm_90 offline, at the tiles, warps and stages
their launchers pick for bf16, head_dim 128 and chunks of 64 (NSA's and block-sparse attention's packed rows
for the selected-blocks kernels), with a launch's divisibility hints: each must fit an H200's shared memory
and spill no registers (one known exception, bounded). CI has no GPU, so this is what catches a kernel edit
that would only fail, or slow down, on the device (the device's `gpu` tests then check the numbers)."""
from __future__ import annotations

import pytest

from fa_lab.kernels.hopper.sm90_offline import SM90_SHARED_LIMIT, compile_all_for_sm90

BF16, F32, I32, INT_PTR = "*bf16", "*fp32", "i32", "*i32"


def _pointers(names: str, kind: str = BF16) -> dict:
    return {name: kind for name in names.split()}


def _ints(names: str) -> dict:
    return {name: I32 for name in names.split()}


def linear_jobs() -> list[tuple[str, dict]]:
    """(label, compile job) of every linear-attention kernel at d_k = d_v = 128, C = 64."""
    from fa_lab.kernels.portable import linear_chunk as chunk
    from fa_lab.kernels.portable import linear_chunk_bwd as bwd
    from fa_lab.kernels.portable import linear_delta as delta
    from fa_lab.kernels.portable import linear_gate as gate
    from fa_lab.kernels.portable import linear_launch as launch

    def launch_warps(label, kernel) -> int:  # the gate kernels take Triton's default, 4
        listed = kernel.__name__ in launch.LAUNCH_WARPS
        return launch.launch_warps(kernel, 64, variants.get(label)) if listed else 4

    tf32 = {"PRECISION": "tf32"}
    variants = {"h pass, per-dim gate": "per_dim", "h pass, scalar gate, float32 states": "scalar",
                "dh pass, per-dim gate": "per_dim", "dh pass, scalar gate": "scalar",
                "dqk pass, gated delta rule": "delta", "dv pass, scalar gate": "carried",
                "WY recomputed in the backward": "recompute"}
    sizes = _ints("seqlen chunks d_k d_v")
    jobs = [
        ("h pass, per-dim gate", chunk.chunk_fwd_h_kernel,
         {**_pointers("k_ptr v_ptr h_ptr"), **_pointers("g_ptr h0_ptr ht_ptr", F32), **sizes},
         dict(CHUNK=64, GATE=2, HAS_H0=True, **launch.h_pass_tiles("per_dim", 128, 128), **tf32)),
        ("h pass, scalar gate, float32 states", chunk.chunk_fwd_h_kernel,
         {**_pointers("k_ptr v_ptr"), **_pointers("h_ptr g_ptr h0_ptr ht_ptr", F32), **sizes},
         dict(CHUNK=64, GATE=1, HAS_H0=True, **launch.h_pass_tiles("scalar", 128, 128), **tf32)),
        ("o pass, scalar gate", chunk.chunk_fwd_o_kernel,
         {**_pointers("q_ptr k_ptr v_ptr h_ptr o_ptr"), "g_ptr": F32, **sizes, "scale": "fp32"},
         dict(CHUNK=64, BLOCK_K=64, BLOCK_V=64, GATE=1, **tf32)),
        ("GLA intra-chunk scores", chunk.chunk_gla_fwd_a_kernel,
         {**_pointers("q_ptr k_ptr a_ptr"), "g_ptr": F32, **_ints("seqlen chunks d_k")},
         dict(CHUNK=64, SUB=16, BLOCK_K=launch.SCORE_BLOCK_K, **tf32)),
        ("GLA o pass", chunk.chunk_gla_fwd_o_kernel,
         {**_pointers("q_ptr v_ptr h_ptr a_ptr o_ptr"), "g_ptr": F32, **sizes, "scale": "fp32"},
         dict(CHUNK=64, BLOCK_K=64, BLOCK_V=64, **tf32)),
        ("dh pass, per-dim gate", bwd.chunk_bwd_dh_kernel,
         {**_pointers("q_ptr do_ptr"), **_pointers("g_ptr dht_ptr dh_ptr dh0_ptr", F32), **sizes, "scale": "fp32"},
         dict(CHUNK=64, BLOCK_K=64, BLOCK_V=64, GATE=2, HAS_DHT=True, **tf32)),
        ("dh pass, scalar gate", bwd.chunk_bwd_dh_kernel,
         {**_pointers("q_ptr do_ptr"), **_pointers("g_ptr dht_ptr dh_ptr dh0_ptr", F32), **sizes, "scale": "fp32"},
         dict(CHUNK=64, BLOCK_K=64, BLOCK_V=64, GATE=1, HAS_DHT=True, **tf32)),
        ("dv pass, scalar gate", bwd.chunk_bwd_dv_kernel,
         {**_pointers("q_ptr k_ptr do_ptr dv_ptr"), **_pointers("g_ptr dh_ptr", F32), **sizes, "scale": "fp32"},
         dict(CHUNK=64, BLOCK_K=64, BLOCK_V=launch.DV_BLOCK_V, GATE=1, CARRIED=True, **tf32)),
        ("dv pass, delta rule's intra-chunk term", bwd.chunk_bwd_dv_kernel,
         {**_pointers("q_ptr k_ptr do_ptr dv_ptr dh_ptr"), "g_ptr": F32, **sizes, "scale": "fp32"},
         dict(CHUNK=64, BLOCK_K=64, BLOCK_V=64, GATE=1, CARRIED=False, **tf32)),
        ("dqk pass, scalar gate", bwd.chunk_bwd_dqk_kernel,
         {**_pointers("q_ptr k_ptr v_ptr do_ptr dq_ptr dk_ptr dv_new_ptr dw_ptr"),
          **_pointers("g_ptr h_ptr dh_ptr dgate_ptr", F32), **sizes, "scale": "fp32"},
         dict(CHUNK=64, BLOCK_K=64, BLOCK_V=launch.DQK_BLOCK_V, GATE=1, **tf32)),
        ("dqk pass, gated delta rule", bwd.chunk_bwd_dqk_kernel,
         {**_pointers("q_ptr k_ptr v_ptr do_ptr dq_ptr dk_ptr h_ptr dh_ptr dv_new_ptr dw_ptr"),
          **_pointers("g_ptr dgate_ptr", F32), **sizes, "scale": "fp32"},
         dict(CHUNK=64, BLOCK_K=64, BLOCK_V=64, GATE=1, DELTA=True, **tf32)),
        ("GLA dA", bwd.chunk_bwd_da_kernel,
         {**_pointers("do_ptr v_ptr"), "da_ptr": F32, **_ints("seqlen chunks d_v"), "scale": "fp32"},
         dict(CHUNK=64, BLOCK_V=64, **tf32)),
        ("GLA dv pass", bwd.chunk_gla_bwd_dv_kernel,
         {**_pointers("k_ptr do_ptr dv_ptr"), **_pointers("g_ptr a_ptr dh_ptr", F32), **sizes, "scale": "fp32"},
         dict(CHUNK=64, BLOCK_K=64, BLOCK_V=64, **tf32)),
        ("GLA dqk pass", bwd.chunk_gla_bwd_dqk_kernel,
         {**_pointers("q_ptr k_ptr v_ptr do_ptr dq_ptr dk_ptr"),
          **_pointers("g_ptr h_ptr dh_ptr da_ptr dgate_ptr", F32), **sizes, "scale": "fp32"},
         dict(CHUNK=64, SUB=16, BLOCK_K=32, BLOCK_V=64, **tf32)),
        ("WY, gated", delta.chunk_wy_kernel,
         {**_pointers("k_ptr v_ptr beta_ptr"), **_pointers("g_ptr t_ptr", F32), **_pointers("w_ptr u_ptr"), **sizes},
         dict(CHUNK=64, BLOCK_K=64, BLOCK_V=64, GATED=True, INVERSE=1, **tf32)),  # T kept for the backward
        ("WY recomputed in the backward", delta.chunk_wy_kernel,
         {**_pointers("k_ptr v_ptr beta_ptr"), **_pointers("g_ptr t_ptr", F32), **_pointers("w_ptr u_ptr"), **sizes},
         dict(CHUNK=64, BLOCK_K=64, BLOCK_V=64, GATED=True, INVERSE=2, **tf32)),  # T from the forward
        ("WY backward, gated", delta.chunk_wy_bwd_kernel,
         {**_pointers("k_ptr v_ptr beta_ptr dw_ptr du_ptr"), **_pointers("g_ptr t_ptr", F32),
          **_pointers("dk_direct_ptr dk_ptr dv_ptr"), **_pointers("dbeta_ptr dgate_ptr", F32), **sizes},
         dict(CHUNK=64, BLOCK_K=64, BLOCK_V=64, GATED=True, INVERSE=2, **tf32)),  # T from the forward
        ("gate chunk cumsum, per-dim", gate.chunk_cumsum_log2_kernel,
         {**_pointers("g_ptr out_ptr", F32), **_ints("seqlen width"), "rcp_ln2": "fp32"}, dict(CHUNK=64, BLOCK=32)),
        ("gate reverse cumsum, scalar", gate.reverse_cumsum_kernel,
         {**_pointers("x_ptr out_ptr", F32), **_ints("seqlen width")}, dict(ROWS=4096, BLOCK=1)),
        ("delta h pass, gated", delta.chunk_delta_fwd_h_kernel,
         {**_pointers("k_ptr w_ptr u_ptr h_ptr v_new_ptr"), **_pointers("g_ptr h0_ptr ht_ptr", F32), **sizes},
         dict(CHUNK=64, GATED=True, HAS_H0=True, **launch.state_pass_tiles(128, 128), **tf32)),
        ("delta dh pass, gated", delta.chunk_delta_bwd_dh_kernel,
         {**_pointers("q_ptr k_ptr w_ptr do_ptr dh_ptr h_ptr dv_local_ptr dv_new_ptr"),
          **_pointers("dht_ptr dh0_ptr g_ptr ht_ptr dlast_ptr", F32), **sizes,
          "scale": "fp32"},
         dict(CHUNK=64, HAS_DHT=True, GATED=True, **launch.state_pass_tiles(128, 128), **tf32)),
    ]
    def stages(label, kernel) -> dict:  # what the launchers pass; else Triton's 3 stages
        found = launch.launch_stages(kernel, variants.get(label))
        return {} if found is None else dict(num_stages=found)
    return [(label, {**_job(kernel, signature, constants, launch_warps(label, kernel)), **stages(label, kernel)})
            for label, kernel, signature, constants in jobs]


def sparse_jobs() -> list[tuple[str, dict]]:
    """(label, compile job) of the selected-blocks kernels at head_dim 128, at the packed rows of NSA (a group
    of 16 over one query each: 16 rows) and of block-sparse tiles (64 rows), with blocks of 64 keys (one
    chunk, one tile: the pipelined flat loops)."""
    from fa_lab.kernels.portable import sparse_select as sparse

    shapes = {**_ints("group seqlen_q seqlen_k head_dim block_q block_k"), "qk_scale": "fp32"}
    rows_in = {**_pointers("q_ptr k_ptr v_ptr do_ptr"), **_pointers("lse2_ptr delta_ptr", F32)}
    jobs = []
    for rows in (16, 64):
        tile = dict(BLOCK_M=rows, BLOCK_N=64, HEAD_DIM=128, CAUSAL=True)
        gather = sparse.gather_config(rows, 64, 128)  # the launcher's: 32 rows at 4 warps for 16, 64 at 8 for 64
        jobs += [
            (f"forward, {rows} rows", sparse.block_select_fwd_kernel,
             {**_pointers("q_ptr k_ptr v_ptr o_ptr"), "index_ptr": INT_PTR, "lse_ptr": F32, **shapes, "slots": I32},
             {**tile, "ONE_CHUNK": True}, 8 if rows * 128 >= 128 * 64 else 4),
            (f"dQ, {rows} rows", sparse.block_select_bwd_dq_kernel,
             {**rows_in, "index_ptr": INT_PTR, "dq_ptr": BF16, **shapes, "slots": I32, "scale": "fp32"},
             {**tile, "ONE_CHUNK": True}, 8),
            (f"dK/dV gather, {rows} rows", sparse.block_select_bwd_dkdv_kernel,
             {**rows_in, **_pointers("offsets_ptr selectors_ptr", INT_PTR), **_pointers("dk_ptr dv_ptr"), **shapes,
              "scale": "fp32"},
             {**tile, "BLOCK_M": gather.block_m, "STACK": gather.block_m // rows, "HEADS_INNER": True},
             gather.num_warps),
        ]
    dq_16 = next(job for job in jobs if job[0] == "dQ, 16 rows")  # and at block_select_backward's other dq_warps:
    jobs += [(f"dQ, 16 rows, {warps} warps", *dq_16[1:4], warps) for warps in (4, 2)]
    return [(label, {**_job(kernel, signature, constants, warps), "num_stages": 2})  # TileConfig's default
            for label, kernel, signature, constants, warps in jobs]


def _job(kernel, signature: dict, constants: dict, num_warps: int) -> dict:
    aligned = tuple(name for name, kind in signature.items() if kind.startswith("*")) + \
        tuple(name for name in ("head_dim", "block_k", "d_k", "d_v") if name in signature)
    return dict(kernel=kernel, signature=signature, constants=constants, num_warps=num_warps, aligned=aligned)


@pytest.fixture(scope="module")
def builds():
    jobs = linear_jobs() + sparse_jobs()
    return dict(zip((label for label, _ in jobs), compile_all_for_sm90([job for _, job in jobs]), strict=True))


# Known spills, bytes a thread, at settings that time faster than those without them (linear_chunk's
# LAUNCH_WARPS): the gated delta rule's dh pass holds all d_k rows of its state slice, h_{c+1}'s tile for the
# gate's gradient and its (C, d_k) operand tiles; simple GLA's dh pass runs at 2 warps.
ALLOWED_STACK = {"delta dh pass, gated": 288, "dh pass, scalar gate": 24}


def test_every_kernel_fits_in_shared_memory_without_spilling(builds):
    too_big = {label: b.shared_bytes for label, b in builds.items() if b.shared_bytes > SM90_SHARED_LIMIT}
    spilled = {label: (b.registers, b.stack_bytes, b.local_bytes) for label, b in builds.items()
               if b.stack_bytes > ALLOWED_STACK.get(label, 0) or b.local_bytes}
    assert not too_big, f"over the {SM90_SHARED_LIMIT} bytes of shared memory: {too_big}"
    assert not spilled, f"(registers, stack, local bytes) of the kernels that spill: {spilled}"


def test_a_failed_build_names_its_error_and_the_next_build_runs(builds):
    """Under the interpreter the builds run in one kept compile process: a job that cannot compile raises with
    the compiler's traceback, and neither that nor the process's death stops the builds after it."""
    from fa_lab.kernels import interpreting
    from fa_lab.kernels.hopper import sm90_offline

    label, job = sparse_jobs()[0]
    broken = {**job, "constants": {**job["constants"], "NOT_AN_ARGUMENT": 1}}
    with pytest.raises(RuntimeError, match="(?s)compiling for sm_90 failed.*NOT_AN_ARGUMENT"):
        compile_all_for_sm90([broken])
    assert compile_all_for_sm90([job])[0].sass == builds[label].sass
    if interpreting():
        sm90_offline._COMPILER.process.kill()
        sm90_offline._COMPILER.process.wait()
        assert compile_all_for_sm90([job])[0].sass == builds[label].sass
