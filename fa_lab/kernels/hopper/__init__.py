"""The Hopper impls: "triton_hopper" and "triton_hopper_fp8" (launchers in :mod:`.attention`,
:mod:`.fp8_attention`), and the Gluon FA3 kernel they run on sm_90.

The kernel is split by role: :mod:`.fa3_kernel` (entry), :mod:`.fa3_producer`, :mod:`.fa3_consumer`,
:mod:`.fa3_softmax`, the shared state :mod:`.fa3_state`, the constants :mod:`.fa3_config`, the loop
bounds :mod:`.block_range`. Around it: the persistent kernel's schedule (:mod:`.tile_schedule`),
the fused FP8 quantization of its operands (:mod:`.fp8_quant`, plain Triton, and on sm_90 its Gluon pass
:mod:`.fp8_quant_gluon`) and its offline
sm_90 build (:mod:`.sm90_offline`). Elsewhere both impls run the portable kernel
(:mod:`fa_lab.kernels.portable.pipelined_forward`; calls with a window, soft cap or ALiBi the portable
``triton_forward``).

Importing this package imports triton (through ``..launch``): import it after ``fa_lab`` (or after
:func:`fa_lab.kernels.load_triton`).
"""
from .attention import FP8_OPTIONS, HopperOptions, gluon_forward, hopper_forward, triton_hopper_attention, uses_gluon
from .fp8_attention import (
    GLUON_TILES,
    V_SCALE_FLOOR,
    fp8_forward,
    quantize_for_kernel,
    rotation_signs,
    triton_hopper_fp8_attention,
    triton_hopper_fp8_prequantized,
)

__all__ = ["FP8_OPTIONS", "GLUON_TILES", "HopperOptions", "V_SCALE_FLOOR", "fp8_forward", "gluon_forward",
           "hopper_forward", "quantize_for_kernel", "rotation_signs", "triton_hopper_attention",
           "triton_hopper_fp8_attention", "triton_hopper_fp8_prequantized", "uses_gluon"]
