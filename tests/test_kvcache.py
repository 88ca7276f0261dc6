"""attention_with_kvcache: in-place append (dense and paged), split-KV with the LSE merge, the split
heuristic, refused calls that leave the cache untouched, and the torch and Triton impls against each
sequence's float64 reference, under the tolerance rule."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import fa_lab
from fa_lab.block_info import BlockInfo
from fa_lab.kvcache import choose_num_splits, split_ranges
from fa_lab.reference import naive_attention, reference_attention
from fa_lab.testing import LSE_FLOOR, compare


def make_cache(generator, batch, capacity, heads_kv, head_dim, dtype, page_size=None):
    """A dense cache (batch, capacity, heads_kv, d), or a shuffled paged pool with its block table."""
    if page_size is None:
        k, v = (torch.randn(batch, capacity, heads_kv, head_dim, generator=generator).to(dtype) for _ in range(2))
        return k, v, None
    pages = capacity // page_size
    pool = batch * pages + 3  # spare pages that no sequence uses
    k, v = (torch.randn(pool, page_size, heads_kv, head_dim, generator=generator).to(dtype) for _ in range(2))
    table = torch.randperm(pool, generator=generator)[:batch * pages].reshape(batch, pages).to(torch.int32)
    return k, v, table


def logical(cache, table, b, n):
    """Tokens 0 .. n - 1 of sequence b, read from the cache by the definition of the layouts."""
    if table is None:
        return cache[b, :n]
    page_size = cache.shape[1]
    return torch.stack([cache[int(table[b, j // page_size]), j % page_size] for j in range(n)]) if n else \
        cache.new_zeros(0, *cache.shape[2:])


def expected(q, k_cache, v_cache, table, lengths, causal, scale, window, softcap, upcast):
    """(out (B, seqlen_q, H, d), lse (B, H, seqlen_q)) sequence by sequence from the (appended) cache."""
    batch, seqlen_q, heads, head_dim = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64 if upcast else q.dtype)
    lse = torch.full((batch, heads, seqlen_q), float("-inf"), dtype=torch.float64 if upcast else torch.float32)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        k, v = (logical(c, table, b, n).transpose(0, 1)[None] for c in (k_cache, v_cache))
        qb = q[b].transpose(0, 1)[None]
        options = dict(window=window, softcap=softcap)
        o, l = (reference_attention(qb, k, v, causal, scale, **options) if upcast
                else naive_attention(qb, k, v, causal, scale, **options))
        out[b], lse[b] = o[0].transpose(0, 1), l[0]
    return out, lse


MATRIX = [  # (heads, heads_kv, seqlen_q, page_size, cache_seqlens, seqlen_new, window, softcap, num_splits)
    (4, 4, 1, None, [0, 17, 61], 3, (-1, -1), 0.0, 1),
    (8, 2, 1, 16, [5, 0, 60], 4, (-1, -1), 0.0, 0),
    (8, 1, 7, 1, [20, 33, 9], 0, (-1, -1), 0.0, 3),
    (4, 1, 7, 64, [64, 0, 50], 7, (10, -1), 0.0, 2),
    (8, 2, 1, 16, [64, 40, 0], 0, (-1, -1), 20.0, 5),
    (4, 4, 3, None, [63, 1, 30], 1, (6, -1), 5.0, 0),
    (8, 1, 1, 256, [300, 0, 509], 2, (-1, -1), 0.0, 0),
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("heads, heads_kv, seqlen_q, page_size, cache_seqlens, seqlen_new, window, softcap, splits",
                         MATRIX)
def test_kvcache_attention_meets_the_tolerance_rule(impl, heads, heads_kv, seqlen_q, page_size, cache_seqlens,
                                                    seqlen_new, window, softcap, splits, generator):
    if impl == "triton":
        pytest.importorskip("triton")
    dtype, batch, head_dim = torch.float16, len(cache_seqlens), 32
    capacity = 512 if page_size == 256 else 64
    k_cache, v_cache, table = make_cache(generator, batch, capacity, heads_kv, head_dim, dtype, page_size)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=generator).to(dtype)
    k_new, v_new = (torch.randn(batch, seqlen_new, heads_kv, head_dim, generator=generator).to(dtype)
                    for _ in range(2)) if seqlen_new else (None, None)
    if seqlen_new:  # keep within capacity
        cache_seqlens = [min(n, capacity - seqlen_new) for n in cache_seqlens]
    seqlens = torch.tensor(cache_seqlens, dtype=torch.int32)
    before = seqlens.clone()
    out, lse = fa_lab.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new, block_table=table,
                                             window=window, softcap=softcap, num_splits=splits, impl=impl,
                                             return_lse=True)
    assert torch.equal(seqlens, before)  # the caller's cache_seqlens is not modified
    lengths = [n + seqlen_new for n in cache_seqlens]
    for b, n in enumerate(cache_seqlens):  # the new keys sit in the cache after the old ones
        if seqlen_new:
            assert torch.equal(logical(k_cache, table, b, n + seqlen_new)[n:], k_new[b])
            assert torch.equal(logical(v_cache, table, b, n + seqlen_new)[n:], v_new[b])
    reference = expected(q, k_cache, v_cache, table, lengths, True, None, window, softcap, upcast=True)
    baseline = expected(q, k_cache, v_cache, table, lengths, True, None, window, softcap, upcast=False)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (batch, heads, seqlen_q)
    for name, got, want, base, floor in (("out", out, reference[0], baseline[0], None),
                                         ("lse", lse, reference[1], baseline[1], LSE_FLOOR)):
        result = compare(name, got, want, base, dtype, floor=floor)
        assert result.ok, str(result)


@pytest.mark.parametrize("page_size, cache_seqlens, seqlen_q, splits",
                         [(16, [64, 0, 37], 1, 3), (32, [1, 64, 33], 3, 2), (64, [64, 17, 50], 1, 1),
                          (16, [63, 5, 64], 2, 4)])
def test_reading_a_splits_pages_ahead_gives_the_same_attention(page_size, cache_seqlens, seqlen_q, splits, generator):
    """With pages_ahead the decode kernel takes each split's block-table entries into registers before its key
    loop (PAGES_AHEAD); the output and LSE are the loop-read kernel's, bit for bit, on ragged lengths
    (0 and full), splits that start mid-page, and shuffled pages."""
    pytest.importorskip("triton")
    from dataclasses import replace as with_field

    from fa_lab.kernels import load_triton
    from fa_lab.kvcache import check_kvcache

    load_triton()
    from fa_lab.kernels.portable.decode import INTERPRETER, pages_ahead, triton_decode

    batch, heads, heads_kv, head_dim, capacity = len(cache_seqlens), 4, 2, 32, 64
    k_cache, v_cache, table = make_cache(generator, batch, capacity, heads_kv, head_dim, torch.float16, page_size)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=generator).to(torch.float16)
    lengths = torch.tensor(cache_seqlens, dtype=torch.int32)
    layout = check_kvcache(q, k_cache, v_cache, lengths, block_table=table)
    assert pages_ahead(layout, splits, INTERPRETER) >= 2
    args = (q, k_cache, v_cache, lengths, table, layout, True, head_dim ** -0.5, (-1, -1), 0.0, splits)
    want = triton_decode(*args, with_field(INTERPRETER, pages_ahead=False))
    got = triton_decode(*args, with_field(INTERPRETER, pages_ahead=True))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("window, softcap", [((-1, -1), 0.0), ((20, -1), 0.0), ((-1, -1), 10.0)])
def test_chunked_prefill_takes_the_prefill_forward_and_ignores_unwritten_slots(window, softcap, generator,
                                                                                monkeypatch):
    """Many queries over a dense cache with one split go to the prefill forward (the decode kernel is
    made to fail), with the cache's lengths as seqused_k; the slots past each length hold NaN, which must
    not reach the output."""
    pytest.importorskip("triton")
    from fa_lab.kernels.portable import decode

    monkeypatch.setattr(decode, "decode_split_kernel", None)  # indexing None for a launch would raise
    dtype, heads, heads_kv, head_dim, capacity, seqlen_q = torch.float16, 4, 2, 32, 160, 40
    cache_seqlens = [0, 57, capacity - seqlen_q]
    batch = len(cache_seqlens)
    k_cache, v_cache, _ = make_cache(generator, batch, capacity, heads_kv, head_dim, dtype)
    for b, n in enumerate(cache_seqlens):
        k_cache[b, n + seqlen_q:], v_cache[b, n + seqlen_q:] = float("nan"), float("nan")
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=generator).to(dtype)
    k_new, v_new = (torch.randn(batch, seqlen_q, heads_kv, head_dim, generator=generator).to(dtype) for _ in range(2))
    out, lse = fa_lab.attention_with_kvcache(q, k_cache, v_cache, torch.tensor(cache_seqlens, dtype=torch.int32),
                                             k_new, v_new, window=window, softcap=softcap, num_splits=1,
                                             impl="triton", return_lse=True)
    lengths = [n + seqlen_q for n in cache_seqlens]
    reference = expected(q, k_cache, v_cache, None, lengths, True, None, window, softcap, upcast=True)
    baseline = expected(q, k_cache, v_cache, None, lengths, True, None, window, softcap, upcast=False)
    for name, got, want, base, floor in (("out", out, reference[0], baseline[0], None),
                                         ("lse", lse, reference[1], baseline[1], LSE_FLOOR)):
        result = compare(name, got, want, base, dtype, floor=floor)
        assert result.ok, str(result)


def test_only_one_split_dense_whole_tile_calls_take_the_prefill_forward():
    """The route's conditions one at a time: a split count above 1, a paged cache, fewer queries than the
    forward's query tile, or a head_dim a descriptor cannot read (not a multiple of 8) keep the decode kernel."""
    pytest.importorskip("triton")
    from fa_lab.kernels import interpreting
    from fa_lab.kernels.portable.configs import forward_config
    from fa_lab.kernels.portable.decode import prefills_by_query_tiles
    from fa_lab.kvcache import CacheLayout

    tile = forward_config(32, True, interpreting()).block_m
    dense = CacheLayout(batch=2, seqlen_q=tile, heads=4, heads_kv=2, head_dim=32, paged=False, page_size=256,
                        capacity=256, seqlen_new=0)
    assert prefills_by_query_tiles(dense, 1)
    assert not prefills_by_query_tiles(dense, 2)
    assert not prefills_by_query_tiles(replace(dense, paged=True, page_size=64), 1)
    assert not prefills_by_query_tiles(replace(dense, seqlen_q=tile - 1), 1)
    assert not prefills_by_query_tiles(replace(dense, head_dim=36), 1)


def test_appending_leaves_every_other_byte_of_the_pool_alone(generator):
    k_cache, v_cache, table = make_cache(generator, 2, 32, 2, 16, torch.float32, page_size=8)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q = torch.randn(2, 1, 2, 16, generator=generator)
    k_new, v_new = (torch.randn(2, 5, 2, 16, generator=generator) for _ in range(2))
    fa_lab.attention_with_kvcache(q, k_cache, v_cache, torch.tensor([6, 20], dtype=torch.int32), k_new, v_new,
                                  block_table=table)
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate((6, 20)):
        for j in range(n, n + 5):
            written[int(table[b, j // 8]), j % 8] = True
    assert torch.equal(k_cache[~written], k_before[~written]) and torch.equal(v_cache[~written], v_before[~written])
    assert not torch.equal(k_cache[written], k_before[written])


def _refused(generator, dtype):
    """(change, error, words): calls that must raise before anything is written, on tensors of ``dtype``."""
    other = torch.float16 if dtype == torch.float32 else torch.float32
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return [
        ({"cache_seqlens": torch.tensor([15, 3], dtype=torch.int32)}, ValueError, ["sequence 0", "more than"]),
        ({"block_table": torch.tensor([[1, 0], [1, 3]], dtype=torch.int32)}, ValueError, ["page 1", "share"]),
        ({"block_table": torch.tensor([[9, 1], [2, 3]], dtype=torch.int32)}, ValueError, ["block_table[0, 0] = 9"]),
        ({"k_new": torch.randn(2, 4, 2, 8, generator=generator).to(other)}, TypeError, ["k_new", str(other)[6:]]),
        ({"v_new": None}, ValueError, ["k_new and v_new"]),
        ({"cache_seqlens": torch.tensor([1, 2])}, ValueError, ["int32"]),
        ({"q": torch.randn(2, 1, 3, 8, generator=generator).to(dtype)}, ValueError, ["heads"]),
        ({"num_splits": -1}, ValueError, ["num_splits"]),
        ({"block_table": table, "impl": "naive"}, ValueError, ["impl"]),
        ({"k_cache": torch.randn(4, 16, 2, 8, generator=generator).to(dtype)[:, :8]}, ValueError, ["contiguous"]),
        ({"check_values": None}, TypeError, ["check_values"]),
    ]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_refused_call_leaves_the_cache_untouched(impl, generator):
    """impl="torch" refuses before writing; impl="triton" decides on the device, writes nothing and raises
    once its kernels are queued: the same errors, and the same bytes in the cache."""
    dtype = torch.float32 if impl == "torch" else torch.float16  # the kernels take half precision only
    if impl == "triton":
        pytest.importorskip("triton")
    k_cache, v_cache = (torch.randn(4, 8, 2, 8, generator=generator).to(dtype) for _ in range(2))  # 4 pages of 8
    base = {"q": torch.randn(2, 1, 4, 8, generator=generator).to(dtype), "k_cache": k_cache, "v_cache": v_cache,
            "cache_seqlens": torch.tensor([3, 9], dtype=torch.int32),
            "k_new": torch.randn(2, 4, 2, 8, generator=generator).to(dtype),
            "v_new": torch.randn(2, 4, 2, 8, generator=generator).to(dtype),
            "block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), "impl": impl}
    for change, error, words in _refused(generator, dtype):
        k_before, v_before = k_cache.clone(), v_cache.clone()
        with pytest.raises(error) as raised:
            fa_lab.attention_with_kvcache(**{**base, **change})
        for word in words:
            assert word in str(raised.value), (change, str(raised.value))
        assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before), change


def test_pages_past_a_sequences_length_are_not_checked(generator):
    """Only the pages a sequence uses must exist and be its own: the slots past its length may hold anything."""
    k_cache, v_cache = (torch.randn(4, 8, 2, 8, generator=generator) for _ in range(2))
    q = torch.randn(2, 1, 4, 8, generator=generator)
    table = torch.tensor([[0, 3], [1, 3]], dtype=torch.int32)  # slot 1 shared, but neither sequence reaches it
    fa_lab.attention_with_kvcache(q, k_cache, v_cache, torch.tensor([8, 5], dtype=torch.int32), block_table=table)
    with pytest.raises(ValueError, match="page 3"):
        fa_lab.attention_with_kvcache(q, k_cache, v_cache, torch.tensor([9, 9], dtype=torch.int32),
                                      block_table=table)


@pytest.mark.parametrize("page_size", [None, 4])
def test_unchecked_triton_decode_reads_nothing_back_and_matches_the_checked_call(page_size, generator, monkeypatch):
    """check_values=False: the same result, and no value copied to the host (what a CUDA graph needs)."""
    k_cache, v_cache, table = make_cache(generator, 2, 16, 2, 16, torch.float16, page_size)
    q = torch.randn(2, 1, 4, 16, generator=generator).half()
    k_new, v_new = (torch.randn(2, 2, 2, 16, generator=generator).half() for _ in range(2))
    seqlens = torch.tensor([5, 13], dtype=torch.int32)
    args = dict(block_table=table, impl="triton", return_lse=True, num_splits=2)
    k_checked, v_checked = k_cache.clone(), v_cache.clone()
    want = fa_lab.attention_with_kvcache(q, k_checked, v_checked, seqlens, k_new, v_new, **args)

    def no_read_back(*_args, **_kwargs):
        raise AssertionError("a value was read back from the device")
    for name in ("tolist", "item", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, no_read_back)
    got = fa_lab.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new, check_values=False, **args)
    monkeypatch.undo()
    assert torch.equal(k_cache, k_checked) and torch.equal(v_cache, v_checked)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("splits", [2, 5, 128])
def test_the_merge_kernel_computes_online_softmaxs_merge(splits, generator):
    """The decode kernel's merge of its splits is the jit copy of online_softmax.merge_splits: splits that
    saw no key weigh 0, a row that no split saw gives zeros and lse = -inf, and the output moves the
    query axis before the heads."""
    from fa_lab.kernels import load_triton
    from fa_lab.online_softmax import merge_splits

    load_triton()
    from fa_lab.kernels.portable.decode import merge_split_results

    batch, heads, seqlen_q, head_dim = 2, 3, 2, 24
    out = torch.randn(splits, batch, heads, seqlen_q, head_dim, generator=generator)
    lse = 4 * torch.randn(splits, batch, heads, seqlen_q, generator=generator)
    lse[1, 0, 1] = float("-inf")  # a split that saw no key
    lse[:, 1, 2, 0] = float("-inf")  # a row that no split saw
    merged, merged_lse = merge_split_results(out, lse, torch.float32)
    want, want_lse = merge_splits(out, lse)
    assert torch.equal(merged[1, 0, 2], torch.zeros(head_dim)) and merged_lse[1, 2, 0] == float("-inf")
    torch.testing.assert_close(merged, want.transpose(1, 2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged_lse, want_lse, rtol=1e-5, atol=1e-6)


# What a launch on torch's allocations with head_dim 128 finds divisible by 16.
ALIGNED_DECODE_ARGS = ("q_ptr", "k_ptr", "v_ptr", "stride_qb", "stride_qs", "stride_qh", "stride_row", "stride_head")


def decode_split_signature(out: str) -> dict:
    """decode_split_kernel's argument types for an offline build on bf16 operands, ``out`` the type of out_ptr
    ("*fp32" for partial results, "*bf16" for a FINAL output)."""
    return {**{name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr")},
            **{name: "*i32" for name in ("table_ptr", "lengths_ptr")}, "out_ptr": out, "lse_ptr": "*fp32",
            **{name: "i32" for name in ("stride_qb", "stride_qs", "stride_qh", "stride_row", "stride_head", "heads",
                                        "group", "seqlen_q", "page_size", "max_pages", "head_dim", "left", "right")},
            **{name: "fp32" for name in ("qk_scale", "softcap_scale", "softcap_log2")}}


@pytest.mark.parametrize("gather, ahead", [(0, 0), (1, 0), (1, 8), (2, 0)])
def test_decode_kernels_build_for_sm90_as_programmatic_dependent_launches(gather, ahead):
    """The split kernel's key loop is pipelined (its K and V tiles arrive by asynchronous copies, cp.async)
    for every gather mode, and with a dense cache or a split's pages read ahead it keeps two tiles' copies
    in flight while it computes (cp.async.wait_group 2), where a block-table load inside the loop drains
    them (the dense build writes its output as one split's final result, FINAL); with PDL it lets the
    merge launch early (griddepcontrol.launch_dependents) and the merge waits for the splits' results
    (griddepcontrol.wait) before it reads them; neither spills."""
    import re

    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90

    load_triton()
    from fa_lab.kernels.portable.decode import DECODE_CUDA, decode_split_kernel, merge_splits_kernel

    split_signature = decode_split_signature("*bf16" if gather == 0 else "*fp32")
    merge_signature = {"out_ptr": "*fp32", "lse_ptr": "*fp32", "merged_ptr": "*bf16", "merged_lse_ptr": "*fp32",
                       **{name: "i32" for name in ("splits", "heads", "seqlen_q", "head_dim")}}
    split, merge = compile_all_for_sm90([
        dict(kernel=decode_split_kernel, signature=split_signature, num_warps=DECODE_CUDA.num_warps,
             num_stages=DECODE_CUDA.num_stages, aligned=ALIGNED_DECODE_ARGS,
             constants=dict(BLOCK_M=16, BLOCK_N=DECODE_CUDA.block_n, HEAD_DIM=128, CAUSAL=True, WINDOW=False,
                            SOFTCAP=False, GATHER=gather, EVEN_D=True, PAGES_AHEAD=ahead, PDL=True,
                            FINAL=gather == 0)),
        dict(kernel=merge_splits_kernel, signature=merge_signature,
             constants=dict(SPLITS=32, SPLIT_CHUNK=16, HEAD_DIM=128, PDL=True))])
    assert "cp.async.cg.shared.global" in split.ptx  # 16-byte asynchronous copies
    waits = set(re.findall(r"cp\.async\.wait_group\s+(\d+);", split.ptx))
    assert waits == ({"0", "2"} if gather == 0 or ahead else {"0"})
    assert "griddepcontrol.launch_dependents" in split.ptx and "griddepcontrol.wait" not in split.ptx
    assert "griddepcontrol.wait" in merge.ptx
    assert split.local_bytes == 0 and merge.local_bytes == 0


def test_the_decode_configs_programs_per_sm_are_what_their_sm90_builds_fit():
    """DecodeConfig.per_sm, which decides what a wave is for decode_config and pages_ahead, is what the offline
    sm_90 build's shared memory lets an SM hold (bf16, head_dim 128, a dense cache)."""
    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.sm90_offline import compile_all_for_sm90, ctas_per_sm

    load_triton()
    from fa_lab.kernels.portable.decode import DECODE_CUDA, SHORT_SPLIT, SMALL_TILE, decode_split_kernel

    signature = decode_split_signature("*bf16")
    configs = (DECODE_CUDA, SMALL_TILE, SHORT_SPLIT)
    builds = compile_all_for_sm90([
        dict(kernel=decode_split_kernel, signature=signature, num_warps=config.num_warps,
             num_stages=config.num_stages, aligned=ALIGNED_DECODE_ARGS,
             constants=dict(BLOCK_M=16, BLOCK_N=config.block_n, HEAD_DIM=128, CAUSAL=True, WINDOW=False,
                            SOFTCAP=False, GATHER=0, EVEN_D=True, PAGES_AHEAD=0, PDL=False, FINAL=True))
        for config in configs])
    assert [ctas_per_sm(build.shared_bytes) for build in builds] == [config.per_sm for config in configs] == [1, 3, 2]


def test_split_ranges_cover_the_keys_in_whole_blocks():
    for length in (1, 127, 128, 129, 1000, 5000):
        for splits in (1, 2, 3, 7, 64):
            ranges = split_ranges(length, splits, block=128)
            assert ranges[0][0] == 0 and ranges[-1][1] == length and len(ranges) <= splits
            assert all(a < b for a, b in ranges) and all(r1[1] == r2[0] for r1, r2 in zip(ranges, ranges[1:]))
            assert all(a % 128 == 0 for a, _ in ranges)


def test_the_split_heuristic_fills_the_waves():
    assert choose_num_splits(32, 8, 65536) == 1  # 256 programs: more than a wave already
    assert choose_num_splits(1, 8, 100) == 1  # one key block: nothing to split
    for batch, seqlen in ((1, 16384), (1, 65536), (8, 16384), (4, 65536)):
        splits = choose_num_splits(batch, 8, seqlen)
        programs = batch * 8 * splits
        waves = -(-programs // 132)
        assert splits <= -(-seqlen // 128) and programs / (waves * 132) >= 0.85 * max(
            batch * 8 * s / (-(-batch * 8 * s // 132) * 132) for s in range(1, min(128, -(-seqlen // 128)) + 1))
    assert choose_num_splits(1, 8, 65536) > 8  # batch 1: the splits are the whole story
    assert choose_num_splits(1, 8, 65536, row_tiles=16) == 1  # chunked prefill: the row tiles fill the GPU


def test_a_dense_split_count_shortens_the_critical_path():
    """The counts the forced sweep of the H200 found fastest (batch 1: 16 splits from 4K to 64K, where the
    waves alone give 14 or 15; batch 8: 2), and the rule's own terms: no count has fewer waves x (blocks of
    the longest split + fixed cost), and on a tie the fewer splits win."""
    from fa_lab.kvcache import PROGRAM_OVERHEAD_BLOCKS, SPLIT_BLOCK, wave_splits

    for seqlen in (4096, 16384, 65536):
        assert choose_num_splits(1, 8, seqlen) == 16
        assert choose_num_splits(8, 8, seqlen) == 2
    assert wave_splits(8, 4096) == 14  # 14 splits of 32 blocks: the longest has 3
    assert choose_num_splits(1, 8, 3 * SPLIT_BLOCK) == 3
    for batch, seqlen in ((1, 1000), (2, 65536), (3, 4096), (3, 65536), (4, 16384), (12, 8192)):
        programs, blocks = batch * 8, -(-seqlen // SPLIT_BLOCK)

        def cost(s, programs=programs, blocks=blocks):
            return -(-programs * s // 132) * (-(-blocks // s) + PROGRAM_OVERHEAD_BLOCKS)
        chosen = choose_num_splits(batch, 8, seqlen)
        assert all(cost(chosen) < cost(s) for s in range(1, chosen))
        assert all(cost(chosen) <= cost(s) for s in range(chosen, min(128, blocks) + 1))


def test_paged_caches_read_ahead_take_the_dense_count_and_the_rest_two_waves():
    from fa_lab.kvcache import MAX_PAGES_AHEAD, split_page_span

    # Pages of whole key tiles whose split touches at most MAX_PAGES_AHEAD pages: the dense count.
    for batch, seqlen, page_size in ((1, 4096, 256), (1, 65536, 256), (8, 4096, 256), (32, 16384, 256)):
        assert choose_num_splits(batch, 8, seqlen, page_size=page_size) == choose_num_splits(batch, 8, seqlen)
    # ... cut in two where that count leaves a split more than PAGED_SPLIT_KEYS keys (8 x 16K: 2 splits of 8K).
    assert choose_num_splits(8, 8, 16384) == 2 and choose_num_splits(8, 8, 16384, page_size=256) == 4
    assert choose_num_splits(1, 8, 65536) == 16 == choose_num_splits(1, 8, 65536, page_size=512)  # 4K keys each
    assert split_page_span(16384, 256, 2) == 64  # 8192 keys: 32 pages, one more if unaligned
    assert split_page_span(65536, 256, 2) == 256 == MAX_PAGES_AHEAD  # 8 x 64K: as many as one split may read ahead
    assert choose_num_splits(8, 8, 65536, page_size=256) == 4  # 2 splits fit, but of 32K keys each
    assert split_page_span(65536, 128, 2) == 512  # pages of 128 there: too many for one split's registers
    assert choose_num_splits(8, 8, 65536, page_size=128) == 4  # so two waves: 64 programs x 4
    assert choose_num_splits(8, 8, 4096, page_size=64) == 4  # pages of 64: 64-key tiles, 33 pages read ahead
    # Pages of 64 too many to read ahead: the fewest splits (a power of two) with 3 programs per SM of 132.
    assert choose_num_splits(32, 8, 16384, page_size=64) == 2  # 256 programs: one wave of 128-key tiles before
    assert choose_num_splits(32, 8, 65536, page_size=64) == 2
    assert choose_num_splits(8, 8, 65536, page_size=64) == 8  # 64 programs, 4 splits: 257 pages to a split
    assert choose_num_splits(8, 8, 16384, page_size=64) == 4  # 65 pages ahead at two waves' 4 splits: unchanged
    assert choose_num_splits(1, 8, 65536, page_size=16) == 32  # pages of 16: 33 for two waves, down to a power of 2
    assert choose_num_splits(1, 8, 4096, page_size=16) == 32
    assert choose_num_splits(32, 8, 65536, page_size=256) == 1  # already more than a wave


def test_the_decode_config_follows_the_waves_and_the_pages():
    """decode_config's rule on the H200's grid (32 query heads, 8 KV heads, one query): TMA_DENSE for a dense
    cache in one split where the GPU has TMA; 64-key tiles where
    128-key ones would leave more programs than SMs for a second wave on short splits (batch 32 x 4K, dense
    or pages of whole 64-key tiles read ahead), and for pages of 64 keys that fit in the registers ahead;
    128-key tiles past 4K keys per split, for pages of 16, and for pages too many to read ahead; pages read
    ahead only while a call's programs fit in one wave; pages of 64 keys always on 64-key tiles."""
    from fa_lab.kernels.portable.decode import (
        DECODE_CUDA,
        SHORT_SPLIT,
        SMALL_TILE,
        TMA_DENSE,
        decode_config,
        pages_ahead,
    )
    from fa_lab.kvcache import check_kvcache

    def layout_of(batch, seqlen, page_size=None):
        q = torch.empty(batch, 1, 32, 128, dtype=torch.bfloat16)
        if page_size is None:
            cache, table = torch.empty(batch, seqlen, 8, 128, dtype=torch.bfloat16), None
        else:
            cache = torch.empty(batch * seqlen // page_size, page_size, 8, 128, dtype=torch.bfloat16)
            table = torch.zeros(batch, seqlen // page_size, dtype=torch.int32)
        lengths = torch.full((batch,), seqlen, dtype=torch.int32)
        return check_kvcache(q, cache, cache, lengths, block_table=table)

    def config(batch, seqlen, page_size=None):
        return decode_config(layout_of(batch, seqlen, page_size), choose_num_splits(batch, 8, seqlen,
                                                                                  page_size=page_size))

    assert config(32, 4096) == config(32, 4096, 256) == config(32, 4096, 64) == SMALL_TILE  # 256 programs
    # Where TMA is there, a dense cache in one split reads through it; other calls keep their configs.
    for batch, seqlen, page_size in ((32, 4096, None), (32, 65536, None), (8, 4096, None), (32, 4096, 256)):
        layout, splits = layout_of(batch, seqlen, page_size), choose_num_splits(batch, 8, seqlen, page_size=page_size)
        with_tma = decode_config(layout, splits, tma=True)
        assert with_tma == (TMA_DENSE if page_size is None and splits == 1 else decode_config(layout, splits))
    assert config(32, 16384) == config(32, 16384, 256) == config(32, 65536) == DECODE_CUDA  # long splits
    # Pages of 64 keys: 64-key tiles, each tile's entry read in the loop where a split has more than 256 pages.
    assert config(32, 16384, 64) == config(32, 65536, 64) == config(8, 65536, 64) == SMALL_TILE
    assert pages_ahead(layout_of(32, 16384, 64), 2, SMALL_TILE) == 0  # 512 programs: past one wave of three
    assert config(8, 4096) == config(8, 16384) == config(8, 4096, 256) == DECODE_CUDA  # 2 splits x 64: one wave
    assert config(8, 16384, 256) == SMALL_TILE  # 4 splits of 4K keys (PAGED_SPLIT_KEYS): two waves of 128-key tiles
    assert config(8, 4096, 64) == config(8, 16384, 64) == config(1, 65536, 64) == SMALL_TILE  # pages of 64
    assert config(8, 4096, 16) == config(1, 65536, 16) == DECODE_CUDA  # pages of 16: keys gathered one by one
    assert config(1, 4096) == SHORT_SPLIT  # 16 splits of 256 keys
    # Pages are read ahead while the programs fit in one wave of the config (one per SM for DECODE_CUDA).
    assert pages_ahead(layout_of(8, 16384, 256), 2, DECODE_CUDA) == 64  # 128 programs, 33 pages to a split
    assert pages_ahead(layout_of(32, 16384, 256), 1, DECODE_CUDA) == 0  # 256 programs: two waves
    assert pages_ahead(layout_of(32, 16384, 256), 1, SMALL_TILE) == 128  # three fit on an SM


def test_the_split_counts_are_what_the_recorded_sweep_found_fastest():
    """Against benchmarks/h200_decode.json's forced sweep (dense and pages of 256): the measured count nearest
    the heuristic's (on a log scale) runs within 3% of the best measured count at every batch and length.
    Each count keeps its fastest timing: the forced sweep times every count once, and the headline row
    times the chosen count again in interleaved rounds (in the 2026-12-03 run, 32 x 4K's one split, the
    first row timed at that shape, read 3.79 TB/s in the sweep and 4.33 in the rounds)."""
    import math
    from pathlib import Path

    from fa_lab.bench import load_results
    from fa_lab.bench.decode import HEADS_KV

    rows = load_results(Path(fa_lab.__file__).resolve().parent.parent / "benchmarks" / "h200_decode.json")["rows"]
    shapes = {(r["batch"], r["seqlen_k"], r["page_size"]) for r in rows if r["impl"] == "triton_forced"}
    assert len(shapes) == 18
    for batch, seqlen, page_size in shapes:
        forced = {r["num_splits"]: r["fwd_ms"] for r in rows if r["impl"] == "triton_forced"
                  and (r["batch"], r["seqlen_k"], r["page_size"]) == (batch, seqlen, page_size)}
        chosen = choose_num_splits(batch, HEADS_KV, seqlen, page_size=page_size)
        for r in rows:
            if r["impl"] == "triton" and r["seqlen_q"] == 1 and r["num_splits"] in forced \
                    and (r["batch"], r["seqlen_k"], r["page_size"]) == (batch, seqlen, page_size):
                forced[r["num_splits"]] = min(forced[r["num_splits"]], r["fwd_ms"])
        nearest = min(forced, key=lambda s: abs(math.log(s / chosen)))
        assert forced[nearest] <= 1.03 * min(forced.values()), (batch, seqlen, page_size, chosen, forced)


@pytest.mark.parametrize("seqlen_q, softcap", [(1, 0.0), (3, 30.0)])
def test_the_tma_decode_path_reads_whole_tiles_and_masks_the_last_one(seqlen_q, softcap, generator):
    """A TMA config (tensor descriptors for a split's whole key tiles, masked loads for its partial last one),
    under the interpreter: ragged lengths (0, shorter than a tile, tile-aligned, one past), NaN in every cache row
    past a sequence's keys (which a tile read whole by TMA would carry into P V), grouped heads and the soft
    cap; the output and LSE equal the default path's and meet the tolerance rule against float64."""
    from fa_lab.kernels import load_triton
    from fa_lab.kvcache import check_kvcache

    load_triton()
    from fa_lab.kernels.portable.decode import DecodeConfig, triton_decode

    batch, capacity, heads, heads_kv, head_dim, block = 4, 64, 4, 2, 32, 16
    k_cache, v_cache, _ = make_cache(generator, batch, capacity, heads_kv, head_dim, torch.bfloat16)
    lengths = [0, 5, 32, 33]
    for b, n in enumerate(lengths):
        k_cache[b, n:] = float("nan")
        v_cache[b, n:] = float("nan")
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=generator).to(torch.bfloat16)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    layout = check_kvcache(q, k_cache, v_cache, seqlens)
    scale = head_dim ** -0.5
    args = (q, k_cache, v_cache, seqlens, None, layout, True, scale, (-1, -1), softcap, 1)
    out, lse = triton_decode(*args, config=DecodeConfig(block, 4, 2, tma=True))
    default = triton_decode(*args, config=DecodeConfig(block, 4, 2))
    assert torch.equal(out, default[0]) and torch.equal(lse, default[1])
    reference = expected(q, k_cache, v_cache, None, lengths, True, scale, (-1, -1), softcap, upcast=True)
    baseline = expected(q, k_cache, v_cache, None, lengths, True, scale, (-1, -1), softcap, upcast=False)
    for name, got, want, base, floor in (("out", out, reference[0], baseline[0], None),
                                         ("lse", lse, reference[1], baseline[1], LSE_FLOOR)):
        result = compare(name, got, want, base, torch.bfloat16, floor=floor)
        assert result.ok, str(result)
    with pytest.raises(ValueError, match="TMA decode config"):
        triton_decode(q, k_cache, v_cache, seqlens, None, layout, True, scale, (8, 0), softcap, 1,
                      config=DecodeConfig(block, 4, 2, tma=True))


def test_decode_without_keys_gives_zeros_and_minus_infinity(generator):
    k_cache, v_cache, _ = make_cache(generator, 2, 16, 1, 8, torch.float32)
    q = torch.randn(2, 2, 2, 8, generator=generator)
    out, lse = fa_lab.attention_with_kvcache(q, k_cache, v_cache, torch.tensor([0, 4], dtype=torch.int32),
                                             return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()
    info = BlockInfo(2, 4, True)
    assert info.key_end(0) == 3  # the first of two queries sees keys 0..2 of 4


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("seqlen_q, splits", [(1, 0), (1, 1), (7, 0), (1, 9), (256, 1)])  # 256: chunked prefill
def test_gpu_decode(page_size, seqlen_q, splits, generator):
    dtype, batch, capacity, heads, heads_kv, head_dim = torch.bfloat16, 4, 4096, 32, 8, 128
    k_cache, v_cache, table = make_cache(generator, batch, capacity, heads_kv, head_dim, dtype, page_size)
    k_cache, v_cache = k_cache.cuda(), v_cache.cuda()
    table = None if table is None else table.cuda()
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=generator).to("cuda", dtype)
    k_new, v_new = (torch.randn(batch, seqlen_q, heads_kv, head_dim, generator=generator).to("cuda", dtype)
                    for _ in range(2))
    cache_seqlens = [0, 1, 2000, capacity - seqlen_q]
    seqlens = torch.tensor(cache_seqlens, dtype=torch.int32, device="cuda")
    out, lse = fa_lab.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new, block_table=table,
                                             num_splits=splits, impl="triton", return_lse=True)
    lengths = [n + seqlen_q for n in cache_seqlens]
    cpu = [t.cpu() if t is not None else None for t in (q, k_cache, v_cache, table)]
    reference = expected(*cpu, lengths, True, None, (-1, -1), 0.0, upcast=True)
    baseline = expected(*cpu, lengths, True, None, (-1, -1), 0.0, upcast=False)
    for name, got, want, base, floor in (("out", out, reference[0], baseline[0], None),
                                         ("lse", lse, reference[1], baseline[1], LSE_FLOOR)):
        result = compare(name, got, want, base, dtype, floor=floor)
        assert result.ok, str(result)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64])
def test_gpu_refused_triton_call_writes_nothing_and_leaves_the_gpu_usable(page_size, generator):
    """The device-side check on CUDA: a sequence past its capacity, a page outside the pool and a page that two
    sequences share raise a ValueError naming it, the cache keeps its bytes, and the next call still runs (no
    kernel read out of bounds, which would have left the CUDA context unusable)."""
    dtype, batch, capacity, heads, heads_kv, head_dim = torch.bfloat16, 2, 256, 8, 2, 64
    k_cache, v_cache, table = make_cache(generator, batch, capacity, heads_kv, head_dim, dtype, page_size)
    k_cache, v_cache = k_cache.cuda(), v_cache.cuda()
    table = None if table is None else table.cuda()
    q = torch.randn(batch, 3, heads, head_dim, generator=generator).to("cuda", dtype)
    k_new, v_new = (torch.randn(batch, 3, heads_kv, head_dim, generator=generator).to("cuda", dtype) for _ in range(2))
    good = torch.tensor([10, 200], dtype=torch.int32, device="cuda")
    bad = [({"cache_seqlens": torch.tensor([10, capacity - 2], dtype=torch.int32, device="cuda")}, "sequence 1")]
    if page_size is not None:
        outside, shared = table.clone(), table.clone()
        outside[1, 0] = 10_000_000
        shared[1, 0] = table[0, 0]
        bad += [({"block_table": outside}, "not a page of the pool"), ({"block_table": shared}, "share")]
    for change, words in bad:
        k_before, v_before = k_cache.clone(), v_cache.clone()
        call = {"cache_seqlens": good, "block_table": table, **change}
        with pytest.raises(ValueError, match=words):
            fa_lab.attention_with_kvcache(q, k_cache, v_cache, k_new=k_new, v_new=v_new, impl="triton", **call)
        torch.cuda.synchronize()
        assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before), change
    out = fa_lab.attention_with_kvcache(q, k_cache, v_cache, good, k_new, v_new, block_table=table, impl="triton")
    assert torch.isfinite(out).all()


def test_a_call_the_kernels_refuse_leaves_the_cache_unwritten():
    lengths = torch.zeros(1, dtype=torch.int32)
    for dtype, splits, error, said in ((torch.float32, 0, TypeError, "float16 and bfloat16"),
                                       (torch.float16, 10 ** 12, ValueError, "num_splits")):
        k_cache, v_cache = torch.zeros(1, 8, 1, 16, dtype=dtype), torch.zeros(1, 8, 1, 16, dtype=dtype)
        new = torch.ones(1, 1, 1, 16, dtype=dtype)
        with pytest.raises(error, match=said):
            fa_lab.attention_with_kvcache(torch.randn(1, 1, 1, 16, dtype=dtype), k_cache, v_cache, lengths, k_new=new,
                                          v_new=new, num_splits=splits, impl="triton")
        assert not k_cache.any() and not v_cache.any()


def test_non_tensors_and_empty_dimensions_are_refused_by_name():
    q, lengths = torch.randn(1, 1, 8, 16), torch.zeros(1, dtype=torch.int32)
    k_cache = torch.zeros(1, 4, 8, 16)
    for change, error, said in (({"k_new": [[0.0]], "v_new": [[0.0]]}, TypeError, "k_new must be a torch.Tensor"),
                                ({"block_table": [[0, 1]]}, TypeError, "block_table must be a torch.Tensor"),
                                ({"k_cache": torch.zeros(1, 4, 0, 16), "v_cache": torch.zeros(1, 4, 0, 16)},
                                 ValueError, "must be >= 1")):
        args = {"k_cache": k_cache, "v_cache": k_cache.clone(), **change}
        with pytest.raises(error, match=said):
            fa_lab.attention_with_kvcache(q, cache_seqlens=lengths, **args)
