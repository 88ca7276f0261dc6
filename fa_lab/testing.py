"""The tolerance rule every test of an attention implementation uses.

From flash-attn's own tests: compare against a float64 reference; the max-abs
error of the implementation under test must be at most twice the max-abs error
of plain PyTorch attention computed in the same dtype (the *baseline*), plus a
small absolute floor per dtype. The same rule applies to dQ, dK and dV; the LSE
is compared in float32 against the float64 LSE.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import naive_attention, reference_attention

# About one unit in the last place at 1.0 (half of it for float16/bfloat16).
ABS_FLOOR = {torch.float32: 1e-5, torch.float16: 5e-4, torch.bfloat16: 4e-3}
LSE_FLOOR = 1e-4


@dataclass
class Comparison:
    """Errors of one tensor: ``error`` (under test) and ``baseline_error`` (naive in the same dtype)."""

    name: str
    error: float
    baseline_error: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.error <= self.bound  # False for NaN

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return (f"{self.name}: max-abs error {self.error:.3g} vs bound {self.bound:.3g} "
                f"(2 x baseline {self.baseline_error:.3g} + floor) {verdict}")


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64; +inf positions must agree exactly, NaN anywhere gives NaN."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    both_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    diff = torch.where(both_inf, torch.zeros_like(a), (a - b).abs())
    if torch.isnan(diff).any():
        return float("nan")
    return diff.max().item() if diff.numel() else 0.0


def compare(name, actual, reference, baseline, dtype=None, floor=None) -> Comparison:
    """Apply the rule to one tensor. ``dtype`` picks the floor (default: actual's dtype)."""
    if tuple(actual.shape) != tuple(reference.shape):
        raise AssertionError(f"{name}: shape {tuple(actual.shape)}, expected {tuple(reference.shape)}")
    floor = ABS_FLOOR[dtype or actual.dtype] if floor is None else floor
    baseline_error = _max_abs(baseline, reference)
    return Comparison(name, _max_abs(actual, reference), baseline_error, 2 * baseline_error + floor)


def assert_attention_close(name, actual, reference, baseline, dtype=None, floor=None) -> Comparison:
    """Raise AssertionError unless ``actual`` meets the rule; return the Comparison."""
    result = compare(name, actual, reference, baseline, dtype, floor)
    if not result.ok:
        raise AssertionError(str(result))
    return result


def make_qkv(batch=1, heads=2, seqlen_q=64, seqlen_k=None, head_dim=32, dtype=torch.float32,
             device="cpu", generator=None, strided=False, requires_grad=True, heads_kv=None):
    """Random q: (B, H, Nq, d), k, v: (B, Hkv, Nk, d) from N(0, 1); Hkv = heads_kv, default H.

    ``strided`` builds them as (B, N, H, d) tensors viewed as (B, H, N, d), the
    non-contiguous layout a transformer's projections produce.
    """
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    heads_kv = heads if heads_kv is None else heads_kv
    tensors = []
    for n, h in ((seqlen_q, heads), (seqlen_k, heads_kv), (seqlen_k, heads_kv)):
        if strided:
            t = torch.randn(batch, n, h, head_dim, generator=generator).to(device, dtype).transpose(1, 2)
        else:
            t = torch.randn(batch, h, n, head_dim, generator=generator).to(device, dtype)
        tensors.append(t.requires_grad_(requires_grad))
    return tuple(tensors)


def check_attention(attention_fn, q, k, v, causal=False, scale=None, grads=True, generator=None, **options):
    """Run ``attention_fn(q, k, v, causal, scale, **options) -> (out, lse)`` and check it all.

    options: window, softcap, alibi_slopes (chapter 05), passed to the references too.

    Compares out, lse and (with ``grads``) dq, dk, dv against the float64
    reference under the tolerance rule; returns the list of Comparisons and
    raises AssertionError naming every tensor that fails.
    """
    dtype = q.dtype
    leaves = [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]
    out, lse = attention_fn(*leaves, causal, scale, **options)
    if out.dtype != dtype:
        raise AssertionError(f"out has dtype {out.dtype}, expected {dtype}")
    if lse.dtype != torch.float32:
        raise AssertionError(f"lse has dtype {lse.dtype}, expected torch.float32")
    # float64 leaves: gradients flowing into bf16 leaves would be rounded back to bf16.
    ref_leaves = [t.detach().double().requires_grad_(grads) for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref_leaves, causal, scale, **options)
    base_leaves = [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]
    base_out, base_lse = naive_attention(*base_leaves, causal, scale, **options)
    results = [compare("out", out, ref_out, base_out, dtype),
               compare("lse", lse, ref_lse, base_lse, floor=LSE_FLOOR)]
    if grads:
        grad_out = torch.randn(out.shape, generator=generator).to(out.device, dtype)
        out.backward(grad_out)
        ref_out.backward(grad_out.double())
        base_out.backward(grad_out)
        for name, t, r, b in zip(("dq", "dk", "dv"), leaves, ref_leaves, base_leaves):
            if t.grad is None:
                raise AssertionError(f"{name} is None: no gradient reached the input")
            results.append(compare(name, t.grad, r.grad, b.grad, dtype))
    failures = [str(r) for r in results if not r.ok]
    if failures:
        raise AssertionError("; ".join(failures))
    return results
