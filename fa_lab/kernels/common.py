"""What every kernel family shares: constants, cdiv (the core's), and the host-side preparation of operands.

Host code only: this module does not import triton (the jit modules wrap the constants they use
as constexprs). The FP8 constants belong to the FP8 emulation of the core (:mod:`fa_lab.fp8`),
whose numerics the kernels reproduce: kernels import the core, never the other way round.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F

from ..block_info import cdiv
from ..fp8 import E4M3_MAX, P_SCALE
from . import interpreting

__all__ = ["E4M3_MAX", "LN2", "LOG2E", "P_SCALE", "SUPPORTED", "SideWork", "cdiv", "check_triton_inputs", "descriptor",
           "device_capability", "gluon_descriptor", "gluon_fp8_key_order", "grouped_entries", "head_dim_bucket",
           "kernel_operand", "on_device", "shared_layout", "sm_count", "tma_readable"]

LOG2E = math.log2(math.e)  # the kernels' softmax runs in base 2: exp(x) = exp2(x * LOG2E)
LN2 = math.log(2.0)  # and their lse comes back from base 2: lse = LN2 * (m + log2 l)
SUPPORTED = (torch.float16, torch.bfloat16)


def head_dim_bucket(head_dim: int) -> int:
    """The power of two >= head_dim (at least 16) that the kernels' tiles are padded to."""
    bucket = 16
    while bucket < head_dim:
        bucket *= 2
    return bucket


def check_triton_inputs(q) -> None:
    """Refuse what the kernels cannot run, with the reason."""
    if q.dtype not in SUPPORTED:
        raise TypeError(
            f"impl='triton' runs float16 and bfloat16; q has dtype {q.dtype}. A compiled tl.dot on "
            "float32 runs in TF32 (10-bit mantissa), which would not meet float32 accuracy: use "
            "impl='torch' for float32, or cast q, k, v to bfloat16."
        )
    if not q.is_cuda and not interpreting():
        raise ValueError(
            f"q is on {q.device}, but this machine has CUDA, so Triton compiles kernels for the GPU. "
            "Move q, k, v to 'cuda', or run on CPU with the interpreter by setting TRITON_INTERPRET=1 "
            "before fa_lab first imports triton."
        )


def kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """A view or copy of t: (B, ..., n) that a tensor descriptor can describe.

    The last dim is zero-padded to 16 bytes (8 elements of bf16, 16 of fp8; zero
    head_dim columns change neither QK^T nor the first d columns of PV), and the
    tensor is made contiguous when its last stride is not 1 or another stride or
    the base is not 16-byte aligned.
    """
    item = t.element_size()
    multiple = 16 // item
    if t.shape[-1] % multiple:
        t = F.pad(t, (0, multiple - t.shape[-1] % multiple))
    if not tma_readable(t):
        t = t.contiguous()
    return t


def tma_readable(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor can describe t: a contiguous last dim, and the base and every other stride a
    multiple of 16 bytes."""
    item = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * item % 16 == 0 for s in t.stride()[:-1])


def on_device(t: torch.Tensor):
    """The CUDA device context of t (Triton launches on the current device); a no-op on CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One high-priority stream per GPU for :class:`SideWork` (its blocks are dispatched before pending
    blocks of the default priority)."""
    return torch.cuda.Stream(device=device, priority=-1)


class SideWork:
    """GPU work queued beside the current stream: ``with side:`` queues its body on a second, high-priority
    stream that starts where the current stream stands when ``SideWork`` is made, so that the body runs while
    the current stream works through what was queued on it since (MoBA's gate and packing beside its first
    pass, :mod:`fa_lab.kernels.portable.moba`: neither needs the other).
    :meth:`join` makes the current stream wait for the body and hands it the body's tensors. On the CPU the
    body runs in order and both are no-ops."""

    def __init__(self, device: torch.device):
        self.main = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.side = _side_stream(device) if self.main is not None else None
        if self.side is not None:
            self.side.wait_stream(self.main)

    def __enter__(self):
        self._context = torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)

    def join(self, *tensors: torch.Tensor) -> None:
        """The current stream waits for the body; ``tensors`` (made by the body, read later on the current
        stream) keep their memory until the current stream's reads are done (``record_stream``)."""
        if self.side is not None:
            self.main.wait_stream(self.side)
            for t in tensors:
                t.record_stream(self.main)


def descriptor(t: torch.Tensor, block_rows: int, block_cols: int | None = None):
    """A plain-Triton descriptor over t: (B, H, rows, cols) whose tiles are (1, 1, block_rows, block_cols).

    block_cols defaults to the padded head_dim of t's last dim (t: (B, H, N, d8)); V^T in FP8,
    (B, H, d8, N), passes the keys per tile.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_cols = head_dim_bucket(t.shape[-1]) if block_cols is None else block_cols
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_rows, block_cols])


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU: a persistent kernel's grid."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def device_capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability (cached: asking torch costs microseconds, and launch paths ask on every call)."""
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The swizzled shared-memory layout of a Gluon TMA tile (cached: it would be rebuilt on every launch)."""
    from triton.experimental.gluon import language as gl

    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv,
               torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


def gluon_descriptor(t: torch.Tensor, block: list[int]):
    """A Gluon TMA descriptor over t: (B, H, N, d8), or V^T (B, H, d, N8), with tiles of shape ``block``.

    Built without the dataclass's own checks, which took a tenth of a launch's host time: t comes from
    :func:`kernel_operand` (a 16-byte aligned base and strides, a contiguous last dim), and the driver refuses a
    descriptor it cannot encode when the kernel is launched."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=block,
                         layout=shared_layout(tuple(block), t.dtype), padding="zero")
    return desc


def gluon_fp8_key_order(seqlen_k: int, device=None) -> torch.Tensor:
    """Where the Gluon FP8 kernel expects each key of V^T: index (N32,) into the keys, N32 = seqlen_k up to 32.

    Inside each 32-key block, position 16h + 4c + 2a + b holds key 16h + 8a + 2c + b: the order
    in which a thread of the WGMMA accumulator holds P, so P becomes an FP8 operand without
    moving data between threads. The jit copies: the Gluon kernel's reordering of P
    (:func:`fa_lab.kernels.hopper.fa3_softmax.p_operand`) and the fused quantization's gather of V
    (:mod:`fa_lab.kernels.hopper.fp8_quant`); tests/test_hopper.py checks both against this order.
    """
    position = torch.arange(cdiv(seqlen_k, 32) * 32, device=device)
    r = position % 32
    h, c, a, b = r // 16, r % 16 // 4, r % 4 // 2, r % 2
    return position - r + 16 * h + 8 * a + 2 * c + b


def grouped_entries(keys: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries grouped by key, as compressed sparse rows: keys integer (E,) in [0, groups], ``groups`` meaning
    "in no group". Returns (order int64 (E,), offsets int32 (groups + 1,)): the entries of group g are
    ``order[offsets[g]:offsets[g + 1]]``, in increasing entry order (a stable sort), and the ungrouped ones
    follow ``offsets[groups]``.

    Nothing waits for the GPU: the offsets come from the sorted keys by binary search. (``torch.bincount``
    on CUDA reads the keys' minimum and maximum back to the host first: at 64K tokens MoBA's forward waited
    there with the GPU idle, docs/experiments/sparse_kernels.md.)
    """
    if groups < 2 ** 31:  # half the bytes for the radix sort to move
        keys = keys.to(torch.int32)
    sorted_keys, order = torch.sort(keys, stable=True)
    starts = torch.arange(groups + 1, dtype=keys.dtype, device=keys.device)
    return order, torch.searchsorted(sorted_keys, starts, out_int32=True)

