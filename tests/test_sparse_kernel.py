"""Chapter 07's kernels (fa_lab/kernels/portable/sparse_select.py, moba.py) under the tolerance rule.

Block-sparse attention over per-tile key lists (``block_sparse_attention(..., impl="triton")``),
per-query selections as NSA makes them (``nsa_select``, ``nsa_attention(..., impl="triton")``) and MoBA's
two passes on the varlen kernels (``moba_attention(..., impl="triton")``), each against float64 dense
attention restricted to the same selection (:func:`fa_lab.sparse.selection_mask`, ``moba_mask``),
with plain attention in the kernel's dtype under that mask as the baseline: out, LSE, dq, dk, dv. On a CPU
the kernels run in Triton's interpreter (small shapes); the ``gpu`` tests compile them at d = 128.
"""
from __future__ import annotations

import pytest
import torch

from fa_lab.block_info import BlockInfo, cdiv
from fa_lab.reference import expand_kv, softmax_with_lse
from fa_lab.sparse import (
    block_sparse_attention,
    moba_attention,
    moba_gate,
    moba_mask,
    nsa_attention,
    nsa_compress,
    nsa_select,
    selection_mask,
)
from fa_lab.testing import LSE_FLOOR, compare, make_qkv

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter


def kernel(block_q, block_k, causal):
    """The launcher as a function of (q, k, v, indices) -> (out, lse)."""
    from fa_lab.kernels import triton_block_select_attention

    return lambda q, k, v, indices: triton_block_select_attention(q, k, v, indices, block_k, causal, block_q=block_q)


def masked_attention(q, k, v, mask):
    """(out, lse) of attention restricted to ``mask`` (B, H, Nq, Nk), computed in q's dtype as
    naive_attention does: float64 gives the reference, the kernel's dtype the rule's baseline."""
    s = torch.matmul(q, expand_kv(k, q.shape[1]).transpose(-2, -1)) * q.shape[-1] ** -0.5
    p, lse = softmax_with_lse(s.masked_fill(~mask, float("-inf")))
    return torch.matmul(p.to(v.dtype), expand_kv(v, q.shape[1])), lse


def outputs_and_grads(fn, q, k, v, grad_out):
    """(out, lse, dq, dk, dv) of fn(q, k, v) -> (out, lse) on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    out.backward(grad_out)
    return (out, lse, *(t.grad for t in leaves))


def dense_mask(indices, q, k, block_q, block_k, causal):
    """The dense (B, H, Nq, Nk) mask of a selection, the causal mask included."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    mask = expand_kv(selection_mask(indices.cpu(), seqlen_q, seqlen_k, block_q, block_k), q.shape[1])
    if causal:
        mask = mask & BlockInfo(seqlen_q, seqlen_k, causal=True).mask()
    return mask.to(q.device)


def check_against_dense(fn, q, k, v, mask, generator):
    """fn(q, k, v) -> (out, lse) against masked attention in float64 under the tolerance rule; returns
    fn's (out, lse, dq, dk, dv)."""
    grad_out = torch.randn(q.shape, generator=generator).to(q.device, q.dtype)
    actual = outputs_and_grads(fn, q, k, v, grad_out)
    reference = outputs_and_grads(lambda *t: masked_attention(*t, mask), *(t.double() for t in (q, k, v)),
                                  grad_out.double())
    baseline = outputs_and_grads(lambda *t: masked_attention(*t, mask), q, k, v, grad_out)
    assert actual[0].dtype == q.dtype and actual[1].dtype == torch.float32
    failures = []
    for name, got, want, base in zip(("out", "lse", "dq", "dk", "dv"), actual, reference, baseline):
        result = compare(name, got, want, base, q.dtype, floor=LSE_FLOOR if name == "lse" else None)
        if not result.ok:
            failures.append(str(result))
    assert not failures, "; ".join(failures)
    return actual


def random_selection(generator, batch, heads_kv, seqlen_q, seqlen_k, block_q, block_k, slots, causal,
                     empty_row=None):
    """(B, Hkv, cdiv(Nq, block_q), slots) int64: distinct key blocks per selection row in random slots,
    -1 in the others (about one in five dropped, and every slot of ``empty_row``). With causal only
    blocks that start before the row's last query's causal end (what check_key_tiles allows)."""
    rows, blocks = cdiv(seqlen_q, block_q), cdiv(seqlen_k, block_k)
    allowed = torch.full((rows,), blocks)
    if causal:
        last = torch.clamp(torch.arange(rows) * block_q + block_q, max=seqlen_q) - 1
        allowed = (BlockInfo(seqlen_q, seqlen_k, causal=True).key_end(last) + block_k - 1) // block_k
    score = torch.rand(batch, heads_kv, rows, blocks, generator=generator)
    score = score.masked_fill(torch.arange(blocks) >= allowed[:, None], -1.0)
    best = score.topk(min(slots, blocks), dim=-1)
    chosen = torch.where(best.values >= 0, best.indices, -1)
    chosen = torch.nn.functional.pad(chosen, (0, slots - chosen.shape[-1]), value=-1)
    chosen = chosen.masked_fill(torch.rand(chosen.shape, generator=generator) < 0.2, -1)
    if empty_row is not None:
        chosen[:, :, empty_row] = -1
    order = torch.rand(chosen.shape, generator=generator).argsort(dim=-1)  # -1 in any slot, not only the last
    return chosen.gather(-1, order)


def assert_rows_see_nothing(actual, rows):
    out, lse, dq = actual[:3]
    assert bool((out[:, :, rows] == 0).all()) and bool(torch.isneginf(lse[:, :, rows]).all())
    assert bool((dq[:, :, rows] == 0).all())


TILE_CASES = [  # (dtype, batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, block_q, block_k, slots, strided)
    (torch.bfloat16, 2, 2, 2, 77, 77, 32, 32, 32, 2, False),
    (torch.float16, 1, 4, 1, 130, 130, 64, 16, 64, 2, False),
    (torch.bfloat16, 1, 4, 2, 77, 130, 32, 64, 32, 3, True),  # 128 packed rows: two programs per tile
    (torch.float16, 1, 2, 1, 130, 77, 64, 32, 48, 2, False),  # causal: the first 53 rows see no key
    (torch.bfloat16, 1, 2, 2, 130, 130, 32, 32, 128, 1, False),  # a block of two chunks of 64 keys
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim, block_q, block_k, slots, "
                         "strided", TILE_CASES)
def test_block_sparse_kernel_meets_the_tolerance_rule(causal, dtype, batch, heads, heads_kv, seqlen_q, seqlen_k,
                                                      head_dim, block_q, block_k, slots, strided, generator):
    q, k, v = make_qkv(batch, heads, seqlen_q, seqlen_k, head_dim, dtype, DEVICE, generator, strided,
                       heads_kv=heads_kv)
    tiles = random_selection(generator, batch, heads_kv, seqlen_q, seqlen_k, block_q, block_k, slots, causal,
                             empty_row=1)
    mask = dense_mask(tiles, q, k, block_q, block_k, causal)
    run = lambda q, k, v: block_sparse_attention(q, k, v, tiles, block_q, block_k, causal, impl="triton")
    actual = check_against_dense(run, q, k, v, mask, generator)
    assert_rows_see_nothing(actual, slice(block_q, 2 * block_q))  # the tile that selects nothing
    if causal and seqlen_q > seqlen_k:
        assert_rows_see_nothing(actual, slice(0, seqlen_q - seqlen_k))


QUERY_CASES = [  # (dtype, heads, heads_kv, seqlen, head_dim, block_k, slots): one selection row per query
    (torch.bfloat16, 4, 1, 77, 32, 32, 2),
    (torch.float16, 2, 1, 130, 64, 64, 2),
    (torch.bfloat16, 2, 2, 77, 32, 16, 3),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, heads, heads_kv, seqlen, head_dim, block_k, slots", QUERY_CASES)
def test_per_query_selection_meets_the_tolerance_rule(causal, dtype, heads, heads_kv, seqlen, head_dim, block_k,
                                                      slots, generator):
    q, k, v = make_qkv(1, heads, seqlen, seqlen, head_dim, dtype, DEVICE, generator, heads_kv=heads_kv)
    selected = random_selection(generator, 1, heads_kv, seqlen, seqlen, 1, block_k, slots, causal, empty_row=5)
    mask = dense_mask(selected, q, k, 1, block_k, causal)
    actual = check_against_dense(lambda *t: kernel(1, block_k, causal)(*t, selected.to(DEVICE)), q, k, v, mask,
                                 generator)
    assert_rows_see_nothing(actual, slice(5, 6))


@pytest.mark.parametrize("heads, heads_kv, seqlen, block_sel", [(4, 1, 77, 32), (4, 2, 130, 64)])
def test_nsa_selection_through_the_kernel(heads, heads_kv, seqlen, block_sel, generator):
    """nsa_select's selection (B, Hkv, N, top_n), as it is, into the kernel: one selection row per query."""
    q, k, v = make_qkv(1, heads, seqlen, seqlen, 32, torch.bfloat16, DEVICE, generator, heads_kv=heads_kv)
    block_cmp, top_n = 16, 2
    selected = nsa_select(q.detach(), nsa_compress(k.detach(), block_cmp), block_cmp, block_sel, top_n, 32 ** -0.5)
    assert selected.shape == (1, heads_kv, seqlen, top_n)
    mask = dense_mask(selected, q, k, 1, block_sel, causal=True)
    check_against_dense(lambda *t: kernel(1, block_sel, True)(*t, selected), q, k, v, mask, generator)


NSA_CASES = [  # (dtype, batch, heads, heads_kv, seqlen, head_dim, block_cmp, block_sel)
    (torch.bfloat16, 1, 4, 1, 77, 32, 16, 32),
    (torch.float16, 2, 4, 2, 130, 64, 8, 32),  # four compressed blocks to a selection block
    (torch.bfloat16, 1, 2, 2, 200, 32, 16, 16),  # a selection block per compressed block, no grouping
    (torch.bfloat16, 1, 4, 2, 11, 32, 16, 32),  # shorter than a compressed block: nothing compressed yet
    (torch.bfloat16, 1, 4, 2, 27, 32, 16, 32),  # one compressed block: only residue 15 of step 0 sees a key
]


@pytest.mark.parametrize("dtype, batch, heads, heads_kv, seqlen, head_dim, block_cmp, block_sel", NSA_CASES)
def test_nsa_compressed_branch_on_the_dense_kernels(dtype, batch, heads, heads_kv, seqlen, head_dim, block_cmp,
                                                   block_sel, generator):
    """The compressed branch on the dense kernels, q and O through residue views (impl="triton"), against the masked
    float64 reference under the tolerance rule, out and lse, and its gradients to q and the compressed k, v."""
    check_compressed_branch(dtype, batch, heads, heads_kv, seqlen, head_dim, block_cmp, DEVICE, generator)


def check_compressed_branch(dtype, batch, heads, heads_kv, seqlen, head_dim, block_cmp, device, generator):
    from fa_lab.sparse import nsa_compressed_attention

    q, k, v = make_qkv(batch, heads, seqlen, seqlen, head_dim, dtype, device, generator, heads_kv=heads_kv)
    k_cmp, v_cmp = (nsa_compress(t.detach(), block_cmp) for t in (k, v))
    if k_cmp.shape[2] == 0:
        out, lse = nsa_compressed_attention(q, k_cmp, v_cmp, block_cmp, head_dim ** -0.5, "triton")
        assert out.dtype == dtype and bool((out == 0).all()) and bool(torch.isneginf(lse).all())
        return
    rows = torch.arange(seqlen)[:, None]
    mask = ((torch.arange(k_cmp.shape[2]) + 1) * block_cmp - 1 <= rows).expand(batch, heads, -1, -1).to(device)
    check_against_dense(lambda *t: nsa_compressed_attention(*t, block_cmp, head_dim ** -0.5, "triton"),
                        q, k_cmp, v_cmp, mask, generator)


@pytest.mark.parametrize("dtype, batch, heads, heads_kv, seqlen, head_dim, block_cmp, block_sel", NSA_CASES)
def test_nsa_importance_kernel_against_its_definition(dtype, batch, heads, heads_kv, seqlen, head_dim, block_cmp,
                                                      block_sel, generator):
    check_nsa_importance(dtype, batch, heads, heads_kv, seqlen, head_dim, block_cmp, block_sel, 2, DEVICE,
                         generator)


@pytest.mark.parametrize("top_n", [2, 3, 40])
def test_nsa_selection_keeps_a_running_top_in_the_importance_kernel(top_n, generator, monkeypatch):
    """nsa_select(impl="triton") with NSA_TOP_IN_KERNEL keeps its top_n in the importance kernel at its default tiles
    (a top of 4 slots for 3; for 40, more than the 13 blocks of 16 tokens in 200, as many as the past holds): a best
    set by the float64 scores. (The top by a sort of both, not the default, is checked at small tiles below: under
    the interpreter its sort of 64 rows of 128 keys takes minutes.)"""
    import fa_lab.sparse

    monkeypatch.setattr(fa_lab.sparse, "NSA_TOP_IN_KERNEL", True)
    check_nsa_importance(torch.bfloat16, 1, 4, 2, 200, 32, 8, 16, top_n, DEVICE, generator)


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("top_n", [3, 6])
def test_nsa_running_top_merges_across_the_kernels_steps(top_n, merge, generator):
    """The importance kernel's running top over 25 compressed keys taken 8 a step (4 selection blocks a step, so
    the top is merged with 4 steps' blocks; with top_n 6, a top of 8 slots, wider than a step) keeps a best set by
    the float64 scores, by a sort of both or by a top-k and a merge."""
    from fa_lab.kernels.portable.nsa_importance import triton_nsa_importance
    from fa_lab.sparse import nsa_compressed_attention, nsa_importance

    block_cmp, block_sel, seqlen, head_dim = 8, 16, 200, 32
    q, k, _ = make_qkv(1, 4, seqlen, seqlen, head_dim, torch.bfloat16, DEVICE, generator, heads_kv=2,
                       requires_grad=False)
    k_cmp, scale = nsa_compress(k, block_cmp), head_dim ** -0.5
    lse = nsa_compressed_attention(q, k_cmp, k_cmp, block_cmp, scale, "triton")[1]
    selected = triton_nsa_importance(q, k_cmp, lse, block_cmp, block_sel, scale, top_n, rows=16, keys=8,
                                     num_warps=1, merge=merge)
    want = nsa_importance(q.double(), k_cmp.double(), block_cmp, block_sel, scale).to(selected.device)
    assert_best_set(selected, want, top_n)
    for keys in (1, 12):  # fewer than a selection block's 2 compressed keys; not a power of two
        with pytest.raises(ValueError, match="keys"):
            triton_nsa_importance(q, k_cmp, lse, block_cmp, block_sel, scale, top_n, keys=keys)


@pytest.mark.parametrize("members, forms", [(1, {}), (None, {}), (1, dict(blocks_first=False, q_by_descriptor=False))])
@pytest.mark.parametrize("top_n", [0, 3])
def test_nsa_importance_full_steps_without_masks(top_n, members, forms, generator):
    """On tiles of 16 queries taking 8 of 25 compressed keys a step, later tiles have two steps every row sees
    before their masked ones and the last tile runs past the sequence; with the group of 3 packed (4 members)
    none is unmasked. ``forms``: the earlier ones too, each pass summed per selection block last and Q read by
    pointer loads."""
    check_full_steps(1, 6, 2, 203, 32, 8, 16, top_n, DEVICE, generator, rows=16, keys=8, members=members,
                     num_warps=1, **forms)


def check_full_steps(batch, heads, heads_kv, seqlen, head_dim, block_cmp, block_sel, top_n, device, generator,
                     **tile) -> None:
    """The importance kernel with the steps every row of a tile sees run without masks (unmasked_full_steps) and
    with them masked, at ``tile``: the scores (top_n 0) or the selection equal bit for bit, and to the float64
    definition."""
    from fa_lab.kernels.portable.nsa_importance import triton_nsa_importance
    from fa_lab.sparse import nsa_compressed_attention, nsa_importance

    q, k, _ = make_qkv(batch, heads, seqlen, seqlen, head_dim, torch.bfloat16, device, generator, heads_kv=heads_kv,
                       requires_grad=False)
    k_cmp, scale = nsa_compress(k, block_cmp), head_dim ** -0.5
    lse = nsa_compressed_attention(q, k_cmp, k_cmp, block_cmp, scale, "triton")[1]
    got, masked = (triton_nsa_importance(q, k_cmp, lse, block_cmp, block_sel, scale, top_n,
                                         unmasked_full_steps=unmasked, **tile) for unmasked in (True, False))
    assert torch.equal(got, masked)
    want = nsa_importance(q.double(), k_cmp.double(), block_cmp, block_sel, scale).to(got.device)
    if top_n:
        assert_best_set(got, want, top_n)
    else:
        assert_importance_close(got, want, heads // heads_kv)


@pytest.mark.parametrize("heads, heads_kv, rows, members", [
    (6, 2, 16, None),  # the group of 3 packed: 4 members (one padding member), 4 queries a tile
    (8, 1, 16, 4),  # the group walked 4 heads at a time, 4 queries a tile
    (8, 2, 16, 1),  # one head at a time, 16 queries a tile
    (4, 1, 2, None),  # a group wider than the tile: 2 members at a time, one query a tile
])
def test_nsa_importance_kernel_tiles_pack_the_group(heads, heads_kv, rows, members, generator):
    """The importance kernel at other packings of the group into its tile (:func:`packed_tile`) against
    nsa_importance's float64 definition: the same barred blocks, the others within float32 rounding."""
    from fa_lab.kernels.portable.nsa_importance import triton_nsa_importance
    from fa_lab.sparse import nsa_compressed_attention, nsa_importance

    block_cmp, block_sel, seqlen, head_dim = 8, 16, 45, 32
    q, k, _ = make_qkv(1, heads, seqlen, seqlen, head_dim, torch.bfloat16, DEVICE, generator, heads_kv=heads_kv,
                       requires_grad=False)
    k_cmp, scale = nsa_compress(k, block_cmp), head_dim ** -0.5
    lse = nsa_compressed_attention(q, k_cmp, k_cmp, block_cmp, scale, "triton")[1]
    got = triton_nsa_importance(q, k_cmp, lse, block_cmp, block_sel, scale, rows=rows, members=members,
                                num_warps=1)
    want = nsa_importance(q.double(), k_cmp.double(), block_cmp, block_sel, scale).to(got.device)
    assert_importance_close(got, want, heads // heads_kv)


def test_nsa_importance_reads_a_misaligned_q_by_pointers(generator):
    """q starting 2 bytes past a 16-byte boundary (a contiguous view one element into its storage), which a tensor
    descriptor cannot read: the kernel reads it by pointer loads, its scores within rounding of the definition."""
    from fa_lab.kernels.portable.nsa_importance import descriptor_readable, triton_nsa_importance
    from fa_lab.sparse import nsa_compressed_attention, nsa_importance

    block_cmp, block_sel, seqlen, head_dim, heads = 8, 16, 45, 32, 4
    q, k, _ = make_qkv(1, heads, seqlen, seqlen, head_dim, torch.bfloat16, DEVICE, generator, heads_kv=1,
                       requires_grad=False)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape).copy_(q)
    assert shifted.is_contiguous() and not descriptor_readable(1, shifted)
    k_cmp, scale = nsa_compress(k, block_cmp), head_dim ** -0.5
    lse = nsa_compressed_attention(q, k_cmp, k_cmp, block_cmp, scale, "triton")[1]
    got = triton_nsa_importance(shifted, k_cmp, lse, block_cmp, block_sel, scale, q_by_descriptor=True)
    want = nsa_importance(q.double(), k_cmp.double(), block_cmp, block_sel, scale).to(got.device)
    assert_importance_close(got, want, heads)


def assert_importance_close(got, want, group: int) -> None:
    """Importance scores against their float64 definition: the same blocks barred (-inf), the others within
    float32 rounding of probabilities summed over at most ``group`` heads."""
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    allowed = torch.isfinite(want)
    torch.testing.assert_close(got[allowed].double(), want[allowed], rtol=1e-5, atol=1e-5 * group)


def check_nsa_importance(dtype, batch, heads, heads_kv, seqlen, head_dim, block_cmp, block_sel, top_n, device,
                         generator):
    """The importance kernel's scores against nsa_importance's PyTorch definition in float64: the same blocks
    barred (-inf: they start after the query), the others within float32 rounding of probabilities summed over
    at most a group's heads; and its selection keeps a best set of blocks by the float64 scores (equal up to
    that rounding, so near-ties may choose either), which also passes the checks a caller's selection gets
    (nsa_attention passes the kernel's on unchecked)."""
    from fa_lab.sparse import check_key_tiles, nsa_importance

    q, k, _ = make_qkv(batch, heads, seqlen, seqlen, head_dim, dtype, device, generator, heads_kv=heads_kv,
                       requires_grad=False)
    k_cmp, scale = nsa_compress(k, block_cmp), head_dim ** -0.5
    got = nsa_importance(q, k_cmp, block_cmp, block_sel, scale, "triton")
    want = nsa_importance(q.double(), k_cmp.double(), block_cmp, block_sel, scale).to(got.device)
    assert got.dtype == torch.float32 and got.shape == want.shape == (batch, heads_kv, seqlen, cdiv(seqlen, block_sel))
    allowed = torch.isfinite(want)
    assert bool((want[allowed] >= 0).all()) and bool((got[allowed] >= 0).all())
    assert_importance_close(got, want, heads // heads_kv)
    selected = nsa_select(q, k_cmp, block_cmp, block_sel, top_n, scale, "triton")
    assert_best_set(selected, want, top_n)
    check_key_tiles(selected, q, k, 1, block_sel, causal=True)  # in range, no block twice, none in the future


def assert_best_set(selected, want, top_n: int) -> None:
    """selected (B, H_kv, N, top_n) blocks, -1 for none, keep a best set by the float64 scores ``want`` (equal up
    to float32 rounding, so near-ties may choose either), as many blocks as the past holds up to top_n."""
    best = want.topk(min(top_n, want.shape[-1]), dim=-1).values
    kept = torch.where(selected >= 0, want.gather(-1, selected.clamp(min=0)), float("-inf"))
    assert torch.equal(torch.isneginf(kept), torch.isneginf(best))
    torch.testing.assert_close(torch.where(torch.isneginf(kept), 0, kept).sum(-1),
                               torch.where(torch.isneginf(best), 0, best).sum(-1), rtol=0, atol=1e-4)


def test_nsa_attention_runs_every_branch_in_the_kernels(generator):
    check_nsa_branches(1, 4, 1, 77, 32, 16, 32, 2, 16, DEVICE, generator)


def check_nsa_branches(batch, heads, heads_kv, seqlen, head_dim, block_cmp, block_sel, top_n, window, device,
                       generator):
    """nsa_attention(impl="triton"): each branch against float64 attention under its own mask (the selected
    branch under the selection the kernels made, nsa_select(impl="triton")), under the tolerance rule; the
    output is the gated sum of the branches in float32."""
    from fa_lab.sparse import nsa_compressed_attention

    q, k, v = make_qkv(batch, heads, seqlen, seqlen, head_dim, torch.bfloat16, device, generator, heads_kv=heads_kv,
                       requires_grad=False)
    gates = torch.rand(batch, heads, seqlen, 3, generator=generator).to(device)
    out, branches = nsa_attention(q, k, v, gates, block_cmp, block_sel, top_n, window, impl="triton")
    assert all(branch.dtype == torch.bfloat16 for branch in branches)
    k_cmp, v_cmp = nsa_compress(k, block_cmp), nsa_compress(v, block_cmp)
    selected = nsa_select(q, k_cmp, block_cmp, block_sel, top_n, head_dim ** -0.5, "triton")
    band = BlockInfo(seqlen, seqlen, causal=True, window=(window - 1, 0)).mask().to(device)
    cases = {"selected": (branches[1], (q, k, v), dense_mask(selected, q, k, 1, block_sel, causal=True)),
             "window": (branches[2], (q, k, v), band.expand(batch, heads, -1, -1))}
    for name, (got, operands, mask) in cases.items():
        want, _ = masked_attention(*(t.double() for t in operands), mask)
        result = compare(name, got, want, masked_attention(*operands, mask)[0], torch.bfloat16)
        assert result.ok, str(result)
    want, _ = nsa_compressed_attention(q.double(), k_cmp.double(), v_cmp.double(), block_cmp, head_dim ** -0.5)
    base, _ = nsa_compressed_attention(q, k_cmp, v_cmp, block_cmp, head_dim ** -0.5)
    result = compare("compressed", branches[0], want, base.to(torch.bfloat16), torch.bfloat16)
    assert result.ok, str(result)
    mixed = sum(gates[..., i:i + 1] * branch.float() for i, branch in enumerate(branches))  # in float32
    assert out.dtype == torch.bfloat16  # the gate mix kernel's sum, rounded once (a fused multiply-add may differ)
    torch.testing.assert_close(out.float(), mixed, rtol=2 ** -8, atol=1e-6)


def test_nsa_attention_kernels_and_reference_agree_with_gradients(generator):
    """Where top_n holds every block a query's past has (the selection is then the whole causal past, with no
    ranking to differ on), impl="triton" and the float64 reference compute the same function: out and the
    gradients to q, k, v and the gates under the tolerance rule (baseline: the reference in bfloat16)."""
    batch, heads, heads_kv, seqlen, head_dim, block_cmp, block_sel, window = 1, 4, 2, 70, 32, 8, 16, 12
    top_n = cdiv(seqlen, block_sel)
    q, k, v = make_qkv(batch, heads, seqlen, seqlen, head_dim, torch.bfloat16, DEVICE, generator, heads_kv=heads_kv)
    gates = torch.rand(batch, heads, seqlen, 3, generator=generator).to(DEVICE)
    grad_out = torch.randn(q.shape, generator=generator).to(DEVICE, q.dtype)

    def run(impl, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, gates)]
        out, _ = nsa_attention(*leaves, block_cmp, block_sel, top_n, window, impl=impl)
        out.backward(grad_out.to(dtype))
        return [out, *(t.grad for t in leaves)]

    failures = []
    for name, got, want, base in zip(("out", "dq", "dk", "dv", "dgates"), run("triton", torch.bfloat16),
                                     run("torch", torch.float64), run("torch", torch.bfloat16)):
        result = compare(name, got, want, base, torch.bfloat16)
        if not result.ok:
            failures.append(str(result))
    assert not failures, "; ".join(failures)


@pytest.fixture
def no_kernel(monkeypatch):
    """Make any launch of the selected-blocks kernel fail the test: checks must come first."""
    from fa_lab.kernels import load_triton

    load_triton()
    from fa_lab.kernels.portable import sparse_select

    def launched(*args):
        raise AssertionError("the kernel ran on input that should have been refused")
    monkeypatch.setattr(sparse_select.BlockSelectFunction, "apply", launched)


@pytest.mark.parametrize("block_q, change, error, words", [
    (16, {"tiles": torch.tensor([[[[0, 5]] * 4]])}, ValueError, "outside"),
    (16, {"tiles": torch.tensor([[[[1, 1]] * 4]])}, ValueError, "twice"),
    (16, {"tiles": torch.tensor([[[[3, -1], [0, 1], [0, 1], [0, 1]]]]), "causal": True}, ValueError, "causal"),
    (1, {"tiles": torch.tensor([[[[1, -1]] * 16 + [[0, -1]] * 48]]), "causal": True}, ValueError, "causal"),
    (1, {"tiles": torch.tensor([[[[0, 1]] * 4]])}, ValueError, "shape"),
    (16, {"tiles": torch.tensor([[[[0.0, 1.0]] * 4]])}, TypeError, "int32 or int64"),
    (16, {"dtype": torch.float32}, TypeError, "float16 and bfloat16"),
    (0, {}, ValueError, "block_q"),
])
def test_bad_selections_are_refused_before_any_kernel_runs(block_q, change, error, words, no_kernel):
    """Four query tiles and four key blocks of 16, or 64 query rows (block_q = 1)."""
    q, k, v = make_qkv(1, 2, 64, 64, 16, change.get("dtype", torch.float16), heads_kv=1, requires_grad=False)
    rows = max(1, cdiv(64, max(block_q, 1)))
    args = {"tiles": torch.tensor([[[[0, 1]] * rows]]), "causal": False, **change}
    with pytest.raises(error, match=words):
        kernel(block_q, 16, args["causal"])(q, k, v, args["tiles"])
    if block_q > 1 and "dtype" not in change:  # block_sparse_attention's impl="triton" refuses the same
        with pytest.raises(error, match=words):
            block_sparse_attention(q, k, v, args["tiles"], block_q, 16, args["causal"], impl="triton")


def test_unknown_impls_are_refused():
    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float16, heads_kv=1, requires_grad=False)
    with pytest.raises(ValueError, match="impl must be one of 'torch', 'triton'; got 'cuda'"):
        block_sparse_attention(q, k, v, torch.zeros(1, 1, 2, 1, dtype=torch.int64), 16, 16, impl="cuda")
    with pytest.raises(ValueError, match="impl must be one of"):
        nsa_attention(q, k, v, torch.rand(1, 2, 32, 3), 8, 16, 1, 8, impl="Triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        nsa_select(q, nsa_compress(k, 8), 8, 16, 1, 0.25, impl="cuda")


@pytest.mark.parametrize("dtype, block_cmp, block_sel, error, words", [
    (torch.float32, 8, 16, TypeError, "float16 and bfloat16"),
    (torch.float16, 8, 20, ValueError, "multiple of block_cmp"),
    (torch.float16, 4, 12, ValueError, "power-of-two number"),  # three compressed blocks a selection block
])
def test_nsa_kernels_refuse_what_they_cannot_run_before_any_runs(dtype, block_cmp, block_sel, error, words,
                                                                 monkeypatch):
    import fa_lab
    from fa_lab import sparse

    def ran(*args, **kwargs):
        raise AssertionError("a branch ran on input that should have been refused")
    monkeypatch.setattr(fa_lab, "attention", ran)
    monkeypatch.setattr(sparse, "nsa_compressed_attention", ran)
    q, k, v = make_qkv(1, 2, 48, 48, 16, dtype, heads_kv=1, requires_grad=False)
    with pytest.raises(error, match=words):
        nsa_attention(q, k, v, torch.rand(1, 2, 48, 3), block_cmp, block_sel, 1, 8, impl="triton")


def test_the_inverted_selection_lists_each_blocks_rows_in_order():
    """selection_csr against a brute-force inversion: every (KV head row, block) lists exactly the selection
    rows that hold the block in some slot, in increasing order, and unused slots are in no list."""
    from fa_lab.kernels.portable.sparse_select import selection_csr

    blocks = 5
    indices = torch.tensor([[[[0, 2, -1], [2, -1, -1], [4, 0, 1]],
                             [[-1, -1, -1], [3, 1, -1], [1, 3, 4]]]], dtype=torch.int32)  # (1, 2, 3, 3)
    offsets, selectors = selection_csr(indices, blocks)
    assert offsets.dtype == selectors.dtype == torch.int32 and offsets.shape == (2 * blocks + 1,)
    for kv_head in range(2):
        for block in range(blocks):
            at = kv_head * blocks + block
            listed = selectors[offsets[at]:offsets[at + 1]].tolist()
            expected = [row for row in range(3) if block in indices[0, kv_head, row].tolist()]
            assert listed == expected, (kv_head, block)
    assert int(offsets[-1]) == int((indices >= 0).sum())


def test_the_gather_programs_order_changes_no_gradient(generator, monkeypatch):
    """The dK/dV gather with the KV head rows innermost, with the key blocks first, and falling back to the
    latter when the key blocks exceed a grid's second axis (MAX_GRID_Y, lowered here): each program sums its
    own list in the same order, so dQ, dK and dV agree bit for bit."""
    pytest.importorskip("triton")
    from fa_lab.kernels.portable import sparse_select

    q, k, v = make_qkv(1, 4, 48, 48, 32, torch.float16, "cpu", generator, heads_kv=2)
    blocks = cdiv(48, 16)
    indices = torch.full((1, 2, 48, 3), -1, dtype=torch.int32)
    for query in range(48):
        past = torch.randperm(query // 16 + 1, generator=generator)[:3]
        indices[0, :, query, :len(past)] = past.to(torch.int32)
    out, lse = sparse_select.block_select_forward(q, k, v, indices, 1, 16, True, 32 ** -0.5)
    operands = (q, k, v, out, lse, torch.randn(out.shape, generator=generator).half(), indices, 1, 16, True,
                32 ** -0.5)
    inner, outer = (sparse_select.block_select_backward(*operands, heads_inner=flag) for flag in (True, False))
    monkeypatch.setattr(sparse_select, "MAX_GRID_Y", blocks - 1)
    fallback = sparse_select.block_select_backward(*operands)
    for a, b, c in zip(inner, outer, fallback):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_short_dq_tiles_take_the_warps_the_recorded_h200_run_timed_fastest():
    """NSA's 16-row dQ tiles launch at SHORT_DQ_TILE_WARPS, the count whose whole backward was fastest in both
    rounds at every length of benchmarks/h200_nsa_dq_warps.json, and tile_config would give them another."""
    import json
    from pathlib import Path

    from fa_lab.bench.sparse import HEAD_DIM, HEADS, HEADS_KV
    from fa_lab.kernels.portable.sparse_select import SHORT_DQ_TILE_ROWS, SHORT_DQ_TILE_WARPS, tile_config

    rows = HEADS // HEADS_KV  # one query of the benchmark's group
    assert tile_config(rows, 64, HEAD_DIM, backward=True).block_m <= SHORT_DQ_TILE_ROWS
    assert tile_config(rows, 64, HEAD_DIM, backward=True).num_warps != SHORT_DQ_TILE_WARPS
    log = json.loads((Path(__file__).parent.parent / "benchmarks" / "h200_nsa_dq_warps.json").read_text())["log"]
    assert [entry["seqlen"] for entry in log] == [16384, 32768, 65536]
    for entry in log:
        chosen = entry[f"warps{SHORT_DQ_TILE_WARPS}_ms"]
        others = [ms for key, times in entry.items() if key.endswith("_ms") and times is not chosen for ms in times]
        assert max(chosen) < min(others), entry


def test_mobas_merge_builds_for_sm90_with_wide_loads_and_no_spills():
    """moba_merge_kernel (ROWS_PER_PROGRAM rows a program, bf16 partial results at d = 128) loads its tiles 16 bytes at
    a time, also through pass 2's entries, and keeps everything in registers."""
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90

    load_triton()
    from fa_lab.kernels.portable.moba import ROWS_PER_PROGRAM, moba_merge_kernel

    signature = {**{name: "*bf16" for name in ("own_out_ptr", "past_out_ptr", "out_ptr")},
                 **{name: "*fp32" for name in ("own_lse_ptr", "past_lse_ptr", "lse_ptr")}, "entry_ptr": "*i32",
                 **{name: "i32" for name in ("rows", "past", "head_dim", "stride_part")}}
    (build,) = compile_all_for_sm90([dict(kernel=moba_merge_kernel, signature=signature, num_warps=4,
                                          constants=dict(ROWS=ROWS_PER_PROGRAM, HEAD_DIM=128),
                                          aligned=("own_out_ptr", "past_out_ptr", "out_ptr", "head_dim",
                                                   "stride_part"))])
    assert build.sass.count("LDG.E.128") >= 2 and build.stack_bytes == 0, (build.registers, build.stack_bytes)


def test_mobas_gather_and_dq_add_build_for_sm90_with_wide_loads_and_stores():
    """gather_rows_kernel and add_past_rows_kernel (bf16 rows of 128) move 16 bytes a load and a store, through
    their index, and keep everything in registers."""
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90

    load_triton()
    from fa_lab.kernels.portable.moba import ROWS_PER_PROGRAM, add_past_rows_kernel, gather_rows_kernel

    constants = dict(ROWS=ROWS_PER_PROGRAM, WIDTH=128)
    builds = compile_all_for_sm90([
        dict(kernel=gather_rows_kernel, signature={"src_ptr": "*bf16", "index_ptr": "*i64", "dst_ptr": "*bf16",
                                                   "count": "i32", "width": "i32"},
             num_warps=4, constants=constants, aligned=("src_ptr", "dst_ptr", "width")),
        dict(kernel=add_past_rows_kernel, signature={"dq_ptr": "*bf16", "part_ptr": "*bf16", "entry_ptr": "*i32",
                                                     "rows": "i32", "past": "i32", "width": "i32"},
             num_warps=4, constants=constants, aligned=("dq_ptr", "part_ptr", "width"))])
    for build in builds:
        assert build.sass.count("LDG.E.128") >= 1 and build.sass.count("STG.E.128") >= 1, build.registers
        assert build.stack_bytes == 0, build.stack_bytes


def test_mobas_count_and_place_build_for_sm90_with_wide_row_copies():
    """moba_place_kernel (64 bf16 rows of 128 against 16 blocks, top-3) copies each query row 16 bytes a load and
    a store to its packed places, and the three packing kernels keep everything in registers."""
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90

    load_triton()
    from fa_lab.kernels.portable.moba import moba_count_kernel, moba_offsets_kernel, moba_place_kernel, place_tile

    rows, blocks = place_tile(16)

    count, offsets, place = compile_all_for_sm90([
        dict(kernel=moba_count_kernel, signature={"selected_ptr": "*i64", "counts_ptr": "*i32", "seqlen": "i32",
                                                  "blocks": "i32"},
             num_warps=4, constants=dict(TOP_K=3, ROWS=rows, BLOCKS=blocks)),
        dict(kernel=moba_offsets_kernel, signature={"counts_ptr": "*i32", "first_ptr": "*i32", "totals_ptr": "*i32",
                                                    "tiles": "i32", "blocks": "i32"},
             num_warps=4, constants=dict(CHUNK=rows, BLOCKS=blocks)),
        dict(kernel=moba_place_kernel, signature={
            "selected_ptr": "*i64", "cu_q_ptr": "*i32", "first_ptr": "*i32", "q_ptr": "*bf16", "packed_q_ptr": "*bf16",
            "query_rows_ptr": "*i64", "inverse_ptr": "*i32", "seqlen": "i32", "blocks": "i32", "rows_total": "i32",
            "width": "i32"},
             num_warps=4, constants=dict(TOP_K=3, ROWS=rows, BLOCKS=blocks, WIDTH=128),
             aligned=("q_ptr", "packed_q_ptr", "width"))])
    assert place.sass.count("LDG.E.128") >= 1 and place.sass.count("STG.E.128") >= 1, place.registers
    stacks = [build.stack_bytes for build in (count, offsets, place)]
    assert stacks == [0, 0, 0], stacks


def test_mobas_gate_builds_for_sm90_on_tensor_cores_without_spills():
    """moba_gate_kernel (GATE_ROWS bf16 rows of 128 against 16 blocks, top-3) scores on the tensor cores (HMMA or
    wgmma: no float32 FMA products), loads q 16 bytes at a time and keeps everything in registers."""
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90

    load_triton()
    from fa_lab.kernels.portable.moba import GATE_ROWS, moba_gate_kernel

    signature = {"q_ptr": "*bf16", "means_ptr": "*bf16", "out_ptr": "*i64",
                 **{name: "i32" for name in ("seqlen", "heads", "group", "blocks", "block", "head_dim", "stride_part",
                                             "stride_qb", "stride_qh", "stride_qn")}}
    (build,) = compile_all_for_sm90([dict(kernel=moba_gate_kernel, signature=signature, num_warps=4,
                                          constants=dict(TOP_K=3, BLOCK_M=GATE_ROWS, BLOCKS=16, HEAD_DIM=128),
                                          aligned=("q_ptr", "means_ptr", "head_dim", "stride_qb", "stride_qh",
                                                   "stride_qn", "stride_part"))])
    assert "HMMA" in build.sass or "HGMMA" in build.sass, build.registers
    assert build.sass.count("LDG.E.128") >= 1 and build.stack_bytes == 0, (build.registers, build.stack_bytes)


def test_nsa_importance_builds_for_sm90_on_tensor_cores_without_spills():
    """nsa_importance_kernel at NSA's sizes (bf16, d = 128, compressed blocks of 32, selection blocks of 64) and
    the benchmark's group of 16, at the default tiles storing scores (64 keys a step) and keeping a running top 16
    (128 keys a step), and with the group packed into a tile of 128 rows at 8 warps, compiles for sm_90, scores on
    the tensor cores and keeps its tiles in registers in the loops that run the products."""
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90, ctas_per_sm, ctas_per_sm_by_registers

    load_triton()
    from fa_lab.kernels.portable import nsa_importance as importance

    signature = {"q_ptr": "*bf16", "k_cmp_ptr": "*bf16", "lse_ptr": "*fp32", "out_ptr": "*fp32",
                 **{name: "i32" for name in ("seqlen", "blocks_cmp", "sel_blocks", "heads", "group", "head_dim",
                                             "top_n")},
                 "qk_scale_log2": "fp32", "log2e": "fp32"}
    default, packed = importance.packed_tile(16), importance.packed_tile(16, 128, None)
    shipped = {name: getattr(importance, name) for name in importance.TWO_PROGRAMS}  # the module's own settings
    tiles = [(default, importance.IMPORTANCE_WARPS, 0, False, shipped),
             (default, importance.SELECTION_WARPS, 16, False, shipped), (packed, 8, 0, False, shipped),
             (default, importance.MERGE_WARPS, 16, True, importance.TWO_PROGRAMS),
             (default, importance.MERGE_WARPS, 16, True, shipped)]
    keys = {0: importance.IMPORTANCE_KEYS, 16: importance.SELECTION_KEYS}

    def job(queries: int, members: int, warps: int, top: int, merge: bool, settings: dict) -> dict:
        """The build the launcher makes of this tile with the module's ``settings``."""
        budget = {}
        if importance.budgeted_tile(top, merge, queries * members, keys[top], warps):
            budget = dict(maxnreg=settings["SELECTION_MAXNREG"], num_stages=settings["SELECTION_STAGES"])
        q = torch.empty(1, 1, queries * members, 128, dtype=torch.bfloat16)  # a q of the tile's rows, for its layout
        by_descriptor = settings["Q_BY_DESCRIPTOR"] and importance.descriptor_readable(members, q)
        return dict(kernel=importance.nsa_importance_kernel, num_warps=warps, **budget,
                    signature={**signature, "out_ptr": "*i64" if top else "*fp32",
                               **({"q_desc": f"tensordesc<bf16[1, 1, {queries}, 128]>"} if by_descriptor else {})},
                    constants=dict(BLOCK_CMP=32, PER=2, QUERIES=queries, MEMBERS=members, BLOCK_N=keys[top],
                                   HEAD_DIM=128, MERGE=merge, FULL_STEPS=importance.UNMASKED_FULL_STEPS,
                                   BLOCKS_FIRST=settings["BLOCKS_FIRST"],
                                   **({} if by_descriptor else {"q_desc": None}),
                                   **dict(zip(("TOP", "SORT"), importance.top_widths(top, keys[top], 2)))),
                    aligned=("q_ptr", "k_cmp_ptr", "head_dim"))

    builds = compile_all_for_sm90([job(*tile, warps, top, merge, settings)
                                   for tile, warps, top, merge, settings in tiles])
    for build in builds:
        assert "HMMA" in build.sass or "HGMMA" in build.sass, build.registers
        assert build.kv_loop_spills == 0, (build.registers, build.stack_bytes)
    # storing the scores, nothing spills; keeping a top by a merge, ptxas keeps values on the stack around the loops
    # that run the products (with its full steps' LSE rows a pass ahead, or in 168 registers)
    assert [build.stack_bytes == 0 for build in builds] == [True, True, True, False, False]
    three = builds[-1]  # the shipped settings: three programs an SM, by registers and by shared memory
    assert three.registers <= importance.SELECTION_MAXNREG
    assert ctas_per_sm_by_registers(three.registers, importance.MERGE_WARPS) >= 3
    assert ctas_per_sm(three.shared_bytes) >= 3, three.shared_bytes


def test_nsa_gate_mix_and_its_backward_against_their_float64_definitions(generator):
    """Rows not a multiple of a program's, a head_dim the tile pads."""
    check_gate_mix((1, 3, 45, 48), DEVICE, generator)


def check_gate_mix(shape: tuple, device, generator) -> None:
    """triton_nsa_gate_mix on branches of ``shape``: out = sum_i g_i o_i and, in its one-pass backward,
    d o_i = g_i dO and d g_i = sum_d(o_i dO), against float64."""
    from fa_lab.kernels import triton_nsa_gate_mix

    branches = [torch.randn(shape, generator=generator).to(device, torch.bfloat16).requires_grad_() for _ in range(3)]
    gates = torch.rand(*shape[:3], 3, generator=generator).to(device).requires_grad_()
    grad_out = torch.randn(shape, generator=generator).to(device, torch.bfloat16)
    out = triton_nsa_gate_mix(gates, *branches)
    out.backward(grad_out)
    wide = [t.detach().double() for t in branches]
    terms = [gates.detach().double()[..., i:i + 1] * branch for i, branch in enumerate(wide)]
    want = sum(terms)
    # One bf16 rounding of the result, plus float32's in the products and sums: a few units of 2^-24 of the
    # terms' magnitudes, which is what is left where the three terms nearly cancel. A dropped or misweighted
    # term would be off by a bf16 rounding of the terms or more, about 2^12 times this bound's second part.
    bound = 2 ** -8 * want.abs() + 2 ** -21 * sum(term.abs() for term in terms)
    excess = (out.double() - want).abs() - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} outputs past the bound, worst by {excess.max():.3g}"
    for i, branch in enumerate(branches):
        want_grad = gates.detach().double()[..., i:i + 1] * grad_out.double()
        torch.testing.assert_close(branch.grad.double(), want_grad, rtol=2 ** -8, atol=0)
    want_gates = torch.stack([(branch * grad_out.double()).sum(-1) for branch in wide], dim=-1)
    torch.testing.assert_close(gates.grad.double(), want_gates, rtol=1e-5, atol=1e-5)


def test_nsa_gate_mix_builds_for_sm90_with_wide_loads_and_stores():
    """nsa_gate_mix_kernel and its backward (bf16, d = 128) read each branch and write each output 16 bytes at a
    time, without spills."""
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90

    load_triton()
    from fa_lab.kernels.portable.nsa_gate import MIX_ROWS, nsa_gate_mix_bwd_kernel, nsa_gate_mix_kernel

    tensors = ("cmp_ptr", "sel_ptr", "win_ptr", "gates_ptr", "out_ptr")
    signature = {**{name: "*bf16" for name in tensors}, "rows": "i32", "head_dim": "i32"}
    grads = ("grad_ptr", "cmp_ptr", "sel_ptr", "win_ptr", "gates_ptr", "grad_cmp_ptr", "grad_sel_ptr", "grad_win_ptr")
    backward = {**{name: "*bf16" for name in grads}, "grad_gates_ptr": "*fp32", "rows": "i32", "head_dim": "i32"}
    forward, reverse = compile_all_for_sm90([
        dict(kernel=nsa_gate_mix_kernel, signature=signature, num_warps=4, constants=dict(ROWS=MIX_ROWS, DIM=128),
             aligned=("cmp_ptr", "sel_ptr", "win_ptr", "out_ptr", "head_dim")),
        dict(kernel=nsa_gate_mix_bwd_kernel, signature=backward, num_warps=4, constants=dict(ROWS=MIX_ROWS, DIM=128),
             aligned=(*(name for name in grads if name != "gates_ptr"), "head_dim"))])
    assert forward.sass.count("LDG.E.128") >= 3 and forward.sass.count("STG.E.128") >= 1, forward.registers
    assert reverse.sass.count("LDG.E.128") >= 4 and reverse.sass.count("STG.E.128") >= 3, reverse.registers
    assert forward.stack_bytes == 0 and reverse.stack_bytes == 0


# ---------------------------------------------------------------- GPU (device machine)

@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, heads_kv, seqlen_q, seqlen_k, block_q, block_k, slots", [
    (8, 2, 1000, 1000, 64, 64, 6), (8, 8, 777, 1537, 128, 64, 8), (16, 1, 1025, 1025, 16, 128, 4)])
def test_gpu_block_sparse_kernel(causal, heads, heads_kv, seqlen_q, seqlen_k, block_q, block_k, slots, generator):
    q, k, v = make_qkv(2, heads, seqlen_q, seqlen_k, 128, torch.bfloat16, "cuda", generator, heads_kv=heads_kv)
    tiles = random_selection(generator, 2, heads_kv, seqlen_q, seqlen_k, block_q, block_k, slots, causal,
                             empty_row=2)
    mask = dense_mask(tiles, q, k, block_q, block_k, causal)
    run = lambda q, k, v: block_sparse_attention(q, k, v, tiles.cuda(), block_q, block_k, causal, impl="triton")
    actual = check_against_dense(run, q, k, v, mask, generator)
    assert_rows_see_nothing(actual, slice(2 * block_q, 3 * block_q))


@pytest.mark.gpu
@pytest.mark.parametrize("heads, heads_kv", [(16, 1), (8, 2)])
def test_gpu_nsa_selection(heads, heads_kv, generator):
    seqlen, block_cmp, block_sel, top_n = 2049, 32, 64, 16
    q, k, v = make_qkv(1, heads, seqlen, seqlen, 128, torch.bfloat16, "cuda", generator, heads_kv=heads_kv)
    selected = nsa_select(q.detach(), nsa_compress(k.detach(), block_cmp), block_cmp, block_sel, top_n,
                          128 ** -0.5)
    mask = dense_mask(selected, q, k, 1, block_sel, causal=True)
    check_against_dense(lambda *t: kernel(1, block_sel, True)(*t, selected), q, k, v, mask, generator)


@pytest.mark.gpu
@pytest.mark.parametrize("top_in_kernel, merge", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("heads, heads_kv, seqlen", [(16, 1, 2049), (8, 2, 1000), (8, 2, 4500)])
def test_gpu_nsa_importance(heads, heads_kv, seqlen, top_in_kernel, merge, generator, monkeypatch):
    import fa_lab.sparse
    from fa_lab.kernels.portable import nsa_importance

    monkeypatch.setattr(fa_lab.sparse, "NSA_TOP_IN_KERNEL", top_in_kernel)
    monkeypatch.setattr(nsa_importance, "TOP_BY_MERGE", merge)
    check_nsa_importance(torch.bfloat16, 1, heads, heads_kv, seqlen, 128, 32, 64, 16, "cuda", generator)


@pytest.mark.gpu
@pytest.mark.parametrize("two_programs", [False, True])
@pytest.mark.parametrize("top_n", [0, 16])
def test_gpu_nsa_importance_full_steps(top_n, two_programs, generator, monkeypatch):
    """NSA's sizes at the default tiles: 8,250 tokens, 257 compressed keys, so steps of 64 or 128 keys unmasked
    for most tiles, and a last tile past the sequence; with the module's settings for two programs an SM too."""
    from fa_lab.kernels.portable import nsa_importance

    if two_programs:
        for name, value in nsa_importance.TWO_PROGRAMS.items():
            monkeypatch.setattr(nsa_importance, name, value)
    check_full_steps(1, 16, 1, 8250, 128, 32, 64, top_n, "cuda", generator)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, heads, heads_kv, seqlen", [(2, 8, 2, 2049), (1, 16, 1, 4500), (1, 4, 4, 4096)])
def test_gpu_nsa_compressed_branch(batch, heads, heads_kv, seqlen, generator):
    """Through the Gluon forward and backward on sm_90: three residue groups (2049 and 4500 tokens) or two (4096)."""
    check_compressed_branch(torch.bfloat16, batch, heads, heads_kv, seqlen, 128, 32, "cuda", generator)


@pytest.mark.gpu
def test_gpu_nsa_gate_mix(generator):
    check_gate_mix((1, 16, 4500, 128), "cuda", generator)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, heads_kv, seqlen, window", [(16, 1, 2049, 512), (8, 2, 1000, 100)])
def test_gpu_nsa_attention_end_to_end(heads, heads_kv, seqlen, window, generator):
    check_nsa_branches(1, heads, heads_kv, seqlen, 128, 32, 64, 16, window, "cuda", generator)


@pytest.mark.gpu
def test_gpu_nsa_attention_never_waits_for_the_gpu(generator, assert_never_waits):
    """NSA's kernels, forward and backward, issue every launch without reading anything back to the host (a read
    would leave the GPU idle while the host waits and then launches the rest); the checks a caller's selection
    gets do read back."""
    from fa_lab.sparse import check_key_tiles, nsa_attention

    q, k, v = make_qkv(1, 16, 4500, 4500, 128, torch.bfloat16, "cuda", generator, heads_kv=1)
    gates = torch.rand(*q.shape[:3], 3, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
    grad = torch.randn(q.shape, generator=generator).to("cuda", torch.bfloat16)
    selected = nsa_select(q.detach(), nsa_compress(k.detach(), 32), 32, 64, 16, 128 ** -0.5)
    assert_never_waits(lambda: nsa_attention(q, k, v, gates, 32, 64, 16, 512, impl="triton")[0].backward(grad),
                       lambda: check_key_tiles(selected, q, k, 1, 64, causal=True))


@pytest.mark.gpu
def test_gpu_sparse_backward_is_deterministic(generator):
    """dK and dV are gathered per key block, not added atomically: two backward passes agree bit for bit."""
    q, k, v = make_qkv(1, 16, 2049, 2049, 128, torch.bfloat16, "cuda", generator, heads_kv=1)
    selected = nsa_select(q.detach(), nsa_compress(k.detach(), 32), 32, 64, 16, 128 ** -0.5)
    grad = torch.randn(q.shape, generator=generator).to("cuda", torch.bfloat16)
    grads = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        kernel(1, 64, True)(*leaves, selected)[0].backward(grad)
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def check_moba_gate(batch, heads, heads_kv, seqlen, head_dim, block, top_k, dtype, device, generator):
    """The kernel's gate against the PyTorch one: the same own block and the same empty slots, and in every
    past slot a block whose float64 score equals the one PyTorch picked there (a near-tie may swap two
    blocks, float32 rounding in another order; a wrong pick differs by far more), none picked twice."""
    q, k, _ = make_qkv(batch, heads, seqlen, seqlen, head_dim, dtype, device, generator, heads_kv=heads_kv)
    ours, reference = moba_gate(q, k, block, top_k, impl="triton"), moba_gate(q, k, block, top_k)
    assert ours.dtype == torch.int64 and ours.shape == reference.shape
    assert torch.equal(ours[..., 0], reference[..., 0]) and torch.equal(ours < 0, reference < 0)
    blocks = cdiv(seqlen, block)
    keys = torch.nn.functional.pad(k.double(), (0, 0, 0, blocks * block - seqlen))
    counts = torch.clamp(seqlen - torch.arange(blocks, device=device) * block, max=block)
    means = expand_kv(keys.view(batch, heads_kv, blocks, block, head_dim).sum(3) / counts[:, None], heads)
    scores = torch.matmul(q.double(), means.transpose(-2, -1))  # (B, H, N, blocks)
    picked = lambda sel: torch.gather(scores, -1, sel[..., 1:].clamp(min=0))
    torch.testing.assert_close(picked(ours), picked(reference), rtol=0, atol=1e-5)
    past = ours[..., 1:]
    repeats = (past[..., :, None] == past[..., None, :]) & (past[..., :, None] >= 0)
    assert int(repeats.sum()) == past.ge(0).sum()  # each pick equals itself only


@pytest.mark.parametrize("batch, heads, heads_kv, seqlen, head_dim, block, top_k", [
    (2, 4, 2, 200, 64, 32, 3),  # GQA, a ragged last block
    (1, 2, 1, 75, 40, 16, 4),  # head_dim padded to the kernel's 64
    (1, 2, 2, 70, 16, 16, 9),  # more slots than blocks: the slots past them dropped, as PyTorch does
    (1, 2, 2, 64, 32, 16, 1),  # the own block only
])
def test_moba_gate_kernel_picks_what_pytorch_picks(batch, heads, heads_kv, seqlen, head_dim, block, top_k,
                                                   generator):
    check_moba_gate(batch, heads, heads_kv, seqlen, head_dim, block, top_k, torch.float16, DEVICE, generator)


def test_moba_gate_past_the_kernels_blocks_runs_in_pytorch(generator):
    from fa_lab.kernels.portable.moba import GATE_BLOCKS

    q, k, _ = make_qkv(1, 1, GATE_BLOCKS + 1, GATE_BLOCKS + 1, 16, torch.float16, DEVICE, generator)
    assert torch.equal(moba_gate(q, k, 1, 3, impl="triton"), moba_gate(q, k, 1, 3))


def sorted_packing(selected, block):
    """Pass 2's packing by a stable sort of the entries' (batch, head, block) keys: (cu_q, query_rows (E,),
    entries (past, rows)), E = cu_q[-1]; the reference of the count-and-place kernels."""
    from fa_lab.kernels.common import grouped_entries

    batch, heads, seqlen, top_k = selected.shape
    blocks, past, rows = cdiv(seqlen, block), top_k - 1, batch * heads * seqlen
    sequences = batch * heads * blocks
    head_rows = torch.arange(batch * heads, device=selected.device).view(batch, heads, 1, 1)
    key = torch.where(selected[..., 1:] >= 0, head_rows * blocks + selected[..., 1:], sequences).flatten()
    order, cu_q = grouped_entries(key, sequences)
    packed = order[:int(cu_q[-1])]
    entries = torch.full((past, rows), -1, dtype=torch.int32, device=selected.device)
    entries.view(-1)[(packed % past) * rows + packed // past] = torch.arange(len(packed), dtype=torch.int32,
                                                                           device=selected.device)
    return cu_q, packed // past, entries


@pytest.mark.parametrize("batch, heads, seqlen, block, top_k", [
    (2, 3, 77, 16, 3),  # a ragged last block, unused slots in the first blocks
    (1, 2, 130, 8, 5),  # more slots, queries spread over 17 blocks
    (1, 1, 300, 1, 2),  # 300 blocks: 16-row tiles
    (1, 2, 64, 16, 1),  # no past slot: nothing packed
])
def test_moba_count_and_place_pack_as_a_stable_sort_does(batch, heads, seqlen, block, top_k, generator):
    from fa_lab.kernels.portable.moba import packing_bounds, past_block_sequences

    q, k, _ = make_qkv(batch, heads, seqlen, seqlen, 16, torch.float16, DEVICE, generator)
    selected = moba_gate(q, k, block, top_k)
    selected[0, 0, seqlen // 2:, -1] = -1  # slots left unused by choice, not only by a short past
    cu_q, query_rows, entries = sorted_packing(selected, block)
    packing = past_block_sequences(selected, block, q)
    total = packing_bounds(packing)[0][-1]
    assert torch.equal(packing["cu_q"], cu_q) and total == int(cu_q[-1])
    assert torch.equal(packing["query_rows"][:total], query_rows)
    assert torch.equal(packing["entries"], entries)
    assert torch.equal(packing["q"][:total, 0], q.reshape(-1, 16)[query_rows])


@pytest.mark.gpu
@pytest.mark.parametrize("heads, heads_kv, seqlen, block, top_k", [(32, 32, 65536, 4096, 3), (8, 2, 4099, 64, 5)])
def test_gpu_moba_gate(heads, heads_kv, seqlen, block, top_k, generator):
    check_moba_gate(1, heads, heads_kv, seqlen, 128, block, top_k, torch.bfloat16, "cuda", generator)


def check_moba(batch, heads, heads_kv, seqlen, head_dim, block, top_k, dtype, device, generator):
    """moba_attention(impl="triton") against dense attention under the mask of the selection it made (its
    kernel gate's, which test_moba_gate_kernel_picks_what_pytorch_picks holds to PyTorch's)."""
    q, k, v = make_qkv(batch, heads, seqlen, seqlen, head_dim, dtype, device, generator, heads_kv=heads_kv)
    mask = moba_mask(moba_gate(q.detach(), k.detach(), block, top_k, impl="triton"), seqlen, block).to(device)
    run = lambda q, k, v: moba_attention(q, k, v, block, top_k, impl="triton")
    check_against_dense(run, q, k, v, mask, generator)


@pytest.mark.parametrize("batch, heads, heads_kv, seqlen, block, top_k", [
    (2, 2, 2, 77, 16, 3),  # a ragged last block, two batch rows: pass 1 on the varlen kernel
    (2, 2, 1, 96, 32, 3),  # blocks that tile the sequence: pass 1 with each block a head of the dense kernel
    (1, 4, 2, 96, 32, 2),  # GQA: the gate and both passes per query head
    (1, 2, 1, 64, 16, 1),  # the own block only: no second pass
])
def test_moba_kernel_path_meets_the_tolerance_rule(batch, heads, heads_kv, seqlen, block, top_k, generator):
    check_moba(batch, heads, heads_kv, seqlen, 32, block, top_k, torch.float16, DEVICE, generator)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, heads_kv, seqlen, block, top_k", [(8, 8, 4099, 512, 3), (8, 2, 2048, 256, 4)])
def test_gpu_moba(heads, heads_kv, seqlen, block, top_k, generator):
    check_moba(1, heads, heads_kv, seqlen, 128, block, top_k, torch.bfloat16, "cuda", generator)
