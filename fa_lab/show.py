"""Showing the package's own source in a notebook.

Notebooks 03 and 04 read kernels top to bottom by printing them. :func:`source` prints a function's
(or class's) source between two comment lines that name its file and mark its end, so the stored
output reads on the web as the code it shows, and ``tests/nbval_sanitize.cfg`` can replace what
lies between the two lines: an edit of a kernel does not make the notebooks that print it fail.
"""
from __future__ import annotations

import inspect
from pathlib import Path


def source(obj) -> None:
    """Print the source of ``obj``: a function, a class, or a ``@triton.jit`` / ``@gluon.jit`` function.

    The first line is ``# <file, relative to the repository root>``, the last ``# (end of <name>)``.
    """
    function = getattr(obj, "fn", obj)  # a jit function keeps the Python function it wraps in .fn
    path = Path(inspect.getsourcefile(function)).resolve()
    root = Path(__file__).resolve().parents[1]
    print(f"# {path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name}")
    print(inspect.getsource(function).rstrip("\n"))
    print(f"# (end of {function.__name__})\n")
