"""Judging a case: the tolerance rule, then a diagnosis that teaches.

A case passes when every output meets :func:`fa_lab.testing.compare` (the
course's one tolerance rule). When it fails, the diagnosis tries, in order:

1. what went wrong before any number was compared (a forbidden call, an
   exception, a wrong type, shape or dtype);
2. *candidates*: the outputs of known mistakes on the same inputs (computed by
   the lab module). Matching one names the mistake ("you did not rescale l"); when
   several mistakes give the learner's numbers on this case, all of them are named,
   since the case cannot tell them apart;
3. *detectors*: invariants a lab checks itself (errors only in the rows that see no
   key, exp overflowing exactly in the rows whose scores pass 88.7, ...). A detector
   names a cause only when it has tested it; otherwise it says what it observed;

and always ends with where the largest error is (which tensor, which index). A
verdict that found no cause is marked ``explained=False``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..testing import ABS_FLOOR, Comparison, compare
from .registry import Case, Verdict

PASS = Verdict(True, "ok")
Candidate = tuple[str, Callable[[], "dict[str, torch.Tensor] | None"]]
Detector = Callable[[dict, dict, dict], "str | None"]


@dataclass(frozen=True)
class Expected:
    """What one output must be.

    reference: the float64 ground truth. baseline: the same computation in the
    input dtype (the rule allows twice its error). dtype: the dtype the output
    must have (None: any). dims: a name per dimension, for messages. floor: the
    rule's absolute floor (None: by dtype).
    """

    reference: torch.Tensor
    baseline: torch.Tensor
    dtype: torch.dtype | None
    dims: tuple[str, ...]
    floor: float | None = None


def forbidden_message(calls: Iterable[str]) -> str:
    return (f"your function called {', '.join(calls)}. This exercise asks you to write the "
            "computation yourself, so it scores 0.")


def outcome_problem(outcome: dict, error_hints: Iterable[tuple[str, str]] = ()) -> str | None:
    """The failure before any comparison: a forbidden call or an exception (with a hint)."""
    if outcome["forbidden"]:
        return forbidden_message(outcome["forbidden"])
    error = outcome["error"]
    if error is None:
        return None
    if error.startswith("NotImplementedError"):
        return "not implemented yet (the function still raises NotImplementedError)."
    hints = [hint for text, hint in error_hints if text in error]
    return f"your function raised {error}." + (f" {hints[0]}" if hints else "")


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, list):
        return f"a tuple of {len(value)} values"
    if isinstance(value, str) and value.startswith("<"):
        return value
    return repr(value) if value is None else type(value).__name__


def unpack(outputs, names: tuple[str, ...]) -> dict | str:
    """The outputs as {name: value}, or a message when they are not a tuple of len(names)."""
    if not isinstance(outputs, list) or len(outputs) != len(names):
        return f"expected a tuple ({', '.join(names)}), got {describe(outputs)}."
    return dict(zip(names, outputs, strict=True))


def structure_problem(actual: dict, expected: dict) -> str | None:
    """A message for the first output that is not a tensor of the expected shape and dtype."""
    for name, spec in expected.items():
        value = actual[name]
        if not isinstance(value, torch.Tensor):
            return f"{name} is {describe(value)}, expected a tensor."
        if tuple(value.shape) != tuple(spec.reference.shape):
            dims = ", ".join(spec.dims)
            return (f"{name} has shape {tuple(value.shape)}, expected {tuple(spec.reference.shape)} "
                    f"({dims}).")
        if spec.dtype is not None and value.dtype != spec.dtype:
            return f"{name} has dtype {value.dtype}, expected {spec.dtype}."
        if spec.dtype is None and not value.is_floating_point():
            return f"{name} has dtype {value.dtype}, expected a floating-point tensor."
    return None


def compare_all(actual: dict, expected: dict) -> dict[str, Comparison]:
    """The tolerance rule applied to every output."""
    return {name: compare(name, actual[name], spec.reference, spec.baseline,
                          dtype=spec.dtype if spec.dtype in ABS_FLOOR else spec.baseline.dtype,
                          floor=spec.floor)
            for name, spec in expected.items()}


def _error_map(actual: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """|actual - target| in float64: 0 where both hold the same infinity or both NaN, inf where
    one of them is NaN or infinite and the other is not."""
    a, t = actual.detach().double(), target.detach().double()
    agree = (torch.isinf(a) & (a == t)) | (torch.isnan(a) & torch.isnan(t))
    diff = torch.where(agree, torch.zeros_like(a), (a - t).abs())
    return torch.nan_to_num(diff, nan=float("inf"))


def wrong_positions(actual: torch.Tensor, target: torch.Tensor, bound: float) -> torch.Tensor:
    """Bool mask of the elements of ``actual`` that miss ``target`` by more than ``bound``."""
    return _error_map(actual, target) > bound


def matches(actual: dict, candidate: dict, comparisons: dict, scaled: bool = True) -> bool:
    """True when every output equals the candidate's (NaN where it has NaN) within the rule's
    bound, ``scaled`` up by the candidate's magnitude: a mistake can make outputs far larger
    than the O(1) values the bound is made for."""
    def bound(name):
        finite = candidate[name][torch.isfinite(candidate[name])]
        magnitude = float(finite.abs().max()) if finite.numel() and scaled else 0.0
        return comparisons[name].bound * max(1.0, magnitude)
    return all(actual[n].shape == candidate[n].shape
               and not wrong_positions(actual[n], candidate[n], bound(n)).any() for n in comparisons)


def matching_mistakes(candidates: Iterable[Candidate], actual: dict, expected: dict,
                      comparisons: dict) -> list[str]:
    """The messages of every known mistake whose outputs the learner's match, in order, once each.

    A candidate that the reference itself would match (the mistake changes nothing on
    this case) is skipped, and so is one that returns None (it does not apply). Several
    candidates may share a message (simulations of one mistake in different forms).
    """
    references = {name: spec.reference for name, spec in expected.items()}
    found = []
    for message, make in candidates:
        if message in found:
            continue
        outputs = make()
        if outputs is None or matches(references, outputs, comparisons, scaled=False):
            continue
        if matches(actual, outputs, comparisons):
            found.append(message)
    return found


def mistakes_message(found: list[str]) -> str:
    """One mistake's message, or all of them when this case cannot tell them apart."""
    if len(found) == 1:
        return found[0]
    listed = " ".join(f"({i}) {message}" for i, message in enumerate(found, 1))
    return (f"on this case {len(found)} different mistakes give exactly your outputs, so it cannot tell "
            f"which one you made (the other cases may): {listed}")


def _format_index(index: tuple[int, ...], dims: tuple[str, ...]) -> str:
    return ", ".join(f"{dim} {i}" for dim, i in zip(dims, index, strict=True))


def largest_error(actual: dict, expected: dict, comparisons: dict) -> str:
    """"Largest error in lse at [batch 0, head 1, query 5]: got nan, expected 2.73." for the
    output that misses its bound the most."""
    def badness(name):
        c = comparisons[name]
        return float("inf") if c.error != c.error else c.error / c.bound
    name = max((n for n in comparisons if not comparisons[n].ok), key=badness)
    a, r = actual[name], expected[name].reference
    errors = _error_map(a, r)
    index = tuple(int(i) for i in torch.unravel_index(torch.argmax(errors), errors.shape))
    return (f"Largest error in {name} at [{_format_index(index, expected[name].dims)}]: "
            f"got {a[index].item():.4g}, expected {r[index].item():.4g}.")


def diagnose(actual: dict, expected: dict, comparisons: dict,
             candidates: Iterable[Candidate] = (), detectors: Iterable[Detector] = ()) -> Verdict:
    """The failing verdict for outputs that miss the rule: the named mistakes, else the first
    detector's finding, else how far they are (``explained=False``); then the largest error."""
    found = matching_mistakes(candidates, actual, expected, comparisons)
    message = mistakes_message(found) if found else None
    for detector in detectors:
        if message is not None:
            break
        message = detector(actual, expected, comparisons)
    explained = message is not None
    if message is None:
        failing = [c for c in comparisons.values() if not c.ok]
        message = "does not match the reference: " + "; ".join(
            f"{c.name} max-abs error {c.error:.3g} > bound {c.bound:.3g}" for c in failing) + "."
    return Verdict(False, f"{message} {largest_error(actual, expected, comparisons)}", explained)


def judge_outputs(case: Case, outcome: dict, names: tuple[str, ...], expected: Callable[[], dict], *,
                  view: Callable[[dict], dict] | None = None,
                  candidates: Callable[[], Iterable[Candidate]] = tuple,
                  detectors: Iterable[Detector] = (), error_hints: Iterable[tuple[str, str]] = (),
                  limit_message: str = "") -> Verdict:
    """The whole judgement of one case whose function returns the tuple ``names``.

    expected() builds {name: Expected} for every returned name (and every name of
    the view); it and candidates() (the known mistakes) are only called when needed.
    view maps the returned outputs to what is compared (default: themselves).
    limit_message explains a broken ``case.tensor_limit``.
    """
    checked = checked_outputs(outcome, names, expected, error_hints)
    if isinstance(checked, Verdict):
        return checked
    actual, specs = checked
    if view is not None:
        actual = view(actual)
    specs = {name: specs[name] for name in actual}
    comparisons = compare_all(actual, specs)
    if all(c.ok for c in comparisons.values()):
        return over_limit(case, outcome, limit_message) or PASS
    return diagnose(actual, specs, comparisons, candidates(), detectors)


def checked_outputs(outcome: dict, names: tuple[str, ...], expected: Callable[[], dict],
                    error_hints: Iterable[tuple[str, str]] = ()) -> tuple[dict, dict] | Verdict:
    """(actual, specs): the returned outputs as {name: value} and expected()'s {name: Expected}; or a
    failing Verdict when the call raised or returned the wrong count, shapes or dtypes."""
    problem = outcome_problem(outcome, error_hints)
    if problem:
        return Verdict(False, problem)
    actual = unpack(outcome["outputs"], names)
    if isinstance(actual, str):
        return Verdict(False, actual)
    specs = expected()
    problem = structure_problem(actual, {name: specs[name] for name in names})
    if problem:
        return Verdict(False, problem)
    return actual, specs


def over_limit(case: Case, outcome: dict, limit_message: str) -> Verdict | None:
    """A failing verdict when the call created a larger tensor than ``case.tensor_limit`` allows."""
    largest = outcome.get("largest")
    if case.tensor_limit is None or largest is None or largest <= case.tensor_limit:
        return None
    return Verdict(False, f"the values are right, but your function created a tensor of {largest} "
                          f"elements (this case allows {case.tensor_limit}). {limit_message}".strip())


def only_some_fail(results: list[tuple[Case, Verdict]], has_property: Callable[[Case], bool],
                   hint: str, unexplained_only: bool = False) -> str | None:
    """``hint`` when every failing case has the property and at least one case without it passes.

    unexplained_only: give it only when no failing case's diagnosis found a cause (a hint
    about where to look must not contradict a mistake the diagnoses named).
    """
    failing = [(case, verdict) for case, verdict in results if not verdict.passed]
    passing = [case for case, verdict in results if verdict.passed]
    if unexplained_only and any(verdict.explained for _, verdict in failing):
        return None
    if failing and all(has_property(c) for c, _ in failing) and any(not has_property(c) for c in passing):
        return hint
    return None


def tensor_problem(value, shape: tuple, dtype: torch.dtype | None, what: str) -> str | None:
    """A message when ``value`` is not a tensor of this shape (and dtype, unless None)."""
    if not isinstance(value, torch.Tensor):
        return f"expected {what}, a tensor of shape {shape}, got {describe(value)}."
    if tuple(value.shape) != shape:
        return f"{what} has shape {tuple(value.shape)}; expected {shape}."
    if dtype is not None and value.dtype != dtype:
        return f"{what} has dtype {value.dtype}; expected {dtype}."
    return None


def exact_verdict(outcome, expected: torch.Tensor, what: str, mistakes, close: bool = False,
           where=lambda index: f"index {index}") -> Verdict:
    """The verdict on an output that must equal ``expected`` (``close``: to float32 rounding): the
    mistakes whose wrong output it equals are named ((message, wrong output) pairs), and the first
    wrong entry is shown, located by ``where(index)``."""
    problem = outcome_problem(outcome)
    if problem:
        return Verdict(False, problem)
    value = outcome["outputs"]
    problem = tensor_problem(value, tuple(expected.shape), expected.dtype, what)
    if problem:
        return Verdict(False, problem)

    def same(a, b):
        if close:
            return bool(torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5, equal_nan=False))
        return torch.equal(a, b)
    if same(value, expected):
        return PASS
    found = [message for message, wrong in mistakes if not same(wrong, expected) and same(value, wrong)]
    index = tuple(int(i) for i in torch.nonzero(~torch.isclose(value.double(), expected.double(),
                                                               rtol=1e-5, atol=1e-5))[0])
    def shown(x):
        return str(bool(x)) if expected.dtype == torch.bool else f"{x.item() + 0.0:.4g}"
    detail = f"First wrong entry: {where(index)} is {shown(value[index])}, expected {shown(expected[index])}."
    message = mistakes_message(found) if found else f"{what} is wrong."
    return Verdict(False, f"{message} {detail}", explained=bool(found))
