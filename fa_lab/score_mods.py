"""What may change a score before the softmax: the soft cap and ALiBi, for every impl.

Both act on the scaled score ``s = scale * q . k`` of query row ``i`` and key ``j``
(bottom-right aligned, ``offset = seqlen_k - seqlen_q``), in this order, as flash-attn does:

* soft cap (Gemma 2): ``s -> softcap * tanh(s / softcap)`` keeps every score in
  ``(-softcap, softcap)``; its derivative is ``1 - tanh^2``, which the backward applies to dS;
* ALiBi: ``s -> s - slope * |i + offset - j|``, a per-head linear penalty on distance
  (an additive constant for the backward).

Masks (causal, windows) come after both, from :class:`fa_lab.block_info.BlockInfo`.
"""
from __future__ import annotations

import torch


def check_softcap(softcap) -> float:
    """``softcap`` as a float: 0.0 (off) or a finite positive number."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0 for none), got {type(softcap).__name__}")
    if softcap != 0 and (not softcap > 0 or softcap == float("inf")):
        raise ValueError(f"softcap must be 0.0 (off) or a finite positive number, got {softcap}")
    return float(softcap)


def check_alibi_slopes(slopes, batch: int, heads: int, device) -> torch.Tensor | None:
    """ALiBi slopes as a float32 (batch, heads) tensor (a (heads,) one is shared by the batch), or None.
    Non-finite slopes are refused on the CPU; on a GPU their values are not read."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {slopes.dtype}")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}) for batch {batch} "
                         f"and {heads} query heads, got {tuple(slopes.shape)}")
    if slopes.device != torch.device(device):
        raise ValueError(f"alibi_slopes is on {slopes.device} but q is on {device}")
    # (values are checked on the CPU only: reading a GPU tensor would make every call wait for the GPU)
    if not slopes.is_cuda and not torch.isfinite(slopes).all():
        raise ValueError("alibi_slopes must be finite")
    return slopes.expand(batch, heads)


def soft_cap(scores: torch.Tensor, softcap: float, inplace: bool = False) -> torch.Tensor:
    """softcap * tanh(scores / softcap) (in place with ``inplace``, which autograd cannot follow);
    scores themselves when softcap is 0."""
    if not softcap:
        return scores
    if inplace:
        return scores.div_(softcap).tanh_().mul_(softcap)
    return softcap * torch.tanh(scores / softcap)


def soft_cap_derivative(capped: torch.Tensor, softcap: float) -> torch.Tensor:
    """d capped / d scores = 1 - tanh^2, from the capped scores (1 where softcap is 0). A masked
    score (-inf) gets 0, not -inf, so that its dS (0) stays 0."""
    if not softcap:
        return torch.ones_like(capped)
    return 1 - (capped / softcap).clamp(-1.0, 1.0) ** 2


def alibi_bias(slopes: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, offset: int) -> torch.Tensor:
    """-slope * |row + offset - col|. slopes: (..., 1, 1) broadcastable; rows: (tq, 1); cols: (1, tk)."""
    return -slopes * (rows + offset - cols).abs().to(slopes.dtype)


def modify_scores(scores: torch.Tensor, softcap: float, slopes: torch.Tensor | None,
                  rows: torch.Tensor, cols: torch.Tensor, offset: int, inplace: bool = False) -> torch.Tensor:
    """The soft cap, then ALiBi, on a tile of scaled scores (..., tq, tk) (in place with ``inplace``).

    slopes: None, or broadcastable to scores' leading dims with two trailing 1s.
    rows, cols: (tq, 1) and (1, tk) int64 positions of the tile's queries and keys.
    """
    scores = soft_cap(scores, softcap, inplace)
    if slopes is None:
        return scores
    bias = alibi_bias(slopes.to(scores.dtype), rows, cols, offset)
    return scores.add_(bias) if inplace else scores + bias
