"""The kernels' jit copies of the block ranges against fa_lab.block_info.BlockInfo, tile by tile.

Plain Triton (fa_lab.kernels.portable.block_range): probe kernels call key_range and query_range
for every tile of many shapes, the windowed ranges, the selected-blocks kernels' row_key_end and the
decode kernel's split_key_range, in the interpreter on a CPU and compiled on a GPU. Gluon
(fa_lab.kernels.hopper.block_range): probe kernels call tile_plan and visible_key_end, and the
window's window_tile_plan, visible_key_start, window_key_end and (the backward's) window_query_plan; they
are compiled for sm_90 here and run on the GPU by the `gpu` tests.
"""
import itertools

import pytest
import torch

from fa_lab.block_info import BlockInfo
from fa_lab.kernels.common import cdiv
from fa_lab.kvcache import split_ranges

triton = pytest.importorskip("triton")  # (after fa_lab, which switches the interpreter on without a GPU)
tl = triton.language
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from fa_lab.kernels.hopper.block_range import (  # noqa: E402
    tile_plan,
    visible_key_end,
    visible_key_start,
    window_key_end,
    window_query_plan,
    window_tile_plan,
)
from fa_lab.kernels.portable.block_range import (  # noqa: E402
    key_range,
    query_range,
    row_key_end,
    split_key_range,
    window_key_range,
    window_query_range,
)

SEQLENS = (1, 17, 113, 128, 1023)
SHAPES = list(itertools.product(SEQLENS, SEQLENS))  # (seqlen_q, seqlen_k): Nq > Nk, Nq < Nk and equal
BLOCKS = [(16, 16), (32, 64), (64, 32), (128, 128), (16, 128)]  # (block_m, block_n)
GLUON_BLOCKS = [(128, 128), (192, 128), (64, 32)]  # the FA3 kernel's tiles (2 or 3 consumers), and a small one
MAX_TILES = 64  # cdiv(1023, 16)
MAX_ROWS = 2048  # every row of every Gluon work tile of the shapes above (6 tiles of 192 rows)


def seqlen_tensors(device):
    """(seqlen_q, seqlen_k): (len(SHAPES),) int32 each, the probes' one case per program."""
    return tuple(torch.tensor(column, dtype=torch.int32, device=device) for column in zip(*SHAPES))


# ---------------------------------------------------------------- plain Triton

@triton.jit
def _portable_block_range_probe(seqlen_q_ptr, seqlen_k_ptr, keys_ptr, queries_ptr, MAX_TILES: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """For case program_id(0): key_range of Q tile t at keys[case, :, t], query_range of K tile t at
    queries[case, :, t]; keys: (cases, 2, MAX_TILES), queries: (cases, 3, MAX_TILES) int32."""
    case = tl.program_id(0)
    seqlen_q = tl.load(seqlen_q_ptr + case)
    seqlen_k = tl.load(seqlen_k_ptr + case)
    tiles = tl.arange(0, MAX_TILES)
    zero = tiles * 0  # (broadcasts the non-causal ranges, which are scalars)
    full_end, end = key_range(tiles * BLOCK_M, seqlen_q, seqlen_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
    keys = keys_ptr + case * 2 * MAX_TILES + tiles
    tl.store(keys, full_end + zero)
    tl.store(keys + MAX_TILES, end + zero)
    begin, full_begin, rows_end = query_range(tiles * BLOCK_N, seqlen_q, seqlen_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                              CAUSAL=CAUSAL)
    queries = queries_ptr + case * 3 * MAX_TILES + tiles
    tl.store(queries, begin + zero)
    tl.store(queries + MAX_TILES, full_begin + zero)
    tl.store(queries + 2 * MAX_TILES, rows_end + zero)


@pytest.mark.parametrize("block_m, block_n", BLOCKS)
@pytest.mark.parametrize("causal", [False, True])
def test_portable_block_ranges_are_block_info(block_m, block_n, causal):
    """key_range is BlockInfo.key_blocks and query_range BlockInfo.query_blocks on every tile.

    One exception, by design: a causal Q tile whose rows see no key (Nq > Nk, the top tiles) gets
    negative bounds from key_range where BlockInfo says (0, 0). The kernels' loops over [0, full_end)
    and [full_end, end) are empty either way (checked here), and the clamp would cost every program.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seqlen_q, seqlen_k = seqlen_tensors(device)
    keys = torch.empty(len(SHAPES), 2, MAX_TILES, dtype=torch.int32, device=device)
    queries = torch.empty(len(SHAPES), 3, MAX_TILES, dtype=torch.int32, device=device)
    _portable_block_range_probe[(len(SHAPES),)](seqlen_q, seqlen_k, keys, queries, MAX_TILES=MAX_TILES,
                                                 BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal)
    keys, queries = keys.cpu().tolist(), queries.cpu().tolist()
    for case, (n_q, n_k) in enumerate(SHAPES):
        info = BlockInfo(n_q, n_k, causal)
        for tile in range(cdiv(n_q, block_m)):
            full_end, end = keys[case][0][tile], keys[case][1][tile]
            expected = info.key_blocks(tile * block_m, block_m, block_n)
            if expected.end == 0 and end < 0:  # rows that see no key: both loops empty
                assert causal and full_end <= 0 and end <= full_end, (n_q, n_k, tile, full_end, end)
            else:
                assert (full_end, end) == expected, (n_q, n_k, tile)
        for tile in range(cdiv(n_k, block_n)):
            got = tuple(queries[case][i][tile] for i in range(3))
            assert got == info.query_blocks(tile * block_n, block_n, block_m), (n_q, n_k, tile)


WINDOWS = [(0, 0), (5, -1), (-1, 3), (37, 2), (200, 0), (-1, -1)]
WINDOW_SHAPES = list(itertools.product((1, 17, 113, 300), (1, 17, 113, 300)))


@triton.jit
def _window_range_probe(seqlen_q_ptr, seqlen_k_ptr, left_ptr, right_ptr, keys_ptr, queries_ptr,
                        MAX_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For case program_id(0): window_key_range of Q tile t at keys[case, :, t] and window_query_range of
    K tile t at queries[case, :, t]; keys, queries: (cases, 4, MAX_TILES) int32."""
    case = tl.program_id(0)
    seqlen_q, seqlen_k = tl.load(seqlen_q_ptr + case), tl.load(seqlen_k_ptr + case)
    left, right = tl.load(left_ptr + case), tl.load(right_ptr + case)
    tiles = tl.arange(0, MAX_TILES)
    ranges = (window_key_range(tiles * BLOCK_M, seqlen_q, seqlen_k, left, right, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N),
              window_query_range(tiles * BLOCK_N, seqlen_q, seqlen_k, left, right, BLOCK_M=BLOCK_M,
                                 BLOCK_N=BLOCK_N))
    keys = keys_ptr + case * 4 * MAX_TILES + tiles
    queries = queries_ptr + case * 4 * MAX_TILES + tiles
    for i in tl.static_range(4):
        tl.store(keys + i * MAX_TILES, ranges[0][i])
        tl.store(queries + i * MAX_TILES, ranges[1][i])


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 64), (64, 32)])
def test_portable_window_ranges_are_block_info(block_m, block_n):
    """window_key_range is BlockInfo.key_tiles and window_query_range BlockInfo.query_tiles on every tile,
    over windows with one, two or no bounded side and causal folded in as right = 0."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [(n_q, n_k, causal, window) for n_q, n_k in WINDOW_SHAPES for causal in (False, True)
             for window in WINDOWS]
    infos = [BlockInfo(n_q, n_k, causal, window) for n_q, n_k, causal, window in cases]
    columns = [[i.seqlen_q for i in infos], [i.seqlen_k for i in infos],
               *zip(*(i.window_bounds() for i in infos))]
    seqlen_q, seqlen_k, left, right = (torch.tensor(c, dtype=torch.int32, device=device) for c in columns)
    max_tiles = 32  # cdiv(300, 16) rounded up to a power of two
    keys = torch.empty(len(cases), 4, max_tiles, dtype=torch.int32, device=device)
    queries = torch.empty_like(keys)
    _window_range_probe[(len(cases),)](seqlen_q, seqlen_k, left, right, keys, queries, MAX_TILES=max_tiles,
                                       BLOCK_M=block_m, BLOCK_N=block_n)
    keys, queries = keys.cpu().tolist(), queries.cpu().tolist()
    for case, info in enumerate(infos):
        for tile in range(cdiv(info.seqlen_q, block_m)):
            got = tuple(keys[case][i][tile] for i in range(4))
            assert got == info.key_tiles(tile * block_m, block_m, block_n), (cases[case], tile)
        for tile in range(cdiv(info.seqlen_k, block_n)):
            got = tuple(queries[case][i][tile] for i in range(4))
            assert got == info.query_tiles(tile * block_n, block_n, block_m), (cases[case], tile)


@triton.jit
def _row_key_end_probe(seqlen_q_ptr, seqlen_k_ptr, ends_ptr, MAX_ROWS: tl.constexpr, CAUSAL: tl.constexpr):
    """For case program_id(0): row_key_end of row r at ends[case, r]; ends: (cases, MAX_ROWS) int32."""
    case = tl.program_id(0)
    seqlen_q, seqlen_k = tl.load(seqlen_q_ptr + case), tl.load(seqlen_k_ptr + case)
    rows = tl.arange(0, MAX_ROWS)
    tl.store(ends_ptr + case * MAX_ROWS + rows, row_key_end(rows, seqlen_q, seqlen_k, CAUSAL=CAUSAL) + rows * 0)


@pytest.mark.parametrize("causal", [False, True])
def test_row_key_end_is_block_info(causal):
    """row_key_end (the selected-blocks kernels' key_limit) is BlockInfo.key_end on every row, except that a
    causal row which sees no key may get a negative end (every range cut to it is then empty)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seqlen_q, seqlen_k = seqlen_tensors(device)
    max_rows = 1024  # every row of the shapes above
    ends = torch.empty(len(SHAPES), max_rows, dtype=torch.int32, device=device)
    _row_key_end_probe[(len(SHAPES),)](seqlen_q, seqlen_k, ends, MAX_ROWS=max_rows, CAUSAL=causal)
    ends = ends.cpu().long()
    for case, (n_q, n_k) in enumerate(SHAPES):
        rows = torch.arange(n_q)
        want = BlockInfo(n_q, n_k, causal).key_end(rows)
        got = ends[case, :n_q]
        assert torch.equal(got.clamp(min=0), want), (n_q, n_k)


SPLIT_CASES = [(n_q, n_k, causal, window) for n_q in (1, 4, 17) for n_k in (1, 100, 128, 300)
               for causal, window in ((True, (-1, -1)), (False, (-1, -1)), (True, (40, -1)), (False, (0, 7)),
                                      (True, (300, -1)))]
MAX_SPLITS = 8


@triton.jit
def _split_key_range_probe(seqlen_q_ptr, lengths_ptr, left_ptr, ranges_ptr, MAX_SPLITS: tl.constexpr,
                           BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """For case program_id(0) and splits = program_id(1) + 1: split_key_range of each split s < splits at
    ranges[case, splits - 1, :, s]; ranges: (cases, MAX_SPLITS, 2, MAX_SPLITS) int32."""
    case, splits = tl.program_id(0), tl.program_id(1) + 1
    seqlen_q, length, left = tl.load(seqlen_q_ptr + case), tl.load(lengths_ptr + case), tl.load(left_ptr + case)
    split = tl.arange(0, MAX_SPLITS)
    begin, end = split_key_range(length, seqlen_q, left, split, splits, BLOCK_N=BLOCK_N, WINDOW=WINDOW)
    out = ranges_ptr + (case * MAX_SPLITS + splits - 1) * 2 * MAX_SPLITS + split
    tl.store(out, begin + split * 0, mask=split < splits)
    tl.store(out + MAX_SPLITS, end + split * 0, mask=split < splits)


@pytest.mark.parametrize("block_n", [16, 64])
def test_decode_split_key_range_is_split_ranges_cut_to_block_info(block_n):
    """The decode kernel's key range of each split: kvcache.split_ranges's split of the sequence's keys into
    whole tiles (a split past the last tile is empty), and under a window no tile before the one holding
    BlockInfo.key_start(0), the first key any query row sees; the splits still cover every visible key."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    infos = [BlockInfo(n_q, n_k, causal, window) for n_q, n_k, causal, window in SPLIT_CASES]
    for windowed in (False, True):
        cases = [info for info in infos if info.banded == windowed]
        columns = [[i.seqlen_q for i in cases], [i.seqlen_k for i in cases],
                   [i.window_bounds()[0] if windowed else 0 for i in cases]]
        seqlen_q, lengths, left = (torch.tensor(c, dtype=torch.int32, device=device) for c in columns)
        ranges = torch.full((len(cases), MAX_SPLITS, 2, MAX_SPLITS), -1, dtype=torch.int32, device=device)
        _split_key_range_probe[(len(cases), MAX_SPLITS)](seqlen_q, lengths, left, ranges, MAX_SPLITS=MAX_SPLITS,
                                                         BLOCK_N=block_n, WINDOW=windowed)
        ranges = ranges.cpu().tolist()
        for case, info in enumerate(cases):
            first = info.key_start(0) // block_n * block_n if windowed else 0
            for splits in range(1, MAX_SPLITS + 1):
                got = list(zip(*ranges[case][splits - 1]))[:splits]
                want = [(max(start, first), end) for start, end in split_ranges(info.seqlen_k, splits, block_n)]
                if splits <= cdiv(info.seqlen_k, block_n):
                    assert got == want, (info, splits)
                else:  # more splits than tiles: split_ranges makes fewer, the kernel leaves the others empty
                    assert [r for r in got if r[1] > r[0]] == [r for r in want if r[1] > r[0]], (info, splits)


# ---------------------------------------------------------------- Gluon

@gluon.jit
def _gluon_block_range_probe(seqlen_q_ptr, seqlen_k_ptr, plan_ptr, key_end_ptr, MAX_TILES: gl.constexpr,
                             MAX_ROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             CAUSAL: gl.constexpr):
    """For case program_id(0): tile_plan of work tile t at plan[case, :, t] ((n_iter, first_masked): (cases, 2,
    MAX_TILES) int32) and visible_key_end of row r at key_end[case, r] ((cases, MAX_ROWS) int32). num_warps=4."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    case = gl.program_id(0)
    seqlen_q = gl.load(seqlen_q_ptr + case)
    seqlen_k = gl.load(seqlen_k_ptr + case)
    tiles = gl.arange(0, MAX_TILES, layout=layout)
    zero = tiles * 0  # (broadcasts the non-causal plan, which is scalar)
    n_iter, first_masked = tile_plan(tiles * BLOCK_M, seqlen_q, seqlen_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                     CAUSAL=CAUSAL)
    plan = plan_ptr + case * 2 * MAX_TILES + tiles
    gl.store(plan, n_iter + zero)
    gl.store(plan + MAX_TILES, first_masked + zero)
    rows = gl.arange(0, MAX_ROWS, layout=layout)
    gl.store(key_end_ptr + case * MAX_ROWS + rows, visible_key_end(rows, seqlen_q, seqlen_k, CAUSAL=CAUSAL))


PROBE_SIGNATURE = {"seqlen_q_ptr": "*i32", "seqlen_k_ptr": "*i32", "plan_ptr": "*i32", "key_end_ptr": "*i32"}


@pytest.mark.parametrize("causal", [False, True])
def test_gluon_block_range_probe_compiles_for_sm90(causal):
    """The Gluon probe (the kernel's tile_plan and visible_key_end) builds for sm_90 on any machine."""
    from fa_lab.kernels.hopper.sm90_offline import compile_for_sm90

    constants = dict(MAX_TILES=MAX_TILES, MAX_ROWS=MAX_ROWS, BLOCK_M=128, BLOCK_N=128, CAUSAL=causal)
    build = compile_for_sm90(_gluon_block_range_probe, PROBE_SIGNATURE, constants, num_warps=4)
    assert "_gluon_block_range_probe" in build.sass and build.local_bytes == 0


@pytest.mark.gpu
@pytest.mark.parametrize("block_m, block_n", GLUON_BLOCKS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gluon_block_ranges_are_block_info(block_m, block_n, causal):
    """tile_plan is (max(cdiv(end, BLOCK_N), 1), full_end // BLOCK_N) of BlockInfo.key_blocks on every work
    tile, and visible_key_end is BlockInfo.key_end on every row, except that a row which sees no key may get
    a negative end (its mask is all False as with 0; the kernel saves the clamp)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon probe is compiled for sm_90 (Hopper)")
    seqlen_q, seqlen_k = seqlen_tensors("cuda")
    plan = torch.empty(len(SHAPES), 2, MAX_TILES, dtype=torch.int32, device="cuda")
    key_end = torch.empty(len(SHAPES), MAX_ROWS, dtype=torch.int32, device="cuda")
    _gluon_block_range_probe[(len(SHAPES),)](seqlen_q, seqlen_k, plan, key_end, MAX_TILES=MAX_TILES,
                                              MAX_ROWS=MAX_ROWS, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                                              num_warps=4)
    plan, key_end = plan.cpu(), key_end.cpu()
    rows = torch.arange(MAX_ROWS)
    for case, (n_q, n_k) in enumerate(SHAPES):
        info = BlockInfo(n_q, n_k, causal)
        for tile in range(cdiv(n_q, block_m)):
            full_end, end = info.key_blocks(tile * block_m, block_m, block_n)
            expected = (max(cdiv(end, block_n), 1), full_end // block_n)
            assert tuple(plan[case, :, tile].tolist()) == expected, (n_q, n_k, tile)
        assert torch.equal(key_end[case].clamp(min=0), info.key_end(rows).to(torch.int32)), (n_q, n_k)


WINDOWS = [(5, 0), (100, 3), (0, 50), (300, -1), (-1, 7)]  # flash-attn's (left, right); -1 unbounded


@gluon.jit
def _gluon_window_probe(seqlen_q_ptr, seqlen_k_ptr, left_ptr, right_ptr, plan_ptr, bounds_ptr, queries_ptr,
                        MAX_TILES: gl.constexpr, MAX_ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr):
    """For case program_id(0) with its window bounds: window_tile_plan of work tile t at plan[case, :, t]
    ((first, n_iter, full_begin, full_end): (cases, 4, MAX_TILES) int32), visible_key_start /
    window_key_end of row r at bounds[case, :, r] ((cases, 2, MAX_ROWS) int32), and window_query_plan of key tile
    t at queries[case, :, t] ((first, count): (cases, 2, MAX_TILES) int32). num_warps=4."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    case = gl.program_id(0)
    seqlen_q = gl.load(seqlen_q_ptr + case)
    seqlen_k = gl.load(seqlen_k_ptr + case)
    left = gl.load(left_ptr + case)
    right = gl.load(right_ptr + case)
    tiles = gl.arange(0, MAX_TILES, layout=layout)
    first, n_iter, full_begin, full_end = window_tile_plan(tiles * BLOCK_M, seqlen_q, seqlen_k, left, right,
                                                           BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    plan = plan_ptr + case * 4 * MAX_TILES + tiles
    gl.store(plan, first)
    gl.store(plan + MAX_TILES, n_iter)
    gl.store(plan + 2 * MAX_TILES, full_begin)
    gl.store(plan + 3 * MAX_TILES, full_end)
    rows = gl.arange(0, MAX_ROWS, layout=layout)
    bounds = bounds_ptr + case * 2 * MAX_ROWS + rows
    gl.store(bounds, visible_key_start(rows, seqlen_q, seqlen_k, left))
    gl.store(bounds + MAX_ROWS, window_key_end(rows, seqlen_q, seqlen_k, right))
    first_q, q_tiles = window_query_plan(tiles * BLOCK_N, seqlen_q, seqlen_k, left, right, BLOCK_M=BLOCK_M,
                                         BLOCK_N=BLOCK_N)
    queries = queries_ptr + case * 2 * MAX_TILES + tiles
    gl.store(queries, first_q)
    gl.store(queries + MAX_TILES, q_tiles)


WINDOW_PROBE_SIGNATURE = {"seqlen_q_ptr": "*i32", "seqlen_k_ptr": "*i32", "left_ptr": "*i32", "right_ptr": "*i32",
                          "plan_ptr": "*i32", "bounds_ptr": "*i32", "queries_ptr": "*i32"}


def test_gluon_window_probe_compiles_for_sm90():
    from fa_lab.kernels.hopper.sm90_offline import compile_for_sm90

    constants = dict(MAX_TILES=MAX_TILES, MAX_ROWS=MAX_ROWS, BLOCK_M=128, BLOCK_N=128)
    build = compile_for_sm90(_gluon_window_probe, WINDOW_PROBE_SIGNATURE, constants, num_warps=4)
    assert "_gluon_window_probe" in build.sass and build.local_bytes == 0


@pytest.mark.gpu
@pytest.mark.parametrize("block_m, block_n", GLUON_BLOCKS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gluon_window_ranges_are_block_info(block_m, block_n, causal):
    """window_tile_plan is BlockInfo.key_tiles in tiles (one fully masked tile for a work tile that sees no
    key), visible_key_start / window_key_end bound each row's keys as BlockInfo.key_start / key_end do
    (a row that sees no key may get any empty range), and window_query_plan is BlockInfo.query_tiles' begin and
    end in query tiles."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon probe is compiled for sm_90 (Hopper)")
    cases = [(n_q, n_k, window) for (n_q, n_k) in SHAPES for window in WINDOWS]
    infos = [BlockInfo(n_q, n_k, causal, window) for n_q, n_k, window in cases]
    bounds_lr = [info.window_bounds() for info in infos]
    columns = [[c[0] for c in cases], [c[1] for c in cases], [b[0] for b in bounds_lr], [b[1] for b in bounds_lr]]
    seqlen_q, seqlen_k, left, right = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in columns)
    plan = torch.empty(len(cases), 4, MAX_TILES, dtype=torch.int32, device="cuda")
    bounds = torch.empty(len(cases), 2, MAX_ROWS, dtype=torch.int32, device="cuda")
    queries = torch.empty(len(cases), 2, MAX_TILES, dtype=torch.int32, device="cuda")
    _gluon_window_probe[(len(cases),)](seqlen_q, seqlen_k, left, right, plan, bounds, queries, MAX_TILES=MAX_TILES,
                                       MAX_ROWS=MAX_ROWS, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    plan, bounds, queries = plan.cpu(), bounds.cpu(), queries.cpu()
    rows = torch.arange(MAX_ROWS)
    for case, info in enumerate(infos):
        for tile in range(cdiv(info.seqlen_q, block_m)):
            tiles = info.key_tiles(tile * block_m, block_m, block_n)
            first, n_iter, full_begin, full_end = plan[case, :, tile].tolist()
            if tiles.end == 0:
                assert (first, n_iter, full_begin, full_end) == (0, 1, 1, 0), (cases[case], tile)
                continue
            expected = (tiles.begin // block_n, cdiv(tiles.end, block_n) - tiles.begin // block_n,
                        tiles.full_begin // block_n, tiles.full_end // block_n)
            assert (first, n_iter, full_begin, full_end) == expected, (cases[case], tile)
        start, end = bounds[case, 0].long(), bounds[case, 1].long()
        seen = end > start.clamp(min=0)
        want_start, want_end = info.key_start(rows), info.key_end(rows)
        rows_ok = rows < info.seqlen_q
        assert torch.equal(seen[rows_ok], (want_end > want_start)[rows_ok]), cases[case]
        assert torch.equal(start.clamp(min=0)[rows_ok & seen], want_start[rows_ok & seen]), cases[case]
        assert torch.equal(end[rows_ok & seen], want_end[rows_ok & seen]), cases[case]
        for tile in range(cdiv(info.seqlen_k, block_n)):
            walk = info.query_tiles(tile * block_n, block_n, block_m)
            expected = (walk.begin // block_m, (walk.end - walk.begin) // block_m)
            assert tuple(queries[case, :, tile].tolist()) == expected, (cases[case], tile)
