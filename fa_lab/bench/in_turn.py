"""A/B timing in turn: the calls under comparison timed one after the other, round after round, so that a drift of
the GPU's clocks over the run falls on every call alike (the protocol of the A/B scripts in benchmarks/)."""
from __future__ import annotations


def checked_in_turn(calls: dict, entry: dict, value, label: str, rounds: int = 2) -> None:
    """Each of ``calls`` run once and ``value(result)`` (a tensor) compared with the first call's: entry[f"{name}:
    {label}"] the largest absolute difference; then each timed as :func:`medians_in_turn` says."""
    first = None
    for name, call in calls.items():
        got = value(call())
        first = got if first is None else first
        entry[f"{name}: {label}"] = float((got - first).abs().max())
    medians_in_turn(calls, entry, rounds)


def medians_in_turn(calls: dict, entry: dict, rounds: int = 2, timer=None) -> None:
    """Time each of ``calls`` (name -> callable) in turn, ``rounds`` times over: entry[f"{name} ms"] lists its
    medians by ``timer`` (``triton.testing.do_bench`` when None), one a round."""
    if timer is None:
        from triton.testing import do_bench as timer

    for _round in range(rounds):
        for name, call in calls.items():
            entry.setdefault(f"{name} ms", []).append(round(timer(call, return_mode="median"), 3))
