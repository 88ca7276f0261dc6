"""peak_memory on known allocations, attention's measured peaks next to the model, the sweep and its plot."""
from __future__ import annotations

import random

import pytest
import torch

from fa_lab.flash_torch import flash_forward
from fa_lab.iomodel import AttentionShape, naive_extra_bytes
from fa_lab.memory import (
    NAIVE_LIVE_MATRICES,
    attention_forward,
    memory_sweep,
    modelled_peak_bytes,
    peak_memory,
    plot_memory_vs_seqlen,
    seqlen_label,
)
from fa_lab.reference import reference_attention
from fa_lab.testing import make_qkv


def test_peak_of_one_known_allocation():
    numel = random.randint(10_000, 1_000_000)
    assert peak_memory(torch.empty, numel, dtype=torch.float64) == 8 * numel


def test_peak_is_the_largest_running_sum_not_the_total():
    numel = random.randint(10_000, 200_000)

    def two_live_then_three(n):
        a, b = torch.ones(n), torch.ones(n)
        del a  # freed: the next allocation reuses its share of the budget
        c = torch.ones(n)
        return b + c  # b, c and the sum are alive together: 3 n floats

    assert peak_memory(two_live_then_three, numel) == 3 * 4 * numel


def test_naive_peak_holds_at_least_s_and_p_and_matches_the_model():
    heads, seqlen, head_dim = 4, random.choice([384, 512, 640]), 32
    q, k, v = make_qkv(1, heads, seqlen, seqlen, head_dim, requires_grad=False)
    peak = peak_memory(attention_forward("naive"), q, k, v)
    shape = AttentionShape(1, heads, seqlen, head_dim, dtype=torch.float32)
    assert peak >= 2 * heads * seqlen * seqlen * 4  # S and P
    assert peak >= naive_extra_bytes(shape, live_matrices=2)
    assert peak / modelled_peak_bytes("naive", shape) == pytest.approx(1, abs=0.05)
    assert NAIVE_LIVE_MATRICES == 3


def test_flash_forward_peak_is_far_below_naive():
    heads, seqlen, head_dim = 4, 1024, 32
    q, k, v = make_qkv(1, heads, seqlen, seqlen, head_dim, requires_grad=False)
    naive = peak_memory(attention_forward("naive"), q, k, v)
    tiled = peak_memory(flash_forward, q, k, v, block_q=64, block_k=64)
    output = heads * seqlen * head_dim * 4
    assert output <= tiled < naive / 20
    default_tiles = peak_memory(attention_forward("torch"), q, k, v)
    shape = AttentionShape(1, heads, seqlen, head_dim, dtype=torch.float32)
    assert default_tiles / modelled_peak_bytes("torch", shape) == pytest.approx(1, abs=0.05)


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_forward_extra_memory_at_16k_is_below_one_percent_of_naive(causal):
    """The tiled forward builds no (Nq, Nk) matrix, causal or not: not S, not P, not the mask."""
    seqlen, head_dim = 16384, 16
    q, k, v = make_qkv(1, 1, seqlen, seqlen, head_dim, requires_grad=False)
    extra = peak_memory(attention_forward("torch", causal=causal), q, k, v)
    naive_s_and_p = 2 * seqlen * seqlen * 4  # float32 S and P of one head
    assert extra < naive_s_and_p / 100


def test_sdpa_scratch_is_counted():
    heads, seqlen, head_dim = 4, 1024, 64
    q, k, v = make_qkv(1, heads, seqlen, seqlen, head_dim, requires_grad=False)
    peak = peak_memory(attention_forward("sdpa"), q, k, v)
    shape = AttentionShape(1, heads, seqlen, head_dim, dtype=torch.float32)
    output = heads * seqlen * head_dim * 4
    assert peak > output  # the output alone would miss the kernel's internal buffers
    assert modelled_peak_bytes("sdpa", shape) <= peak < naive_extra_bytes(shape) / 10


def test_the_three_forwards_compute_attention():
    q, k, v = make_qkv(2, 3, 37, 29, 16, requires_grad=False)
    expected, _ = reference_attention(q, k, v)
    for impl in ("naive", "torch", "sdpa"):
        torch.testing.assert_close(attention_forward(impl)(q, k, v).double(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="impl"):
        attention_forward("flex")
    with pytest.raises(ValueError, match="impl"):
        modelled_peak_bytes("flex", AttentionShape(1, 1, 8, 8))


def test_sweep_measures_up_to_the_limit_and_models_beyond():
    rows = memory_sweep(impls=("naive", "sdpa"), seqlens=(64, 128, 256), heads=2, head_dim=16,
                        measure_up_to=128)
    assert [(r["impl"], r["seqlen"]) for r in rows] == [
        ("naive", 64), ("sdpa", 64), ("naive", 128), ("sdpa", 128), ("naive", 256), ("sdpa", 256)]
    assert all(r["measured_bytes"] > 0 for r in rows if r["seqlen"] <= 128)
    assert all(r["measured_bytes"] is None for r in rows if r["seqlen"] > 128)
    naive = {r["seqlen"]: r["modelled_bytes"] for r in rows if r["impl"] == "naive"}
    assert naive[256] / naive[128] == pytest.approx(4, rel=0.05)

    fig = plot_memory_vs_seqlen(rows, limits={"a small budget": 2**20}, title="tiny")
    (ax,) = fig.axes
    assert len(ax.get_lines()) == 2 * 2 + 1  # model and measured per impl, and the limit
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "128", "256"]


def test_seqlen_labels():
    assert [seqlen_label(n) for n in (1, 512, 1024, 1536, 16384)] == ["1", "512", "1K", "1536", "16K"]


def test_causal_forwards_agree():
    q, k, v = make_qkv(1, 2, 45, 45, 16, requires_grad=False)
    expected, _ = reference_attention(q, k, v, causal=True)
    for impl in ("naive", "torch", "sdpa"):
        got = attention_forward(impl, causal=True)(q, k, v).double()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
