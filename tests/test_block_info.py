"""BlockInfo against brute force: every range and tile kind is read off a dense mask built here."""
from __future__ import annotations

import itertools

import pytest
import torch

from fa_lab.block_info import BlockInfo, band_visible, causal_visible, cdiv

SEQLENS = (1, 17, 64, 113, 128, 300)
BLOCKS = ((16, 16), (32, 64), (64, 32), (128, 128))


def dense_mask(seqlen_q: int, seqlen_k: int, causal: bool) -> torch.Tensor:
    """(Nq, Nk) bool from the definition, one pair at a time: query i sees key j <= i + Nk - Nq."""
    return torch.tensor([[not causal or j <= i + seqlen_k - seqlen_q for j in range(seqlen_k)]
                         for i in range(seqlen_q)], dtype=torch.bool).reshape(seqlen_q, seqlen_k)


def check_tile(info: BlockInfo, dense: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> None:
    """The tile [q0, q1) x [k0, k1): BlockInfo's mask of it is the dense one, and its kind follows from it."""
    tile = dense[q0:q1, k0:k1]
    assert torch.equal(info.mask(q0, q1, k0, k1), tile)
    expected = "full" if bool(tile.all()) else "skipped" if not bool(tile.any()) else "masked"
    assert info.tile_kind(q0, q1, k0, k1) == expected, (q0, q1, k0, k1)


def shapes():
    return [(nq, nk, causal) for nq, nk in itertools.product(SEQLENS, SEQLENS) for causal in (False, True)]


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal", shapes())
def test_rows_and_the_whole_mask(seqlen_q, seqlen_k, causal):
    info, dense = BlockInfo(seqlen_q, seqlen_k, causal), dense_mask(seqlen_q, seqlen_k, causal)
    assert torch.equal(info.mask(), dense)
    seen = dense.sum(1)
    ends = torch.tensor([info.key_end(i) for i in range(seqlen_q)])
    assert torch.equal(ends, seen)  # the visible keys of a row are [0, key_end): a prefix
    assert torch.equal(info.key_end(torch.arange(seqlen_q)), seen)
    assert info.visible_pairs() == int(dense.sum())
    for key in range(seqlen_k):
        rows = dense[:, key].nonzero()
        assert info.first_query(key) == (int(rows[0]) if len(rows) else seqlen_q)


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal", shapes())
def test_tiles(seqlen_q, seqlen_k, causal):
    info, dense = BlockInfo(seqlen_q, seqlen_k, causal), dense_mask(seqlen_q, seqlen_k, causal)
    for block_m, block_n in BLOCKS:
        for q0, k0 in itertools.product(range(0, seqlen_q, block_m), range(0, seqlen_k, block_n)):
            q1, k1 = q0 + block_m, k0 + block_n
            check_tile(info, dense, q0, q1, k0, k1)
            rows = dense[q0:q1]
            any_seen = rows.any(0).nonzero()
            end = int(any_seen[-1]) + 1 if len(any_seen) else 0
            assert info.key_range(q0, q1) == (0, end)


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal", shapes())
def test_kernel_loop_bounds_visit_every_visible_key_and_mask_only_where_needed(seqlen_q, seqlen_k, causal):
    """key_blocks / query_blocks as the kernels loop: whole tiles of block_n keys (block_m rows), padding
    past the sequence counted as keys (rows) that must be masked (that carry zero probability)."""
    info, dense = BlockInfo(seqlen_q, seqlen_k, causal), dense_mask(seqlen_q, seqlen_k, causal)
    for block_m, block_n in BLOCKS:
        padded = torch.zeros(-(-seqlen_q // block_m) * block_m, -(-seqlen_k // block_n) * block_n + block_n,
                             dtype=torch.bool)
        padded[:seqlen_q, :seqlen_k] = dense
        for start_m in range(0, seqlen_q, block_m):
            full_end, end = info.key_blocks(start_m, block_m, block_n)
            rows = padded[start_m:min(start_m + block_m, seqlen_q)]  # the real rows of the tile
            seen = rows.any(0).nonzero()
            assert end == (int(seen[-1]) + 1 if len(seen) else 0)  # nothing visible is skipped
            assert full_end % block_n == 0 and full_end <= max(end, 0)
            assert bool(rows[:, :full_end].all())  # the unmasked tiles really need no mask
            if full_end + block_n <= end:  # the next tile is whole and inside: it does need the mask
                assert not bool(rows[:, full_end:full_end + block_n].all())
        for start_n in range(0, seqlen_k, block_n):
            begin, full_begin, end = info.query_blocks(start_n, block_n, block_m)
            assert end == padded.shape[0] and begin % block_m == 0 and full_begin % block_m == 0
            cols = padded[:, start_n:start_n + block_n]
            assert not bool(cols[:begin].any())  # the skipped query tiles see none of these keys
            if causal:  # past full_begin every real row sees every key of the tile, padding included
                last_key = start_n + block_n - 1
                assert all(causal_visible(i, last_key, info.offset) for i in range(full_begin, seqlen_q))
            else:
                assert (begin, full_begin) == (0, 0)


def test_causal_visible_takes_any_offset():
    rows, cols = torch.arange(4)[:, None], torch.arange(6)[None, :]
    assert torch.equal(causal_visible(rows, cols, 2), dense_mask(4, 6, True))
    assert torch.equal(causal_visible(rows, cols, 0), torch.ones(4, 6, dtype=torch.bool).tril())


def test_band_visible_is_the_window_mask_at_any_offset_and_sides():
    """band_visible with a BlockInfo's offset and sides is its mask; other sides (a graders' mistake, -1 taken
    literally) are the literal band."""
    rows, cols = torch.arange(5)[:, None], torch.arange(9)[None, :]
    for window in [(-1, -1), (2, -1), (-1, 1), (1, 3), (0, 0)]:
        info = BlockInfo(5, 9, False, window)
        assert torch.equal(band_visible(rows, cols, info.offset, info.left, info.right), info.mask())
    literal = (cols >= rows + 4 + 1) & (cols <= rows + 4 + 2)
    assert torch.equal(band_visible(rows, cols, 4, -1, 2), literal)


@pytest.mark.parametrize("bad", [{"seqlen_q": -1}, {"seqlen_k": 2.0}, {"seqlen_q": True}, {"causal": 1}])
def test_bad_arguments_say_what_they_got(bad):
    args = {"seqlen_q": 4, "seqlen_k": 4, "causal": False, **bad}
    (name, value), = bad.items()
    with pytest.raises((ValueError, TypeError), match=name):
        BlockInfo(**args)


def test_a_tile_mask_costs_the_tile_only():
    info = BlockInfo(1 << 20, 1 << 20, causal=True)
    tile = info.mask(5000, 5128, 4992, 5120)
    assert tile.shape == (128, 128) and bool(tile[0, 8]) and not bool(tile[0, 9])


WINDOWS = ((0, 0), (3, -1), (-1, 5), (7, 2), (40, 0), (1000, 1000))


def dense_window_mask(seqlen_q: int, seqlen_k: int, causal: bool, window) -> torch.Tensor:
    """(Nq, Nk) bool from flash-attn's definition of window_size, one pair at a time."""
    left, right = window
    offset = seqlen_k - seqlen_q
    return torch.tensor([[(not causal or j <= i + offset) and (left < 0 or j >= i + offset - left)
                          and (right < 0 or j <= i + offset + right) for j in range(seqlen_k)]
                         for i in range(seqlen_q)], dtype=torch.bool).reshape(seqlen_q, seqlen_k)


def window_shapes():
    lengths = (1, 17, 64, 113)
    return [(nq, nk, causal, window) for nq, nk in itertools.product(lengths, lengths)
            for causal in (False, True) for window in WINDOWS]


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal,window", window_shapes())
def test_windows_rows_ranges_and_tiles(seqlen_q, seqlen_k, causal, window):
    info = BlockInfo(seqlen_q, seqlen_k, causal, window)
    dense = dense_window_mask(seqlen_q, seqlen_k, causal, window)
    assert torch.equal(info.mask(), dense)
    assert info.visible_pairs() == int(dense.sum())
    rows = torch.arange(seqlen_q)
    starts, ends = info.key_start(rows), info.key_end(rows)
    for i in range(seqlen_q):
        seen = dense[i].nonzero().flatten()
        assert (info.key_start(i), info.key_end(i)) == (int(starts[i]), int(ends[i]))
        if len(seen):  # one contiguous range [key_start, key_end)
            assert (int(starts[i]), int(ends[i])) == (int(seen[0]), int(seen[-1]) + 1)
        else:
            assert starts[i] >= ends[i]
    for key in range(seqlen_k):
        seen_by = dense[:, key].nonzero()
        assert info.first_query(key) == (int(seen_by[0]) if len(seen_by) else seqlen_q)
    for block_m, block_n in ((16, 16), (32, 64)):
        for q0, k0 in itertools.product(range(0, seqlen_q, block_m), range(0, seqlen_k, block_n)):
            q1, k1 = q0 + block_m, k0 + block_n
            check_tile(info, dense, q0, q1, k0, k1)
            union = dense[q0:q1].any(0).nonzero().flatten()
            start, end = info.key_range(q0, q1)
            if len(union):
                assert (start, end) == (int(union[0]), int(union[-1]) + 1)
            else:
                assert start >= end


def test_a_window_is_checked_and_causal_means_right_zero():
    assert BlockInfo(8, 8, True, (2, 5)).right == 0 and BlockInfo(8, 8, True).left is None
    assert not BlockInfo(8, 8).masked and BlockInfo(8, 8, False, (-1, 3)).masked
    for bad, error in (((-2, 0), ValueError), ((0,), TypeError), ((1.5, 0), TypeError), (3, TypeError),
                       ((True, 0), TypeError)):
        with pytest.raises(error, match="window"):
            BlockInfo(8, 8, False, bad)
    with pytest.raises(NotImplementedError, match="left bound"):
        BlockInfo(8, 8, True, (4, 0)).key_blocks(0, 4, 4)


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal,window", window_shapes())
def test_windowed_loop_bounds_visit_every_visible_key_and_mask_only_where_needed(seqlen_q, seqlen_k, causal,
                                                                                window):
    """key_tiles / query_tiles as the windowed kernels loop (whole tiles; keys past seqlen_k follow the
    window rule, since the dK/dV kernel drops their results, and rows past seqlen_q carry zero P)."""
    info = BlockInfo(seqlen_q, seqlen_k, causal, window)
    left, right = info.window_bounds()
    for block_m, block_n in ((16, 16), (32, 64), (64, 32)):
        rows_pad, keys_pad = cdiv(seqlen_q, block_m) * block_m, cdiv(seqlen_k, block_n) * block_n
        rows, keys = torch.arange(rows_pad)[:, None], torch.arange(keys_pad)[None, :]
        band = (keys >= rows + info.offset - left) & (keys <= rows + info.offset + right)  # no seqlen bounds
        real = (rows < seqlen_q) & (keys < seqlen_k)
        for start_m in range(0, seqlen_q, block_m):
            begin, full_begin, full_end, end = info.key_tiles(start_m, block_m, block_n)
            assert begin % block_n == 0 and full_begin % block_n == 0 and full_end % block_n == 0
            assert begin <= full_begin <= full_end and (full_begin == full_end or full_end <= min(end, seqlen_k))
            tile = (band & real)[start_m:start_m + block_m]
            seen = tile.any(0).nonzero().flatten()
            if len(seen):
                assert begin <= int(seen[0]) and end == int(seen[-1]) + 1  # nothing visible is skipped
            else:
                assert full_begin == full_end and begin >= end or end == 0
            real_rows = tile[:min(block_m, seqlen_q - start_m)]
            assert bool(real_rows[:, full_begin:full_end].all())  # the unmasked tiles really need no mask
        for start_n in range(0, seqlen_k, block_n):
            begin, full_begin, full_end, end = info.query_tiles(start_n, block_n, block_m)
            assert all(x % block_m == 0 for x in (begin, full_begin, full_end, end))
            assert begin <= full_begin <= full_end <= end <= rows_pad
            cols = (band & (rows < seqlen_q))[:, start_n:start_n + block_n]
            real_cols = cols[:, :max(min(block_n, seqlen_k - start_n), 0)]
            assert not bool(real_cols[:begin].any()) and not bool(real_cols[end:].any())  # skipped tiles see none
            assert bool(cols[full_begin:min(full_end, seqlen_q)].all())  # full tiles: every key, padding too


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal,window", window_shapes())
def test_split_key_loops_test_one_bound_on_each_edge(seqlen_q, seqlen_k, causal, window):
    """key_tile_edges, the three loops of the Gluon forward's split_loops: every key of a tile before full_begin
    (the kernel's whole tile, keys past seqlen_k included) lies below each real row's key_end, so the lower bound
    alone masks it; every key of a tile from full_end on lies at or after each row's key_start. None (one loop
    testing both) exactly when the query tile has no full key tile."""
    info = BlockInfo(seqlen_q, seqlen_k, causal, window)
    for block_m, block_n in ((16, 16), (32, 64), (64, 32)):
        for start_m in range(0, seqlen_q, block_m):
            tiles = info.key_tile_edges(start_m, block_m, block_n)
            plain = info.key_tiles(start_m, block_m, block_n)
            assert (tiles is None) == (plain.full_end <= plain.full_begin)
            if tiles is None:
                continue
            assert tiles == plain
            rows = range(start_m, min(start_m + block_m, seqlen_q))
            assert all(tiles.full_begin <= info.key_end(row) for row in rows)  # lower-edge tiles: below every end
            assert all(info.key_start(row) <= tiles.full_end for row in rows)  # upper-edge tiles: past every start


def test_windowed_bounds_without_a_window_are_the_plain_ones():
    for seqlen_q, seqlen_k, causal in shapes():
        info = BlockInfo(seqlen_q, seqlen_k, causal)
        for block_m, block_n in BLOCKS:
            for start_m in range(0, seqlen_q, block_m):
                tiles, plain = info.key_tiles(start_m, block_m, block_n), info.key_blocks(start_m, block_m, block_n)
                assert (tiles.full_end, tiles.end) == tuple(plain) and tiles.begin == tiles.full_begin == 0
