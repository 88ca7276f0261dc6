"""Autograding for the labs: ``check()`` in notebooks, the grader, lab generation.

In a lab notebook::

    from fa_lab.grading import check
    check("flash_forward", flash_forward)

The grader (``fa-lab grade``, :mod:`fa_lab.grading.grade`) and lab generation
(``fa-lab assign``, :mod:`fa_lab.grading.assign`) need nbformat and nbclient;
they are imported only when used. Labs live in :mod:`fa_lab.grading.labs`.
"""
from .check import check

__all__ = ["check"]
