"""Chapter 07's sparse attention: block-sparse attention over a tile list and MoBA, against dense
attention under the same selection (float64), gradients included, and their refused inputs."""
from __future__ import annotations

import math

import pytest
import torch

from fa_lab.block_info import BlockInfo
from fa_lab.reference import expand_kv, softmax_with_lse
from fa_lab.sparse import block_sparse_attention, moba_attention, moba_gate, moba_mask, selection_mask
from fa_lab.testing import make_qkv


def dense_masked(q, k, v, mask, scale):
    """(out, lse) of attention restricted to ``mask`` (B, H, Nq, Nk), in float64."""
    k, v = expand_kv(k, q.shape[1]).double(), expand_kv(v, q.shape[1]).double()
    s = torch.matmul(q.double(), k.transpose(-2, -1)) * scale
    p, lse = softmax_with_lse(s.masked_fill(~mask, float("-inf")))
    return torch.matmul(p, v), lse


def random_tiles(generator, batch, heads_kv, q_tiles, k_tiles, count, causal_limit=None):
    """Distinct key tiles per query tile (-1 padding), only past ones when causal_limit[t] bounds them."""
    tiles = torch.full((batch, heads_kv, q_tiles, count), -1, dtype=torch.int64)
    for b in range(batch):
        for h in range(heads_kv):
            for t in range(q_tiles):
                allowed = k_tiles if causal_limit is None else causal_limit[t]
                chosen = torch.randperm(allowed, generator=generator)[:min(count, allowed)]
                tiles[b, h, t, :len(chosen)] = chosen
    return tiles


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, heads_kv, seqlen_q, seqlen_k, block_q, block_k", [
    (2, 2, 70, 70, 32, 32), (4, 2, 45, 97, 16, 32), (4, 1, 64, 64, 32, 16)])
def test_block_sparse_equals_dense_attention_under_the_same_selection(causal, heads, heads_kv, seqlen_q, seqlen_k,
                                                                      block_q, block_k, generator):
    q, k, v = (t.double() for t in make_qkv(2, heads, seqlen_q, seqlen_k, 16, generator=generator,
                                             heads_kv=heads_kv, requires_grad=False))
    q_tiles, k_tiles = math.ceil(seqlen_q / block_q), math.ceil(seqlen_k / block_k)
    info = BlockInfo(seqlen_q, seqlen_k, causal)
    limit = [math.ceil(info.key_end(min(t * block_q + block_q, seqlen_q) - 1) / block_k) for t in range(q_tiles)] \
        if causal else None
    tiles = random_tiles(generator, 2, heads_kv, q_tiles, k_tiles, 2, limit)
    mask = expand_kv(selection_mask(tiles, seqlen_q, seqlen_k, block_q, block_k), heads)
    if causal:
        mask = mask & info.mask()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = block_sparse_attention(*leaves, tiles, block_q, block_k, causal)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = dense_masked(*ref_leaves, mask, 16 ** -0.5)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    dout = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    out.backward(dout)
    ref_out.backward(dout)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("change, words", [
    ({"tiles": torch.tensor([[[[0, 5]] * 4]])}, "outside"),
    ({"tiles": torch.tensor([[[[1, 1]] * 4]])}, "twice"),
    ({"tiles": torch.tensor([[[[3, -1], [0, 1], [0, 1], [0, 1]]]]), "causal": True}, "causal"),
    ({"tiles": torch.tensor([[[0, 1]]])}, "shape"),
    ({"tiles": torch.tensor([[[[0.0, 1.0]] * 4]])}, "int32 or int64"),
])
def test_bad_selections_are_refused(change, words):
    q, k, v = make_qkv(1, 1, 64, 64, 8, requires_grad=False)  # four query tiles and four key tiles of 16
    args = {"tiles": torch.tensor([[[[0, 1]] * 4]]), "causal": False, **change}
    with pytest.raises((ValueError, TypeError), match=words):
        block_sparse_attention(q, k, v, args["tiles"], 16, 16, args["causal"])


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("change, words", [
    ({"block": 0}, "block must be a positive int"),
    ({"block": 16.0}, "block must be a positive int"),
    ({"top_k": 0}, "top_k must be an int >= 1"),
    ({"keys": 48}, "self-attention"),
])
def test_bad_moba_arguments_are_refused_before_any_pass(impl, change, words):
    """The kernel path calls the gate only once its first pass is queued: its arguments are checked first."""
    args = {"block": 16, "top_k": 3, "keys": 64, **change}
    q, _, _ = make_qkv(1, 2, 64, 64, 16, requires_grad=False, dtype=torch.bfloat16)
    _, k, v = make_qkv(1, 2, args["keys"], args["keys"], 16, requires_grad=False, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=words):
        moba_attention(q, k, v, args["block"], args["top_k"], impl=impl)


@pytest.mark.parametrize("top_k", [3, 8])
def test_moba_keeps_its_own_block_and_the_best_past_blocks(top_k, generator):
    """Own block first, then the best past blocks best first (-1 where a query has fewer past blocks; 8 asks for
    more than the 5 blocks hold)."""
    q, k, _ = make_qkv(1, 2, 70, 70, 16, generator=generator, requires_grad=False)
    block = 16
    selected = moba_gate(q, k, block, top_k)
    assert selected.shape == (1, 2, 70, min(top_k, 1 + 5))
    own = torch.arange(70) // block
    assert torch.equal(selected[..., 0], own.expand(1, 2, 70))
    past = selected[..., 1:]
    assert bool(((past < own[:, None]) | (past == -1)).all())  # never the own block again, never the future
    for i in (5, 20, 40, 69):  # by brute force: the mean keys' scores, past blocks only
        means = torch.stack([k[0, :, b * block:min(b * block + block, 70)].mean(dim=1) for b in range(5)], dim=1)
        scores = torch.einsum("hd,hbd->hb", q[0, :, i], means)
        for h in range(2):
            want = scores[h, :own[i]].argsort(descending=True)[:top_k - 1].tolist()
            got = [x for x in past[0, h, i].tolist() if x >= 0]
            assert got == want, (i, h)  # in the same order: best first


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_moba_two_passes_equal_dense_attention_under_its_selection(top_k, generator):
    """In float32 (its own-block pass runs through attention_varlen) against float64 dense attention."""
    q, k, v = make_qkv(2, 2, 75, 75, 16, generator=generator, requires_grad=False)
    out, lse = moba_attention(q, k, v, 16, top_k)
    mask = moba_mask(moba_gate(q, k, 16, top_k), 75, 16)
    ref_out, ref_lse = dense_masked(q, k, v, mask, 16 ** -0.5)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_moba_gradients_equal_dense_attention_under_its_selection(generator):
    """The merge differentiates through each pass's LSE: float64 inputs (merged in float32, as the forward
    test says) against float64 dense attention."""
    q, k, v = (t.double() for t in make_qkv(1, 4, 70, 70, 16, generator=generator, heads_kv=2, requires_grad=False))
    mask = moba_mask(moba_gate(q, k, 16, 3), 70, 16)
    grad = torch.randn(q.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad(moba_attention(*(t.requires_grad_() for t in (q, k, v)), 16, 3)[0], (q, k, v), grad)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(dense_masked(*leaves, mask, 16 ** -0.5)[0], leaves, grad)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_nsa_three_branches_by_brute_force(generator):
    """Each branch and the gated sum against a query-by-query computation of NSA's definitions."""
    from fa_lab.sparse import nsa_attention, nsa_select

    batch, heads, heads_kv, seqlen, d = 1, 4, 2, 40, 8
    q, k, v = (t.double() for t in make_qkv(batch, heads, seqlen, seqlen, d, generator=generator,
                                             heads_kv=heads_kv, requires_grad=False))
    gates = torch.rand(batch, heads, seqlen, 3, generator=generator, dtype=torch.float64)
    block_cmp, block_sel, top_n, window, scale = 4, 8, 2, 6, d ** -0.5
    out, (out_cmp, out_sel, out_win) = nsa_attention(q, k, v, gates, block_cmp, block_sel, top_n, window)
    selected = nsa_select(q, k.reshape(1, heads_kv, 10, 4, d).mean(3), block_cmp, block_sel, top_n, scale)

    def attend(qv, keys, values):
        if len(keys) == 0:
            return torch.zeros(d, dtype=torch.float64)
        w = torch.softmax(torch.stack([qv @ kk for kk in keys]) * scale, 0)
        return sum(wi * vi for wi, vi in zip(w, values))

    for h in range(heads):
        g = h // (heads // heads_kv)
        for t in range(seqlen):
            qt = q[0, h, t]
            blocks = [j for j in range(seqlen // block_cmp) if (j + 1) * block_cmp - 1 <= t]
            k_cmp = [k[0, g, j * block_cmp:(j + 1) * block_cmp].mean(0) for j in blocks]
            v_cmp = [v[0, g, j * block_cmp:(j + 1) * block_cmp].mean(0) for j in blocks]
            want_cmp = attend(qt, k_cmp, v_cmp)
            chosen = [b for b in selected[0, g, t].tolist() if b >= 0]
            assert all(b * block_sel <= t for b in chosen)  # a selected block starts at or before the query
            keys = [j for j in range(t + 1) if j // block_sel in chosen]
            want_sel = attend(qt, [k[0, g, j] for j in keys], [v[0, g, j] for j in keys])
            keys = range(max(0, t - window + 1), t + 1)
            want_win = attend(qt, [k[0, g, j] for j in keys], [v[0, g, j] for j in keys])
            for got, want in ((out_cmp, want_cmp), (out_sel, want_sel), (out_win, want_win)):
                torch.testing.assert_close(got[0, h, t], want, rtol=1e-10, atol=1e-10)
            want = gates[0, h, t, 0] * want_cmp + gates[0, h, t, 1] * want_sel + gates[0, h, t, 2] * want_win
            torch.testing.assert_close(out[0, h, t], want, rtol=1e-10, atol=1e-10)


def test_nsa_selection_is_shared_by_the_group_and_importance_ranks_it(generator):
    from fa_lab.sparse import nsa_compress, nsa_select

    q, k, _ = make_qkv(1, 4, 64, 64, 8, generator=generator, heads_kv=1, requires_grad=False)
    selected = nsa_select(q, nsa_compress(k, 8), 8, 16, 2, 8 ** -0.5)
    assert selected.shape == (1, 1, 64, 2)  # one selection per KV head: its four query heads share it
    assert bool((selected[0, 0, :16] == -1)[:, 1].all())  # the first 16 queries have only block 0 in their past
    k_cmp = nsa_compress(k, 8)[0, 0]  # (8, d)
    for t in (20, 37, 63):  # importance by its definition: compressed probabilities, per selection block, per group
        past = [j for j in range(8) if (j + 1) * 8 - 1 <= t]
        importance = torch.zeros(4, dtype=torch.float64)
        for h in range(4):
            p = torch.softmax(torch.stack([q[0, h, t].double() @ k_cmp[j].double() for j in past]) * 8 ** -0.5, 0)
            for j, pj in zip(past, p):
                importance[j // 2] += pj
        candidates = [b for b in range(4) if b * 16 <= t]
        want = sorted(sorted(candidates, key=lambda b: -importance[b])[:2])
        assert sorted(selected[0, 0, t].tolist()) == want, t


def test_nsa_gradients_reach_every_input(generator):
    from fa_lab.sparse import nsa_attention

    q, k, v = make_qkv(1, 2, 32, 32, 8, generator=generator)
    gates = torch.rand(1, 2, 32, 3, generator=generator).requires_grad_()
    out, _ = nsa_attention(q, k, v, gates, 4, 8, 2, 8)
    out.sum().backward()
    for t in (q, k, v, gates):
        assert t.grad is not None and bool(torch.isfinite(t.grad).all()) and bool((t.grad != 0).any())


@pytest.mark.parametrize("window", [0, -3, 2.0, True])
def test_nsa_window_must_hold_the_query_itself(window):
    from fa_lab.sparse import nsa_attention

    q, k, v = make_qkv(1, 2, 16, 16, 8)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        nsa_attention(q, k, v, torch.rand(1, 2, 16, 3), 4, 8, 2, window)


@pytest.mark.parametrize("seqlen, block", [(31, 8), (32, 8), (40, 8), (47, 16), (16, 16), (9, 4), (3, 4)])
def test_nsa_residue_views_hold_each_query_once_under_its_mask(seqlen, block, generator):
    """The compressed branch's launches (fa_lab.kernels.hopper.nsa_compressed): every query of (B, H, N) is in
    exactly one residue view, at [b * H + h, r, s] = query s * block + first + r, and the launch's bottom-right
    causal mask over its first ``keys`` compressed keys shows it exactly the blocks wholly in its past."""
    from fa_lab.kernels.hopper.nsa_compressed import residue_groups, residue_rows

    batch, heads = 2, 3
    t = torch.randn(batch, heads, seqlen, 5, generator=generator)
    seen_at = {}  # query -> (group, step)
    for group in residue_groups(seqlen, block):
        rows = residue_rows(t, group, block)
        assert rows.shape == (batch * heads, group.residues, group.queries, 5)
        for r in range(group.residues):
            for s in range(group.queries):
                query = s * block + group.first + r
                assert query < seqlen and query not in seen_at
                seen_at[query] = (group, s)
                assert torch.equal(rows[:, r, s], t[:, :, query].reshape(batch * heads, 5))
    assert sorted(seen_at) == list(range(seqlen))
    blocks = seqlen // block
    for query, (group, s) in seen_at.items():
        visible = {j for j in range(group.keys) if j <= s + group.keys - group.queries}
        assert visible == {j for j in range(blocks) if (j + 1) * block - 1 <= query}, (query, group)


def test_bad_sizes_and_gates_are_refused_by_name():
    from fa_lab.sparse import block_sparse_attention, nsa_attention

    q, k, v = (torch.randn(1, heads, 16, 16) for heads in (2, 1, 1))
    tiles = torch.zeros(1, 1, 4, 1, dtype=torch.int32)
    for block_q, block_k, said in ((0, 4, "block_q"), (4, -4, "block_k"), (2.0, 4, "block_q")):
        with pytest.raises(ValueError, match=f"{said} must be a positive int"):
            block_sparse_attention(q, k, v, tiles, block_q=block_q, block_k=block_k)
    gates = torch.rand(1, 2, 16, 3)
    for change, error, said in (({"block_cmp": 0}, ValueError, "block_cmp"), ({"block_sel": 0}, ValueError,
                                                                              "block_sel"),
                                ({"top_n": 0}, ValueError, "top_n"), ({"top_n": 1.5}, ValueError, "top_n"),
                                ({"gates": gates.int()}, TypeError, "gates must be a floating-point")):
        args = {"gates": gates, "block_cmp": 4, "block_sel": 8, "top_n": 2, "window": 4, **change}
        with pytest.raises(error, match=said):
            nsa_attention(q, k, v, **args)
