"""The running (m, l) state, its update, the streamed softmax and the LSE merge."""
import torch

from fa_lab.online_softmax import SoftmaxState, merge_partials, online_softmax, online_softmax_update
from fa_lab.reference import reference_attention


def test_streamed_softmax_equals_softmax(generator):
    scores = torch.randn(5, 37, generator=generator) * 20
    blocks = torch.split(scores, [7, 16, 1, 13], dim=-1)
    torch.testing.assert_close(online_softmax(blocks), torch.softmax(scores, -1), atol=1e-6, rtol=1e-5)


def test_state_lse_equals_logsumexp_with_masked_blocks(generator):
    scores = torch.randn(4, 30, generator=generator)
    scores[0] = float("-inf")  # a row that sees no key
    scores[1, :10] = float("-inf")
    state = SoftmaxState.empty((4,))
    for block in torch.split(scores, 10, dim=-1):
        state, p, alpha = online_softmax_update(state, block)
        assert torch.isfinite(p).all() and torch.isfinite(alpha).all()
    torch.testing.assert_close(state.lse, torch.logsumexp(scores, -1))
    assert state.l[0] == 0 and torch.isneginf(state.lse[0])


def test_update_inplace_matches_out_of_place(generator):
    state = SoftmaxState(torch.randn(3), torch.rand(3) + 0.5)
    block = torch.randn(3, 8, generator=generator)
    a, p_a, alpha_a = online_softmax_update(state, block.clone())
    b, p_b, alpha_b = online_softmax_update(state, block.clone(), inplace=True)
    torch.testing.assert_close((a.m, a.l, p_a, alpha_a), (b.m, b.l, p_b, alpha_b))


def test_merge_partials_by_lse_equals_full_attention(generator):
    q = torch.randn(2, 3, 11, 16, generator=generator, dtype=torch.float64)
    k = torch.randn(2, 3, 40, 16, generator=generator, dtype=torch.float64)
    v = torch.randn(2, 3, 40, 16, generator=generator, dtype=torch.float64)
    out_a, lse_a = reference_attention(q, k[:, :, :25], v[:, :, :25])
    out_b, lse_b = reference_attention(q, k[:, :, 25:], v[:, :, 25:])
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference_attention(q, k, v)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def test_merge_with_an_empty_part_keeps_the_other():
    out = torch.randn(1, 4, 8, dtype=torch.float64)
    lse = torch.randn(1, 4, dtype=torch.float64)
    empty_lse = torch.full_like(lse, float("-inf"))
    merged, merged_lse = merge_partials(out, lse, torch.zeros_like(out), empty_lse)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse)
    both, both_lse = merge_partials(torch.zeros_like(out), empty_lse, torch.zeros_like(out), empty_lse)
    assert torch.all(both == 0) and torch.isneginf(both_lse).all()
