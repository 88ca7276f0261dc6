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


@pytest.mark.parametrize("causal, window, softcap, with_alibi, heads_kv", [
    (False, (-1, -1), 0.0, False, 4), (True, (-1, -1), 0.0, False, 2), (True, (9, -1), 0.0, True, 1),
    (False, (5, 7), 3.0, False, 4), (True, (-1, -1), 2.0, True, 2)])
def test_key_major_backward_is_the_same_backward(causal, window, softcap, with_alibi, heads_kv, generator):
    """FlashAttention-3's loop order (key tiles outer, dQ accumulated across them) against float64 autograd by
    the tolerance rule, with the query-major backward as the baseline; any order of the key tiles' adds
    into dQ gives the same dK and dV bit for bit and the same dQ to float32 rounding, and one order
    repeated gives the same bits."""
    from fa_lab.flash_torch import flash_backward, flash_backward_key_major, flash_forward
    from fa_lab.reference import reference_attention
    from fa_lab.testing import compare

    q, k, v = make_qkv(2, 4, 45, 70, 16, torch.float32, generator=generator, heads_kv=heads_kv,
                       requires_grad=False)
    slopes = torch.rand(2, 4, generator=generator) * 0.2 if with_alibi else None
    options = dict(window=window, softcap=softcap, alibi_slopes=slopes)
    out, lse = flash_forward(q, k, v, causal, None, block_q=16, block_k=16, **options)
    grad_out = torch.randn(out.shape, generator=generator)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    reference_out, _ = reference_attention(*leaves, causal, None, **options)
    reference_out.backward(grad_out.double())
    baseline = flash_backward(q, k, v, out, lse, grad_out, causal, None, 16, 16, **options)
    key_major = flash_backward_key_major(q, k, v, out, lse, grad_out, causal, None, 16, 16, **options)
    for name, got, base, leaf in zip(("dq", "dk", "dv"), key_major, baseline, leaves):
        result = compare(name, got, leaf.grad, base, torch.float32)
        assert result.ok, str(result)
    shuffled = torch.randperm(5, generator=generator).tolist()  # 70 keys: 5 tiles of 16
    again = [flash_backward_key_major(q, k, v, out, lse, grad_out, causal, None, 16, 16, key_tile_order=shuffled,
                                      **options) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*again))
    assert torch.equal(again[0][1], key_major[1]) and torch.equal(again[0][2], key_major[2])
    torch.testing.assert_close(again[0][0], key_major[0], rtol=1e-5, atol=1e-6)
