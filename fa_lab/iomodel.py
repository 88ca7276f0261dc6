"""The IO model: FLOPs, HBM bytes and extra memory of naive vs flash attention, and the roofline.

Everything here is arithmetic on shapes: no tensor is built. Counts are per
call, summed over batch and heads, with q: (B, H, Nq, d) and k, v: (B, H, Nk, d).

* FLOPs follow the FA3 paper's convention: the forward does two matmuls, 4·Nq·Nk·d
  per head, halved for causal; the backward counts 2.5x the forward (five matmuls
  of the same size: S recomputed, dV, dP, dQ, dK). :func:`matmul_flops` gives the
  exact per-matmul counts, with causal counted pair by pair.
* Naive attention writes S and P to HBM and reads them back (FA1 paper, Algorithm 0
  and its backward): Θ(N·d + N²) accesses.
* Flash attention keeps S and P on chip. Each Q tile reads K and V once, so K and V
  are streamed ceil(Nq / block_q) times; with block_q ~ M / (4·d) for an SRAM of M
  elements this is FA1's Θ(N²·d² / M). With ``l2_reuse`` the Q tiles of one head
  share K and V through L2 and HBM sees them once (what happens on A100/H100).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .block_info import BlockInfo

# Bytes per element of each precision; torch dtypes and long names map onto these keys.
DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
LSE_BYTES = 4  # the log-sum-exp (and D = rowsum(dO * O)) are float32 whatever the input dtype
# Element-wise work, in FLOPs per score: softmax does max, subtract, exp, sum, divide;
# the backward's dS = P * (dP - D) does a multiply-add for D, a subtract and a multiply.
SOFTMAX_FLOPS_PER_SCORE = 5
DS_FLOPS_PER_SCORE = 4


def precision_name(dtype) -> str:
    """The short name of ``dtype`` ("bf16", "fp16", "fp8", "fp32"): from a name or a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    name = "fp8" if name.startswith("float8") else _ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} or a torch dtype, got {dtype!r}")
    return name


def dtype_bytes(dtype) -> int:
    """Bytes per element of ``dtype``: a name ("bf16", "fp32", ...) or a torch dtype."""
    return DTYPE_BYTES[precision_name(dtype)]


@dataclass(frozen=True)
class AttentionShape:
    """One attention call: q (batch, heads, seqlen_q, head_dim), k and v (batch, heads, seqlen_k, head_dim).

    ``seqlen_k`` defaults to ``seqlen_q``; ``dtype`` is a name or a torch dtype.
    """

    batch: int
    heads: int
    seqlen_q: int
    head_dim: int
    seqlen_k: int | None = None
    causal: bool = False
    dtype: object = "bf16"

    def __post_init__(self):
        if self.seqlen_k is None:
            object.__setattr__(self, "seqlen_k", self.seqlen_q)
        for name in ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def element_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def heads_total(self) -> int:
        """batch * heads: every count below is per head times this."""
        return self.batch * self.heads


# The seed's running example: N = 8192, d = 128, 32 heads, batch 2, bf16.
RUNNING_EXAMPLE = AttentionShape(batch=2, heads=32, seqlen_q=8192, head_dim=128, dtype="bf16")


# ---------------------------------------------------------------- FLOPs

def attention_flops(shape: AttentionShape, direction: str = "fwd") -> int:
    """FLOPs by the FA3 paper's convention: fwd 4·B·H·Nq·Nk·d, halved for causal; bwd 2.5x fwd."""
    fwd = 4 * shape.heads_total * shape.seqlen_q * shape.seqlen_k * shape.head_dim
    fwd = fwd // 2 if shape.causal else fwd
    if direction == "fwd":
        return fwd
    if direction == "bwd":
        return fwd * 5 // 2
    raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")


def visible_pairs(shape: AttentionShape) -> int:
    """(query, key) pairs that attention computes, per head: Nq·Nk, or fewer when causal.

    Causal is bottom-right aligned: query i sees keys j <= i + Nk - Nq (:class:`fa_lab.block_info.BlockInfo`).
    """
    return BlockInfo(shape.seqlen_q, shape.seqlen_k, shape.causal).visible_pairs()


def matmul_flops(shape: AttentionShape, direction: str = "fwd") -> dict[str, int]:
    """Exact FLOPs of each matmul, 2·d per visible (query, key) pair and head.

    fwd: S = QK^T and O = PV. bwd (recomputation, as FlashAttention does it): S
    recomputed, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q. Without causal
    the bwd sum is exactly 2.5x the fwd sum.
    """
    per_matmul = 2 * shape.head_dim * visible_pairs(shape) * shape.heads_total
    names = {"fwd": ("S = QK^T", "O = PV"),
             "bwd": ("S = QK^T (recomputed)", "dV = P^T dO", "dP = dO V^T", "dQ = dS K", "dK = dS^T Q")}
    if direction not in names:
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    return {name: per_matmul for name in names[direction]}


# ---------------------------------------------------------------- HBM bytes

def naive_kernels(shape: AttentionShape, direction: str = "fwd") -> dict[str, tuple[int, int]]:
    """The kernels of standard attention and their (FLOPs, HBM bytes), every one a round trip to HBM.

    The matrices are always full (Nq, Nk): causal masking does not save naive any work.
    fwd: S = QK^T, P = softmax(S), O = PV. bwd (FA1 paper, Appendix B.2): dV = P^T dO,
    dP = dO V^T, dS = P * (dP - D), dQ = dS K, dK = dS^T Q.
    """
    scores = shape.seqlen_q * shape.seqlen_k  # elements of S, P, dP or dS
    q_side, k_side = shape.seqlen_q * shape.head_dim, shape.seqlen_k * shape.head_dim  # Q, O, dO; K, V
    matmul = 2 * scores * shape.head_dim
    # (flops, elements read + written) per head
    if direction == "fwd":
        per_head = {
            "S = QK^T": (matmul, q_side + k_side + scores),  # read Q, K; write S
            "P = softmax(S)": (SOFTMAX_FLOPS_PER_SCORE * scores, 2 * scores),  # read S; write P
            "O = PV": (matmul, scores + k_side + q_side),  # read P, V; write O
        }
    elif direction == "bwd":
        per_head = {
            "dV = P^T dO": (matmul, scores + q_side + k_side),  # read P, dO; write dV
            "dP = dO V^T": (matmul, q_side + k_side + scores),  # read dO, V; write dP
            "dS = P * (dP - D)": (DS_FLOPS_PER_SCORE * scores, 3 * scores),  # read P, dP; write dS
            "dQ = dS K": (matmul, scores + k_side + q_side),  # read dS, K; write dQ
            "dK = dS^T Q": (matmul, scores + q_side + k_side),  # read dS, Q; write dK
        }
    else:
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    scale = shape.heads_total
    return {name: (flops * scale, elements * shape.element_bytes * scale)
            for name, (flops, elements) in per_head.items()}


def naive_hbm_bytes(shape: AttentionShape, direction: str = "fwd") -> int:
    """HBM bytes of standard attention: per head (4·Nq·Nk + 2·(Nq + Nk)·d) elements fwd, 7·Nq·Nk + ... bwd."""
    return sum(nbytes for _, nbytes in naive_kernels(shape, direction).values())


def sram_tile_rows(head_dim: int, dtype="bf16", sram_bytes: int = 228 * 1024) -> int:
    """Rows of a Q (or K) tile for an SRAM of ``sram_bytes``: FA1's M / (4·d), rounded down to a power of 2.

    FA1 sizes blocks so that a Q, a K, a V and an output tile fit in the SRAM's M
    elements; kernels use powers of two. H100 (228 KB), bf16, d = 128 gives 128.
    """
    elements = sram_bytes // dtype_bytes(dtype)
    rows = elements // (4 * head_dim)
    if rows < 1:
        raise ValueError(f"an SRAM of {sram_bytes} bytes cannot hold four tiles of head_dim {head_dim}")
    return 1 << (rows.bit_length() - 1)


def flash_hbm_bytes(shape: AttentionShape, direction: str = "fwd", block_q: int | None = None,
                    block_k: int | None = None, sram_bytes: int = 228 * 1024, l2_reuse: bool = False) -> int:
    """HBM bytes of FlashAttention (FA2's loop order), S and P never leaving the chip.

    fwd: each Q tile of ``block_q`` rows reads Q once, streams all of K and V, and
    writes O and the float32 LSE. bwd: D = rowsum(dO * O) first; then each K tile
    of ``block_k`` rows reads K, V once, writes dK, dV, and streams Q, dO, LSE, D and
    the float32 dQ accumulator (a read and a write). Tiles default to
    :func:`sram_tile_rows` of ``sram_bytes``. Causal streams half of the tiles.
    ``l2_reuse``: the tiles of one head share the streamed tensors through L2, so
    HBM sees them once instead of once per tile.
    """
    el, d, nq, nk = shape.element_bytes, shape.head_dim, shape.seqlen_q, shape.seqlen_k
    half = 0.5 if shape.causal else 1.0
    if direction == "fwd":
        block_q = block_q or sram_tile_rows(d, shape.dtype, sram_bytes)
        passes = 1 if l2_reuse else math.ceil(nq / block_q) * half
        per_head = el * (nq * d + passes * 2 * nk * d + nq * d) + LSE_BYTES * nq
    elif direction == "bwd":
        block_k = block_k or sram_tile_rows(d, shape.dtype, sram_bytes)
        passes = 1 if l2_reuse else math.ceil(nk / block_k) * half
        preprocess = el * 2 * nq * d + LSE_BYTES * nq  # read dO, O; write D
        kv_side = el * 4 * nk * d  # read K, V; write dK, dV
        streamed = el * 2 * nq * d + LSE_BYTES * 2 * nq + LSE_BYTES * 2 * nq * d  # Q, dO, LSE, D, dQ
        final_dq = LSE_BYTES * nq * d + el * nq * d  # float32 dQ read, dQ written in the input dtype
        per_head = preprocess + kv_side + passes * streamed + final_dq
    else:
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    return int(round(per_head * shape.heads_total))


def arithmetic_intensity(shape: AttentionShape, impl: str = "naive", direction: str = "fwd",
                         **flash_options) -> float:
    """FLOPs per HBM byte of ``impl`` ("naive" or "flash"); ``flash_options`` go to flash_hbm_bytes.

    Naive computes full (Nq, Nk) matrices even when causal, so its FLOPs are never halved.
    """
    if impl == "naive":
        return attention_flops(replace(shape, causal=False), direction) / naive_hbm_bytes(shape, direction)
    if impl == "flash":
        return attention_flops(shape, direction) / flash_hbm_bytes(shape, direction, **flash_options)
    raise ValueError(f"impl must be 'naive' or 'flash', got {impl!r}")


# ---------------------------------------------------------------- extra memory

def score_matrix_bytes(shape: AttentionShape, per_head: bool = False) -> int:
    """Bytes of one (Nq, Nk) matrix such as S, in the input dtype, for one head or for all of them."""
    per = shape.seqlen_q * shape.seqlen_k * shape.element_bytes
    return per if per_head else per * shape.heads_total


def naive_extra_bytes(shape: AttentionShape, live_matrices: int = 2) -> int:
    """Peak extra memory of naive attention: ``live_matrices`` (Nq, Nk) matrices plus the output O.

    Two (S and P) is the textbook count; an implementation may hold a third
    temporary at its peak (see :data:`fa_lab.memory.NAIVE_LIVE_MATRICES`).
    """
    output = shape.heads_total * shape.seqlen_q * shape.head_dim * shape.element_bytes
    return live_matrices * score_matrix_bytes(shape) + output


def flash_extra_bytes(shape: AttentionShape, workspace_bytes: int = 0) -> int:
    """Peak extra memory of flash attention: O and the float32 LSE, O(N), plus any ``workspace_bytes``.

    On a GPU the tiles live in SRAM; a CPU implementation keeps them in RAM (its workspace).
    """
    rows = shape.heads_total * shape.seqlen_q
    return rows * shape.head_dim * shape.element_bytes + rows * LSE_BYTES + workspace_bytes


def format_bytes(nbytes: float) -> str:
    """Bytes in binary units, three significant digits: 134217728 -> '128 MiB', 1.5e9 -> '1.4 GiB'."""
    units, power = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while abs(nbytes) >= 1000 and power < len(units) - 1:
        nbytes, power = nbytes / 1024, power + 1
    return f"{nbytes:.3g} {units[power]}" if abs(nbytes) < 1000 else f"{nbytes:.0f} {units[power]}"


# ---------------------------------------------------------------- GPUs and the roofline

@dataclass(frozen=True)
class GPUSpec:
    """Peak figures of one GPU. TFLOP/s are dense (no sparsity); fp32 is the non-tensor-core rate."""

    name: str
    bf16_tflops: float
    fp16_tflops: float
    fp8_tflops: float | None
    fp32_tflops: float
    hbm_tb_s: float
    hbm_gb: float
    smem_kb_per_sm: int
    registers_kb_per_sm: int
    sm_count: int
    l2_mb: int
    source: str

    def peak_tflops(self, dtype="bf16") -> float:
        """Dense peak TFLOP/s for ``dtype`` (bf16, fp16, fp8, fp32)."""
        name = precision_name(dtype)
        value = getattr(self, f"{name}_tflops")
        if value is None:
            raise ValueError(f"{self.name} has no {name} tensor cores")
        return value


GPU_SPECS = {
    "A100": GPUSpec(
        "A100 SXM 80GB", bf16_tflops=312, fp16_tflops=312, fp8_tflops=None, fp32_tflops=19.5,
        hbm_tb_s=2.039, hbm_gb=80, smem_kb_per_sm=164, registers_kb_per_sm=256, sm_count=108, l2_mb=40,
        source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column, dense rates = half the sparse "
               "ones) and NVIDIA A100 Tensor Core GPU Architecture whitepaper (SMs, L2, shared memory)"),
    "H100": GPUSpec(
        "H100 SXM", bf16_tflops=989, fp16_tflops=989, fp8_tflops=1979, fp32_tflops=67,
        hbm_tb_s=3.35, hbm_gb=80, smem_kb_per_sm=228, registers_kb_per_sm=256, sm_count=132, l2_mb=50,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM column, dense = half of the sparse figures) and "
               "NVIDIA H100 Tensor Core GPU Architecture whitepaper; FA3 paper: 989 TFLOP/s fp16"),
    "H200": GPUSpec(
        "H200 SXM", bf16_tflops=989, fp16_tflops=989, fp8_tflops=1979, fp32_tflops=67,
        hbm_tb_s=4.8, hbm_gb=141, smem_kb_per_sm=228, registers_kb_per_sm=256, sm_count=132, l2_mb=50,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM column, dense = half of the sparse figures); "
               "same GH100 die as H100, so SMs, L2 and shared memory as in the H100 whitepaper"),
}


def ridge_point(gpu: GPUSpec, dtype="bf16") -> float:
    """FLOPs per HBM byte at which ``gpu`` turns from memory-bound to compute-bound."""
    return gpu.peak_tflops(dtype) / gpu.hbm_tb_s


def attainable_tflops(gpu: GPUSpec, intensity: float, dtype="bf16") -> float:
    """The roofline: min(peak, bandwidth x intensity), in TFLOP/s."""
    return min(gpu.peak_tflops(dtype), gpu.hbm_tb_s * intensity)


def roofline_points(shape: AttentionShape = RUNNING_EXAMPLE,
                    sram_bytes: int = 228 * 1024) -> dict[str, float]:
    """Arithmetic intensities (forward) of the kernels the roofline plot places."""
    softmax_flops, softmax_bytes = naive_kernels(shape)["P = softmax(S)"]
    return {
        "naive: softmax kernel": softmax_flops / softmax_bytes,
        "naive: whole forward": arithmetic_intensity(shape, "naive"),
        "flash: K, V per Q tile": arithmetic_intensity(shape, "flash", sram_bytes=sram_bytes),
        "flash: K, V shared in L2": arithmetic_intensity(shape, "flash", l2_reuse=True),
    }


def plot_roofline(gpus=("A100", "H100", "H200"), shape: AttentionShape = RUNNING_EXAMPLE,
                  points: dict[str, float] | None = None, figsize=(7.5, 4.5), dpi=90):
    """A log-log roofline of ``gpus`` in ``shape.dtype`` with the naive and flash kernels placed on it.

    ``points`` maps a label to an intensity (FLOP/byte); it defaults to
    :func:`roofline_points` of ``shape``. Returns a matplotlib Figure.
    """
    from matplotlib.figure import Figure

    points = roofline_points(shape) if points is None else points
    fig = Figure(figsize=figsize, dpi=dpi)
    ax = fig.subplots()
    lowest, highest = min(points.values()) / 2, max(points.values()) * 2
    colors = [f"C{index}" for index in range(len(gpus))]
    for color, key in zip(colors, gpus, strict=True):
        gpu = GPU_SPECS[key]
        ridge = ridge_point(gpu, shape.dtype)
        xs = [lowest, ridge, highest]
        ax.plot(xs, [attainable_tflops(gpu, x, shape.dtype) for x in xs], color=color,
                label=f"{gpu.name}: ridge {ridge:.0f} FLOP/B")
    gpu_legend = ax.legend(fontsize=8, loc="upper left", title="roof (HBM bandwidth, peak)", title_fontsize=8)
    markers = ("v", "o", "s", "*", "D", "^", "P", "X")
    for marker, (label, intensity) in zip(markers, points.items(), strict=False):  # up to 8 points
        ax.axvline(intensity, color="gray", lw=0.6, ls=":")
        for color, key in zip(colors, gpus, strict=True):
            ax.plot(intensity, attainable_tflops(GPU_SPECS[key], intensity, shape.dtype), marker,
                    color=color, ms=7)
        shown = f"{intensity:.3g}" if intensity < 1000 else f"{intensity:,.0f}"
        ax.plot([], [], marker, color="gray", label=f"{label} ({shown} FLOP/B)")
    handles = ax.get_legend_handles_labels()
    ax.legend(handles[0][len(gpus):], handles[1][len(gpus):], fontsize=8, loc="lower right")
    ax.add_artist(gpu_legend)
    precision = precision_name(shape.dtype)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP per HBM byte)",
           ylabel=f"attainable {precision} TFLOP/s",
           title=f"Roofline, attention forward (N={shape.seqlen_q}, d={shape.head_dim}, {precision})")
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    return fig
