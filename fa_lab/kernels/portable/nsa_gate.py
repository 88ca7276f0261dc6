"""NSA's gated sum of its three branches in one pass: out = g_cmp o_cmp + g_sel o_sel + g_win o_win.

In PyTorch the sum over float32 copies of the branches moves about 72 bytes per output element (reads and
writes) through float32 temporaries (each branch widened, three products, two sums, the cast back): at 64K
tokens, 64 heads and d = 128 that is about 36 GiB, several milliseconds against an NSA forward of about thirty.
:func:`nsa_gate_mix_kernel` reads the three branches and the gates once, adds in float32 in registers and writes
the output once: 8 bytes per element in 16-bit dtypes. The backward, d branch_i = g_i dO and
d g_i = sum_d(o_i dO), is one pass too (:func:`nsa_gate_mix_bwd_kernel`): dO and the branches read once, the
three branch gradients written once, where PyTorch's float32 temporaries moved about three times the bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import head_dim_bucket, on_device

MIX_ROWS = 32  # rows of d values a program


@triton.jit
def nsa_gate_mix_kernel(cmp_ptr, sel_ptr, win_ptr, gates_ptr, out_ptr, rows, head_dim, ROWS: tl.constexpr,
                        DIM: tl.constexpr):
    """Branches and out (rows, head_dim), gates (rows, 3), all contiguous."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    dim = tl.arange(0, DIM)
    row_ok = row < rows
    mask = row_ok[:, None] & (dim < head_dim)[None, :]
    offsets = row[:, None] * head_dim + dim[None, :]
    total = _gated(cmp_ptr, gates_ptr, row, 0, offsets, row_ok, mask)
    total += _gated(sel_ptr, gates_ptr, row, 1, offsets, row_ok, mask)
    total += _gated(win_ptr, gates_ptr, row, 2, offsets, row_ok, mask)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated(branch_ptr, gates_ptr, row, index, offsets, row_ok, mask):
    """gates[row, index] * branch[row, :] in float32, (ROWS, DIM)."""
    gate = tl.load(gates_ptr + row * 3 + index, mask=row_ok, other=0.0).to(tl.float32)
    return gate[:, None] * tl.load(branch_ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def nsa_gate_mix_bwd_kernel(grad_ptr, cmp_ptr, sel_ptr, win_ptr, gates_ptr, grad_cmp_ptr, grad_sel_ptr,
                            grad_win_ptr, grad_gates_ptr, rows, head_dim, ROWS: tl.constexpr, DIM: tl.constexpr):
    """grad (dO), the branches and their gradients (rows, head_dim); gates (rows, 3); grad_gates (rows, 3)
    float32; all contiguous."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    dim = tl.arange(0, DIM)
    row_ok = row < rows
    mask = row_ok[:, None] & (dim < head_dim)[None, :]
    offsets = row[:, None] * head_dim + dim[None, :]
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    _branch_grads(grad, cmp_ptr, grad_cmp_ptr, gates_ptr, grad_gates_ptr, row, 0, offsets, row_ok, mask)
    _branch_grads(grad, sel_ptr, grad_sel_ptr, gates_ptr, grad_gates_ptr, row, 1, offsets, row_ok, mask)
    _branch_grads(grad, win_ptr, grad_win_ptr, gates_ptr, grad_gates_ptr, row, 2, offsets, row_ok, mask)


@triton.jit
def _branch_grads(grad, branch_ptr, grad_branch_ptr, gates_ptr, grad_gates_ptr, row, index, offsets, row_ok, mask):
    """Branch ``index``'s gradient gates[row, index] * grad and its gate's, sum_d(branch * grad), in float32."""
    gate = tl.load(gates_ptr + row * 3 + index, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(grad_branch_ptr + offsets, (gate[:, None] * grad).to(grad_branch_ptr.dtype.element_ty), mask=mask)
    branch = tl.load(branch_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(grad_gates_ptr + row * 3 + index, tl.sum(branch * grad, axis=1), mask=row_ok)


class GateMixFunction(torch.autograd.Function):
    """out = sum_i gates[..., i] * branches[i], the forward in :func:`nsa_gate_mix_kernel`."""

    @staticmethod
    def forward(ctx, gates, out_cmp, out_sel, out_win):
        branches = [t.contiguous() for t in (out_cmp, out_sel, out_win)]
        gates_rows = gates.contiguous()
        out = torch.empty_like(branches[0])
        rows, head_dim = out.numel() // out.shape[-1], out.shape[-1]
        with on_device(out):
            nsa_gate_mix_kernel[(triton.cdiv(rows, MIX_ROWS),)](*branches, gates_rows, out, rows, head_dim,
                                                                ROWS=MIX_ROWS, DIM=head_dim_bucket(head_dim))
        ctx.save_for_backward(gates_rows, *branches)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        gates, *branches = ctx.saved_tensors
        grad = grad_out.contiguous()
        grad_branches = [torch.empty_like(branch) for branch in branches]
        grad_gates = torch.empty(gates.shape, dtype=torch.float32, device=gates.device)
        rows, head_dim = grad.numel() // grad.shape[-1], grad.shape[-1]
        with on_device(grad):
            nsa_gate_mix_bwd_kernel[(triton.cdiv(rows, MIX_ROWS),)](
                grad, *branches, gates, *grad_branches, grad_gates, rows, head_dim, ROWS=MIX_ROWS,
                DIM=head_dim_bucket(head_dim))
        return grad_gates.to(gates.dtype), *grad_branches


def triton_nsa_gate_mix(gates: torch.Tensor, out_cmp, out_sel, out_win) -> torch.Tensor:
    """gates (B, H, N, 3), the three branches (B, H, N, d) in one 16-bit dtype: their gated sum in that dtype,
    summed in float32; differentiable in every input."""
    return GateMixFunction.apply(gates, out_cmp, out_sel, out_win)
