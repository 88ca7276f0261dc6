"""The public contract of fa_lab.attention: shapes, dtypes, defaults and clear errors on bad input."""
import pytest
import torch
import torch.nn.functional as F

import fa_lab
from fa_lab.testing import make_qkv


@pytest.mark.parametrize("impl", ["naive", "torch"])
def test_matches_sdpa_with_default_scale(impl, generator):
    q, k, v = make_qkv(2, 3, 37, 37, 24, generator=generator, requires_grad=False)
    out = fa_lab.attention(q, k, v, impl=impl)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["naive", "torch"])
def test_causal_equals_sdpa_lower_right(impl, generator):
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = make_qkv(1, 2, 13, 29, 16, generator=generator, requires_grad=False)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(13, 29))
    torch.testing.assert_close(fa_lab.attention(q, k, v, causal=True, impl=impl), expected,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["naive", "torch"])
def test_rows_that_see_no_key_are_zero_with_lse_minus_inf(impl, generator):
    q, k, v = make_qkv(1, 2, 9, 4, 16, generator=generator)
    out, lse = fa_lab.attention(q, k, v, causal=True, impl=impl, return_lse=True)
    assert torch.all(out[:, :, :5] == 0) and torch.all(torch.isneginf(lse[:, :, :5]))
    assert torch.isfinite(lse[:, :, 5:]).all() and torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("impl", ["naive", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_output_dtype_and_lse_detached(impl, dtype, generator):
    q, k, v = make_qkv(1, 1, 8, 8, 16, dtype, generator=generator)
    out, lse = fa_lab.attention(q, k, v, impl=impl, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (1, 1, 8)
    assert not lse.requires_grad and out.requires_grad


def test_explicit_scale_is_used(generator):
    q, k, v = make_qkv(1, 1, 8, 8, 16, generator=generator, requires_grad=False)
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(fa_lab.attention(q, k, v, scale=0.3), expected, atol=1e-5, rtol=1e-5)


def _qkv(shape_q=(1, 2, 8, 16), shape_kv=(1, 2, 8, 16), dtype=torch.float32):
    return torch.randn(shape_q, dtype=dtype), torch.randn(shape_kv, dtype=dtype), torch.randn(shape_kv, dtype=dtype)


@pytest.mark.parametrize("make, error, words", [
    (lambda: (torch.randn(2, 8, 16),) + _qkv()[1:], ValueError, ["q", "4 dimensions", "(2, 8, 16)"]),
    (lambda: _qkv(shape_kv=(2, 2, 8, 16)), ValueError, ["k", "batch 2", "batch 1"]),
    (lambda: _qkv(shape_kv=(1, 2, 8, 32)), ValueError, ["head_dim 32", "head_dim 16"]),
    (lambda: _qkv((1, 3, 8, 16), (1, 2, 8, 16)), ValueError, ["2 heads", "q has 3", "multiple"]),
    (lambda: (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 9, 16)), ValueError,
     ["v has seqlen 9", "8"]),
    (lambda: _qkv(dtype=torch.float64), TypeError, ["float64", "float32, float16 or bfloat16"]),
    (lambda: (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16).half(), torch.randn(1, 2, 8, 16)), TypeError,
     ["k", "float16", "float32"]),
    (lambda: _qkv((1, 2, 0, 16), (1, 2, 8, 16)), ValueError, ["q is empty", "(1, 2, 0, 16)"]),
    (lambda: _qkv((1, 1, 4, 264), (1, 1, 4, 264)), ValueError, ["264", "256"]),
    (lambda: ([[1.0]],) + _qkv()[1:], TypeError, ["q must be a torch.Tensor", "list"]),
])
def test_bad_input_names_argument_and_need(make, error, words):
    with pytest.raises(error) as info:
        fa_lab.attention(*make())
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


def test_bad_impl_scale_causal():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="impl must be one of .*'naive'.*got 'fast'"):
        fa_lab.attention(q, k, v, impl="fast")
    with pytest.raises(ValueError, match="scale must be a finite positive number, got -1"):
        fa_lab.attention(q, k, v, scale=-1.0)
    with pytest.raises(TypeError, match="causal must be True or False"):
        fa_lab.attention(q, k, v, causal="yes")


def test_a_window_past_the_kernels_int32_bounds_is_refused():
    q, k, v = _qkv()
    for window in ((-1, 2 ** 31 - 1), (10 ** 20, -1)):
        with pytest.raises(ValueError, match=r"at most 2\*\*30 \(-1 means unbounded\)"):
            fa_lab.attention(q, k, v, window=window)
    wide = fa_lab.attention(q, k, v, window=(2 ** 30, 2 ** 30), impl="torch")  # wider than any sequence
    torch.testing.assert_close(wide, fa_lab.attention(q, k, v, impl="torch"))


def test_moba_checks_v_like_k_before_anything_runs():
    from fa_lab.sparse import moba_attention

    q, k = torch.randn(1, 2, 16, 16).half(), torch.randn(1, 1, 16, 16).half()
    for v, said in ((torch.randn(1, 1, 16, 8).half(), "v has head_dim 8"), (torch.randn(1, 2, 16, 16).half(),
                                                                          "v has 2 heads but k has 1"),
                    (torch.randn(1, 1, 16, 16), "v has dtype torch.float32")):
        for impl in ("torch", "triton"):
            with pytest.raises((ValueError, TypeError), match=said):
                moba_attention(q, k, v, block=4, top_k=2, impl=impl)


def test_flags_must_be_true_or_false():
    from fa_lab.sparse import block_sparse_attention

    q, k, v = _qkv()
    with pytest.raises(TypeError, match="return_lse must be True or False, got 'no'"):
        fa_lab.attention(q, k, v, return_lse="no")
    tiles = torch.zeros(1, 2, 1, 1, dtype=torch.int32)
    for impl in ("torch", "triton"):
        with pytest.raises(TypeError, match="causal must be True or False"):
            block_sparse_attention(q.half(), k.half(), v.half(), tiles, block_q=8, block_k=8, causal="no", impl=impl)
        with pytest.raises(ValueError, match="key_tiles holds indices outside"):
            block_sparse_attention(q.half(), k.half(), v.half(), tiles + 5, block_q=8, block_k=8, impl=impl)
