"""The exercise registry: which labs exist, their exercises, and the cases each one runs.

A lab is one module ``fa_lab.grading.labs.labNN`` that defines ``LAB``, a
:class:`Lab`. Adding a lab means adding that module (and its solution
notebook); the engine (check, grade, assign) finds it by its id.
"""
from __future__ import annotations

import hashlib
import importlib
import pkgutil
import re
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

LAB_ID = re.compile(r"lab\d\d")


@dataclass(frozen=True)
class Case:
    """One call of the learner's function.

    args: the positional arguments (tensors, lists of tensors, numbers, bools, None:
        what ``torch.save`` can carry to the grading kernel).
    tensor_limit: when set, the call may create no tensor with more elements, as
        :class:`fa_lab.grading.harness.TensorProbe` counts them (a tiled algorithm never
        builds the full score matrix).
    """

    name: str
    args: tuple
    tensor_limit: int | None = None
    hidden: bool = False


@dataclass(frozen=True)
class Verdict:
    """The judgement of one case: passed, and a message (the diagnosis when it failed).

    explained: False when the diagnosis found no cause (it only says how far the outputs
    are from the reference); a summary hint about where to look is given only then.
    """

    passed: bool
    message: str
    explained: bool = True


@dataclass(frozen=True)
class Exercise:
    """One graded function of a lab.

    name: the key learners pass to ``check(name, fn)`` and the grader reports.
    function: the name the notebook defines (the grader looks it up in the kernel).
    calling: how the harness calls it, see :func:`fa_lab.grading.harness.run_cases`.
    public_cases(): the cases ``check`` runs (fixed inputs).
    hidden_cases(generator): more cases, drawn from the instructor's seed.
    judge(case, outcome): compares the harness's outcome of a case (a dict) with
        the reference, in the grader's process, and diagnoses a failure.
    summarize(results): optional hint drawn from all (case, verdict) pairs
        (e.g. "only the causal cases fail").
    forbidden, allowed: dotted names of functions or modules that this exercise
        forbids on top of the course-wide list, or lets the learner call (a
        reference the exercise builds on); see :class:`fa_lab.grading.harness.CallGuard`.
    """

    name: str
    function: str
    points: float
    public_cases: Callable[[], list[Case]]
    hidden_cases: Callable[[torch.Generator], list[Case]]
    judge: Callable[[Case, dict], Verdict]
    calling: str = "call"
    summarize: Callable[[list[tuple[Case, Verdict]]], str | None] | None = None
    forbidden: tuple[str, ...] = ()
    allowed: tuple[str, ...] = ()

    def cases(self, seed: int | None = None) -> list[Case]:
        """The public cases, followed by the hidden ones drawn from ``seed`` when it is given."""
        return list(self.public_cases()) + (self.hidden(seed) if seed is not None else [])

    def hidden(self, seed: int) -> list[Case]:
        """The hidden cases drawn from ``seed`` (marked hidden)."""
        return [replace(c, hidden=True) for c in self.hidden_cases(case_generator(seed, self.name))]


@dataclass(frozen=True)
class Lab:
    """A lab: its id (``"lab01"``, also in the notebook's metadata), title, notebook file name, exercises."""

    id: str
    title: str
    notebook: str
    exercises: tuple[Exercise, ...] = field(default_factory=tuple)

    @property
    def max_score(self) -> float:
        return float(sum(e.points for e in self.exercises))


class UnknownLab(LookupError):
    """Raised for a lab id that no module in fa_lab.grading.labs defines."""


def case_generator(seed: int, salt: str) -> torch.Generator:
    """A generator seeded from (seed, salt): each exercise draws its own stream from one seed."""
    digest = hashlib.sha256(f"{seed}:{salt}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def lab_ids() -> list[str]:
    """The ids of every lab module, sorted."""
    from . import labs
    return sorted(m.name for m in pkgutil.iter_modules(labs.__path__) if LAB_ID.fullmatch(m.name))


def get_lab(lab_id: str) -> Lab:
    """The :class:`Lab` with this id; raises :class:`UnknownLab` naming the known ones."""
    if not isinstance(lab_id, str) or lab_id not in lab_ids():
        raise UnknownLab(f"unknown lab {lab_id!r}; known labs: {', '.join(lab_ids()) or 'none'}")
    return importlib.import_module(f"fa_lab.grading.labs.{lab_id}").LAB


def find_exercise(name: str) -> Exercise:
    """The exercise called ``name`` in any lab (names are unique across labs)."""
    known = []
    for lab_id in lab_ids():
        for exercise in get_lab(lab_id).exercises:
            if exercise.name == name:
                return exercise
            known.append(exercise.name)
    raise KeyError(f"no exercise called {name!r}; the exercises are: {', '.join(known)}")
