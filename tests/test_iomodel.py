"""The IO model against hand counts, brute force and torch's own FLOP counter."""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fa_lab.flash_torch import flash_backward, flash_forward
from fa_lab.iomodel import (
    GPU_SPECS,
    RUNNING_EXAMPLE,
    AttentionShape,
    arithmetic_intensity,
    attainable_tflops,
    attention_flops,
    dtype_bytes,
    flash_extra_bytes,
    flash_hbm_bytes,
    format_bytes,
    matmul_flops,
    naive_extra_bytes,
    naive_hbm_bytes,
    naive_kernels,
    plot_roofline,
    ridge_point,
    roofline_points,
    score_matrix_bytes,
    sram_tile_rows,
    visible_pairs,
)
from fa_lab.reference import naive_attention
from fa_lab.testing import make_qkv


def test_running_example_score_matrix_is_128_mib_per_head_and_8_gib_in_all():
    assert score_matrix_bytes(RUNNING_EXAMPLE, per_head=True) == 8192 * 8192 * 2 == 128 * 2**20
    assert score_matrix_bytes(RUNNING_EXAMPLE) == 2 * 32 * 128 * 2**20 == 8 * 2**30
    assert format_bytes(score_matrix_bytes(RUNNING_EXAMPLE)) == "8 GiB"
    assert naive_extra_bytes(RUNNING_EXAMPLE) == 2 * 8 * 2**30 + 2 * 32 * 8192 * 128 * 2  # S, P and O


def test_dtype_bytes_accepts_names_and_torch_dtypes():
    torch_dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    assert [dtype_bytes(t) for t in torch_dtypes] == [4, 2, 2, 1]
    assert [dtype_bytes(t) for t in ("fp32", "bfloat16", "fp16", "fp8")] == [4, 2, 2, 1]
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("int4")
    with pytest.raises(ValueError, match="seqlen_q"):
        AttentionShape(1, 1, 0, 64)


def test_forward_flops_match_torch_flop_counter_on_naive_attention():
    rng = random.Random()
    batch, heads, nq, nk, d = rng.randint(1, 3), rng.randint(1, 3), rng.randint(5, 40), rng.randint(5, 40), 16
    q, k, v = make_qkv(batch, heads, nq, nk, d, requires_grad=False)
    with FlopCounterMode(display=False) as counter:
        naive_attention(q, k, v)
    shape = AttentionShape(batch, heads, nq, d, seqlen_k=nk)
    assert counter.get_total_flops() == attention_flops(shape) == sum(matmul_flops(shape).values())
    assert attention_flops(shape) == 4 * batch * heads * nq * nk * d


def test_backward_flops_match_the_five_matmuls_of_the_recomputation_backward():
    batch, heads, n, d = 2, 3, 96, 16
    q, k, v = make_qkv(batch, heads, n, n, d, requires_grad=False)
    out, lse = flash_forward(q, k, v, block_q=32, block_k=32)
    with FlopCounterMode(display=False) as counter:
        flash_backward(q, k, v, out, lse, torch.randn_like(out), block_q=32, block_k=32)
    shape = AttentionShape(batch, heads, n, d)
    assert len(matmul_flops(shape, "bwd")) == 5
    five_matmuls = sum(matmul_flops(shape, "bwd").values())
    assert counter.get_total_flops() == five_matmuls == attention_flops(shape, "bwd")
    assert attention_flops(shape, "bwd") * 2 == attention_flops(shape, "fwd") * 5


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (7, 7), (5, 12), (12, 5), (9, 1), (1, 9)])
def test_causal_visible_pairs_counted_by_brute_force(seqlen_q, seqlen_k):
    shape = AttentionShape(1, 1, seqlen_q, 8, seqlen_k=seqlen_k, causal=True)
    brute = sum(1 for i in range(seqlen_q) for j in range(seqlen_k) if j <= i + seqlen_k - seqlen_q)
    assert visible_pairs(shape) == brute
    assert sum(matmul_flops(shape).values()) == 2 * 2 * 8 * brute
    assert visible_pairs(AttentionShape(1, 1, seqlen_q, 8, seqlen_k=seqlen_k)) == seqlen_q * seqlen_k


def test_causal_flop_convention_halves_the_forward():
    shape = AttentionShape(2, 4, 1024, 64, causal=True)
    assert attention_flops(shape) == 2 * 4 * 1024 * 1024 * 64 * 2
    assert attention_flops(shape, "bwd") == attention_flops(shape) * 5 // 2
    with pytest.raises(ValueError, match="direction"):
        attention_flops(shape, "both")


def test_naive_hbm_bytes_by_hand():
    shape = AttentionShape(1, 1, 4, 2, seqlen_k=3, dtype="fp32")  # Nq=4, Nk=3, d=2
    # fwd: read Q(8) K(6), write S(12); read S, write P (24); read P(12) V(6), write O(8)
    assert naive_hbm_bytes(shape) == 4 * (8 + 6 + 12 + 24 + 12 + 6 + 8)
    # bwd: P, dO -> dV; dO, V -> dP; P, dP -> dS; dS, K -> dQ; dS, Q -> dK
    by_hand = (12 + 8 + 6) + (8 + 6 + 12) + (3 * 12) + (12 + 6 + 8) + (12 + 8 + 6)
    assert naive_hbm_bytes(shape, "bwd") == 4 * by_hand
    batched = AttentionShape(3, 5, 4, 2, seqlen_k=3, dtype="fp32")
    assert naive_hbm_bytes(batched) == 15 * naive_hbm_bytes(shape)
    kernels = naive_kernels(RUNNING_EXAMPLE)
    flops, nbytes = kernels["P = softmax(S)"]
    assert flops / nbytes == 5 / 4  # five FLOPs per score, a bf16 read and a bf16 write


def test_flash_hbm_bytes_by_hand():
    shape = AttentionShape(1, 1, 256, 64, dtype="fp16")
    elements = 256 * 64
    lse = 256 * 4
    # Q once, K and V once per Q tile (4 tiles of 64 rows), O once, float32 LSE
    assert flash_hbm_bytes(shape, block_q=64) == 2 * (1 + 4 * 2 + 1) * elements + lse
    assert flash_hbm_bytes(shape, block_q=64, l2_reuse=True) == 2 * 4 * elements + lse
    causal = AttentionShape(1, 1, 256, 64, dtype="fp16", causal=True)
    assert flash_hbm_bytes(causal, block_q=64) == 2 * (1 + 2 * 2 + 1) * elements + lse
    # bwd: D pass (read dO, O; write D), K V dK dV once, then per K tile Q dO (fp16), LSE D (fp32)
    # and a float32 dQ read-modify-write, and the final dQ cast
    per_pass = 2 * 2 * elements + 4 * 2 * 256 + 4 * 2 * elements
    by_hand = (2 * 2 * elements + lse) + 2 * 4 * elements + 4 * per_pass + (4 + 2) * elements
    assert flash_hbm_bytes(shape, "bwd", block_k=64) == by_hand


def test_flash_traffic_scales_as_n2_d2_over_sram():
    def streamed(n, d, sram):
        shape = AttentionShape(1, 1, n, d)
        return flash_hbm_bytes(shape, sram_bytes=sram) - flash_hbm_bytes(shape, l2_reuse=True)

    base = streamed(2**15, 64, 2**17)
    assert streamed(2**16, 64, 2**17) / base == pytest.approx(4, rel=0.01)  # N^2
    assert streamed(2**15, 128, 2**17) / base == pytest.approx(4, rel=0.01)  # d^2
    assert streamed(2**15, 64, 2**18) / base == pytest.approx(0.5, rel=0.01)  # 1 / M
    assert sram_tile_rows(128, "bf16", 228 * 1024) == 128  # H100, d = 128: FA3's 128-row tiles
    with pytest.raises(ValueError, match="SRAM"):
        sram_tile_rows(256, "fp32", 1024)


def test_intensities_place_naive_left_and_flash_right_of_every_ridge():
    shape = AttentionShape(1, 1, 2**15, 128, dtype="bf16")
    assert arithmetic_intensity(shape, "naive") == pytest.approx(128 / 2, rel=0.01)  # d / 2 FLOP/byte
    assert arithmetic_intensity(shape, "flash", block_q=128) == pytest.approx(128, rel=0.01)  # block_q
    for gpu in GPU_SPECS.values():
        ridge = ridge_point(gpu)
        assert arithmetic_intensity(RUNNING_EXAMPLE, "naive") < ridge
        assert arithmetic_intensity(RUNNING_EXAMPLE, "naive", "bwd") < ridge
        assert arithmetic_intensity(RUNNING_EXAMPLE, "flash", l2_reuse=True) > ridge
        assert attainable_tflops(gpu, 10 * ridge) == gpu.bf16_tflops
        assert attainable_tflops(gpu, ridge / 10) == pytest.approx(gpu.bf16_tflops / 10)
    causal = AttentionShape(1, 1, 2**12, 64, causal=True)
    not_causal = AttentionShape(1, 1, 2**12, 64)
    assert arithmetic_intensity(causal, "naive") == arithmetic_intensity(not_causal, "naive")


def test_extra_memory_naive_quadratic_flash_linear():
    small, large = AttentionShape(1, 8, 4096, 64, dtype="fp32"), AttentionShape(1, 8, 8192, 64, dtype="fp32")
    assert naive_extra_bytes(large) / naive_extra_bytes(small) == pytest.approx(4, rel=0.01)
    assert flash_extra_bytes(large) / flash_extra_bytes(small) == 2
    assert naive_extra_bytes(AttentionShape(1, 8, 16384, 64, dtype="fp32")) > 16 * 2**30  # the 16 GiB of 16K
    assert flash_extra_bytes(small) == 8 * 4096 * (64 * 4 + 4)


def test_gpu_specs_carry_the_seed_figures_and_sources():
    h100, h200, a100 = GPU_SPECS["H100"], GPU_SPECS["H200"], GPU_SPECS["A100"]
    assert (h100.bf16_tflops, h100.hbm_tb_s, h200.hbm_tb_s) == (989, 3.35, 4.8)
    assert ridge_point(h100) == pytest.approx(989 / 3.35)
    assert ridge_point(h200) < ridge_point(h100)  # more bandwidth, same compute
    assert all(len(spec.source) > 40 for spec in GPU_SPECS.values())
    with pytest.raises(ValueError, match="fp8"):
        ridge_point(a100, "fp8")
    assert ridge_point(h100, torch.float32) == pytest.approx(67 / 3.35)


def test_plot_roofline_draws_every_gpu_and_point():
    points = roofline_points()
    fig = plot_roofline(gpus=("A100", "H200"))
    (ax,) = fig.axes
    assert ax.get_xscale() == ax.get_yscale() == "log"
    roofs = [line for line in ax.get_lines() if len(line.get_xdata()) == 3]
    assert len(roofs) == 2
    assert len(ax.get_legend().get_texts()) == len(points)
    assert points["naive: softmax kernel"] < points["naive: whole forward"] \
        < points["flash: K, V per Q tile"] < points["flash: K, V shared in L2"]
