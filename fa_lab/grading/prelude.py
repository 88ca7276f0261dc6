"""Run in the grading kernel before the notebook: torch's own attention kernels raise.

The course's answers are absent from the sandbox (:mod:`fa_lab.grading.view`), but
torch's attention is part of torch itself. :func:`block_torch_attention` replaces,
in torch's dispatcher, the kernels of every aten operator of SDPA (all back ends),
of the fused multi-head attention and of the transformer layer with one that raises
:class:`TorchAttentionHidden`, and FlexAttention's Python entry point likewise.
A dispatcher entry is what every route reaches: ``F.scaled_dot_product_attention``,
``torch.ops.aten...``, a builtin kept under another name, a thread started earlier,
autograd. The registration handle is then left unreachable from Python.

This runs in the learner's process, so it is hardening rather than a guarantee:
code that rewrites the interpreter's memory (ctypes) could undo it. The guarantee
the grader gives is that the course's implementations are not there.

Only the standard library and torch are imported here.
"""
from __future__ import annotations

import ctypes
import warnings

import torch

# Words of the aten operators that compute attention (names as torch._C lists them, "aten::...").
ATTENTION_OPERATORS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention",
                       "_fused_sdp", "multi_head_attention", "transformer_encoder_layer")
_KEYS = ("CPU", "CUDA", "CompositeImplicitAutograd", "CompositeExplicitAutograd")


class TorchAttentionHidden(RuntimeError):
    """Raised by torch's attention while grading; ``hidden_name`` says which operator."""

    def __init__(self, name: str):
        super().__init__(f"{name} is not available while grading: the lab asks you to write attention yourself")
        self.hidden_name = name


def _raiser(name: str):
    def blocked(*args, **kwargs):
        raise TorchAttentionHidden(name)
    return blocked


def block_torch_attention() -> int:
    """Make torch's attention raise in this process; returns how many kernels were replaced."""
    operators = sorted(name for name in torch._C._dispatch_get_all_op_names()
                       if name.startswith("aten::") and any(word in name for word in ATTENTION_OPERATORS))
    library = torch._C._dispatch_library("IMPL", "aten", "", __file__, 0)
    replaced = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for qualified in operators:
            name = qualified.removeprefix("aten::")
            for key in _KEYS:
                if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key):
                    library.impl(name, key, _raiser(f"torch: {name}"), False)
                    replaced += 1
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(library))  # never freed, so never unregistered
    del library
    from torch.nn.attention import flex_attention
    flex_attention.flex_attention = _raiser("torch: flex_attention")
    return replaced
