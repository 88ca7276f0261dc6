"""Argument types of the ``fa-lab`` command: counts, limits and output files, checked when the command line is
parsed, so that a bad value stops the command (argparse's message, exit status 2) before a benchmark or a
grading run has spent its time, and before a result it would have written is lost.

Each is an argparse ``type=``: it takes the argument's text and returns the value, or raises
:class:`argparse.ArgumentTypeError` saying what it needs.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path


def _number(text: str, kind, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    """A count or a size: an integer of at least 1."""
    value = _number(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """An integer of at least 0 (a number of warm-up calls, say)."""
    value = _number(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def positive_float(text: str) -> float:
    """A limit (seconds, GiB): a finite number above 0."""
    value = _number(text, float, "a number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not above 0")
    return value


def output_file(text: str) -> str:
    """A file the command will write: its folder must exist, and the path must not be a folder."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist")
    return text


def plot_file(text: str) -> str:
    """An image file (:func:`output_file`) whose suffix names a format matplotlib writes (png, pdf, svg...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    output_file(text)
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(text).suffix.lstrip(".").lower()
    if suffix not in formats:
        raise argparse.ArgumentTypeError(f"{text}: {'.' + suffix if suffix else 'no suffix'} is not an image "
                                         f"format matplotlib writes (use one of {', '.join(sorted(formats))})")
    return text
