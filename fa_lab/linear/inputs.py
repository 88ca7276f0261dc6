"""Validation of the arguments of :func:`fa_lab.linear.linear_attention` and :func:`fa_lab.linear.delta_rule`.

Every check runs before anything is computed and raises ``ValueError`` or ``TypeError`` naming the
argument, what it got and what it needs (the rule of :mod:`fa_lab.inputs`, whose q/k/v checks are
reused). Value checks (gates <= 0, beta in [0, 1]) read the tensors once, as :mod:`fa_lab.sparse`'s
index checks do.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..inputs import check_block_size, check_flag, check_tensors, resolve_scale

FORMS = ("recurrent", "parallel", "chunk")
IMPLS = ("torch", "triton")
# The PyTorch forms take float64 too (and then compute in float64; otherwise in float32).
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
LAYOUT = "(batch, heads, seqlen, head_dim)"
NO_GATE, SCALAR_GATE, DIM_GATE = "none", "scalar", "per_dim"


@dataclass(frozen=True)
class LinearCall:
    """A checked call: the resolved scale, which gate ``g`` is, and the options."""

    scale: float
    gate: str
    form: str
    impl: str
    chunk_size: int
    output_final_state: bool


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise: states and gates never run in 16 bits."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def gate_kind(g) -> str:
    """The kind of an already checked gate: "none", "scalar" ((B, H, N)) or "per_dim" ((B, H, N, d_k))."""
    return NO_GATE if g is None else (SCALAR_GATE if g.ndim == 3 else DIM_GATE)


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.nonzero(mask)[0])


def _check_float_tensor(name: str, t, device, optional: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; they must match")


def check_gate(g, q, allow_per_dim: bool) -> str:
    """g: None, (B, H, N) (one log-decay per head and step) or, if allowed, (B, H, N, d_k) (one per key
    dimension); finite and <= 0, since exp(g) is a decay in (0, 1]. Returns the gate kind."""
    if g is None:
        return NO_GATE
    _check_float_tensor("g", g, q.device)
    batch, heads, seqlen, head_dim_k = q.shape
    shapes = {(batch, heads, seqlen): SCALAR_GATE}
    if allow_per_dim:
        shapes[(batch, heads, seqlen, head_dim_k)] = DIM_GATE
    kind = shapes.get(tuple(g.shape))
    if kind is None:
        wants = " or ".join(str(s) for s in shapes)
        what = "one log-decay per head and step" + (", or per key dimension too" if allow_per_dim else "")
        raise ValueError(f"g must have shape {wants} ({what}), got {tuple(g.shape)}")
    if not bool(torch.isfinite(g).all()):
        where = _first(~torch.isfinite(g))
        raise ValueError(f"g must be finite; g{list(where)} = {g[where].item()}")
    if bool((g > 0).any()):
        where = _first(g > 0)
        raise ValueError(f"g is a log-decay and must be <= 0 (the decay exp(g) lies in (0, 1]); "
                         f"g{list(where)} = {g[where].item():.4g}. Pass log-decays such as F.logsigmoid(x)")
    return kind


def check_beta(beta, q) -> None:
    """beta: (B, H, N), in [0, 1]. The closed interval: sigmoid rounds to exactly 0 or 1 in bfloat16
    (sigmoid(6) = 1.0 there), and both ends are well defined (0 skips a step, 1 overwrites the value)."""
    _check_float_tensor("beta", beta, q.device, optional=False)
    if tuple(beta.shape) != tuple(q.shape[:3]):
        raise ValueError(f"beta must have shape (batch, heads, seqlen) = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    bad = ~((beta >= 0) & (beta <= 1))  # NaN fails both comparisons
    if bool(bad.any()):
        where = _first(bad)
        raise ValueError(f"beta must lie in [0, 1] (a learning rate, usually sigmoid(x)); beta{list(where)} = "
                         f"{beta[where].item():.4g}")


def check_state(initial_state, q, v) -> None:
    """initial_state: None or (B, H, d_k, d_v), any floating dtype (it is cast to the compute dtype)."""
    if initial_state is None:
        return
    _check_float_tensor("initial_state", initial_state, q.device)
    want = (*q.shape[:2], q.shape[3], v.shape[3])
    if tuple(initial_state.shape) != want:
        raise ValueError(f"initial_state must have shape (batch, heads, head_dim_k, head_dim_v) = {want}, "
                         f"got {tuple(initial_state.shape)}")


def check_linear_call(q, k, v, g, beta, initial_state, scale, output_final_state, form, chunk_size, impl,
                      delta: bool) -> LinearCall:
    """Check every argument of a linear-attention call (``delta``: the delta rule's, with beta)."""
    check_tensors(q, k, v, LAYOUT, empty_ok=False, dtypes=DTYPES)
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have q's shape {tuple(q.shape)} (batch, heads, seqlen, head_dim_k), "
                         f"got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != tuple(q.shape[:3]):
        raise ValueError(f"v must have shape (batch, heads, seqlen, head_dim_v) with q's first three "
                         f"{tuple(q.shape[:3])}, got {tuple(v.shape)}")
    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(map(repr, FORMS))}; got {form!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}; got {impl!r}")
    if impl == "triton" and form == "parallel":
        raise ValueError("form='parallel' is a reference in PyTorch only: use impl='torch', or form='chunk' "
                         "or 'recurrent' with impl='triton'")
    check_block_size("chunk_size", chunk_size)
    check_flag("output_final_state", output_final_state)
    scale = resolve_scale(scale, q.shape[-1])
    gate = check_gate(g, q, allow_per_dim=not delta)
    if delta:
        check_beta(beta, q)
    check_state(initial_state, q, v)
    return LinearCall(scale, gate, form, impl, chunk_size, output_final_state)
