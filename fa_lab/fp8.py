"""FP8 attention numerics on a CPU: e4m3 quantization, Hadamard incoherent processing, the FA3 error table.

FlashAttention-3 runs both matmuls of attention in FP8 (e4m3: 4 exponent bits,
3 mantissa bits, largest value 448) and keeps its error in check with two tricks
from the paper:

* block quantization: Q, K and V get one scale per block of rows aligned with
  the kernel's tiles (not one per tensor), and each S tile absorbs the scales
  of its Q and K blocks;
* incoherent processing: Q and K are both multiplied by a random orthogonal
  M = diag(signs) H / sqrt(d) (H a Hadamard matrix) before quantization. Since
  (QM)(KM)^T = Q M M^T K^T = Q K^T, the scores are unchanged in exact arithmetic,
  but an outlier that sat in one coordinate is spread over all d of them.
  The fast Walsh-Hadamard transform applies M in O(d log d).

torch has a ``float8_e4m3fn`` dtype on the CPU but no FP8 matmul, so an FP8
matmul is emulated exactly where it matters: operands are rounded to e4m3 and
multiplied in float32 (a product of two e4m3 numbers is exact in float32), then
the result is multiplied by the operands' descales. :func:`reproduce_error_table`
measures every row of the paper's error table this way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .block_info import cdiv
from .flash_torch import flash_forward
from .inputs import check_block_size, check_qkv, resolve_scale
from .online_softmax import SoftmaxState, online_softmax_update
from .reference import causal_mask, naive_attention, reference_attention

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
# FA3 computes exp2(s - (m - 8)) for FP8, so P lies in [0, 2^8] instead of [0, 1]: a power of two
# keeps the descale exact, and entries below 2^-10, which e4m3 rounds to zero, stay representable.
P_SCALE = 256.0

# Table 3 of the FlashAttention-3 paper: RMSE of the output O against an FP64 reference.
PAPER_ERROR_TABLE = {
    "baseline_fp16": 3.2e-4,
    "flash_fp16": 1.9e-4,
    "baseline_fp8": 2.4e-2,
    "flash_fp8": 9.1e-3,
    "flash_fp8_no_block_quant": 9.3e-3,
    "flash_fp8_no_incoherent": 2.4e-2,
}


# ----------------------------------------------------------------------------- quantization


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value (saturating at +-448) and return it as float32, same shape."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float()


def _expand_to_rows(scales: torch.Tensor, block: int, seqlen: int) -> torch.Tensor:
    """Per-block scales (B, H, num_blocks) -> per-row scales (B, H, seqlen, 1)."""
    return scales.repeat_interleave(block, dim=-1)[..., :seqlen, None]


@dataclass
class Fp8Tensor:
    """An e4m3 tensor with one float32 scale per block of ``block`` rows: x ~ data * scale.

    data: (B, H, N, d) float8_e4m3fn; scales: (B, H, ceil(N / block)) float32.
    A per-tensor quantization is the case block = N with every scale equal.
    """

    data: torch.Tensor
    scales: torch.Tensor
    block: int

    def values(self) -> torch.Tensor:
        """The e4m3 values as float32 (exact), before descaling: (B, H, N, d)."""
        return self.data.float()

    def row_scales(self) -> torch.Tensor:
        """The scale of every row: (B, H, N, 1)."""
        return _expand_to_rows(self.scales, self.block, self.data.shape[2])

    def dequantize(self) -> torch.Tensor:
        """data * scale, float32 (B, H, N, d)."""
        return self.values() * self.row_scales()

    def scale_of_rows(self, start: int, stop: int) -> torch.Tensor:
        """The one scale of rows [start, stop): (B, H, 1, 1). The rows must lie in one block (a tile)."""
        if start // self.block != (stop - 1) // self.block:
            raise ValueError(f"rows [{start}, {stop}) straddle two quantization blocks of {self.block} rows")
        return self.scales[:, :, start // self.block, None, None]


def quantize_e4m3(x: torch.Tensor, block: int | None = None, floor_ratio: float = 0.0) -> Fp8Tensor:
    """Quantize x: (B, H, N, d) to e4m3 with scale = amax / 448.

    block=None: one scale for the whole tensor (per-tensor scaling). Otherwise
    one scale per (batch, head, block of ``block`` rows), the rows of one
    kernel tile. An all-zero block gets scale 1. ``floor_ratio``: no block's
    scale falls below that fraction of its head's largest (a kernel that divides
    by the ratio of two scales needs it bounded).
    """
    if x.ndim != 4:
        raise ValueError(f"x must be (batch, heads, seqlen, head_dim), got shape {tuple(x.shape)}")
    batch, heads, seqlen, head_dim = x.shape
    x = x.float()
    if block is None:
        block = seqlen
        amax = x.abs().amax().expand(batch, heads, 1)
    else:
        check_block_size("block", block)
        num_blocks = cdiv(seqlen, block)
        padded = torch.nn.functional.pad(x, (0, 0, 0, num_blocks * block - seqlen))
        amax = padded.abs().reshape(batch, heads, num_blocks, block * head_dim).amax(dim=-1)
        amax = torch.maximum(amax, floor_ratio * amax.amax(dim=-1, keepdim=True))
    # (divided by a tensor, not a Python number: torch's CUDA kernels divide by a number as a multiplication
    # by its float32 reciprocal, which can move the scale's last bit; this way it is the IEEE quotient everywhere)
    scales = torch.where(amax > 0, amax / amax.new_tensor(E4M3_MAX), torch.ones_like(amax))
    data = (x / _expand_to_rows(scales, block, seqlen)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return Fp8Tensor(data, scales.contiguous(), block)


# ----------------------------------------------------------------------------- incoherent processing


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over the last dim: x @ H / sqrt(d), H Sylvester's.

    x: (..., d) with d a power of 2; returns the same shape and dtype. log2(d)
    rounds of butterflies (a + b, a - b) on pairs h apart, h = 1, 2, 4, ...:
    O(d log d) work, no d x d matrix.
    """
    head_dim = x.shape[-1]
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-2 last dim, got {head_dim}")
    y = x.reshape(-1, head_dim)
    half = 1
    while half < head_dim:
        pairs = y.view(-1, head_dim // (2 * half), 2, half)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, head_dim)
        half *= 2
    return (y / math.sqrt(head_dim)).view(x.shape)


def random_signs(head_dim: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random +-1 vector (head_dim,) float32: the diagonal of the sign matrix in M."""
    return torch.randint(0, 2, (head_dim,), generator=generator).float() * 2 - 1


def incoherent_rotation(q: torch.Tensor, k: torch.Tensor, signs: torch.Tensor):
    """Return (QM, KM) with M = diag(signs) H / sqrt(d), an orthogonal matrix, so (QM)(KM)^T = QK^T.

    q: (..., Nq, d), k: (..., Nk, d), signs: (d,) of +-1. V is not rotated (O would need M^T back).
    """
    signs = signs.to(device=q.device, dtype=q.dtype)
    return hadamard_transform(q * signs), hadamard_transform(k * signs)


# ----------------------------------------------------------------------------- FP8 attention


def fp8_attention_forward(q, k, v, causal: bool = False, scale: float | None = None,
                          block_quant: bool = True, incoherent: bool = True,
                          block_q: int = 128, block_k: int = 128, p_scale: float = P_SCALE,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """Tiled online-softmax forward with FP8 matmuls, as an FP8 FlashAttention kernel computes it.

    q: (B, H, Nq, d), k, v: (B, H, Nk, d) in any float dtype; returns O: (B, H, Nq, d) in q.dtype.

    1. With ``incoherent``, Q and K are rotated by M (signs drawn from
       ``generator``; d must be a power of 2).
    2. Q is quantized to e4m3 with one scale per ``block_q`` rows and K, V with
       one per ``block_k`` rows (``block_quant``), or one scale per tensor.
    3. For each K/V tile: S = Q8 K8^T accumulated in float32, times both
       descales and the softmax scale; the online softmax, in float32, gives
       P = exp(S - m) <= 1; P * p_scale is rounded to e4m3, P8 V8 accumulated in
       float32 and multiplied by v_descale / p_scale.
    4. O = acc / l, with l summed from the float32 P.

    What an FP8 kernel (FA3, or a Triton FP8 kernel) does the same: e4m3
    operands for both matmuls, float32 accumulators and softmax statistics, P
    raised by 2^8 before its cast (``P_SCALE``; FA3 subtracts 8 from the row max
    inside exp2), row sums taken before P is rounded. What differs: flash-attn's
    Hopper code takes one descale per (batch, KV head) for each of Q, K, V, where
    this emulates the paper's per-tile block scales; the Hadamard rotation is
    left to the caller there, fused into a preceding op such as rotary embedding,
    in 16-bit; Hopper's FP8 tensor cores keep fewer accumulator bits than float32
    (about 14, DeepSeek-V3 reports), which is not modelled; the kernel writes O
    in bf16/fp16, this in q.dtype.
    """
    check_qkv(q, k, v)
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    scale = resolve_scale(scale, head_dim)
    check_block_size("block_q", block_q)
    check_block_size("block_k", block_k)
    q32, k32 = q.float(), k.float()
    if incoherent:
        q32, k32 = incoherent_rotation(q32, k32, random_signs(head_dim, generator))
    q8 = quantize_e4m3(q32, block_q if block_quant else None)
    k8 = quantize_e4m3(k32, block_k if block_quant else None)
    v8 = quantize_e4m3(v, block_k if block_quant else None)
    # Q tiles are independent (a GPU gives each its own thread block), so all of them go through
    # each K/V tile at once: every row still sees its own Q block's descale, tile by tile.
    q_vals, q_descale = q8.values(), q8.row_scales()
    k_vals, v_vals = k8.values(), v8.values()
    hidden = ~causal_mask(seqlen_q, seqlen_k, q.device) if causal else None
    state = SoftmaxState.empty((batch, heads, seqlen_q), q.device)
    acc = torch.zeros((batch, heads, seqlen_q, head_dim), device=q.device)
    for j0 in range(0, seqlen_k, block_k):
        j1 = min(j0 + block_k, seqlen_k)
        # Block quantization costs one multiply per tile: the S tile absorbs both descales.
        descale = q_descale * k8.scale_of_rows(j0, j1) * scale
        scores = torch.matmul(q_vals, k_vals[:, :, j0:j1].transpose(-2, -1)) * descale
        if causal:
            scores.masked_fill_(hidden[:, j0:j1], float("-inf"))
        state, p, alpha = online_softmax_update(state, scores, inplace=True)
        p8 = round_to_e4m3(p * p_scale)  # P <= 1: scaled up first, or its small entries underflow
        pv = torch.matmul(p8, v_vals[:, :, j0:j1]) * (v8.scale_of_rows(j0, j1) / p_scale)
        acc.mul_(alpha[..., None]).add_(pv)
    l = state.l[..., None]
    return (acc / torch.where(l == 0, torch.ones_like(l), l)).to(q.dtype)


def fp8_naive_attention(q, k, v, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """The paper's FP8 baseline: standard attention on per-tensor e4m3 Q, K, V, S and P kept in fp16.

    q: (B, H, Nq, d), k, v: (B, H, Nk, d); returns O: (B, H, Nq, d) in float16.
    Q, K, V are rounded to e4m3 with one scale per tensor, then handed to
    :func:`fa_lab.reference.naive_attention` as fp16 (e4m3 value times its
    scale: one more rounding, 2^-11 relative, 1/128 of e4m3's). S = Q K^T and
    P = softmax(S) are materialized in fp16 and P V takes the fp16 P, as the
    paper describes its baseline ("intermediate softmax results kept in FP16").
    Rounding this normalized P (entries about 1/Nk) to e4m3 without a scale would
    flush every entry below 2^-10 to zero: on the error table's data that adds
    about 1.7e-2 in quadrature (seed 0: 1.8e-2 becomes 2.5e-2).
    """
    check_qkv(q, k, v)
    dequantized = (quantize_e4m3(t).dequantize().half() for t in (q, k, v))
    return naive_attention(*dequantized, causal, scale)[0]


# ----------------------------------------------------------------------------- the paper's error table

# The shape reproduce_error_table uses by default: 2048 queries attending to 8192 keys, one head.
ERROR_TABLE_SHAPE = {"batch": 1, "heads": 1, "seqlen_q": 2048, "seqlen_k": 8192, "head_dim": 128}
OUTLIER_PROBABILITY = 1e-3
OUTLIER_STD = 10.0


def outlier_qkv(batch, heads, seqlen_q, seqlen_k, head_dim, generator=None):
    """The paper's synthetic data: every entry N(0, 1), plus N(0, 100) with probability 0.001.

    Returns float64 q: (B, H, Nq, d), k, v: (B, H, Nk, d).
    """
    def draw(seqlen):
        shape = (batch, heads, seqlen, head_dim)
        normal = torch.randn(shape, generator=generator, dtype=torch.float64)
        is_outlier = torch.rand(shape, generator=generator, dtype=torch.float64) < OUTLIER_PROBABILITY
        outlier = OUTLIER_STD * torch.randn(shape, generator=generator, dtype=torch.float64)
        return normal + torch.where(is_outlier, outlier, torch.zeros_like(outlier))

    return draw(seqlen_q), draw(seqlen_k), draw(seqlen_k)


def rmse(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Root mean squared error over all elements, computed in float64."""
    return (actual.double() - reference.double()).pow(2).mean().sqrt().item()


def reproduce_error_table(seed: int = 0, batch: int = ERROR_TABLE_SHAPE["batch"],
                          heads: int = ERROR_TABLE_SHAPE["heads"],
                          seqlen_q: int = ERROR_TABLE_SHAPE["seqlen_q"],
                          seqlen_k: int = ERROR_TABLE_SHAPE["seqlen_k"],
                          head_dim: int = ERROR_TABLE_SHAPE["head_dim"]) -> dict:
    """Table 3 of the FA3 paper, measured on a CPU: row name -> RMSE of O against float64.

    Q, K, V are drawn by :func:`outlier_qkv` (in float64, from ``seed``) and
    rounded to fp16: every row starts from those fp16 tensors, and the float64
    reference sees the values before that rounding (so the inputs' own rounding
    is part of every row's error, as in the paper's FP64 comparison). Rows:

    * ``baseline_fp16``: :func:`fa_lab.reference.naive_attention` in fp16 (S, P in fp16);
    * ``flash_fp16``: :func:`fa_lab.flash_torch.flash_forward` (float32 tiles, O in fp16; the tile
      size only reorders float32 roundings);
    * ``baseline_fp8``: :func:`fp8_naive_attention` (per-tensor e4m3 Q, K, V; S, P in fp16);
    * ``flash_fp8``: :func:`fp8_attention_forward` with block quantization and incoherent processing;
    * ``flash_fp8_no_block_quant``, ``flash_fp8_no_incoherent``: the same without one of them.

    The error of a row grows with the number of keys it sees (more chances that
    an outlier of q meets an outlier of k in the same coordinate), and the paper
    does not give its shape, so the table's ratios to the paper's depend on
    seqlen_k (docs/experiments/hopper_forward.md, "FP8 error table on a CPU").
    The rows of non-causal attention are independent, so the default shape
    (ERROR_TABLE_SHAPE: 2048 queries, 8192 keys) estimates a square 8192 problem at
    a quarter of the cost.
    """
    generator = torch.Generator().manual_seed(seed)
    q64, k64, v64 = outlier_qkv(batch, heads, seqlen_q, seqlen_k, head_dim, generator)
    reference = reference_attention(q64, k64, v64)[0]
    q, k, v = q64.half(), k64.half(), v64.half()
    signs_seed = int(torch.randint(0, 2**31, (1,), generator=generator))

    def flash_fp8(**ablation):
        signs_generator = torch.Generator().manual_seed(signs_seed)
        return fp8_attention_forward(q, k, v, generator=signs_generator, **ablation)

    outputs = {
        "baseline_fp16": lambda: naive_attention(q, k, v)[0],
        "flash_fp16": lambda: flash_forward(q, k, v)[0],
        "baseline_fp8": lambda: fp8_naive_attention(q, k, v),
        "flash_fp8": lambda: flash_fp8(),
        "flash_fp8_no_block_quant": lambda: flash_fp8(block_quant=False),
        "flash_fp8_no_incoherent": lambda: flash_fp8(incoherent=False),
    }
    return {name: rmse(compute(), reference) for name, compute in outputs.items()}
