"""impl="triton": the launchers of the plain-Triton kernels and their autograd.Function.

The kernels (:mod:`.forward`, :mod:`.backward`, :mod:`.pipelined_forward`) read and write tiles
through tensor descriptors over (batch, heads, seqlen, head_dim) tensors. The launchers take
operands prepared by :func:`fa_lab.kernels.common.kernel_operand` (head_dim padded to a multiple
of 8, unit stride in head_dim, 16-byte aligned strides), pick the tile configuration and launch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...block_info import BlockInfo
from .. import interpreting, load_triton
from ..common import LOG2E, cdiv, check_triton_inputs, descriptor, head_dim_bucket, kernel_operand, on_device
from .configs import TileConfig, backward_config, forward_config


@dataclass(frozen=True)
class ScoreOptions:
    """Chapter 05's options as the kernels take them: window (left, right), softcap (0: off),
    alibi_slopes ((B, H) float32 or None). Grouped K/V heads are read off the tensors' shapes."""

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None

    def kernel_args(self, q, k, causal: bool, scale: float) -> tuple[tuple, dict]:
        """(runtime arguments, constexprs) after qk_scale in every kernel: group, left, right,
        softcap_scale, softcap_log2, slopes_ptr; CAUSAL, WINDOW, SOFTCAP, ALIBI, GQA. A window that
        bounds more than causal does takes the kernels' windowed path, with causal folded in."""
        group = q.shape[1] // k.shape[1]
        info = BlockInfo(q.shape[2], k.shape[2], causal, self.window)
        left, right = info.window_bounds() if info.banded else (0, 0)
        softcap_scale = scale / self.softcap if self.softcap else 0.0
        slopes = self.alibi_slopes
        slopes = slopes.float().contiguous() if slopes is not None else torch.empty(1, device=q.device)
        constexprs = dict(CAUSAL=info.causal_only, WINDOW=info.banded, SOFTCAP=bool(self.softcap),
                          ALIBI=self.alibi_slopes is not None, GQA=group > 1)
        return (group, left, right, softcap_scale, self.softcap * LOG2E, slopes), constexprs


NO_OPTIONS = ScoreOptions()


def triton_forward(q, k, v, causal: bool, scale: float, config: TileConfig | None = None,
                   options: ScoreOptions = NO_OPTIONS, seqused_k=None, out=None):
    """Forward on prepared operands q: (B, H, Nq, d8), k, v: (B, Hkv, Nk, d8).

    seqused_k: int32 (B,) on q's device, or None: k and v are a KV cache of Nk slots of which sequence
    b uses the first seqused_k[b] (flash-attn's name; causal and windows align to them). out: where to write O, a
    view shaped like q that a descriptor can describe (:func:`fa_lab.kernels.common.tma_readable`), or None.
    Returns (out: (B, H, Nq, d8) in q.dtype, lse: (B, H, Nq) float32).
    """
    from .forward import attention_fwd_kernel

    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    config = config or forward_config(head_dim, causal, interpreting())
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    grid = (cdiv(seqlen_q, config.block_m), batch * heads)
    option_args, constexprs = options.kernel_args(q, k, causal, scale)
    attention_fwd_kernel[grid](
        descriptor(q, config.block_m), descriptor(k, config.block_n), descriptor(v, config.block_n),
        descriptor(out, config.block_m), lse, heads, seqlen_q, seqlen_k, scale * LOG2E, *option_args,
        *_no_varlen(lse, 1, seqused_k), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HEAD_DIM=head_dim_bucket(head_dim), REVERSE_GRID=causal, VARLEN=False, SEQUSED=seqused_k is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **constexprs,
    )
    return out, lse


def _no_varlen(any_tensor, outputs: int, seqused_k=None) -> tuple:
    """The packed-batch arguments of a dense launch (cu_q, cu_k, tiles, the output pointers, head_dim):
    never read, since VARLEN is off, except cu_k, which carries seqused_k where one is given."""
    cu_k = any_tensor if seqused_k is None else seqused_k
    return (any_tensor, cu_k) + (any_tensor,) * (1 + outputs) + (0,)


def pipelined_forward(q, k, v, out, lse, descales, causal: bool, scale: float, config: TileConfig,
                      pipeline: bool = False, warp_specialize: bool = False, fp8: bool = False):
    """Launch :mod:`.pipelined_forward` on prepared operands, writing out and lse (as :func:`triton_forward`).

    v is V (B, H, Nk, d8) or, in FP8, V^T (B, H, d8, Nk); descales: the (B, H, tiles) float32 descales
    of q, k and v in FP8 (any three pointers otherwise: they are not read).
    """
    from .pipelined_forward import attention_fwd_pipelined_kernel

    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    head_dim_pad = head_dim_bucket(head_dim)
    desc_v = descriptor(v, head_dim_pad, config.block_n) if fp8 else descriptor(v, config.block_n)
    grid = (cdiv(seqlen_q, config.block_m), batch * heads)
    attention_fwd_pipelined_kernel[grid](
        descriptor(q, config.block_m), descriptor(k, config.block_n), desc_v, descriptor(out, config.block_m),
        lse, *descales, heads, seqlen_q, seqlen_k, scale * LOG2E,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim_pad, CAUSAL=causal,
        PIPELINE=pipeline, WARP_SPECIALIZE=warp_specialize, FP8=fp8,
        num_warps=config.num_warps, num_stages=config.num_stages)


def backward_preprocess(out, grad_out, lse):
    """(delta, lse2), each shaped like lse ((B, H, Nq), or (total_q, H) packed; float32): delta =
    rowsum(dO * O) and lse2 = lse * log2(e) (+inf where lse = -inf). out, grad_out: contiguous, their rows
    in lse's order ((B, H, Nq, d8), or (total_q, H, d8))."""
    from .backward import attention_bwd_preprocess_kernel

    rows, head_dim = lse.numel(), out.shape[-1]
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    pre_block = 64
    attention_bwd_preprocess_kernel[(cdiv(rows, pre_block),)](
        out, grad_out, lse, delta, lse2, rows, head_dim, LOG2E, HEAD_DIM=head_dim_bucket(head_dim), BLOCK=pre_block)
    return delta, lse2


def triton_backward(q, k, v, out, lse, grad_out, causal: bool, scale: float, config: TileConfig | None = None,
                    options: ScoreOptions = NO_OPTIONS, atomic_dq: bool = False, row_vectors=None, dq=None):
    """Backward on prepared operands (as :func:`triton_forward`); grad_out like out.

    atomic_dq: one kernel adds each tile pair's dQ share into a float32 buffer (5 tile products, not
    deterministic) instead of a second kernel recomputing S and dP per Q tile (7, deterministic).
    row_vectors: (delta, lse2) of :func:`backward_preprocess` where the caller has them (out and lse are then not
    read, and grad_out may be any view a descriptor can describe); dq: where to write dQ (such a view), or None.
    Returns (dq, dk, dv) in q.dtype, shaped like q, k, v (dk, dv summed over each group of query heads).
    """
    from .backward import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel

    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    config = config or backward_config(head_dim, interpreting())
    if row_vectors is None:
        grad_out = grad_out.contiguous()
        row_vectors = backward_preprocess(out, grad_out, lse)
    delta, lse2 = row_vectors
    dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))
    if dq is None:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    option_args, constexprs = options.kernel_args(q, k, causal, scale)
    meta = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim_bucket(head_dim),
                VARLEN=False, num_warps=config.num_warps, num_stages=config.num_stages, **constexprs)
    desc_q, desc_k, desc_v, desc_do = (descriptor(t, block) for t, block in (
        (q, config.block_m), (k, config.block_n), (v, config.block_n), (grad_out, config.block_m)))
    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic_dq else dq  # (dq: not read)
    attention_bwd_dkdv_kernel[(cdiv(seqlen_k, config.block_n), batch * k.shape[1])](
        desc_q, desc_k, desc_v, desc_do, descriptor(dk, config.block_n), descriptor(dv, config.block_n),
        descriptor(dq32, config.block_m), lse2, delta, heads, seqlen_q, seqlen_k, scale * LOG2E, scale,
        *option_args, *_no_varlen(lse2, 2), ATOMIC_DQ=atomic_dq, **meta)
    if atomic_dq:
        return dq.copy_(dq32), dk, dv
    attention_bwd_dq_kernel[(cdiv(seqlen_q, config.block_m), batch * heads)](
        desc_q, desc_k, desc_v, desc_do, descriptor(dq, config.block_m), lse2, delta, heads, seqlen_q,
        seqlen_k, scale * LOG2E, scale, *option_args, *_no_varlen(lse2, 1), **meta)
    return dq, dk, dv


def triton_backward_from_lse(q, k, v, out, lse, grad_out, causal: bool, scale: float):
    """The backward of one attention call whose forward ran elsewhere: given its output and natural-log
    LSE, return (dq, dk, dv) in q's dtype. q, out, grad_out (B, H, Nq, d); k, v (B, Hkv, Nk, d); lse
    (B, H, Nq) float32. With a merged (global) out and LSE, as ring attention passes them, the result is
    this block's exact share of the global gradients (P = exp(S - lse) is then the final softmax)."""
    head_dim = q.shape[-1]
    operands = [kernel_operand(t.contiguous()) for t in (q, k, v, out.to(q.dtype), grad_out.to(q.dtype))]
    with on_device(q):
        dq, dk, dv = triton_backward(*operands[:4], lse.float().contiguous(), operands[4], causal, scale)
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]


class TritonAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves the prepared q, k, v, O and the LSE for the backward.

    ``forward_fn(qp, kp, vp, causal, scale) -> (out, lse)`` runs on prepared operands
    (:func:`triton_forward` with a tile config, or the Hopper forward); the backward is
    ``backward_fn`` (the Hopper backward), by default :func:`triton_backward`, called with
    triton_backward's arguments.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, forward_fn, bwd_config, options=NO_OPTIONS, backward_fn=None):
        head_dim = q.shape[-1]
        qp, kp, vp = kernel_operand(q), kernel_operand(k), kernel_operand(v)
        with on_device(q):
            out, lse = forward_fn(qp, kp, vp, causal, scale)
        ctx.save_for_backward(qp, kp, vp, out, lse)
        ctx.args = (causal, scale, bwd_config, head_dim, options, backward_fn or triton_backward)
        ctx.mark_non_differentiable(lse)
        return out[..., :head_dim], lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        qp, kp, vp, out, lse = ctx.saved_tensors
        causal, scale, bwd_config, head_dim, options, backward_fn = ctx.args
        grad_out = kernel_operand(grad_out.to(qp.dtype))
        with on_device(qp):
            dq, dk, dv = backward_fn(qp, kp, vp, out, lse, grad_out, causal, scale, bwd_config, options)
        return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim], None, None, None, None, None, None


def triton_attention(q, k, v, causal: bool, scale: float | None,
                     fwd_config: TileConfig | None = None, bwd_config: TileConfig | None = None,
                     window=(-1, -1), softcap: float = 0.0, alibi_slopes=None):
    """Differentiable Triton attention on float16/bfloat16 q: (B, H, Nq, d), k, v: (B, Hkv, Nk, d):
    returns (out, lse). window, softcap, alibi_slopes ((B, H) float32): as :func:`fa_lab.attention`."""
    load_triton()
    check_triton_inputs(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    options = ScoreOptions(tuple(window), float(softcap), alibi_slopes)
    forward_fn = functools.partial(triton_forward, config=fwd_config, options=options)
    return TritonAttentionFunction.apply(q, k, v, causal, scale, forward_fn, bwd_config, options)


# ---- packed variable-length batches ---------------------------------------------------------------

def varlen_schedule(bounds_q: list[int], bounds_k: list[int], block: int, by_keys: bool, causal: bool,
                    window, device) -> torch.Tensor:
    """(tiles, 2) int32 (sequence, first row): the tiles of a packed batch, one program each.

    by_keys: tiles of ``block`` keys (the dK/dV kernel), else of ``block`` queries. No tile is padded
    to the longest sequence: each sequence has cdiv(length, block) of them. They are ordered by their
    work, largest first, so that the long ones start first and the short ones fill the end
    (longest-processing-time order): a query tile's work is the keys it visits, a key tile's the query
    rows that may see it (an upper bound, which is enough to order them).

    A training loop calls this for every forward and twice per backward, so the schedule of a batch is
    built once and kept on the device (the last few batches' schedules; the tensor is only read).
    """
    return _cached_schedule(tuple(bounds_q), tuple(bounds_k), block, by_keys, causal, tuple(window), str(device))


@functools.lru_cache(maxsize=64)
def _cached_schedule(bounds_q: tuple, bounds_k: tuple, block: int, by_keys: bool, causal: bool, window: tuple,
                     device: str) -> torch.Tensor:
    tiles = tile_schedule(bounds_q, bounds_k, block, by_keys, causal, window)
    if torch.device(device).type == "cpu":
        return tiles
    return tiles.pin_memory().to(device, non_blocking=True)  # a copy from pageable memory would wait for the GPU


def tile_schedule(bounds_q, bounds_k, block: int, by_keys: bool, causal: bool, window) -> torch.Tensor:
    """:func:`varlen_schedule`'s tiles on the host, built with tensor operations rather than a loop over
    the tiles: MoBA's second pass packs 512 sequences in about 20,000 query tiles at 64K tokens, and a new
    selection every call (a loop over :class:`BlockInfo` took 0.14 s for them on the CPU). Each tile's work
    is :meth:`BlockInfo.key_range`'s width (query tiles) or the rows from :meth:`BlockInfo.first_query` on
    (key tiles), with every sequence's own offset; ties keep (sequence, start) order."""
    bounds_q, bounds_k = (torch.as_tensor(b, dtype=torch.int64) for b in (bounds_q, bounds_k))
    seqlen_q, seqlen_k = bounds_q[1:] - bounds_q[:-1], bounds_k[1:] - bounds_k[:-1]
    tiles = -(-(seqlen_k if by_keys else seqlen_q) // block)
    sequence = torch.repeat_interleave(torch.arange(len(tiles)), tiles)
    start = (torch.arange(len(sequence)) - torch.repeat_interleave(torch.cumsum(tiles, 0) - tiles, tiles)) * block
    info = BlockInfo(0, 0, causal, tuple(window))  # the sides only: lengths and offsets are per sequence
    left, right = info.left, info.right
    seqlen_q, seqlen_k = seqlen_q[sequence], seqlen_k[sequence]
    offset = seqlen_k - seqlen_q
    if by_keys:  # the first query row that sees key `start` (BlockInfo.first_query)
        first = torch.zeros_like(start) if right is None else (start - offset - right).clamp(min=0)
        last = seqlen_q - 1 if left is None else torch.minimum(start - offset + left, seqlen_q - 1)
        work = seqlen_q - torch.where(first <= last, first, seqlen_q)
    else:  # the keys rows [start, start + block) see (BlockInfo.key_range)
        last_row = torch.minimum(start + block, seqlen_q) - 1
        begin = torch.zeros_like(start) if left is None else (start + offset - left).clamp(min=0)
        begin = torch.minimum(begin, seqlen_k)
        end = seqlen_k if right is None else torch.minimum((last_row + offset + right + 1).clamp(min=0), seqlen_k)
        work = (end - begin).clamp(min=0)
    order = torch.sort(-work, stable=True).indices
    return torch.stack([sequence[order], start[order]], dim=1).to(torch.int32)


@dataclass(frozen=True)
class DeviceTiles:
    """A packed batch whose offsets stay on the device, for a forward without a mask whose caller knows only how
    many query rows it packed at most (MoBA's second pass: a kernel counts its sequences, and reading them back
    would wait for the GPU). cu_q, cu_k: int32 (S + 1,) on the device; max_rows: at least cu_q[-1].

    :meth:`schedule` gives every launch an upper bound of tiles: each sequence's, in order, then tiles of an empty
    sequence appended after the last (no keys and no rows: the kernel reads nothing of it and stores nothing), so
    the grid is sized without reading the offsets."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_rows: int

    def schedule(self, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tiles (T, 2) int32 (sequence, first row), cu_q, cu_k with the empty sequence) for tiles of ``block``
        query rows; T = cdiv(max_rows, block) + S, at least the tiles the sequences need."""
        sequences = len(self.cu_q) - 1
        lengths = (self.cu_q[1:] - self.cu_q[:-1]).long()
        ends = torch.cumsum(-(-lengths // block), 0)  # each sequence's tiles end here
        tile = torch.arange(cdiv(self.max_rows, block) + sequences, device=self.cu_q.device)
        sequence = torch.searchsorted(ends, tile, right=True)  # `sequences` past the last: the empty one
        first = torch.cat([ends.new_zeros(1), ends])[sequence]
        start = torch.where(sequence < sequences, (tile - first) * block, 0)
        tiles = torch.stack([sequence, start], dim=1).to(torch.int32)
        return tiles, torch.cat([self.cu_q, self.cu_q[-1:]]), torch.cat([self.cu_k, self.cu_k[-1:]])


def query_tiles(bounds, cu_q, cu_k, block: int, causal: bool, window, device):
    """(tiles, cu_q, cu_k) of a packed forward's launch over tiles of ``block`` query rows: ``bounds`` as
    :func:`host_bounds` takes them (:func:`varlen_schedule`), or :class:`DeviceTiles` (no mask)."""
    if isinstance(bounds, DeviceTiles):
        if causal or tuple(window) != (-1, -1):
            raise ValueError("DeviceTiles packs batches without a mask: causal and window are not taken")
        return bounds.schedule(block)
    return varlen_schedule(*host_bounds(bounds), block, False, causal, window, device), cu_q, cu_k


def host_bounds(bounds) -> tuple[list[int], list[int]]:
    """(cu_seqlens_q, cu_seqlens_k) as lists: ``bounds`` is that pair, or an object whose ``lists()`` gives it
    (:class:`fa_lab.varlen.PackedBounds`, which waits there for its copy to the host: a launcher calls this
    as late as it can)."""
    return bounds.lists() if hasattr(bounds, "lists") else bounds


def heads_view(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, heads, d8) operand seen as (1, heads, total, d8), what the descriptors take."""
    return t.permute(1, 0, 2).unsqueeze(0)


def triton_varlen_forward(q, k, v, cu_q, cu_k, bounds, causal: bool, scale: float, options: ScoreOptions,
                          config: TileConfig | None = None):
    """Forward of a packed batch on prepared operands q: (total_q, H, d8), k, v: (total_k, Hkv, d8).

    bounds: (cu_seqlens_q, cu_seqlens_k) as lists, as :func:`host_bounds` takes them, or :class:`DeviceTiles`
    (no mask). Returns
    (out: (total_q, H, d8), lse: (H, total_q) float32).
    """
    from .forward import attention_fwd_kernel

    total_q, heads, head_dim = q.shape
    config = config or forward_config(head_dim, causal, interpreting())
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    tiles, cu_q, cu_k = query_tiles(bounds, cu_q, cu_k, config.block_m, causal, options.window, q.device)
    if not len(tiles):
        return out, lse
    qv, kv, vv = heads_view(q), heads_view(k), heads_view(v)
    option_args, constexprs = options.kernel_args(qv, kv, causal, scale)
    attention_fwd_kernel[(len(tiles), heads)](
        descriptor(qv, config.block_m), descriptor(kv, config.block_n), descriptor(vv, config.block_n),
        descriptor(heads_view(out), config.block_m), lse, heads, total_q, k.shape[0], scale * LOG2E,
        *option_args, cu_q, cu_k, tiles, out, head_dim,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim_bucket(head_dim), REVERSE_GRID=False,
        VARLEN=True, num_warps=config.num_warps, num_stages=config.num_stages, **constexprs)
    return out, lse


def triton_varlen_backward(q, k, v, out, lse, grad_out, cu_q, cu_k, bounds, causal: bool, scale: float,
                           options: ScoreOptions, config: TileConfig | None = None):
    """Backward of a packed batch (operands as :func:`triton_varlen_forward`); returns (dq, dk, dv)."""
    from .backward import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel

    total_q, heads, head_dim = q.shape
    bounds = host_bounds(bounds)
    config = config or backward_config(head_dim, interpreting())
    grad_out = grad_out.contiguous()
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if total_q * heads == 0:
        return dq, dk, dv
    # (total_q, H): the row order of out and grad_out
    delta, lse2 = backward_preprocess(out, grad_out, lse.t().contiguous())
    views = [heads_view(t) for t in (q, k, v, grad_out)]
    option_args, constexprs = options.kernel_args(views[0], views[1], causal, scale)
    meta = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim_bucket(head_dim), VARLEN=True,
                num_warps=config.num_warps, num_stages=config.num_stages, **constexprs)
    descriptors = [descriptor(t, block) for t, block in zip(views, (config.block_m, config.block_n,
                                                                    config.block_n, config.block_m))]
    key_tiles = varlen_schedule(*bounds, config.block_n, True, causal, options.window, q.device)
    if len(key_tiles):
        attention_bwd_dkdv_kernel[(len(key_tiles), k.shape[1])](
            *descriptors, descriptors[1], descriptors[2], descriptors[0], lse2, delta, heads, total_q, k.shape[0],
            scale * LOG2E, scale, *option_args, cu_q, cu_k, key_tiles, dk, dv, head_dim, **meta)
    query_tiles = varlen_schedule(*bounds, config.block_m, False, causal, options.window, q.device)
    if len(query_tiles):
        attention_bwd_dq_kernel[(len(query_tiles), heads)](
            *descriptors, descriptors[0], lse2, delta, heads, total_q, k.shape[0], scale * LOG2E, scale,
            *option_args, cu_q, cu_k, query_tiles, dq, head_dim, **meta)
    return dq, dk, dv


class TritonVarlenFunction(torch.autograd.Function):
    """Autograd wrapper of a packed batch: saves the prepared q, k, v, O and the LSE."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, bounds, causal, scale, options, forward_fn=None, backward_fn=None):
        head_dim = q.shape[-1]
        qp, kp, vp = kernel_operand(q), kernel_operand(k), kernel_operand(v)
        with on_device(q):
            out, lse = (forward_fn or triton_varlen_forward)(qp, kp, vp, cu_q, cu_k, bounds, causal, scale, options)
        ctx.save_for_backward(qp, kp, vp, out, lse, cu_q, cu_k)
        ctx.args = (bounds, causal, scale, options, head_dim, backward_fn or triton_varlen_backward)
        ctx.mark_non_differentiable(lse)
        return out[..., :head_dim], lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        qp, kp, vp, out, lse, cu_q, cu_k = ctx.saved_tensors
        bounds, causal, scale, options, head_dim, backward_fn = ctx.args
        grad_out = kernel_operand(grad_out.to(qp.dtype))
        with on_device(qp):
            dq, dk, dv = backward_fn(qp, kp, vp, out, lse, grad_out, cu_q, cu_k, bounds, causal, scale, options)
        return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim], *(None,) * 8


def triton_varlen_attention(q, k, v, cu_q, cu_k, bounds, causal: bool, scale: float, window=(-1, -1),
                            softcap: float = 0.0, alibi_slopes=None, forward_fn=None, backward_fn=None):
    """Differentiable attention of a packed batch in one launch per kernel: q (total_q, H, d), k, v
    (total_k, Hkv, d) float16/bfloat16, cu_q, cu_k int32 offsets, bounds their values as lists;
    alibi_slopes (batch, H) float32 or None. Returns (out (total_q, H, d), lse (H, total_q)).
    forward_fn, backward_fn: the forward and backward on prepared operands (:func:`triton_varlen_forward`'s and
    :func:`triton_varlen_backward`'s signatures; those are the defaults), which impl="triton_hopper" replaces
    with its Gluon kernels."""
    load_triton()
    check_triton_inputs(q)
    options = ScoreOptions(tuple(window), float(softcap), alibi_slopes)
    return TritonVarlenFunction.apply(q, k, v, cu_q, cu_k, bounds, causal, scale, options, forward_fn, backward_fn)
