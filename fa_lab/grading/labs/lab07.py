"""Lab 07: sparse attention as a choice of key tiles (goes with notebook 07).

====================  ===============================================================================
exercise              the learner's function, as the harness calls it
====================  ===============================================================================
block_sparse_forward  block_sparse_forward(q, k, v, key_tiles, block_q, block_k, causal, scale) -> (out, lse):
                      each query tile over its listed key tiles, one online softmax, tiles only
mean_pool_blocks      mean_pool_blocks(k, block) -> (B, H, ceil(N / block), d): the mean key of each block
moba_gate             moba_gate(q, k, block, top_k) -> int64 (B, H, N, top_k): own block, then the best past blocks
moba_attention        moba_attention(q, k, v, selected, block, scale) -> (out, lse): MoBA's two passes, merged
====================  ===============================================================================

Judged in the grader's process against float64 attention restricted to the selection and against the
gate's definition (:mod:`.lab07_judges`, :mod:`.lab07_moba`). fa_lab's own sparse code (:mod:`fa_lab.sparse`,
the selected-blocks kernel), its merge (:mod:`fa_lab.online_softmax`) and its attention functions are
forbidden in every exercise, so they are absent while grading.
"""
from __future__ import annotations

import torch

from ...block_info import BlockInfo, cdiv
from ...sparse import check_key_tiles, moba_gate
from ...testing import make_qkv
from ..registry import Case, Exercise, Lab
from . import lab07_judges as judges
from . import lab07_moba as moba
from .attention_cases import draw_choice, draw_int

FORBIDDEN = ("fa_lab.sparse", "fa_lab.kernels.triton_block_select_attention")


# ----------------------------------------------------------------------------- block_sparse_forward

def tile_lists(generator, batch, heads_kv, seqlen_q, seqlen_k, block_q, block_k, causal, slots,
               unused=0.25, empty_tile=None) -> torch.Tensor:
    """int64 (B, H_kv, query tiles, slots): distinct key tiles per query tile in a random order, about
    ``unused`` of the slots -1 (anywhere in the list). With ``causal`` only tiles that some row of the query
    tile may see, and always the one that holds its last row's diagonal. empty_tile: a query tile left
    with no tile at all."""
    info = BlockInfo(seqlen_q, seqlen_k, causal)
    q_tiles, k_tiles = cdiv(seqlen_q, block_q), cdiv(seqlen_k, block_k)
    tiles = torch.full((batch, heads_kv, q_tiles, slots), -1, dtype=torch.int64)
    for b in range(batch):
        for h in range(heads_kv):
            for t in range(q_tiles):
                last_row = min(t * block_q + block_q, seqlen_q) - 1
                allowed = cdiv(info.key_end(last_row), block_k) if causal else k_tiles
                if allowed == 0 or t == empty_tile:
                    continue
                chosen = torch.randperm(allowed, generator=generator)[:slots].tolist()
                if causal and allowed - 1 not in chosen:
                    chosen[-1] = allowed - 1
                drop = torch.rand(len(chosen), generator=generator) < unused
                kept = [tile for tile, gone in zip(chosen, drop.tolist(), strict=True) if not gone]
                row = torch.tensor(kept + [-1] * (slots - len(kept)), dtype=torch.int64)
                tiles[b, h, t] = row[torch.randperm(slots, generator=generator)]
    return tiles


def _sparse_case(generator, name, batch, heads, heads_kv, seqlen_q, seqlen_k, block_q, block_k, slots, causal,
                 scale=None, dtype=torch.float32, gain=1.0, empty_tile=None, tiles_only=False) -> Case:
    head_dim = 8 if tiles_only else 16
    q, k, v = make_qkv(batch, heads, seqlen_q, seqlen_k, head_dim, generator=generator, heads_kv=heads_kv,
                       requires_grad=False)
    tiles = tile_lists(generator, batch, heads_kv, seqlen_q, seqlen_k, block_q, block_k, causal, slots,
                       empty_tile=empty_tile)
    check_key_tiles(tiles, q, k, block_q, block_k, causal)
    # Tiles only: no tensor larger than the output, (B, H, Nq, d): one tile of scores at a time fits, the
    # listed tiles of a query tile gathered at once do not (group * block_q * slots * block_k is larger).
    limit = batch * heads * seqlen_q * head_dim if tiles_only else None
    return Case(name, ((q * gain).to(dtype), k.to(dtype), v.to(dtype), tiles, block_q, block_k, causal, scale), limit)


def public_sparse_cases() -> list[Case]:
    g = torch.Generator().manual_seed(7100)
    return [
        _sparse_case(g, "one head, 48 queries and keys, tiles of 16, lists of 2, full", 1, 1, 1, 48, 48, 16, 16, 2,
                     False),
        _sparse_case(g, "GQA: 4 query heads over 2 KV heads, Nq = 40, Nk = 64, lists of 3, full, scale 0.3",
                     1, 4, 2, 40, 64, 8, 16, 3, False, 0.3),
        _sparse_case(g, "causal, Nq = Nk = 50 (ragged last tiles), tiles of 16, 4 query heads over 2 KV heads",
                     2, 4, 2, 50, 50, 16, 16, 3, True),
        _sparse_case(g, "causal, Nq = 24, Nk = 56: query i sees keys j <= i + 32", 1, 2, 1, 24, 56, 8, 16, 3, True),
        _sparse_case(g, "causal, Nq = 40, Nk = 24: the first 16 queries see no key", 1, 2, 2, 40, 24, 8, 8, 2, True),
        _sparse_case(g, "query tile 1 lists no tile (zeros, lse = -inf)", 1, 2, 1, 32, 32, 8, 8, 3, False,
                     empty_tile=1),
        _sparse_case(g, "causal, bfloat16, 4 query heads over 1 KV head", 1, 4, 1, 32, 32, 16, 8, 3, True,
                     dtype=torch.bfloat16),
        _sparse_case(g, "scores far above 88 (q x 60)", 1, 2, 2, 32, 48, 16, 16, 2, False, gain=60.0),
        _sparse_case(g, "tiles only: Nq = Nk = 512, tiles of 32, lists of 8, causal, no tensor over (B, H, Nq, d)",
                     1, 2, 1, 512, 512, 32, 32, 8, True, tiles_only=True),
    ]


def hidden_sparse_cases(generator) -> list[Case]:
    cases = []
    # (causal, Nq against Nk, dtype, gain, KV heads, group size): both above 1 in half of them (GQA).
    for causal, relation, dtype, gain, heads_kv, group in (
            (True, "square", torch.float32, 1.0, 2, 2), (True, "fewer", torch.float32, 1.0, 1, 3),
            (True, "more", torch.float16, 1.0, 2, 1), (False, "any", torch.float32, 1.0, 2, 3),
            (False, "any", torch.bfloat16, 1.0, 1, 2), (False, "any", torch.float32, 60.0, 2, 2)):
        seqlen_q = draw_int(generator, 1, 60)
        if relation == "square":
            seqlen_k = seqlen_q
        elif relation == "fewer":  # fewer queries than keys
            seqlen_k = seqlen_q + draw_int(generator, 1, 30)
        elif relation == "more":
            seqlen_k = max(1, seqlen_q - draw_int(generator, 1, 30))
        else:
            seqlen_k = draw_int(generator, 1, 60)
        block_q, block_k = draw_choice(generator, (4, 8, 16)), draw_choice(generator, (4, 8, 16))
        slots = draw_int(generator, 1, 4)
        cases.append(_sparse_case(generator, f"{'causal' if causal else 'full'}, {heads_kv * group} query heads over "
                                             f"{heads_kv} KV heads, Nq = {seqlen_q}, Nk = {seqlen_k}, tiles "
                                             f"{block_q}x{block_k}, lists of {slots}"
                                             + (f", {dtype}" if dtype != torch.float32 else "")
                                             + (f", q x {gain:g}" if gain != 1.0 else ""),
                                  1, heads_kv * group, heads_kv, seqlen_q, seqlen_k, block_q, block_k, slots, causal,
                                  dtype=dtype, gain=gain))
    n = draw_int(generator, 400, 520)
    cases.append(_sparse_case(generator, f"tiles only: Nq = Nk = {n}, causal", 1, 2, 1, n, n, 32, 32, 8, True,
                              tiles_only=True))
    return cases


# ----------------------------------------------------------------------------- mean_pool_blocks

def _keys(generator, batch, heads, seqlen, head_dim=8) -> torch.Tensor:
    return torch.randn(batch, heads, seqlen, head_dim, generator=generator)


def public_pool_cases() -> list[Case]:
    g = torch.Generator().manual_seed(7200)
    return [Case("16 tokens in blocks of 4 (whole blocks)", (_keys(g, 1, 1, 16), 4)),
            Case("19 tokens in blocks of 8 (a last block of 3)", (_keys(g, 1, 2, 19), 8)),
            Case("blocks of 1 (each key is its own block)", (_keys(g, 1, 1, 5), 1)),
            Case("5 tokens in blocks of 16 (one partial block)", (_keys(g, 1, 1, 5), 16)),
            Case("batch 2, 3 heads, 30 tokens in blocks of 7", (_keys(g, 2, 3, 30), 7))]


def hidden_pool_cases(generator) -> list[Case]:
    cases = []
    for _ in range(5):
        seqlen, block = draw_int(generator, 1, 60), draw_choice(generator, (2, 4, 5, 8, 16))
        cases.append(Case(f"{seqlen} tokens in blocks of {block}",
                          (_keys(generator, draw_int(generator, 1, 2), draw_int(generator, 1, 3), seqlen), block)))
    return cases


# ----------------------------------------------------------------------------- moba_gate

def _gate_case(generator, name, batch, heads, seqlen, block, top_k) -> Case:
    q, k, _ = make_qkv(batch, heads, seqlen, seqlen, 16, generator=generator, requires_grad=False)
    return Case(name, (q, k, block, top_k))


def public_gate_cases() -> list[Case]:
    g = torch.Generator().manual_seed(7300)
    return [_gate_case(g, "64 tokens, blocks of 16, top_k 3 (the own block and 2 past ones)", 1, 1, 64, 16, 3),
            _gate_case(g, "70 tokens, blocks of 16 (a last block of 6), top_k 2", 1, 2, 70, 16, 2),
            _gate_case(g, "top_k 1: the own block only", 1, 1, 40, 8, 1),
            _gate_case(g, "48 tokens, blocks of 8, top_k 5: early queries have fewer past blocks (-1)", 1, 2, 48, 8,
                       5),
            _gate_case(g, "batch 2, 2 heads, 50 tokens, blocks of 10, top_k 4", 2, 2, 50, 10, 4)]


def hidden_gate_cases(generator) -> list[Case]:
    cases = []
    for _ in range(5):
        block = draw_choice(generator, (4, 8, 16))
        seqlen = draw_int(generator, block + 1, 80)
        top_k = draw_int(generator, 1, min(6, cdiv(seqlen, block)))
        cases.append(_gate_case(generator, f"{seqlen} tokens, blocks of {block}, top_k {top_k}",
                                draw_int(generator, 1, 2), draw_int(generator, 1, 2), seqlen, block, top_k))
    return cases


# ----------------------------------------------------------------------------- moba_attention

def _moba_case(generator, name, batch, heads, seqlen, block, top_k, scale=None, gain=1.0) -> Case:
    q, k, v = make_qkv(batch, heads, seqlen, seqlen, 16, generator=generator, requires_grad=False)
    q = q * gain
    return Case(name, (q, k, v, moba_gate(q, k, block, top_k), block, scale))


def public_moba_cases() -> list[Case]:
    g = torch.Generator().manual_seed(7400)
    return [_moba_case(g, "64 tokens, blocks of 16, top_k 3", 1, 2, 64, 16, 3),
            _moba_case(g, "70 tokens, blocks of 16 (a ragged last block), top_k 2, scale 0.3", 1, 1, 70, 16, 2, 0.3),
            _moba_case(g, "top_k 1: the own block only (pass 2 sees no key)", 1, 2, 40, 8, 1),
            _moba_case(g, "batch 2, 2 heads, 48 tokens, blocks of 8, top_k 4", 2, 2, 48, 8, 4),
            _moba_case(g, "scores far above 88 (q x 60): LSEs past float32's exp limit", 1, 2, 48, 8, 3, None, 60.0)]


def hidden_moba_cases(generator) -> list[Case]:
    cases = []
    for gain in (1.0, 1.0, 1.0, 60.0):
        block = draw_choice(generator, (4, 8, 16))
        seqlen = draw_int(generator, block + 1, 72)
        top_k = draw_int(generator, 1, min(5, cdiv(seqlen, block)))
        cases.append(_moba_case(generator, f"{seqlen} tokens, blocks of {block}, top_k {top_k}"
                                           + (f", q x {gain:g}" if gain != 1.0 else ""),
                                draw_int(generator, 1, 2), draw_int(generator, 1, 2), seqlen, block, top_k, None, gain))
    return cases


LAB = Lab(
    id="lab07",
    title="Sparse attention: a block-sparse forward over tile lists, MoBA's gate and its two passes",
    notebook="lab07_sparse.ipynb",
    exercises=(
        Exercise("block_sparse_forward", "block_sparse_forward", 3.5, public_sparse_cases, hidden_sparse_cases,
                 judges.judge_block_sparse, summarize=judges.summarize_block_sparse, forbidden=FORBIDDEN),
        Exercise("mean_pool_blocks", "mean_pool_blocks", 1.5, public_pool_cases, hidden_pool_cases,
                 moba.judge_pool, forbidden=FORBIDDEN),
        Exercise("moba_gate", "moba_gate", 2.5, public_gate_cases, hidden_gate_cases, moba.judge_gate,
                 forbidden=FORBIDDEN),
        Exercise("moba_attention", "moba_attention", 2.5, public_moba_cases, hidden_moba_cases, moba.judge_moba,
                 forbidden=FORBIDDEN),
    ),
)
