"""The parallelism model against hand counts, brute force over causal_mask, and a step-by-step scheduler."""
from __future__ import annotations

import math

import pytest
import torch

from fa_lab.iomodel import RUNNING_EXAMPLE, AttentionShape, attention_flops
from fa_lab.parallelism import (
    H100_SMS,
    LAUNCH_ORDERS,
    busy_over_time,
    computed_matmul_flops,
    grid,
    kv_tiles_per_cta,
    launch_order,
    list_schedule,
    load_imbalance,
    nonmatmul_flops,
    simulate_grid,
    split_k_reduction_bytes,
    tile_counts,
    tile_kind,
    tile_map,
    waves,
)
from fa_lab.reference import causal_mask


def randint(generator, low, high):
    """An int in [low, high] from the test's generator."""
    return int(torch.randint(low, high + 1, (1,), generator=generator))


def brute_force_kinds(seqlen_q, seqlen_k, block_q, block_k):
    """Tile kinds read off the element-wise causal mask: all visible, none visible, or some."""
    mask = causal_mask(seqlen_q, seqlen_k)
    kinds = []
    for i0 in range(0, seqlen_q, block_q):
        kinds.append([])
        for j0 in range(0, seqlen_k, block_k):
            visible = mask[i0:i0 + block_q, j0:j0 + block_k]
            kinds[-1].append("full" if visible.all() else "skipped" if not visible.any() else "masked")
    return kinds


# ---------------------------------------------------------------- non-matmul FLOPs

def test_nonmatmul_flops_by_hand_on_a_tiny_head():
    # One head, N = 4, d = 3, tiles of 2 x 2: 2 Q tiles x 2 K/V tiles = 4 steps of 4 scores each.
    shape = AttentionShape(1, 1, 4, 3)
    fa2 = nonmatmul_flops(shape, block_q=2, block_k=2, deferred_rescale=True)
    fa1 = nonmatmul_flops(shape, block_q=2, block_k=2, deferred_rescale=False)
    assert fa2 == {
        "scores: max, subtract, sum": 3 * 16,
        "scores: exp": 16,
        "row statistics m, l": 5 * 4 * 2 + 2 * 2 * 2,  # 5 per row per step; lse (log, add) per row at the end
        "output: rescale": 4 * 2 * 3,  # acc *= alpha: one multiply per element per step
        "output: divide by l": 2 * 2 * 3,  # once per Q tile
    }
    assert fa1 == {
        "scores: max, subtract, sum": 3 * 16,
        "scores: exp": 16,
        "row statistics m, l": 9 * 4 * 2,
        "output: rescale": 3 * 4 * 2 * 3,  # scale the old O, scale the new P V, add them
        "output: divide by l": 4 * 2 * 3,  # every step
    }


def test_deferred_rescale_divides_once_per_q_tile_on_the_running_example():
    fa1, fa2 = (nonmatmul_flops(RUNNING_EXAMPLE, 128, 128, deferred) for deferred in (False, True))
    q_tiles, kv_tiles, heads = 8192 // 128, 8192 // 128, 2 * 32
    assert fa2["output: divide by l"] == q_tiles * 128 * 128 * heads
    assert fa1["output: divide by l"] == kv_tiles * fa2["output: divide by l"]  # 64 divisions instead of one
    assert fa1["output: rescale"] == 3 * fa2["output: rescale"]
    assert fa1["scores: exp"] == fa2["scores: exp"] == 8192 * 8192 * heads  # one exp per score either way
    # The score work is the same; FA2 saves on everything that touches the output.
    assert sum(fa2.values()) < sum(fa1.values()) < 2 * sum(fa2.values())


def test_nonmatmul_flops_count_the_tiles_that_causal_computes(generator):
    for _ in range(5):
        block_q, block_k = 2 ** randint(generator, 2, 5), 2 ** randint(generator, 2, 5)
        seqlen_q, seqlen_k = randint(generator, 1, 200), randint(generator, 1, 200)
        shape = AttentionShape(randint(generator, 1, 3), randint(generator, 1, 3), seqlen_q, 8,
                               seqlen_k=seqlen_k, causal=True)
        computed = sum(kind != "skipped" for row in brute_force_kinds(seqlen_q, seqlen_k, block_q, block_k)
                       for kind in row)
        flops = nonmatmul_flops(shape, block_q, block_k)
        assert flops["scores: exp"] == computed * block_q * block_k * shape.heads_total
        assert computed_matmul_flops(shape, block_q, block_k) == 4 * block_q * block_k * 8 * computed * \
            shape.heads_total


def test_computed_matmul_flops_exceed_useful_ones_by_the_masked_halves():
    tiles = 16  # N = 16 tiles of 128: square causal computes 16 * 17 / 2 tiles for 16 * 16 / 2 tiles' worth
    shape = AttentionShape(2, 4, tiles * 128, 64, causal=True)
    assert computed_matmul_flops(shape) * tiles == attention_flops(shape) * (tiles + 1)
    full = AttentionShape(2, 4, tiles * 128, 64)
    assert computed_matmul_flops(full) == attention_flops(full)


# ---------------------------------------------------------------- grids and waves

def test_fa1_fills_16_of_132_sms_where_fa2_fills_them_all():
    shape = AttentionShape(1, 16, 16384, 128)
    assert grid(shape, 128, split_seqlen=False) == (1, 16)
    assert grid(shape, 128) == (128, 16, 1)
    fa1, fa2 = waves(16), waves(math.prod(grid(shape, 128)))
    assert (fa1.sms_busy, fa1.count, fa1.efficiency) == (16, 1, 16 / 132)
    assert (fa2.sms_busy, fa2.count) == (132, 16)  # 15 full waves of 132 and 68 CTAs left over
    assert fa2.last_wave_fill == 68 / 132
    assert fa2.efficiency == 2048 / (16 * 132)
    two_per_sm = waves(2048, ctas_per_sm=2)
    assert (two_per_sm.slots, two_per_sm.count, two_per_sm.last_wave_fill) == (264, 8, (2048 - 7 * 264) / 264)
    assert waves(200, ctas_per_sm=2).sms_busy == 132  # a CTA per SM first, then the second slots
    assert H100_SMS == 132
    with pytest.raises(ValueError, match="ctas"):
        waves(0)


def test_wave_efficiency_equals_the_utilisation_of_a_schedule_of_equal_ctas(generator):
    for _ in range(10):
        ctas, sms, per_sm = randint(generator, 1, 600), randint(generator, 1, 140), randint(generator, 1, 3)
        model = waves(ctas, sms, per_sm)
        schedule = list_schedule([1.0] * ctas, sms * per_sm)
        assert schedule.makespan == model.count
        assert schedule.utilisation == pytest.approx(model.efficiency, rel=1e-12)


# ---------------------------------------------------------------- causal tiles

def test_tile_kinds_agree_with_causal_mask(generator):
    for _ in range(12):
        block_q, block_k = 2 ** randint(generator, 1, 5), 2 ** randint(generator, 1, 5)
        seqlen_q, seqlen_k = randint(generator, 1, 150), randint(generator, 1, 150)
        kinds = tile_map(seqlen_q, seqlen_k, block_q, block_k)
        assert kinds == brute_force_kinds(seqlen_q, seqlen_k, block_q, block_k), (seqlen_q, seqlen_k)
        counts = tile_counts(seqlen_q, seqlen_k, block_q, block_k)
        assert sum(counts.values()) == math.ceil(seqlen_q / block_q) * math.ceil(seqlen_k / block_k)
        assert kv_tiles_per_cta(seqlen_q, seqlen_k, block_q, block_k) == [
            sum(kind != "skipped" for kind in row) for row in kinds]
    assert tile_counts(100, 70, 32, 32, causal=False) == {"full": 12, "masked": 0, "skipped": 0}


def test_work_per_cta_by_hand():
    assert kv_tiles_per_cta(1024, 1024, 128, 128) == [1, 2, 3, 4, 5, 6, 7, 8]  # square: the diagonal grows
    assert kv_tiles_per_cta(3 * 64, 5 * 64, 64, 64) == [3, 4, 5]  # Nq < Nk: every query sees the prefix
    assert kv_tiles_per_cta(5 * 64, 2 * 64, 64, 64) == [0, 0, 0, 1, 2]  # Nq > Nk: top rows see no key
    assert tile_counts(1024, 1024, 128, 128) == {"full": 28, "masked": 8, "skipped": 28}
    assert tile_kind(0, 0, 1024, 1024, 128, 128) == "masked"
    assert tile_kind(1, 0, 1024, 1024, 128, 128) == "full"
    assert tile_kind(0, 1, 1024, 1024, 128, 128) == "skipped"
    assert load_imbalance([1, 2, 3, 4, 5, 6, 7, 8]) == 8 / 4.5
    assert load_imbalance([3, 3, 3]) == 1.0


# ---------------------------------------------------------------- launch orders and scheduling

def test_launch_orders_by_hand():
    assert launch_order([1, 2, 3], 2, "natural") == [1, 2, 3, 1, 2, 3]
    assert launch_order([1, 2, 3], 2, "reversed") == [3, 2, 1, 3, 2, 1]
    assert launch_order([1, 2, 3], 2, "heaviest first") == [3, 3, 2, 2, 1, 1]
    with pytest.raises(ValueError, match="order"):
        launch_order([1], 1, "random")


def test_list_schedule_by_hand():
    schedule = list_schedule([3, 1, 1, 1], 2)
    assert (schedule.start, schedule.end, schedule.slot) == ([0, 0, 1, 2], [3, 1, 2, 3], [0, 1, 1, 1])
    assert schedule.makespan == 3 and schedule.utilisation == 1.0
    late = list_schedule([1, 1, 1, 3], 2)  # the long CTA comes last and runs alone at the end
    assert (late.makespan, late.utilisation, late.lower_bound) == (4, 6 / 8, 3)
    assert busy_over_time(late) == ([0, 1, 2, 4], [2, 2, 1, 0])


def test_simulated_causal_grid_by_hand():
    # Two heads of three Q tiles (work 1, 2, 3) on two SMs.
    shape = AttentionShape(1, 2, 3 * 64, 16, causal=True)
    makespans = {order: simulate_grid(shape, 64, 64, order, sm_count=2).makespan for order in LAUNCH_ORDERS}
    # natural: SM0 runs 1, 3, 3 (ends at 7) while SM1 runs 2, 1, 2 (ends at 5).
    assert makespans == {"natural": 7, "reversed": 6, "heaviest first": 6}
    # A fixed cost of one tile per CTA: work 2, 3, 4; heaviest first pairs them up as 4+3+2 on each SM.
    with_overhead = {order: simulate_grid(shape, 64, 64, order, sm_count=2, cta_overhead=1).makespan
                     for order in LAUNCH_ORDERS}
    assert with_overhead == {"natural": 10, "reversed": 10, "heaviest first": 9}


def step_by_step_schedule(durations, slots):
    """An independent scheduler: advance time one unit at a time, hand the next CTAs to free slots."""
    start, end, slot = [None] * len(durations), [None] * len(durations), [None] * len(durations)
    busy_until, next_cta, time = [0] * slots, 0, 0
    while next_cta < len(durations):
        for index in range(slots):
            while next_cta < len(durations) and busy_until[index] <= time:
                start[next_cta], slot[next_cta] = time, index
                busy_until[index] = end[next_cta] = time + durations[next_cta]
                next_cta += 1
        time += 1
    return start, end, slot


def test_list_schedule_matches_a_step_by_step_scheduler(generator):
    for _ in range(10):
        slots = randint(generator, 1, 9)
        durations = torch.randint(0, 10, (randint(generator, 1, 60),), generator=generator).tolist()
        schedule = list_schedule(durations, slots)
        assert (schedule.start, schedule.end, schedule.slot) == step_by_step_schedule(durations, slots)
        total, longest = sum(durations), max(durations)
        assert schedule.makespan >= schedule.lower_bound == max(total / slots, longest)
        # Graham's bound: a list schedule ends at most one longest CTA after the average load.
        assert schedule.makespan <= total / slots + (1 - 1 / slots) * longest


def test_heaviest_first_is_near_optimal_and_reversing_helps_long_sequences():
    shape = AttentionShape(1, 16, 16384, 128, causal=True)  # FA3-protocol shape: 16 heads of 128 Q tiles
    results = {order: simulate_grid(shape, order=order) for order in LAUNCH_ORDERS}
    assert results["heaviest first"].makespan <= 1.01 * results["heaviest first"].lower_bound
    assert results["reversed"].makespan < 0.95 * results["natural"].makespan
    assert results["natural"].utilisation < 0.95


# ---------------------------------------------------------------- warp partitioning

def test_split_k_reduction_bytes_by_hand():
    traffic = split_k_reduction_bytes(block_q=128, head_dim=128, warps=4)
    assert traffic["partial outputs written"] == 4 * 128 * 128 * 4  # 256 KiB of fp32 partial outputs
    assert traffic["partial outputs read"] == traffic["partial outputs written"]
    assert traffic["row statistics written"] == 4 * 2 * 128 * 4
    assert traffic["row statistics read"] == 4 * traffic["row statistics written"]


def test_split_k_partials_are_what_the_reduction_must_add(generator):
    # 4 warps each take a quarter of the keys of one tile: their fp32 outputs must be summed.
    block_q, block_k, head_dim, warps = 16, 32, 8, 4
    p = torch.rand(block_q, block_k, generator=generator)
    v = torch.randn(block_k, head_dim, generator=generator)
    partials = [p_part @ v_part for p_part, v_part in zip(p.chunk(warps, 1), v.chunk(warps, 0), strict=True)]
    torch.testing.assert_close(sum(partials), p @ v)
    assert not torch.allclose(partials[0], p @ v)
    traffic = split_k_reduction_bytes(block_q, head_dim, warps)
    assert traffic["partial outputs written"] == sum(part.nbytes for part in partials)
