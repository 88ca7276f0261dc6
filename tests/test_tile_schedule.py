"""The persistent FA3 kernel's work schedule (fa_lab.kernels.hopper.tile_schedule), checked on the CPU, and the
Gluon backward's launch order (fa3_backward.key_tile_of_cta): a probe kernel compiled for sm_90 here and run on the
GPU by a `gpu` test."""
import pytest
import torch

from fa_lab.kernels.hopper.fa3_backward import key_tile_of_cta
from fa_lab.kernels.hopper.tile_schedule import (
    FIXED_TILE_COST,
    encode_tile,
    group_count,
    head_groups,
    heads_per_group,
    kv_tiles_visited,
    persistent_schedule,
    schedule_tensor,
)

triton = pytest.importorskip("triton")  # (after fa_lab, which switches the interpreter on without a GPU)
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

H200_SMS = 132


def decode_tile(tile: int, m_tiles: int, causal: bool) -> tuple[int, int]:
    """(pid_bh, pid_m) as the kernel's WorkList.tile (fa_lab.kernels.hopper.fa3_state) computes them."""
    pid_m = tile % m_tiles
    return tile // m_tiles, (m_tiles - 1 - pid_m if causal else pid_m)


def brute_force_kv_tiles(start_m, seqlen_q, seqlen_k, block_m, block_n, causal) -> int:
    """K/V tiles holding a key that some row of the work tile sees (at least one: the kernel visits one)."""
    rows = torch.arange(start_m, min(start_m + block_m, seqlen_q))
    keys = torch.arange(seqlen_k)
    visible = torch.ones(len(rows), seqlen_k, dtype=torch.bool)
    if causal:
        visible = keys[None, :] <= rows[:, None] + seqlen_k - seqlen_q
    seen = keys[visible.any(0)]
    return max(int(seen.max()) // block_n + 1, 1) if len(seen) else 1


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1000, 1100), (1100, 1000), (700, 300), (128, 4096), (4096, 4096)])
@pytest.mark.parametrize("causal", [False, True])
def test_kv_tiles_visited_matches_the_mask(seqlen_q, seqlen_k, causal):
    for start_m in range(0, seqlen_q, 128):
        assert kv_tiles_visited(start_m, seqlen_q, seqlen_k, 128, 128, causal) == \
            brute_force_kv_tiles(start_m, seqlen_q, seqlen_k, 128, 128, causal)


@pytest.mark.parametrize("batch_heads, seqlen_q, seqlen_k, ctas",
                         [(64, 1000, 1100, 132), (3, 300, 300, 132), (32, 8192, 8192, 132), (7, 2000, 900, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_every_tile_is_computed_exactly_once(batch_heads, seqlen_q, seqlen_k, ctas, causal):
    m_tiles = -(-seqlen_q // 128)
    plan = persistent_schedule(batch_heads, seqlen_q, seqlen_k, 128, 128, causal, ctas)
    assert len(plan) == ctas
    tiles = sorted(decode_tile(tile, m_tiles, causal) for tiles in plan for tile in tiles)
    assert tiles == [(bh, m) for bh in range(batch_heads) for m in range(m_tiles)]
    for pid_bh, pid_m in [(0, 0), (batch_heads - 1, m_tiles - 1)]:
        assert decode_tile(encode_tile(pid_bh, pid_m, m_tiles, causal), m_tiles, causal) == (pid_bh, pid_m)


def modelled_makespan(plan, seqlen_q, seqlen_k, causal) -> tuple[float, float]:
    """(largest CTA's work, mean work) in K/V tiles plus the fixed cost per tile."""
    m_tiles = -(-seqlen_q // 128)
    loads = [sum(kv_tiles_visited(decode_tile(t, m_tiles, causal)[1] * 128, seqlen_q, seqlen_k, 128, 128, causal)
                 + FIXED_TILE_COST for t in tiles) for tiles in plan]
    return max(loads), sum(loads) / len(loads)


@pytest.mark.parametrize("seqlen", [2048, 4096, 8192, 16384])
def test_causal_schedule_is_balanced_where_a_round_robin_is_not(seqlen):
    """The FA3 benchmark's shapes (16K tokens, 16 heads of 128) on an H200's 132 SMs."""
    batch_heads = 16 * 16384 // seqlen
    plan = persistent_schedule(batch_heads, seqlen, seqlen, 128, 128, True, H200_SMS)
    longest, mean = modelled_makespan(plan, seqlen, seqlen, True)
    assert longest <= 1.03 * mean
    m_tiles = seqlen // 128
    round_robin = [list(range(cta, batch_heads * m_tiles, H200_SMS)) for cta in range(H200_SMS)]
    rr_longest, rr_mean = modelled_makespan(round_robin, seqlen, seqlen, True)
    assert rr_mean == pytest.approx(mean) and rr_longest > 1.05 * rr_mean


def test_heads_run_group_by_group():
    """Every CTA finishes its tiles of one group of heads before it starts the next group's (their K and V
    stay in L2 meanwhile), and within a group a CTA's tiles get shorter (LPT order)."""
    batch_heads, seqlen = 32, 8192
    m_tiles = seqlen // 128
    groups = head_groups(batch_heads, m_tiles, H200_SMS)
    assert 1 < len(groups) < batch_heads and [h for g in groups for h in g] == list(range(batch_heads))
    assert max(map(len, groups)) - min(map(len, groups)) <= 1
    group_of = {h: i for i, g in enumerate(groups) for h in g}
    for tiles in persistent_schedule(batch_heads, seqlen, seqlen, 128, 128, True, H200_SMS):
        coords = [decode_tile(t, m_tiles, True) for t in tiles]
        order = [group_of[bh] for bh, _ in coords]
        assert order == sorted(order)
        for g in set(order):
            rows = [m for (bh, m) in coords if group_of[bh] == g]
            assert rows == sorted(rows, reverse=True)


def test_schedule_tensor_layout():
    plan = persistent_schedule(5, 1000, 1000, 128, 128, True, 7)
    flat = schedule_tensor(5, 1000, 1000, 128, 128, True, 7, torch.device("cpu"))
    assert flat.dtype == torch.int32
    offsets, tiles = flat[:8].tolist(), flat[8:].tolist()
    assert offsets[0] == 0 and offsets[-1] == len(tiles) == 5 * 8
    assert [tiles[offsets[c]:offsets[c + 1]] for c in range(7)] == plan


def backward_order(batch_heads: int, key_tiles: int, head_group: int) -> list[tuple[int, int]]:
    """The (key tile, batch * K/V head) of each CTA of the Gluon backward's dense launch, in launch order, as
    fa3_backward.key_tile_of_cta's docstring describes it: groups of head_group heads, key tile by key tile."""
    return [(tile, bh) for first in range(0, batch_heads, head_group) for tile in range(key_tiles)
            for bh in range(first, first + head_group)]


def list_scheduled_balance(costs: list[int], ctas: int) -> float:
    """Mean SM busy time over the makespan when CTAs of these costs start in order on the first free SM."""
    import heapq

    free = [0] * ctas
    end = 0
    for cost in costs:
        start = heapq.heappop(free)
        end = max(end, start + cost)
        heapq.heappush(free, start + cost)
    return sum(costs) / ctas / end


@pytest.mark.parametrize("seqlen, batch, heads_kv, group", [(2048, 8, 8, 4), (4096, 4, 8, 4), (8192, 2, 8, 4),
                                                             (16384, 1, 8, 4), (8192, 2, 32, 1), (4096, 3, 5, 2)])
def test_backward_head_groups_balance_the_causal_tail(seqlen, batch, heads_kv, group):
    """heads_per_group divides the (batch, K/V head) pairs into at most group_count groups, and with it the causal
    backward's CTAs (a key tile's cost: its query steps over the group's heads, plus two for its prologue and
    epilogue) keep the H200's SMs busier than head by head, at least 0.97 of the time. Chapter 05's grouped-query
    shapes (32 query heads over 8 K/V heads) leave 10-12% idle head by head, since their CTAs are 4 times longer."""
    batch_heads, key_tiles = batch * heads_kv, seqlen // 128
    size = heads_per_group(batch_heads, key_tiles, H200_SMS)
    assert batch_heads % size == 0 and batch_heads // size <= group_count(batch_heads, key_tiles, H200_SMS)

    def balance(head_group):
        order = backward_order(batch_heads, key_tiles, head_group)
        assert sorted(order) == [(t, bh) for t in range(key_tiles) for bh in range(batch_heads)]
        return list_scheduled_balance([group * (key_tiles - tile) + 2 for tile, _ in order], H200_SMS)

    grouped, head_by_head = balance(size), balance(1)
    assert grouped >= 0.97 and grouped >= head_by_head
    if group == 4 and seqlen <= 8192:
        assert head_by_head < 0.9


@gluon.jit
def _key_tile_probe(out_ptr, key_tiles, head_group):
    """key_tile_of_cta's (key tile, batch * head) of every CTA at out[cta]: (ctas, 2) int32."""
    cta = gl.program_id(0)
    key_tile, batch_head = key_tile_of_cta(cta, key_tiles, head_group)
    gl.store(out_ptr + 2 * cta, key_tile)
    gl.store(out_ptr + 2 * cta + 1, batch_head)


PROBE_CASES = [(64, 16, 22), (16, 64, 8), (16, 64, 1), (6, 5, 3), (6, 5, 6), (1, 7, 1)]  # (BH, tiles, head_group)


def test_key_tile_probe_compiles_for_sm90():
    from fa_lab.kernels.hopper.sm90_offline import compile_for_sm90

    signature = {"out_ptr": "*i32", "key_tiles": "i32", "head_group": "i32"}
    build = compile_for_sm90(_key_tile_probe, signature, {}, num_warps=1)
    assert "key_tile_probe" in build.sass


@pytest.mark.gpu
@pytest.mark.parametrize("batch_heads, key_tiles, head_group", PROBE_CASES)
def test_gpu_backward_ctas_run_in_the_documented_order(batch_heads, key_tiles, head_group):
    """CTA c of the dense backward gets the c-th (key tile, head) of backward_order: every pair exactly once, a
    group's heads key tile by key tile."""
    if batch_heads % head_group:
        head_group = heads_per_group(batch_heads, key_tiles, H200_SMS)
    out = torch.empty(batch_heads * key_tiles, 2, dtype=torch.int32, device="cuda")
    _key_tile_probe[(len(out),)](out, key_tiles, head_group, num_warps=1)
    assert [tuple(pair) for pair in out.tolist()] == backward_order(batch_heads, key_tiles, head_group)
