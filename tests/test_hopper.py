"""The Hopper forward (impl "triton_hopper") and the FP8 forward (impl "triton_hopper_fp8")."""
import pytest
import torch

import fa_lab
from fa_lab.testing import check_attention, make_qkv

pytest.importorskip("triton")
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")


def hopper_impl(q, k, v, causal, scale):
    return fa_lab.attention(q, k, v, causal=causal, scale=scale, impl="triton_hopper", return_lse=True)


@CPU_ONLY
@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (113, 203), (203, 113), (64, 64), (70, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_hopper_variants(pipeline, seqlen_q, seqlen_k, causal, generator):
    from fa_lab.kernels.configs import TileConfig
    from fa_lab.kernels.hopper import HopperOptions, triton_hopper_attention

    q, k, v = make_qkv(1, 2, seqlen_q, seqlen_k, 40, torch.bfloat16, generator=generator)
    fn = lambda *a: triton_hopper_attention(*a, config=TileConfig(32, 32), options=HopperOptions(kernel="triton", pipeline=pipeline))
    check_attention(fn, q, k, v, causal, None, generator=generator)


@CPU_ONLY
def test_interpreter_hopper_through_api(generator):
    q, k, v = make_qkv(1, 2, 50, 70, 64, torch.float16, generator=generator, strided=True)
    check_attention(hopper_impl, q, k, v, True, None, generator=generator)


@CPU_ONLY
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_fp8_matches_the_cpu_emulation(causal, generator):
    """The kernel computes what the FP8 emulation in fa_lab.fp8 computes (same quantization, same P scale)."""
    from fa_lab.fp8 import fp8_attention_forward, rmse
    from fa_lab.kernels.configs import TileConfig
    from fa_lab.kernels.hopper import triton_hopper_fp8_attention
    from fa_lab.reference import reference_attention

    q, k, v = (torch.randn(1, 2, n, 64, generator=generator).bfloat16() for n in (96, 160, 160))
    reference = reference_attention(q, k, v, causal)[0]
    out = triton_hopper_fp8_attention(q, k, v, causal, None, config=TileConfig(32, 32), rotate=False)[0]
    kernel_rmse = rmse(out, reference)
    emulated_rmse = rmse(fp8_attention_forward(q, k, v, causal, block_q=32, block_k=32, incoherent=False),
                         reference)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert abs(kernel_rmse - emulated_rmse) <= 0.05 * emulated_rmse, (kernel_rmse, emulated_rmse)
    assert kernel_rmse < 0.05  # far from garbage: e4m3 keeps 3 mantissa bits


def test_fp8_is_forward_only(generator):
    q, k, v = make_qkv(1, 1, 32, 32, 32, torch.bfloat16, "cuda" if torch.cuda.is_available() else "cpu",
                       generator=generator)
    out = fa_lab.attention(q, k, v, impl="triton_hopper_fp8")
    with pytest.raises(RuntimeError, match="forward-only"):
        out.sum().backward()


# ---------------------------------------------------------------- GPU (device machine)

@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(97, 97), (1024, 1024), (1025, 1025), (2048, 2048), (113, 203),
                                                (1023, 1024), (239, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_hopper(head_dim, seqlen_q, seqlen_k, causal, generator):
    q, k, v = make_qkv(2, 3, seqlen_q, seqlen_k, head_dim, torch.bfloat16, "cuda", generator=generator)
    check_attention(hopper_impl, q, k, v, causal, None, generator=generator)


@pytest.mark.gpu
def test_gpu_fp8_error_on_outlier_data_matches_the_table():
    """RMSE on the FA3 paper's outlier data within 2x of reproduce_error_table's flash_fp8 row."""
    from fa_lab.fp8 import ERROR_TABLE_SHAPE, outlier_qkv, reproduce_error_table, rmse
    from fa_lab.reference import reference_attention

    s = ERROR_TABLE_SHAPE
    q64, k64, v64 = outlier_qkv(s["batch"], s["heads"], s["seqlen_q"], s["seqlen_k"], s["head_dim"],
                                torch.Generator().manual_seed(1))
    out = fa_lab.attention(*(t.to("cuda", torch.float16) for t in (q64, k64, v64)), impl="triton_hopper_fp8")
    error = rmse(out.cpu(), reference_attention(q64, k64, v64)[0])
    table = reproduce_error_table(seed=1)
    assert table["flash_fp8"] / 2 <= error <= 2 * table["flash_fp8"], (error, table["flash_fp8"])
    assert error < table["flash_fp8_no_incoherent"]  # the rotation is doing its job
