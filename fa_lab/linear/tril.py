"""solve_tril: the inverse of a unit lower-triangular matrix by blocked forward substitution.

The chunkwise delta rule needs ``T = A^{-1}`` for ``A = I + L`` (L strictly lower triangular), one per
chunk (:mod:`.delta`). fla's ``solve_tril`` computes it in 16 x 16 pieces, the size of a tensor-core
tile, and this is the same algorithm in PyTorch:

1. Invert every diagonal 16 x 16 block ``A_rr`` by forward substitution, one row at a time and all
   blocks at once: row i of the inverse is ``e_i - L_i,:i X_:i``, which reads only rows before it.
2. Fill in the block rows below, one at a time: for block row r,
   ``X_r,:r = -X_rr A_r,:r X_:r,:r`` (the blocks above are done, and ``X_:r,:r`` is lower triangular),
   which is one matmul per block row. fla's kernels merge the same identity pairwise instead, 16 -> 32
   -> 64: ``[[X_11, 0], [-X_22 A_21 X_11, X_22]]``, since a chunk of 64 has exactly four blocks.

A size that is not a multiple of 16 is padded with an identity block (whose inverse is itself).
Like ``torch.linalg.solve_triangular(A, I, upper=False, unitriangular=True)``, the function reads only
the strictly lower triangle: the diagonal is taken as ones and the upper triangle is ignored.
Differentiable through autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..block_info import cdiv

BLOCK = 16


def _invert_diagonal_blocks(lower: torch.Tensor) -> torch.Tensor:
    """lower: (..., blocks, B, B) strictly lower -> (..., blocks, B, B), the inverses of I + lower."""
    size = lower.shape[-1]
    eye = torch.eye(size, dtype=lower.dtype, device=lower.device).expand(lower.shape)
    rows = eye[..., :1, :]  # row 0 of the inverse is e_0
    for i in range(1, size):
        row = eye[..., i:i + 1, :] - lower[..., i:i + 1, :i] @ rows  # (..., 1, B): e_i - L_i,:i X_:i
        rows = torch.cat([rows, row], dim=-2)
    return rows


def solve_tril(a: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """(I + strictly_lower(a))^{-1} for a: (..., n, n) floating; returns (..., n, n) in a's dtype."""
    if not isinstance(a, torch.Tensor) or not a.is_floating_point():
        raise TypeError(f"a must be a floating-point tensor, got {type(a).__name__}"
                        + (f" of {a.dtype}" if isinstance(a, torch.Tensor) else ""))
    if a.ndim < 2 or a.shape[-1] != a.shape[-2] or a.shape[-1] == 0:
        raise ValueError(f"a must be a batch of square matrices (..., n, n) with n >= 1, got {tuple(a.shape)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    n = a.shape[-1]
    blocks = cdiv(n, block)
    pad = blocks * block - n
    lower = F.pad(torch.tril(a, diagonal=-1), (0, pad, 0, pad))  # padded rows are identity rows of A
    batch = lower.shape[:-2]
    tiles = lower.reshape(*batch, blocks, block, blocks, block).transpose(-3, -2)  # (..., r, c, B, B)
    diagonal_inverse = _invert_diagonal_blocks(torch.diagonal(tiles, dim1=-4, dim2=-3).movedim(-1, -3))
    inverse = diagonal_inverse[..., 0, :, :]  # X_:1,:1, grown one block row at a time
    for r in range(1, blocks):
        x_rr = diagonal_inverse[..., r, :, :]
        a_row = lower[..., r * block:(r + 1) * block, :r * block]  # A_r,:r
        x_row = -x_rr @ (a_row @ inverse)  # X_r,:r
        top = F.pad(inverse, (0, block))  # [X_:r,:r, 0]
        inverse = torch.cat([top, torch.cat([x_row, x_rr], dim=-1)], dim=-2)
    return inverse[..., :n, :n]
