"""Fixes for bfloat16 in Triton's CPU interpreter, applied only when kernels run interpreted.

Triton 3.6's interpreter stores bfloat16 tensors as their raw 16-bit patterns
(numpy has no bfloat16), and two operations get them wrong:

* ``tl.dot`` multiplies the integer patterns instead of the numbers, so every
  bfloat16 product is garbage. The fix widens bfloat16 operands to float32
  first, which is what tensor cores compute (exact products, float32 sums).
* ``x.to(tl.bfloat16)`` from float32 truncates the mantissa, where the GPU rounds
  to nearest even. A probability of 0.99999994 then becomes 0.99609375 instead
  of 1.0, an error a compiled kernel never makes. The fix rounds to nearest even
  (and does the same for float32 -> float8 e4m3, through torch's own conversion;
  that cast also reaches ``create_fp_to_fp``, whose e4m3 rounding drops the carry
  into the exponent: 1.9868 became 1.0).

It also lacks one operation: a tensor descriptor's ``atomic_add`` (a TMA reduce-add on sm_90), which the
backward with atomic dQ uses. :func:`patch_descriptor_reduce` adds it as a load, an add and a store: the
interpreter runs one program at a time, so nothing can interleave.
"""
from __future__ import annotations

import numpy as np


def _float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest even), returned as uint16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(x)
    return np.where(nan, 0x7FC0, rounded).astype(np.uint16)


def patch_bfloat16(interpreter_module) -> None:
    """Patch ``InterpreterBuilder.create_dot`` and ``cast_impl`` as described above (idempotent)."""
    import triton.language as tl

    builder = interpreter_module.InterpreterBuilder
    if getattr(builder, "_fa_lab_bf16_fix", False):
        return
    original_dot, original_cast = builder.create_dot, builder.cast_impl
    handle_type = interpreter_module.TensorHandle

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter_module._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return handle_type(data.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return handle_type(_float32_to_bfloat16_bits(src.data), tl.bfloat16)
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            import torch

            e4m3 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.float8_e4m3fn)
            return handle_type(e4m3.view(torch.uint8).numpy(), tl.float8e4nv)
        return original_cast(self, src, dst_type)

    original_fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar in (tl.bfloat16, tl.float8e4nv):
            return cast_impl(self, src, dst_type)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    builder._fa_lab_bf16_fix = True


def patch_descriptor_reduce(interpreter_module) -> None:
    """Give ``InterpreterBuilder`` the ``create_descriptor_reduce`` it lacks, for additions (idempotent)."""
    builder = interpreter_module.InterpreterBuilder
    if hasattr(builder, "create_descriptor_reduce"):
        return
    ir = interpreter_module._ir
    handle_type = interpreter_module.TensorHandle

    def create_descriptor_reduce(self, kind, desc, value, indices):
        if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
            raise NotImplementedError(f"descriptor reduction {kind} in the interpreter")
        ptrs, mask = desc.materialize_pointers(indices)
        zeros = handle_type(np.zeros(ptrs.data.shape, dtype=value.data.dtype), value.dtype.scalar)
        current = self.create_masked_load(ptrs, mask, zeros, None, None, False)
        total = handle_type(current.data + value.data.reshape(current.data.shape), value.dtype.scalar)
        return self.create_masked_store(ptrs, total, mask, None, None)

    builder.create_descriptor_reduce = create_descriptor_reduce
