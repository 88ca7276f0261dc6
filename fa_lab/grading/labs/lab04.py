"""Lab 04: FP8 attention with block quantization and incoherent processing (goes with notebook 04).

=================  =========================================================================
exercise           the learner's function, as the harness calls it
=================  =========================================================================
quantize_blocks    quantize_blocks(x, block) -> (data e4m3 (B, H, N, d), scales (B, H, ceil(N / block)))
hadamard           hadamard(x) -> x H / sqrt(d) over the last dim, by butterflies
rotate_qk          rotate_qk(q, k, signs) -> (q M, k M), M = diag(signs) H / sqrt(d)
fp8_error_table    fp8_error_table(seed) -> {row: RMSE}, the FA3 paper's table at TABLE_SHAPE
consumer_steps     consumer_steps() -> the two-stage loop of a consumer warpgroup, as steps
                   (:mod:`fa_lab.pipeline_steps`), judged by the pipeline simulator (:mod:`.lab04_schedule`)
=================  =========================================================================

Every exercise forbids ``fa_lab.fp8`` (its quantization, transform, rotation and FP8
attention are the answers), except the helpers that draw the paper's data and
measure an RMSE. The table may use fa_lab's attention references for the float64
reference and the fp16 rows; its FP8 rows go through the learner's own pieces.
The judges are in :mod:`.lab04_judges` and :mod:`.lab04_table`.
"""
from __future__ import annotations

import torch

from ...block_info import cdiv
from ...fp8 import outlier_qkv, random_signs
from ..judge import only_some_fail
from ..registry import Case, Exercise, Lab
from .attention_cases import DTYPE_NAMES as ATTENTION_DTYPE_NAMES
from .attention_cases import draw_choice, draw_int
from .lab04_judges import judge_hadamard, judge_quantize, judge_rotate
from .lab04_schedule import hidden_schedule_cases, judge_schedule, public_schedule_cases
from .lab04_table import TABLE_SHAPE, judge_table

FORBIDDEN = ("fa_lab.fp8",)
HELPERS = ("fa_lab.fp8.outlier_qkv", "fa_lab.fp8.random_signs", "fa_lab.fp8.rmse")
REFERENCES = ("fa_lab.reference.reference_attention", "fa_lab.reference.naive_attention",
              "fa_lab.flash_torch.flash_forward")
DTYPE_NAMES = {**ATTENTION_DTYPE_NAMES, torch.float64: "float64"}
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view: (B, H, N, d) stored as (B, N, H, d)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


# ----------------------------------------------------------------------------- quantize_blocks


def quantize_case(name, shape, block, generator, exponents=(0.0, 0.0), per_row=False,
                  dtype=torch.float32, zero_block=None, strided=False) -> Case:
    """quantize_blocks(x, block) on N(0, 1) values times 10^u per block (or per row), u uniform in
    ``exponents``. zero_block: (batch, head, block index) set to zero."""
    batch, heads, seqlen, head_dim = shape
    x = torch.randn(shape, generator=generator)
    low, high = exponents
    groups = seqlen if per_row else cdiv(seqlen, block)
    gains = 10 ** (low + (high - low) * torch.rand(batch, heads, groups, generator=generator))
    x = x * (gains if per_row else gains.repeat_interleave(block, dim=-1)[..., :seqlen])[..., None]
    if zero_block is not None:
        b, h, j = zero_block
        x[b, h, j * block:(j + 1) * block] = 0
    x = x.to(dtype)
    return Case(name, (_strided(x) if strided else x, block))


def public_quantize_cases() -> list[Case]:
    def generator(i):
        return torch.Generator().manual_seed(4100 + i)
    return [
        quantize_case("256 rows in 4 blocks of 64, d=32", (1, 2, 256, 32), 64, generator(0)),
        quantize_case("300 rows in blocks of 128: the last block has 44 rows", (2, 1, 300, 16), 128,
                      generator(1), exponents=(-1, 1)),
        quantize_case("blocks of 128 whose magnitudes differ by up to 10^4", (1, 1, 512, 64), 128,
                      generator(2), exponents=(-2, 2)),
        quantize_case("an all-zero block (rows 64-127 of head 1)", (1, 2, 200, 16), 64, generator(3),
                      zero_block=(0, 1, 1)),
        quantize_case("row magnitudes from 1e-2 to 1e2, bfloat16 input", (1, 2, 96, 32), 32, generator(4),
                      exponents=(-2, 2), per_row=True, dtype=torch.bfloat16),
        quantize_case("a block longer than the sequence: one block of 50 rows", (1, 1, 50, 16), 128,
                      generator(5)),
    ]


def hidden_quantize_cases(generator) -> list[Case]:
    cases = []
    for i, dtype in enumerate((torch.float32, torch.float32, torch.float16, torch.bfloat16, torch.float32,
                               torch.float32)):
        block = draw_choice(generator, (16, 32, 64, 128))
        seqlen = draw_int(generator, block + 1 if i == 4 else 1, 400)
        shape = (draw_int(generator, 1, 2), draw_int(generator, 1, 3), seqlen,
                 draw_choice(generator, (8, 16, 32, 64, 128)))
        zero_block = (shape[0] - 1, shape[1] - 1, 0) if i == 4 else None
        name = (f"B={shape[0]} H={shape[1]} N={seqlen} d={shape[3]}, blocks of {block}, {DTYPE_NAMES[dtype]}"
                + (", an all-zero block" if zero_block else "") + (", non-contiguous" if i == 5 else ""))
        cases.append(quantize_case(name, shape, block, generator, exponents=(-3, 3), dtype=dtype,
                                   zero_block=zero_block, strided=i == 5))
    return cases


def _ragged(case: Case) -> bool:
    x, block = case.args
    return x.shape[-2] % block != 0


def summarize_quantize(results) -> str | None:
    return only_some_fail(results, _ragged,
                          "Only the cases where block does not divide N fail: the last block is shorter "
                          "(N % block rows) and gets its own scale too. Pad the rows up to a multiple of "
                          "block (zero rows change no amax), or handle the last block apart.")


# ----------------------------------------------------------------------------- hadamard


def hadamard_case(name, shape, generator, dtype=torch.float32, strided=False, tiles_only=False) -> Case:
    """hadamard(x) on N(0, 1) values; tiles_only: the call may create no tensor larger than 4x x."""
    x = torch.randn(shape, generator=generator).to(dtype)
    x = _strided(x) if strided else x
    return Case(name, (x,), 4 * x.numel() if tiles_only else None)


def public_hadamard_cases() -> list[Case]:
    def generator(i):
        return torch.Generator().manual_seed(4200 + i)
    return [
        hadamard_case("d=2, one butterfly: (a + b, a - b) / sqrt(2)", (3, 2), generator(0)),
        hadamard_case("d=8, x of shape (2, 3, 8)", (2, 3, 8), generator(1)),
        Case("the identity: hadamard(torch.eye(16)) is H / 4", (torch.eye(16),)),
        hadamard_case("d=128, (B, H, N, d) = (1, 2, 16, 128)", (1, 2, 16, 128), generator(3)),
        hadamard_case("bfloat16, d=64", (4, 64), generator(4), dtype=torch.bfloat16),
        hadamard_case("non-contiguous: a (B, N, H, d) tensor seen as (B, H, N, d)", (2, 3, 5, 32),
                      generator(5), strided=True),
        hadamard_case("d=1024, 2 rows: no 1024 x 1024 matrix", (2, 1024), generator(6), tiles_only=True),
    ]


def hidden_hadamard_cases(generator) -> list[Case]:
    cases = []
    for i, dtype in enumerate(FLOAT_DTYPES + (torch.float32, torch.float32)):
        head_dim = 2 ** draw_int(generator, 1, 9)
        if i == 4:
            shape = (draw_int(generator, 1, 2), draw_int(generator, 1, 3), draw_int(generator, 1, 9),
                     head_dim)
        elif i == 5:
            head_dim = 2 ** draw_int(generator, 11, 12)
            shape = (draw_int(generator, 1, 3), head_dim)
        else:
            shape = tuple(draw_int(generator, 1, 5) for _ in range(draw_int(generator, 1, 3))) + (head_dim,)
        name = (f"x of shape {shape}, {DTYPE_NAMES[dtype]}" + (", non-contiguous" if i == 4 else "")
                + (f": no {head_dim} x {head_dim} matrix" if i == 5 else ""))
        cases.append(hadamard_case(name, shape, generator, dtype, strided=i == 4, tiles_only=i == 5))
    return cases


# ----------------------------------------------------------------------------- rotate_qk


def rotate_case(name, batch, heads, seqlen_q, seqlen_k, head_dim, generator, dtype=torch.float32,
                outliers=False, strided=False) -> Case:
    """rotate_qk(q, k, signs): N(0, 1) q and k (or the paper's outlier data), signs (head_dim,) of +-1."""
    if outliers:
        q, k, _ = outlier_qkv(batch, heads, seqlen_q, seqlen_k, head_dim, generator)
    else:
        q = torch.randn(batch, heads, seqlen_q, head_dim, generator=generator)
        k = torch.randn(batch, heads, seqlen_k, head_dim, generator=generator)
    q, k = q.to(dtype), k.to(dtype)
    if strided:
        q, k = _strided(q), _strided(k)
    return Case(name, (q, k, random_signs(head_dim, generator)))


def public_rotate_cases() -> list[Case]:
    def generator(i):
        return torch.Generator().manual_seed(4300 + i)
    return [
        rotate_case("Nq=16, Nk=24, d=32, float32", 1, 2, 16, 24, 32, generator(0)),
        rotate_case("the paper's outlier data, float64, d=128", 1, 1, 32, 48, 128, generator(1),
                    dtype=torch.float64, outliers=True),
        rotate_case("bfloat16, d=64", 2, 1, 8, 8, 64, generator(2), dtype=torch.bfloat16),
        rotate_case("non-contiguous q and k, d=16", 1, 3, 10, 12, 16, generator(3), strided=True),
    ]


def hidden_rotate_cases(generator) -> list[Case]:
    cases = []
    for i, dtype in enumerate(FLOAT_DTYPES + (torch.float32,)):
        sizes = (draw_int(generator, 1, 2), draw_int(generator, 1, 3), draw_int(generator, 1, 64),
                 draw_int(generator, 1, 64), draw_choice(generator, (8, 16, 32, 64, 128, 256)))
        name = (f"B={sizes[0]} H={sizes[1]} Nq={sizes[2]} Nk={sizes[3]} d={sizes[4]}, {DTYPE_NAMES[dtype]}"
                + (", outlier data" if i == 1 else "") + (", non-contiguous" if i == 4 else ""))
        cases.append(rotate_case(name, *sizes, generator, dtype, outliers=i == 1, strided=i == 4))
    return cases


# ----------------------------------------------------------------------------- fp8_error_table

TABLE_NAME = (f"{TABLE_SHAPE['seqlen_q']} queries, {TABLE_SHAPE['seqlen_k']} keys, "
              f"d={TABLE_SHAPE['head_dim']} (TABLE_SHAPE)")


def public_table_cases() -> list[Case]:
    return [Case(f"seed 0: {TABLE_NAME}", (0,))]


def hidden_table_cases(generator) -> list[Case]:
    seed = draw_int(generator, 1, 10**6)  # another seed: a table that only knows seed 0 fails it
    return [Case(f"seed {seed}: {TABLE_NAME}", (seed,))]


LAB = Lab(
    id="lab04",
    title="FP8 attention (block quantization, the Hadamard transform, the FA3 error table) and FA3's two-stage loop",
    notebook="lab04_fp8_incoherent_processing.ipynb",
    exercises=(
        Exercise("quantize_blocks", "quantize_blocks", 2.5, public_quantize_cases, hidden_quantize_cases,
                 judge_quantize, summarize=summarize_quantize, forbidden=FORBIDDEN, allowed=HELPERS),
        Exercise("hadamard", "hadamard", 2, public_hadamard_cases, hidden_hadamard_cases, judge_hadamard,
                 forbidden=FORBIDDEN, allowed=HELPERS),
        Exercise("rotate_qk", "rotate_qk", 1.5, public_rotate_cases, hidden_rotate_cases, judge_rotate,
                 forbidden=FORBIDDEN, allowed=HELPERS),
        Exercise("fp8_error_table", "fp8_error_table", 2.5, public_table_cases, hidden_table_cases,
                 judge_table, forbidden=FORBIDDEN, allowed=HELPERS + REFERENCES),
        Exercise("consumer_steps", "consumer_steps", 1.5, public_schedule_cases, hidden_schedule_cases,
                 judge_schedule, forbidden=FORBIDDEN),
    ),
)
