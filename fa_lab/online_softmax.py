"""Online softmax: the running (m, l) state, its update with a new block, and the LSE merge.

The state of one query row after seeing some keys is ``m`` (the largest score so
far) and ``l`` (the sum of ``exp(s - m)`` over those keys). A new block of scores
raises ``m`` to ``m_new`` and rescales the old sum by ``alpha = exp(m - m_new)``;
nothing seen earlier needs to be revisited. Partial attention outputs computed
over disjoint key sets merge exactly by their log-sum-exp (:func:`merge_splits`, which
split-KV decoding and ring attention reuse; :func:`merge_partials` merges two).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass
class SoftmaxState:
    """Running softmax statistics of a batch of rows. m, l: (...,) float32."""

    m: torch.Tensor
    l: torch.Tensor

    @classmethod
    def empty(cls, shape, device=None) -> "SoftmaxState":
        """The state before any key: m = -inf, l = 0."""
        return cls(torch.full(shape, NEG_INF, device=device), torch.zeros(shape, device=device))

    @property
    def lse(self) -> torch.Tensor:
        """log(sum_j exp(s_j)) = m + log(l); -inf for rows that have seen no key."""
        return torch.where(self.l > 0, self.m + torch.log(self.l), torch.full_like(self.m, NEG_INF))


def finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """Replace -inf (a row with no visible key yet) by 0 so that exp(s - m) stays exp(-inf) = 0, never NaN."""
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def online_softmax_update(state: SoftmaxState, scores: torch.Tensor, inplace: bool = False):
    """Fold a block of scores into the state.

    scores: (..., Bc), -inf where masked. Returns (new_state, p, alpha) where
    p = exp(scores - m_new): (..., Bc) holds the unnormalized probabilities of
    this block and alpha = exp(m_old - m_new): (...,) is the factor by which
    everything accumulated so far (l and the output accumulator) must be rescaled.
    With ``inplace`` the probabilities overwrite ``scores`` (saves a tile-sized
    allocation in the hot loop of :mod:`fa_lab.flash_torch`).
    """
    m_new = torch.maximum(state.m, scores.amax(dim=-1))
    m_safe = finite_or_zero(m_new)[..., None]
    alpha = torch.exp(state.m - m_safe[..., 0])
    p = scores.sub_(m_safe).exp_() if inplace else torch.exp(scores - m_safe)
    l_new = alpha * state.l + p.sum(dim=-1)
    return SoftmaxState(m_new, l_new), p, alpha


def online_softmax(blocks):
    """Softmax of rows streamed as a sequence of column blocks, in two passes over the blocks.

    blocks: iterable of (..., Bc_j) tensors. Returns the (..., sum Bc_j) softmax,
    computed with only the running (m, l) state in the first pass.
    """
    blocks = list(blocks)
    state = SoftmaxState.empty(blocks[0].shape[:-1], blocks[0].device)
    for block in blocks:
        state, _, _ = online_softmax_update(state, block.float())
    lse = state.lse
    return torch.cat([torch.exp(b.float() - finite_or_zero(lse)[..., None]) for b in blocks], dim=-1)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Merge two attention results over disjoint key sets into the result over their union.

    out_*: (..., N, d), lse_*: (..., N) float32. The merged output is the
    LSE-weighted mix w_a * out_a + w_b * out_b with w_x = exp(lse_x - lse),
    lse = logaddexp(lse_a, lse_b). Rows empty in both stay 0 with lse = -inf.
    """
    out, lse = merge_splits(torch.stack([out_a.float(), out_b.float()]), torch.stack([lse_a, lse_b]))
    return out.to(out_a.dtype), lse


def merge_splits(outs, lses):
    """Merge S partial results over disjoint key sets (split-KV, ring steps): outs (S, ..., N, d),
    lses (S, ..., N) float32 -> (out (..., N, d) float32, lse (..., N)).

    lse = log sum_s exp(lse_s) and out = sum_s exp(lse_s - lse) out_s: each split's output is already
    normalized over its own keys, and exp(lse_s - lse) is the share of the softmax mass its keys hold.
    A split that saw no key (lse_s = -inf) weighs 0; rows empty in every split stay 0 with lse = -inf.
    """
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - finite_or_zero(lse)[None])[..., None]
    return (weights * outs.float()).sum(dim=0), lse
