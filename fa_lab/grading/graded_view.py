"""``fa_lab.grading`` as a graded notebook sees it: ``check()`` does nothing, hidden names raise.

The grader writes this file as ``fa_lab/grading/__init__.py`` of the package that it
shows a graded notebook (:mod:`fa_lab.grading.view`): the labs' cases, judges and
solutions are not there at all, and each name that the lab hides (what an exercise
asks the learner to write) is a placeholder made by :func:`hidden`, so that the
notebook's imports still work and using one says why it fails.

Only the standard library is imported here.
"""


class HiddenWhileGrading(RuntimeError):
    """Raised by a hidden name; ``hidden_name`` says which one."""

    def __init__(self, name: str):
        super().__init__(f"{name} is not available while grading: the lab asks you to write it yourself")
        self.hidden_name = name


class _Hidden:
    """A placeholder: calling it, indexing it (a Triton launch) or reading an attribute raises."""

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def __call__(self, *args, **kwargs):
        raise HiddenWhileGrading(self._name)

    def __getitem__(self, key):
        raise HiddenWhileGrading(self._name)

    def __getattr__(self, attribute: str):
        if attribute.startswith("__") and attribute.endswith("__"):  # introspection finds nothing
            raise AttributeError(attribute)
        raise HiddenWhileGrading(self._name)

    def __repr__(self) -> str:
        return f"<{self._name}: hidden while grading>"


def hidden(name: str) -> _Hidden:
    """The placeholder for the function or class ``name`` ("fa_lab.flash_torch.flash_forward")."""
    return _Hidden(name)


def check(name: str, fn) -> None:
    """While grading, the grader runs its own cases: this prints that and returns."""
    print(f"check({name!r}) skipped: the grader runs its own cases.")


__all__ = ["check"]
