"""Do wider K/V steps fit a consumer's registers? An offline probe of the Gluon forward's loop at d = 128.

flash-attn-4 (FA3's SM90 design) steps over 176 keys at d = 128 without a mask; Gluon on Triton 3.6 takes tensors of
power-of-two shapes only, so a wider step must hold its scores in two pieces: 128 keys and a tail of 16, 32 or 64,
each with its own Q K^T and P V products. This builds one consumer warpgroup's K/V loop, stripped to its registers'
work (the two products in flight as in the kernel: S_j issued, P_{j-1} V_{j-1} in flight during the softmax, the row
maximum reduced within a thread before its shuffles, partial row sums kept per thread), for sm_90a at 240 registers a
thread (what ``setmaxnreg`` gives a consumer of two), and prints what ptxas made of it. No GPU needed:

    .venv/bin/python benchmarks/key_tile_register_probe.py
"""
import re

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from fa_lab.kernels.hopper.fa3_softmax import thread_row_sums

TAILS = (0, 16, 32, 64)  # keys a step beyond the first 128 (0: the kernel's step)
CONSUMER_REGISTERS = 240


@gluon.jit
def _thread_row_max(x):
    """(64, N) in the accumulator layout -> (64, 4): each thread's max of its own values of a row (the max
    counterpart of :func:`fa_lab.kernels.hopper.fa3_softmax.thread_row_sums`)."""
    return gl.max(gl.max(x.reshape([x.shape[0], x.shape[1] // 8, 4, 2]), axis=3), axis=1)


@gluon.jit
def key_steps(out_ptr, n_iter, scale, TAIL: gl.constexpr):
    """n_iter steps of 128 + TAIL keys over one warpgroup's 64 query rows; O (64, 128) float32 goes to out_ptr."""
    D: gl.constexpr = 128
    dt: gl.constexpr = gl.bfloat16
    q_smem = gl.allocate_shared_memory(dt, [64, D], gl.NVMMASharedLayout.get_default_for([64, D], dt))
    k_smem = gl.allocate_shared_memory(dt, [128, D], gl.NVMMASharedLayout.get_default_for([128, D], dt))
    v_smem = gl.allocate_shared_memory(dt, [128, D], gl.NVMMASharedLayout.get_default_for([128, D], dt))
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m = gl.full([64], float("-inf"), gl.float32, row_layout)
    l = thread_row_sums(gl.zeros([64, 128], gl.float32, s_layout))
    o = gl.zeros([64, D], gl.float32, o_layout)
    alpha = gl.full([64], 1.0, gl.float32, row_layout)
    p = gl.zeros([64, 128], dt, p_layout)
    if TAIL > 0:
        tail_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TAIL, D], dt)
        k2_smem = gl.allocate_shared_memory(dt, [TAIL, D], tail_smem_layout)
        v2_smem = gl.allocate_shared_memory(dt, [TAIL, D], tail_smem_layout)
        s2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, TAIL, 16])
        p2 = gl.zeros([64, TAIL], dt, p_layout)
    for _j in range(n_iter):
        s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), gl.zeros([64, 128], gl.float32, s_layout), use_acc=False,
                          is_async=True)
        if TAIL > 0:
            s2 = warpgroup_mma(q_smem, k2_smem.permute((1, 0)), gl.zeros([64, TAIL], gl.float32, s2_layout),
                               use_acc=False, is_async=True)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        o = warpgroup_mma(p, v_smem, o, is_async=True)
        if TAIL > 0:
            o = warpgroup_mma(p2, v2_smem, o, is_async=True)
            s, s2 = warpgroup_mma_wait(2, deps=(s, s2))
            thread_max = gl.maximum(_thread_row_max(s), gl.convert_layout(_thread_row_max(s2), l.type.layout))
        else:
            s = warpgroup_mma_wait(1, deps=(s,))
            thread_max = _thread_row_max(s)
        m_new = gl.maximum(m, gl.convert_layout(gl.max(thread_max, axis=1), row_layout) * scale)
        alpha = gl.exp2(m - m_new)
        pa = gl.exp2(s * scale - m_new[:, None])
        l = l * gl.convert_layout(alpha, gl.SliceLayout(1, l.type.layout))[:, None] + thread_row_sums(pa)
        if TAIL > 0:
            pb = gl.exp2(s2 * scale - gl.convert_layout(m_new, gl.SliceLayout(1, s2_layout))[:, None])
            l = l + gl.convert_layout(thread_row_sums(pb), l.type.layout)
            o, p, p2 = warpgroup_mma_wait(0, deps=(o, p, p2))
            p2 = gl.convert_layout(pb.to(dt), p_layout)
        else:
            o, p = warpgroup_mma_wait(0, deps=(o, p))
        p = gl.convert_layout(pa.to(dt), p_layout)
        m = m_new
    row_sums = gl.convert_layout(gl.sum(l, axis=1), row_layout)
    o = o * gl.convert_layout(alpha / row_sums, gl.SliceLayout(1, o_layout))[:, None]
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + rows[:, None] * D + cols[None, :], o)


def main() -> None:
    from key_tile_register_probe import key_steps  # by module name: the builds run in a fresh process

    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90

    jobs = [dict(kernel=key_steps, signature={"out_ptr": "*fp32", "n_iter": "i32", "scale": "fp32"},
                 constants={"TAIL": tail}, num_warps=4, maxnreg=CONSUMER_REGISTERS) for tail in TAILS]
    print(f"{'keys a step':>12}{'registers':>10}{'highest':>8}{'stack B':>8}{'spills':>7}{'loop':>6}")
    for tail, build in zip(TAILS, compile_all_for_sm90(jobs)):
        (body,) = build.loop_bodies
        highest = max(int(r) for line in body for r in re.findall(r"\bR(\d+)\b", line))
        print(f"{128 + tail:>12}{build.registers:>10}{'R' + str(highest):>8}{build.stack_bytes:>8}"
              f"{build.kv_loop_spills:>7}{len(body):>6}")


if __name__ == "__main__":
    main()
