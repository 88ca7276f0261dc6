"""The Gluon FA3 consumer's register math: the online softmax of a score tile and the operands of P V.

P feeds the P V WGMMA from registers. In bf16/fp16 the accumulator layout of S already is the
operand layout (FA2/FA3's trick). In FP8 each K/V tile's descales fold into the softmax scale
and into P's exponent, and P's keys are taken in the order a thread holds them (V^T is stored in
that order: :func:`fa_lab.kernels.common.gluon_fp8_key_order`), so P becomes an e4m3 operand
without moving data between threads.
"""
import struct

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate  # Triton 3.6's Gluon aggregate

from ..portable.score_mod import TANH_APPROX_PTX
from .fa3_config import LOG2_P_SCALE

# How softmax_tile masks a score tile (its MASK): MASK_BY_TILE decides at run time from the tile's index (the
# WorkTile's full_begin and first_masked, testing both of a window's bounds); the others are fixed at compile time,
# one per loop of the consumer (.fa3_consumer._consumer_tile): nothing, the key_start bound only (a window's lower
# edge), or the key_end bound only (the causal diagonal, the ragged end, a window's upper edge).
MASK_BY_TILE = gl.constexpr(0)
MASK_NONE = gl.constexpr(1)
MASK_LOWER = gl.constexpr(2)
MASK_UPPER = gl.constexpr(3)

# softmax_tile's SOFTCAP, a set of bits (0: no soft cap): SOFTCAP_ON caps each score before the row max;
# SOFTCAP_MAX_FIRST takes the row max over the raw scores and caps it once per row (tanh is increasing), so that
# the max no longer waits for the tile's tanh; SOFTCAP_Q_SCALED: the launcher multiplied Q by scale / softcap
# beforehand, so a score needs no multiply before its tanh.
SOFTCAP_ON = gl.constexpr(1)
SOFTCAP_MAX_FIRST = gl.constexpr(2)
SOFTCAP_Q_SCALED = gl.constexpr(4)

# 2**f on [0, 1) as 1 + f (C1 + f (C2 + f C3)), the largest relative error 8.6e-5 (a bf16 P rounds to 2**-9):
# least squares of the relative error, reweighted towards its largest values, in float32.
EXP2_POLY_C1 = 0.6951168179512024
EXP2_POLY_C2 = 0.22764484584331512
EXP2_POLY_C3 = 0.07706718146800995


def exp2_ptx(on_fma: int) -> str:
    """The PTX of :func:`exp2_mixed` for four scores a thread holds, ``on_fma`` of them (the last) by a polynomial
    on the FMA units and the others by ``ex2.approx`` on the MUFU, which a soft cap's tanh shares (16 results a
    clock an SM against 128 FFMA). x = j + f (j = floor(x), by adding 1.5 * 2**23 rounding down, which leaves j
    in the low bits); 2**x = 2**f with j added to its exponent. x is first raised to -127 (2**-127 -> +0: -inf
    still gives 0); x must stay below 128."""
    if not 0 <= on_fma <= 4:
        raise ValueError(f"on_fma is how many of four exponentials take the polynomial (0-4), got {on_fma}")
    hexf = lambda value: "0f" + struct.pack(">f", value).hex().upper()  # noqa: E731 (PTX's float literal)
    magic = hexf(1.5 * 2 ** 23)
    lines = ["{", ".reg .b32 t, j, f, p, e;"]
    for i in range(4):
        out, x = f"${i}", f"${i + 4}"
        if i < 4 - on_fma:
            lines.append(f"ex2.approx.ftz.f32 {out}, {x};")
        else:
            lines += [f"max.ftz.f32 f, {x}, {hexf(-127.0)};", f"add.rm.ftz.f32 t, f, {magic};",
                      f"sub.ftz.f32 j, t, {magic};", "sub.ftz.f32 f, f, j;",
                      f"fma.rn.ftz.f32 p, f, {hexf(EXP2_POLY_C3)}, {hexf(EXP2_POLY_C2)};",
                      f"fma.rn.ftz.f32 p, p, f, {hexf(EXP2_POLY_C1)};", f"fma.rn.ftz.f32 p, p, f, {hexf(1.0)};",
                      "shl.b32 e, t, 23;", f"add.s32 {out}, p, e;"]
    return "\n".join(lines + ["}"])


EXP2_PTX = gl.constexpr(tuple(exp2_ptx(on_fma) for on_fma in range(5)))  # exp2_ptx(n), n = 0 .. 4


@gluon.jit
def exp2_mixed(x, ON_FMA: gl.constexpr):
    """2**x, ON_FMA of every four values by a polynomial on the FMA units (:func:`exp2_ptx`), the rest on the MUFU.
    ON_FMA = 0 is gl.exp2 itself."""
    if ON_FMA == 0:
        return gl.exp2(x)
    else:
        return gl.inline_asm_elementwise(EXP2_PTX[ON_FMA], "=r,=r,=r,=r,r,r,r,r", [x], dtype=gl.float32,
                                         is_pure=True, pack=4)


@gluon.jit
def softmax_tile(s, m_i, l_i, tile_scale, log2_p_scale, key_start, key_end, j, tile, mods, BLOCK_N: gl.constexpr,
                 FP8: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                 s_layout: gl.constexpr, MASK: gl.constexpr = MASK_BY_TILE, EXP2_ON_FMA: gl.constexpr = 0):
    """Online-softmax update with raw scores s = Q K_j^T of K/V tile j of the sequence: (64, BLOCK_N) fp32.

    Returns (p, alpha, m_new, l_new), m in log2 units (tile_scale = scale * log2 e, times
    the Q and K descales in FP8). l is kept as each thread's partial sums (64, 4) (:func:`thread_row_sums`),
    so a step adds its probabilities without a shuffle; the consumer sums the four once, after the loop
    (flash-attn-4 does the same; the row maximum still needs every thread's values at every step).

    Only tiles from the WorkTile's ``first_masked`` on pay for a mask
    (causal diagonal, ragged end): key_end (64,) int32 is each row's end of visible keys
    (:func:`.block_range.visible_key_end`), so the mask is one compare per score. With a WINDOW the
    tiles before ``full_begin`` are masked too, and a score also needs its key at or after the row's
    key_start (:func:`.block_range.visible_key_start`). That is MASK_BY_TILE; the other MASKs fix the mask at compile
    time for a loop whose tiles all need the same one (the constants above). In FP8, p comes out
    multiplied by 2**log2_p_scale (folded into the exponent, so it costs nothing per score) while l
    sums the true p.

    mods: the :class:`ScoreMods` of this consumer's rows. SOFTCAP: s becomes tanh(s * softcap_scale)
    (tile_scale is then softcap * log2 e); ALIBI: s gets -slope * |row + offset - key| in s's units (the
    slope divided by the scale that tile_scale applies), so the bias costs one FADD (the distance) and one
    FFMA (|distance| is a free operand modifier) per score, and the exponent keeps its single FFMA.
    EXP2_ON_FMA: of every four probabilities, how many :func:`exp2_mixed` takes off the MUFU.
    """
    MAX_FIRST: gl.constexpr = (SOFTCAP & SOFTCAP_MAX_FIRST) != 0
    if SOFTCAP and not MAX_FIRST:
        s = _capped(s, mods.softcap_scale, SOFTCAP)
    if ALIBI:  # key positions: a constant float vector, and this tile's start folded into the rows
        keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)).to(gl.float32)
        rows = mods.alibi_rows - (j * BLOCK_N).to(gl.float32)
        s = s - mods.slope * gl.abs(rows[:, None] - keys[None, :])
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if MASK == MASK_LOWER:
        s = gl.where(cols[None, :] >= (key_start - j * BLOCK_N)[:, None], s, float("-inf"))
    elif MASK == MASK_UPPER:
        s = gl.where(cols[None, :] < (key_end - j * BLOCK_N)[:, None], s, float("-inf"))
    elif MASK == MASK_BY_TILE:
        if WINDOW:
            if (j < tile.full_begin) | (j >= tile.first_masked):
                visible = ((cols[None, :] < (key_end - j * BLOCK_N)[:, None])
                           & (cols[None, :] >= (key_start - j * BLOCK_N)[:, None]))
                s = gl.where(visible, s, float("-inf"))
        elif j >= tile.first_masked:
            s = gl.where(cols[None, :] < (key_end - j * BLOCK_N)[:, None], s, float("-inf"))
    row_max = gl.max(s, axis=1)
    if MAX_FIRST:  # s is raw here, -inf where hidden: cap the row max, then the scores (hidden ones stay -inf)
        capped = _capped(s, mods.softcap_scale, SOFTCAP)
        if MASK == MASK_NONE:  # every score finite
            row_max = _capped(row_max, mods.softcap_scale, SOFTCAP)
            s = capped
        else:
            row_max = gl.where(row_max == float("-inf"), row_max, _capped(row_max, mods.softcap_scale, SOFTCAP))
            s = gl.where(s == float("-inf"), s, capped)
    m_new = gl.maximum(m_i, row_max * tile_scale)
    # A row that has seen no visible key keeps m = -inf: subtract 0 there so exp2 gives 0, not NaN.
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_sub)
    alpha_rows = gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))[:, None]  # (moves no data)
    if FP8:
        p = exp2_mixed(s * tile_scale - (m_sub - log2_p_scale)[:, None], EXP2_ON_FMA)
        l_new = l_i * alpha_rows + thread_row_sums(p) * gl.exp2(-log2_p_scale)
    else:
        p = exp2_mixed(s * tile_scale - m_sub[:, None], EXP2_ON_FMA)  # one FFMA + (by default) one MUFU.EX2 a score
        l_new = l_i * alpha_rows + thread_row_sums(p)
    return p, alpha, m_new, l_new


@gluon.jit
def _capped(x, softcap_scale, SOFTCAP: gl.constexpr):
    """tanh(x * softcap_scale), or tanh(x) when the launcher scaled Q already (SOFTCAP_Q_SCALED)."""
    if (SOFTCAP & SOFTCAP_Q_SCALED) == 0:
        x = x * softcap_scale
    return gl.inline_asm_elementwise(TANH_APPROX_PTX, "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def thread_row_sums(x):
    """x (64, N) in the WGMMA accumulator layout -> (64, 4): each thread's sum of its own values of a row. A row's
    columns 8 j + 2 t + b (b = 0, 1) sit with lane t of the row's four lanes, so the sums over j and b stay in
    registers: no shuffle between threads."""
    rows: gl.constexpr = x.shape[0]
    cols: gl.constexpr = x.shape[1]
    return gl.sum(gl.sum(x.reshape([rows, cols // 8, 4, 2]), axis=3), axis=1)


@aggregate
class ScoreMods:
    """Chapter 05's score modifiers for one consumer's 64 rows (read only under SOFTCAP / ALIBI).

    softcap_scale: scale / softcap; slope: the head's ALiBi slope in the units of the raw (or soft-capped)
    score s, i.e. slope * log2 e / tile_scale (slope / scale, or slope / softcap); alibi_rows (64,) float32:
    each row's position plus seqlen_k - seqlen_q, the key it is aligned with (ALiBi's distance is
    |alibi_row - key|, formed in float32: exact below 2^24)."""
    softcap_scale: gl.tensor
    slope: gl.tensor
    alibi_rows: gl.tensor

    @gluon.constexpr_function
    def __init__(self, softcap_scale, slope, alibi_rows):
        self.softcap_scale = softcap_scale
        self.slope = slope
        self.alibi_rows = alibi_rows


@gluon.jit
def p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, FP8: gl.constexpr):
    """P (64, BLOCK_N) fp32 in the accumulator layout -> the A operand of the P V WGMMA.

    FP8: the columns are reordered within each 32-key block (key 16h + 8a + 2c + b goes to
    position 16h + 4c + 2a + b), which is the order in which a thread already holds them, so the
    operand needs no data exchange between threads; V^T's keys are stored in the same order.
    """
    if FP8:
        rows: gl.constexpr = p.shape[0]
        keys: gl.constexpr = p.shape[1]
        p = p.reshape([rows, keys // 32, 2, 2, 4, 2])  # (row, block, h, a, c, b)
        p = p.permute((0, 1, 2, 4, 3, 5)).reshape([rows, keys])  # (row, block, h, c, a, b)
        return to_e4m3x4(gl.convert_layout(p, p_layout))
    elif p.dtype == gl.int32:  # carried_p's packed pairs of keys
        lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [p], dtype=(dtype.value, dtype.value),
                                           is_pure=True, pack=1)
        pairs = gl.join(lo, hi)
        return gl.convert_layout(pairs.reshape([pairs.shape[0], pairs.shape[1] * 2]), p_layout)
    else:
        return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def carried_p(p, dtype: gl.constexpr, p_layout: gl.constexpr, FP8: gl.constexpr, PACKED: gl.constexpr):
    """What the loop carries of P_j into step j+1, where it feeds the P V WGMMA (:func:`p_operand` takes any).

    16-bit types: P rounded to dtype, half the registers of float32 P. PACKED: as 32-bit registers of two
    neighbouring keys each (int32, ``cvt.rn.bf16x2.f32``), which the compiler never repacks where one loop hands P
    to the next (16-bit values carried across the consumer's split loops cost 32-64 PRMT a step); otherwise the
    operand itself. FP8 carries P in float32 and converts it in step j+1: an e4m3 tensor carried across the loop's
    back edge is kept one byte per register and repacked.
    """
    if FP8:
        return p
    elif not PACKED:
        return p_operand(p, dtype, p_layout, FP8=FP8)
    else:
        lo, hi = p.reshape([p.shape[0], p.shape[1] // 2, 2]).split()
        if dtype == gl.bfloat16:
            asm: gl.constexpr = "cvt.rn.bf16x2.f32 $0, $2, $1;"
        else:
            asm: gl.constexpr = "cvt.rn.f16x2.f32 $0, $2, $1;"
        return gl.inline_asm_elementwise(asm, "=r,r,r", [lo, hi], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def to_e4m3x4(x):
    """fp32 -> e4m3, four neighbours in a thread's registers into one 32-bit register.

    Two ``cvt.rn.satfinite.e4m3x2.f32`` per register: the compiler's own conversion makes
    16-bit halves and then moves the bytes one by one.
    In the operand layout of P, a register's four values are four consecutive keys of one row.
    """
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi}; }",
        "=r,r,r,r,r", [x], dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def v_operand(v_tile, FP8: gl.constexpr):
    """The B operand (BLOCK_N, d) of P V. FP8 WGMMA reads B K-major, so V arrives as V^T tiles (d, BLOCK_N)."""
    if FP8:
        return v_tile.reshape([v_tile.type.shape[2], v_tile.type.shape[3]]).permute((1, 0))
    else:
        return v_tile.reshape([v_tile.type.shape[2], v_tile.type.shape[3]])


@gluon.jit
def fp8_tile_scales(qk_scale, k_descale_ptr, v_exponent_ptr, tile):
    """(tile_scale, log2_p_scale) of K/V tile ``tile`` (index into the flat per-tile arrays).

    S is descaled through the softmax scale; P is stored as P * P_SCALE * v_descale_j / v_descale_max,
    which keeps it below e4m3's maximum and folds V's per-tile descale into P (one constant is left for
    the epilogue), so P V accumulates in one register tile across all tiles. The exponent
    log2(v_descale_j / v_descale_max) comes precomputed (a float32 log2 is a long instruction sequence).
    """
    return qk_scale * gl.load(k_descale_ptr + tile), LOG2_P_SCALE + gl.load(v_exponent_ptr + tile)
