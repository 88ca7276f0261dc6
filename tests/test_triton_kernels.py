"""The Triton kernels (impl="triton") under the tolerance rule.

On a CPU the kernels run in Triton's interpreter (small shapes, every feature);
the ``gpu`` tests compile them on CUDA and cover flash-attn's own test shapes.
"""
import pytest
import torch

import fa_lab
from fa_lab.testing import check_attention, make_qkv

pytest.importorskip("triton")
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")


def triton_impl(q, k, v, causal, scale):
    return fa_lab.attention(q, k, v, causal=causal, scale=scale, impl="triton", return_lse=True)


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (17, 17), (113, 203), (203, 113), (64, 64), (1, 70), (70, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_shapes(dtype, seqlen_q, seqlen_k, causal, generator):
    q, k, v = make_qkv(1, 2, seqlen_q, seqlen_k, 32, dtype, generator=generator)
    check_attention(triton_impl, q, k, v, causal, None, generator=generator)


@CPU_ONLY
@pytest.mark.parametrize("head_dim", [16, 40, 59, 80, 96, 128, 256])
def test_interpreter_head_dims(head_dim, generator):
    q, k, v = make_qkv(1, 1, 45, 37, head_dim, torch.bfloat16, generator=generator)
    check_attention(triton_impl, q, k, v, True, None, generator=generator)


@CPU_ONLY
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_non_contiguous_and_scale(causal, generator):
    q, k, v = make_qkv(2, 2, 40, 50, 24, torch.float16, generator=generator, strided=True)
    assert not q.is_contiguous()
    check_attention(triton_impl, q, k, v, causal, 0.37, generator=generator)


@CPU_ONLY
def test_interpreter_gpu_tile_sizes(generator):
    """The compiled kernels' 128 x 128 tiles, run by the interpreter on a ragged causal case."""
    from fa_lab.kernels.portable.attention import triton_attention
    from fa_lab.kernels.portable.configs import TileConfig

    q, k, v = make_qkv(1, 1, 150, 260, 64, torch.bfloat16, generator=generator)
    fn = lambda *a: triton_attention(*a, fwd_config=TileConfig(128, 128), bwd_config=TileConfig(64, 128))
    check_attention(fn, q, k, v, True, None, generator=generator)


@CPU_ONLY
def test_rows_that_see_no_key(generator):
    q, k, v = make_qkv(1, 2, 40, 8, 16, torch.bfloat16, generator=generator)
    out, lse = triton_impl(q, k, v, True, None)
    assert torch.all(out[:, :, :32] == 0) and torch.isneginf(lse[:, :, :32]).all()
    check_attention(triton_impl, q, k, v, True, None, generator=generator)


def test_float32_is_refused_with_the_reason():
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(TypeError, match="TF32"):
        fa_lab.attention(q, q, q, impl="triton")


def test_cpu_tensor_on_cuda_machine_gets_clear_error(monkeypatch):
    from fa_lab.kernels import common

    monkeypatch.setattr(common, "interpreting", lambda: False)
    q = torch.randn(1, 1, 8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="Move q, k, v to 'cuda'"):
        common.check_triton_inputs(q)


# ---------------------------------------------------------------- GPU (device machine)

GPU_HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
GPU_SEQLENS = [97, 128, 200, 384, 768, 1024, 1025, 2048]
GPU_PAIRS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
             (1023, 1024), (1024, 1023), (2048, 2048), (1, 239), (239, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", GPU_HEAD_DIMS)
@pytest.mark.parametrize("seqlen", GPU_SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_flash_attn_shapes(head_dim, seqlen, causal, generator):
    q, k, v = make_qkv(2, 3, seqlen, seqlen, head_dim, torch.bfloat16, "cuda", generator=generator)
    check_attention(triton_impl, q, k, v, causal, None, generator=generator)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("seqlen_q, seqlen_k", GPU_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_unequal_seqlens(dtype, head_dim, seqlen_q, seqlen_k, causal, generator):
    q, k, v = make_qkv(2, 3, seqlen_q, seqlen_k, head_dim, dtype, "cuda", generator=generator,
                       strided=seqlen_q % 2 == 1)
    check_attention(triton_impl, q, k, v, causal, None, generator=generator)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_repeat_is_race_free(causal, generator):
    """The same inputs 30 times: a bitwise-equal forward, a backward within tolerance every time."""
    q, k, v = make_qkv(4, 8, 1000, 1000, 128, torch.bfloat16, "cuda", generator=generator)
    grad_out = torch.randn(q.shape, generator=generator).to("cuda", torch.bfloat16)
    first_out = first_grads = None
    for _ in range(30):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fa_lab.attention(*leaves, causal=causal, impl="triton")
        out.backward(grad_out)
        grads = [t.grad for t in leaves]
        if first_out is None:
            first_out, first_grads = out.detach(), grads
            check_attention(triton_impl, q, k, v, causal, None, generator=generator)
        assert torch.equal(out.detach(), first_out)
        for grad, first in zip(grads, first_grads):
            assert torch.equal(grad, first)  # no atomics: the backward is deterministic
