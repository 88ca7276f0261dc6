"""The plain-Triton kernels' score modifiers and window mask: jit copies of :mod:`fa_lab.score_mods`.

The forward works in log2 units (exp2 is the fast exponential), so a modified score is returned
as ``log2(e) * s``, where ``s`` is the natural-unit score of :func:`fa_lab.score_mods.modify_scores`:
``softcap * tanh(scale * q.k / softcap)``, then ``- slope * |i + offset - j|``. ``tanh`` is written as
``2 sigmoid(2x) - 1``, which every Triton target (and the interpreter) has.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softcap_tanh(qk, softcap_scale):
    """tanh(qk * softcap_scale), with softcap_scale = scale / softcap."""
    return 2.0 * tl.sigmoid(2.0 * qk * softcap_scale) - 1.0


@triton.jit
def modified_scores(qk, rows, cols, qk_scale, softcap_scale, softcap_log2, slope_log2, offset,
                    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """The scores of a tile in log2 units: qk * qk_scale (qk_scale = scale * log2 e), soft-capped
    (softcap_log2 = softcap * log2 e) and with ALiBi's bias (slope_log2 = slope * log2 e).

    rows, cols: the tile's query and key positions, broadcastable to qk's shape (either orientation).
    """
    if SOFTCAP:
        s = softcap_tanh(qk, softcap_scale) * softcap_log2
    else:
        s = qk * qk_scale
    if ALIBI:
        s = s - slope_log2 * tl.abs(rows + offset - cols).to(tl.float32)
    return s


@triton.jit
def in_window(rows, cols, offset, left, right):
    """True where query ``rows`` sees key ``cols`` under the window (left, right) (both bounds finite:
    ``BlockInfo.window_bounds``); rows, cols broadcastable."""
    return (cols >= rows + offset - left) & (cols <= rows + offset + right)
