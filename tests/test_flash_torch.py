"""The plain-PyTorch tiled attention ("torch" impl) under the tolerance rule, over the shape matrix."""
import pytest
import torch

import fa_lab
from fa_lab.flash_torch import flash_attention
from fa_lab.testing import check_attention, make_qkv

SEQLENS = [(1, 1), (17, 17), (113, 203), (203, 113), (128, 128), (1, 70), (70, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seqlen_q, seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_tolerance_rule_over_shapes(dtype, seqlen_q, seqlen_k, causal, generator):
    q, k, v = make_qkv(2, 2, seqlen_q, seqlen_k, 32, dtype, generator=generator)
    tiled = lambda *args: flash_attention(*args, block_q=32, block_k=16)  # many tiles, ragged edges
    check_attention(tiled, q, k, v, causal, None, generator=generator)


@pytest.mark.parametrize("head_dim", [8, 16, 40, 64, 80, 96, 128, 256])
def test_head_dims(head_dim, generator):
    q, k, v = make_qkv(1, 2, 33, 47, head_dim, torch.bfloat16, generator=generator)
    check_attention(lambda *a: flash_attention(*a, block_q=16, block_k=16), q, k, v, True, None,
                    generator=generator)


@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_inputs(causal, generator):
    q, k, v = make_qkv(2, 3, 50, 61, 32, torch.float16, generator=generator, strided=True)
    assert not q.is_contiguous()
    check_attention(flash_attention, q, k, v, causal, 0.2, generator=generator)


def test_default_blocks_through_public_api(generator):
    q, k, v = make_qkv(1, 2, 700, 1100, 64, generator=generator)
    check_attention(lambda q, k, v, c, s: fa_lab.attention(q, k, v, c, s, return_lse=True), q, k, v,
                    True, None, generator=generator)


def test_large_logits_do_not_overflow(generator):
    q, k, v = make_qkv(1, 1, 64, 64, 16, generator=generator)
    with torch.no_grad():
        q.mul_(60.0)  # scores of several hundred: exp() overflows float32 without the max subtraction
    check_attention(lambda *a: flash_attention(*a, block_q=16, block_k=16), q, k, v, False, None,
                    generator=generator)


def test_tolerance_rule_rejects_a_wrong_implementation(generator):
    """The rule can fail: dropping the last key tile must be caught."""
    q, k, v = make_qkv(1, 2, 40, 40, 16, generator=generator)
    truncated = lambda q, k, v, c, s: flash_attention(q, k[:, :, :-1], v[:, :, :-1], c, s)
    with pytest.raises(AssertionError, match="out: max-abs error"):
        check_attention(truncated, q, k, v, False, None, grads=False, generator=generator)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda(dtype, causal, generator):
    q, k, v = make_qkv(2, 4, 300, 517, 64, dtype, "cuda", generator=generator)
    check_attention(lambda *a: flash_attention(*a, block_q=128, block_k=128), q, k, v, causal, None,
                    generator=generator)
