"""Packed variable-length batches, flash-attn's ``flash_attn_varlen_func`` layout.

Sequence ``b`` of a batch owns rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` of the packed
``q: (total_q, heads, d)`` and ``k, v: (total_k, heads_kv, d)``: no padding is stored and
none is computed. Masks (causal, windows) are bottom-right aligned inside each sequence,
and a sequence may be empty. The output is packed the same way; the LSE is
``(heads, total_q)`` float32, as flash-attn returns it.

:func:`attention_varlen` with ``impl="triton"`` launches each kernel once for the whole batch:
every program takes one tile of one sequence from a schedule built over the sequences' tiles
(:func:`fa_lab.kernels.portable.attention.varlen_schedule`). ``impl="triton_hopper"`` walks the same
schedule in one launch of its Gluon forward (on sm_90; the portable kernels elsewhere); its backward
(``hopper_varlen_backward``) is the Gluon FA3 backward where ``uses_gluon_backward`` and
``gluon_backward_is_faster`` allow it, else the portable kernels. The other impls run each sequence
through the dense impl on views of the packed tensors. Either way nothing is padded, and
gradients flow to the packed inputs.
"""
from __future__ import annotations

import torch

from . import impls
from .inputs import check_flag, check_head_dims, check_heads, check_options, check_tensors
from .score_mods import check_alibi_slopes


def check_cu_seqlens(cu_seqlens, name: str, device) -> None:
    """What can be checked of ``cu_seqlens`` without reading it: a torch.Tensor, int32, 1-D with at least one
    offset, on ``device`` (:func:`check_bounds` checks its values)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (as flash-attn takes it), got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor of batch + 1 offsets, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != torch.device(device):
        raise ValueError(f"{name} is on {cu_seqlens.device} but q is on {device}; they must match")


def check_bounds(bounds: list[int], name: str, total: int) -> None:
    """The values of ``cu_seqlens`` (as a list): from 0, non-decreasing, ending at ``total``."""
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[0]}")
    steps = [b - a for a, b in zip(bounds, bounds[1:])]
    if any(step < 0 for step in steps):
        where = next(i for i, step in enumerate(steps) if step < 0)
        raise ValueError(f"{name} must be non-decreasing, but {name}[{where + 1}] = {bounds[where + 1]} < "
                         f"{name}[{where}] = {bounds[where]}")
    if bounds[-1] != total:
        raise ValueError(f"{name} ends at {bounds[-1]} but the packed tensor holds {total} tokens")


def _check_max_seqlen_type(max_seqlen, name: str) -> None:
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)):
        raise TypeError(f"{name} must be an int or None, got {type(max_seqlen).__name__}")


def _check_max_seqlen(max_seqlen, name: str, bounds: list[int]) -> None:
    longest = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"{name} is {max_seqlen} but the longest sequence has {longest} tokens; "
                         "a smaller max_seqlen would silently drop tokens")


def _version(t: torch.Tensor):
    """torch's count of in-place writes to t's storage, or None where it keeps none (inference-mode tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None


class PackedBounds:
    """cu_seqlens_q and cu_seqlens_k read back to the host, checked, as lists.

    Reading a GPU tensor waits for the GPU to finish the work queued before it, and the GPU then idles
    until the host has launched the next kernel. Two things keep that off the critical path:

    - a tensor is read once per version: its values stay with it (an attribute) together with torch's
      count of in-place writes to it, and a call with the same, unwritten tensor reads nothing. A model
      passes one ``cu_seqlens`` to every layer, so a batch is read once, not once per layer; a write by a
      torch operation (``copy_``, ``cu[1] = 5``) makes the next call read again. A write that torch does not
      count (a custom kernel writing through the pointer, a write through ``.data``) is not seen: give such
      a buffer to the call as a new tensor (``cu.clone()``).
    - otherwise the two offsets leave in one asynchronous copy when the call starts, and :meth:`lists`
      waits for it only where a kernel launch needs the values (the schedule of tiles), after the host work
      that needs none (operands, outputs, descriptors).

    :meth:`lists` raises the ValueError of bad values before anything is computed; the checks run on every
    call (a batch's values may be right for one call and wrong for the next: a total, a max_seqlen).
    """

    _VALUES = "_fa_lab_offsets"  # the attribute a read tensor carries: (version, values as a list)

    def __init__(self, cu_q, cu_k, totals: tuple[int, int], max_seqlens: tuple):
        self.totals, self.max_seqlens = totals, max_seqlens
        self.sizes = (cu_q.numel(), cu_k.numel())
        self._tensors = (cu_q, cu_k)
        self._versions = (_version(cu_q), _version(cu_k))
        known = [self._known_values(cu, version) for cu, version in zip(self._tensors, self._versions)]
        self._host, self._ready, self._lists = None, None, None
        if all(values is not None for values in known):
            self._values = known
            return
        self._values = None
        both = torch.cat([cu_q, cu_k])
        if both.is_cuda:
            self._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            self._host.copy_(both, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = both

    @classmethod
    def _known_values(cls, cu: torch.Tensor, version):
        """The values an earlier call read from ``cu`` if it has not been written since, else None."""
        entry = getattr(cu, cls._VALUES, None)
        return entry[1] if version is not None and entry is not None and entry[0] == version else None

    def _read(self) -> list[list[int]]:
        """Wait for the copy to the host and leave the values with their tensors for the next call."""
        if self._ready is not None:
            self._ready.synchronize()
        values = self._host.tolist()
        values = [values[:self.sizes[0]], values[self.sizes[0]:]]
        for cu, version, read in zip(self._tensors, self._versions, values):
            if version is not None:
                setattr(cu, self._VALUES, (version, read))
        return values

    def lists(self) -> tuple[list[int], list[int]]:
        """(bounds_q, bounds_k): the offsets as lists, once checked."""
        if self._lists is None:
            bounds = tuple(self._values or self._read())
            for name, values, total, longest in zip(("cu_seqlens_q", "cu_seqlens_k"), bounds, self.totals,
                                                    self.max_seqlens):
                check_bounds(values, name, total)
                _check_max_seqlen(longest, name.replace("cu_seqlens", "max_seqlen"), values)
            if self.sizes[0] != self.sizes[1]:
                raise ValueError(f"cu_seqlens_q describes {self.sizes[0] - 1} sequences but cu_seqlens_k "
                                 f"{self.sizes[1] - 1}; they must match")
            self._lists = bounds
        return self._lists


def _check_packed(q, k, v) -> None:
    """q: (total_q, H, d), k, v: (total_k, Hkv, d); a total may be 0."""
    check_tensors(q, k, v, "(total_tokens, heads, head_dim)", empty_ok=True)
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"v holds {v.shape[0]} tokens but k holds {k.shape[0]}; they must match")
    check_heads(q.shape[1], k.shape[1], v.shape[1])
    check_head_dims(q.shape[2], k.shape[2], v.shape[2])


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     causal: bool = False, scale: float | None = None, impl: str = "torch",
                     return_lse: bool = False, window=(-1, -1), softcap: float = 0.0, alibi_slopes=None):
    """Attention over a packed batch of sequences of different lengths.

    q: (total_q, heads, d); k, v: (total_k, heads_kv, d); cu_seqlens_q, cu_seqlens_k: int32
    (batch + 1,). max_seqlen_*: optional, at least the longest length. alibi_slopes: float32
    (heads,) or (batch, heads). Other arguments as :func:`fa_lab.attention`. Returns out
    (total_q, heads, d) or (out, lse) with lse (heads, total_q) float32, detached.
    """
    _check_packed(q, k, v)
    causal, scale, window, softcap = check_options(q.shape[-1], causal, scale, window, softcap)
    check_flag("return_lse", return_lse)
    check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.device)
    check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q.device)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()  # the kernels read them flat
    _check_max_seqlen_type(max_seqlen_q, "max_seqlen_q")
    _check_max_seqlen_type(max_seqlen_k, "max_seqlen_k")
    batch, heads = cu_seqlens_q.numel() - 1, q.shape[1]
    slopes = check_alibi_slopes(alibi_slopes, batch, heads, q.device)
    if impl not in impls.IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, impls.IMPLS))}; got {impl!r}")
    bounds = PackedBounds(cu_seqlens_q, cu_seqlens_k, (q.shape[0], k.shape[0]), (max_seqlen_q, max_seqlen_k))
    if impl in ("triton", "triton_hopper"):  # one launch per kernel: the kernels walk each sequence's tiles
        from .kernels import triton_varlen_attention
        out, lse = triton_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, bounds, causal,
                                           scale, window, softcap, slopes, hopper=impl == "triton_hopper")
        return (out, lse.detach()) if return_lse else out
    bounds_q, bounds_k = bounds.lists()
    outs, lses = [], []
    for b in range(batch):
        (q0, q1), (k0, k1) = bounds_q[b:b + 2], bounds_k[b:b + 2]
        if q1 == q0:
            continue
        if k1 == k0:  # no key at all: zeros and lse = -inf, as for any row that sees no key
            outs.append(q.new_zeros(q1 - q0, heads, q.shape[2]))
            lses.append(torch.full((heads, q1 - q0), float("-inf"), device=q.device))
            continue
        dense = [t[a:e].transpose(0, 1)[None] for t, (a, e) in ((q, (q0, q1)), (k, (k0, k1)), (v, (k0, k1)))]
        out, lse = impls.run(*dense, causal, scale, impl, window, softcap,
                             None if slopes is None else slopes[b:b + 1])
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs) if outs else q.new_zeros(0, heads, q.shape[2])
    lse = torch.cat(lses, dim=1) if lses else torch.zeros(heads, 0, device=q.device)
    return (out, lse.detach()) if return_lse else out
