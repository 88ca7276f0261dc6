"""Lab 02: FlashAttention-2's work partitioning (goes with notebook 02).

=================  =================================================================================
exercise           the learner's function, as the harness calls it
=================  =================================================================================
grid_and_waves     grid_and_waves(batch, heads, seqlen_q, block_q, sm_count) -> ((x, y, z), waves)
kv_tiles           kv_tiles(seqlen_q, seqlen_k, block_q, block_k, causal) -> [K/V tiles of each Q tile]
makespan           makespan(durations, slots) -> when the last program ends under list scheduling
lpt_order          lpt_order(work, slots) -> a launch order (a permutation of the programs)
=================  =================================================================================

Judged against :mod:`fa_lab.parallelism` (``grid``, ``waves``, ``kv_tiles_per_cta``,
``list_schedule``): a wrong answer is matched against the typical wrong ones (FA1's grid, waves
rounded down, causal tiles counted as full, the mask aligned top-left, round-robin instead of the
first free slot, the row-major or lightest-first order). An order passes when its makespan is no
longer than the longest-first order's. fa_lab.parallelism is forbidden in every exercise.
"""
from __future__ import annotations

import math

from ...iomodel import AttentionShape
from ...parallelism import grid, kv_tiles_per_cta, list_schedule, waves
from ..judge import PASS, mistakes_message, outcome_problem
from ..registry import Case, Exercise, Lab, Verdict
from .attention_cases import draw_choice, draw_int

FORBIDDEN = ("fa_lab.parallelism", "fa_lab.iomodel", "fa_lab.block_info")


def _named(value, want, mistakes, what: str) -> Verdict:
    """Exact equality, naming the mistakes whose wrong answer the value equals."""
    if value == want:
        return PASS
    found = list(dict.fromkeys(m for m, wrong in mistakes if wrong != want and value == wrong))
    return Verdict(False, (mistakes_message(found) if found else f"{what} is wrong.") +
                   f" Got {value!r}, expected {want!r}.", explained=bool(found))


def _plain(outcome):
    """The learner's return value with lists for tuples (the wire carries tuples as lists)."""
    value = outcome["outputs"]
    return [_plain({"outputs": v}) for v in value] if isinstance(value, (list, tuple)) else value


# ----------------------------------------------------------------------------- grid and waves

PUBLIC_GRIDS = ((2, 32, 8192, 128, 132), (1, 8, 1000, 128, 132), (4, 16, 2048, 64, 108), (1, 1, 128, 128, 132))


def public_grid_cases() -> list[Case]:
    return [Case(f"B={b} H={h} Nq={n} block_q={bq}, {s} SMs", (b, h, n, bq, s)) for b, h, n, bq, s in PUBLIC_GRIDS]


def hidden_grid_cases(generator) -> list[Case]:
    cases = []
    for _ in range(5):
        b, h = draw_int(generator, 1, 8), draw_choice(generator, (1, 8, 16, 32))
        n, bq, s = draw_int(generator, 1, 9000), draw_choice(generator, (64, 128)), draw_choice(generator, (108, 132))
        cases.append(Case(f"B={b} H={h} Nq={n} block_q={bq}, {s} SMs", (b, h, n, bq, s)))
    return cases


def judge_grid(case, outcome) -> Verdict:
    batch, heads, seqlen_q, block_q, sms = case.args
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    shape = AttentionShape(batch, heads, seqlen_q, 64)
    fa2 = list(grid(shape, block_q))
    want = [fa2, waves(math.prod(fa2), sms).count]
    ctas = math.prod(fa2)
    mistakes = [("that is FlashAttention-1's grid (batch, heads): FA2 also splits the sequence, one program per Q "
                 "tile, (ceil(Nq / block_q), heads, batch).", [[batch, heads], waves(batch * heads, sms).count]),
                ("the waves are rounded down: a last, partial wave still takes a round of the GPU's time; "
                 "waves = ceil(programs / SMs).", [fa2, ctas // sms]),
                ("the Q tiles are rounded down: the last, partial tile needs its program too, ceil(Nq / block_q).",
                 [[seqlen_q // block_q, heads, batch], math.ceil(seqlen_q // block_q * heads * batch / sms)])]
    return _named(_plain(outcome), want, mistakes, "the grid or the waves")


# ----------------------------------------------------------------------------- K/V tiles per program

PUBLIC_TILES = ((512, 512, 128, 128, True), (512, 512, 128, 128, False), (300, 1000, 64, 128, True),
                (1000, 300, 128, 64, True), (256, 256, 128, 64, True))


def public_tile_cases() -> list[Case]:
    return [Case(f"Nq={nq} Nk={nk}, tiles {bq}x{bk}{', causal' if c else ''}", (nq, nk, bq, bk, c))
            for nq, nk, bq, bk, c in PUBLIC_TILES]


def hidden_tile_cases(generator) -> list[Case]:
    cases = []
    for causal in (True, True, False, True, True):
        nq, nk = draw_int(generator, 1, 2000), draw_int(generator, 1, 2000)
        bq, bk = draw_choice(generator, (64, 128)), draw_choice(generator, (64, 128))
        cases.append(Case(f"Nq={nq} Nk={nk}, tiles {bq}x{bk}{', causal' if causal else ''}", (nq, nk, bq, bk, causal)))
    return cases


def judge_tiles(case, outcome) -> Verdict:
    seqlen_q, seqlen_k, block_q, block_k, causal = case.args
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    want = kv_tiles_per_cta(seqlen_q, seqlen_k, block_q, block_k, causal)
    rows, cols = math.ceil(seqlen_q / block_q), math.ceil(seqlen_k / block_k)
    top_left = [min(cols, math.ceil(min((i + 1) * block_q, seqlen_q) / block_k)) for i in range(rows)]
    mistakes = [("the causal tiles are counted as full: under the causal mask a Q tile skips the K/V tiles after "
                 "its last row's diagonal (query i sees keys j <= i + Nk - Nq).", [cols] * rows),
                ("the mask is aligned top-left (query i sees keys j <= i): the course's causal mask is bottom-right "
                 "aligned, j <= i + Nk - Nq.", top_left if causal else None),
                ("the last, partial K/V tile is dropped: a program visits ceil(keys / block_k) tiles.",
                 [max(w - (1 if seqlen_k % block_k else 0), 0) for w in want])]
    return _named(_plain(outcome), want, [(m, w) for m, w in mistakes if w is not None], "the tile counts")


# ----------------------------------------------------------------------------- list scheduling

def _durations(generator, count):
    return [float(draw_int(generator, 1, 20)) for _ in range(count)]


def public_makespan_cases() -> list[Case]:
    return [Case("4 programs of 1 on 2 slots", ([1.0, 1.0, 1.0, 1.0], 2)),
            Case("a long one first: 5, 1, 1, 1, 1, 1 on 2 slots", ([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2)),
            Case("a long one last: 1, 1, 1, 1, 1, 5 on 2 slots", ([1.0, 1.0, 1.0, 1.0, 1.0, 5.0], 2)),
            Case("more slots than programs", ([3.0, 2.0], 4)),
            Case("3, 1, 4, 1, 5, 9, 2, 6 on 3 slots", ([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0], 3))]


def hidden_makespan_cases(generator) -> list[Case]:
    return [Case(f"{n} programs on {s} slots", (_durations(generator, n), s))
            for n, s in ((10, 3), (25, 4), (7, 7), (40, 6))]


def judge_makespan(case, outcome) -> Verdict:
    durations, slots = case.args
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    value = outcome["outputs"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return Verdict(False, f"expected the makespan as a number, got {value!r}.")
    want = list_schedule(durations, slots).makespan
    by_slot = [sum(durations[i::slots]) for i in range(slots)]
    mistakes = [("round robin: program c does not go to slot c % slots, but to the slot that frees first (a GPU "
                 "dispatches a block as soon as an SM has room).", max(by_slot)),
                ("the work divided by the slots is a lower bound, not the makespan: simulate the dispatch.",
                 sum(durations) / slots),
                ("the makespan is when the last program ends, the largest end time, not the sum of the "
                 "durations.", sum(durations))]
    return _named(float(value), want, mistakes, "the makespan")


# ----------------------------------------------------------------------------- a launch order

def _causal_work(seqlen: int, block: int, programs: int) -> list[float]:
    """The per-program work of a causal grid in its natural order: each head's Q tiles from the top."""
    return [float(w) for w in kv_tiles_per_cta(seqlen, seqlen, block, block, True)] * programs


def public_order_cases() -> list[Case]:
    return [Case("causal N=2048, tiles of 128, 12 heads, 16 slots", (_causal_work(2048, 128, 12), 16)),
            Case("causal N=1024, tiles of 64, 6 heads, 9 slots", (_causal_work(1024, 64, 6), 9)),
            Case("2, 7, 3, 5, 4 on 2 slots", ([2.0, 7.0, 3.0, 5.0, 4.0], 2))]


def hidden_order_cases(generator) -> list[Case]:
    cases = []
    for _ in range(4):
        n, block = draw_choice(generator, (1024, 2048, 4096)), draw_choice(generator, (64, 128))
        programs, slots = draw_int(generator, 2, 16), draw_int(generator, 3, 40)
        cases.append(Case(f"causal N={n}, tiles of {block}, {programs} heads, {slots} slots",
                          (_causal_work(n, block, programs), slots)))
    return cases


def judge_order(case, outcome) -> Verdict:
    work, slots = case.args
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    order = _plain(outcome)
    if not isinstance(order, list) or sorted(order) != list(range(len(work))) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in order):
        return Verdict(False, f"expected a permutation of the {len(work)} program indices 0 .. {len(work) - 1} (the "
                              "order in which to launch them), each exactly once.")
    got = list_schedule([work[i] for i in order], slots).makespan
    best = list_schedule(sorted(work, reverse=True), slots).makespan
    if got <= best + 1e-9:
        return PASS
    natural = list_schedule(work, slots).makespan
    lightest = list_schedule(sorted(work), slots).makespan
    if order == list(range(len(work))) or math.isclose(got, natural):
        why = ("this is the grid's row-major order: under causal the light Q tiles come first and the heavy ones "
               "run last, alone; launch the programs heaviest first (longest processing time first).")
    elif math.isclose(got, lightest):
        why = "the lightest programs come first: sort by work, largest first."
    else:
        why = "sort the programs by their work, largest first (longest processing time first)."
    return Verdict(False, f"{why} Your order ends at {got:g}, heaviest first at {best:g} (no order can beat "
                          f"{max(sum(work) / slots, max(work)):g}).")


LAB = Lab(
    id="lab02",
    title="FlashAttention-2's work partitioning: grids, waves, causal work per program and launch orders",
    notebook="lab02_work_partitioning.ipynb",
    exercises=(
        Exercise("grid_and_waves", "grid_and_waves", 2, public_grid_cases, hidden_grid_cases, judge_grid,
                 forbidden=FORBIDDEN),
        Exercise("kv_tiles", "kv_tiles", 3, public_tile_cases, hidden_tile_cases, judge_tiles, forbidden=FORBIDDEN),
        Exercise("makespan", "makespan", 2, public_makespan_cases, hidden_makespan_cases, judge_makespan,
                 forbidden=FORBIDDEN),
        Exercise("lpt_order", "lpt_order", 3, public_order_cases, hidden_order_cases, judge_order,
                 forbidden=FORBIDDEN),
    ),
)
