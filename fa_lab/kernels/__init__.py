"""Triton kernels and their launchers.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so triton is
imported lazily here: on a machine without CUDA the interpreter is switched on
before the first import, and a learner never sets an environment variable.
"""
from __future__ import annotations

import importlib
import os

import torch


def load_triton():
    """Import triton, turning the interpreter on first when no CUDA GPU is present.

    Raises ImportError with set-up advice when Triton is not installed (it publishes
    Linux wheels only).
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        return importlib.import_module("triton")
    except ImportError as exc:  # pragma: no cover - depends on the platform
        raise ImportError(
            "impl='triton' needs Triton, which publishes Linux wheels only. On macOS or "
            "Windows run the course in WSL, a Linux container or a hosted notebook "
            "(see README.md, 'Running the Triton chapters')."
        ) from exc


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_attention(q, k, v, causal, scale):
    """Differentiable Triton attention: returns (out, lse). See :mod:`fa_lab.kernels.flash_triton`."""
    load_triton()
    from .flash_triton import triton_attention as run
    return run(q, k, v, causal, scale)
