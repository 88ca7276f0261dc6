"""The plain-Triton kernels' score modifiers and masks: jit copies of :mod:`fa_lab.score_mods`.

The forward works in log2 units (exp2 is the fast exponential), so a modified score is returned
as ``log2(e) * s``, where ``s`` is the natural-unit score of :func:`fa_lab.score_mods.modify_scores`:
``softcap * tanh(scale * q.k / softcap)``, then ``- slope * |i + offset - j|``.

``tanh`` on a GPU is PTX's ``tanh.approx.f32``: one special-function instruction, like the exp2 of
the softmax (flash-attn's soft cap uses the same instruction). ``2 sigmoid(2x) - 1`` costs an
exponential and an IEEE division per score on top of the softmax's (docs/experiments/interfaces.md,
"Soft cap: the instruction that computes tanh"). The CPU interpreter runs no PTX, so there it is the
sigmoid form.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import interpreting

# PTX's tanh: one special-function instruction (the Gluon forward inlines the same string).
TANH_APPROX_PTX = tl.constexpr("tanh.approx.f32 $0, $1;")

if interpreting():
    @triton.jit
    def softcap_tanh(qk, softcap_scale):
        """tanh(qk * softcap_scale), with softcap_scale = scale / softcap."""
        return 2.0 * tl.sigmoid(2.0 * qk * softcap_scale) - 1.0
else:
    @triton.jit
    def softcap_tanh(qk, softcap_scale):
        """tanh(qk * softcap_scale), with softcap_scale = scale / softcap (tanh.approx.f32)."""
        return tl.inline_asm_elementwise(TANH_APPROX_PTX, "=r,r", [qk * softcap_scale],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def modified_scores(qk, rows, cols, qk_scale, softcap_scale, softcap_log2, slope_log2, offset,
                    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """The scores of a tile in log2 units: qk * qk_scale (qk_scale = scale * log2 e), soft-capped
    (softcap_log2 = softcap * log2 e) and with ALiBi's bias (slope_log2 = slope * log2 e).

    rows, cols: the tile's query and key positions, broadcastable to qk's shape (either orientation).
    ALiBi's distance is formed in float32 from positions converted once per row and once per column
    (exact below 2^24): one subtraction per score, where converting each score's integer distance
    would put an int-to-float conversion, a quarter-rate instruction like exp2's, on every score.
    """
    if SOFTCAP:
        s = softcap_tanh(qk, softcap_scale) * softcap_log2
    else:
        s = qk * qk_scale
    if ALIBI:
        s = s - slope_log2 * tl.abs((rows + offset).to(tl.float32) - cols.to(tl.float32))
    return s


@triton.jit
def in_window(rows, cols, offset, left, right):
    """True where query ``rows`` sees key ``cols`` under the window (left, right) (both bounds finite:
    ``BlockInfo.window_bounds``); rows, cols broadcastable."""
    return (cols >= rows + offset - left) & (cols <= rows + offset + right)


@triton.jit
def visible_keys(rows, cols, key_end, offset, left, right, CAUSAL: tl.constexpr, WINDOW: tl.constexpr = False):
    """True where query ``rows`` sees key ``cols``: the keys before ``key_end``, with CAUSAL those up to
    ``rows + offset`` (bottom-right aligned), with WINDOW those in the band (left, right) (:func:`in_window`).
    rows, cols broadcastable: (M, 1) and (1, N) for a tile of scores, (1, M) and (N, 1) for its transpose."""
    visible = cols < key_end
    if CAUSAL:
        visible = visible & (cols <= rows + offset)
    if WINDOW:
        visible = visible & in_window(rows, cols, offset, left, right)
    return visible
