"""Sparse attention as a choice of key tiles (chapter 07): block-sparse attention over a tile list, MoBA, NSA.

Block-sparse attention: query tile ``t`` of ``block_q`` rows attends only to the key tiles listed in
``key_tiles[b, h_kv, t]`` (``block_k`` keys each, -1 pads a shorter list), the same list for every query
head of a GQA group, so that a kernel reads each selected K/V tile once per group. With ``causal``
the course's bottom-right mask applies inside the selection too. :func:`selection_mask` is the dense
(Nq, Nk) mask of a selection, for references and tests only.

MoBA (Moonshot's mixture of block attention): keys are cut into blocks of ``block`` tokens, each block
is represented by its mean key, and query ``i`` keeps its own block (always, attended causally) plus the
``top_k - 1`` past blocks whose mean key scores highest against it (future blocks are never selected).
:func:`moba_attention` computes it in MoBA's two passes: the own block as causal attention within each
block, the selected past blocks as full attention per query, merged by their log-sum-exp
(:func:`fa_lab.online_softmax.merge_splits`); with ``impl="triton"`` the first pass runs on the
dense causal kernel with each block a head (on chapter 05's varlen kernel, one sequence per block, when N is not a
multiple of the block), the second on the varlen kernel, key-block-major (:mod:`fa_lab.kernels.portable.moba`).

NSA (DeepSeek's native sparse attention): three causal branches mixed by a learned gate, the query
over the mean keys of compressed blocks (:func:`nsa_compress`), over the raw keys of the ``top_n``
selection blocks that its GQA group ranks highest by the compressed branch's probabilities
(:func:`nsa_select`), and over a sliding window (:func:`nsa_attention`: a dense masked reference, or kernels
throughout).

Self-attention layouts as :func:`fa_lab.attention`: q (B, H, N, d), k, v (B, H_kv, N, d).
``impl="triton"`` (block-sparse attention, NSA's selected branch) runs the selected-blocks kernel of
:mod:`fa_lab.kernels.portable.sparse_select`, which takes both selections as they are: a per-tile list
(``block_q`` queries per row) and NSA's per-query one (``block_q = 1``); NSA's other branches then run on the
dense kernels and its selection scores on :mod:`fa_lab.kernels.portable.nsa_importance`.
"""
from __future__ import annotations

import torch

from .block_info import BlockInfo, cdiv
from .inputs import SUPPORTED_DTYPES, check_block_size, check_flag, check_qkv, resolve_scale
from .online_softmax import merge_splits
from .reference import expand_kv, softmax_with_lse

# The references take float64 too (then they compute in float64; otherwise in float32).
DTYPES = (*SUPPORTED_DTYPES, torch.float64)
IMPLS = ("torch", "triton")


def _compute_dtype(q) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def check_key_tiles(key_tiles, q, k, block_q: int, block_k: int, causal: bool,
                    name: str = "key_tiles") -> torch.Tensor:
    """key_tiles as int64 (B, H_kv, ceil(Nq / block_q), S), checked: indices in [-1, key tiles), no tile
    listed twice for one query tile, and with ``causal`` no tile that lies wholly after the diagonal of
    every row of its query tile. ``name``: the argument's name in the messages."""
    check_flag("causal", causal)
    if not isinstance(key_tiles, torch.Tensor) or key_tiles.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {type(key_tiles).__name__}"
                        + (f" of {key_tiles.dtype}" if isinstance(key_tiles, torch.Tensor) else ""))
    q_tiles, k_tiles = cdiv(q.shape[2], block_q), cdiv(k.shape[2], block_k)
    want = (q.shape[0], k.shape[1], q_tiles)
    if key_tiles.ndim != 4 or tuple(key_tiles.shape[:3]) != want:
        raise ValueError(f"{name} must have shape (batch, heads_kv, query tiles, S) = {want + ('S',)}, got "
                         f"{tuple(key_tiles.shape)}")
    tiles = key_tiles.long()
    if bool(((tiles < -1) | (tiles >= k_tiles)).any()):
        raise ValueError(f"{name} holds indices outside [-1, {k_tiles}): {k_tiles} key tiles of {block_k}")
    ordered = tiles.sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if bool(repeated.any()):
        b, h, t, _ = (int(i) for i in torch.nonzero(repeated)[0])
        raise ValueError(f"{name}[{b}, {h}, {t}] lists a key tile twice: {tiles[b, h, t].tolist()}")
    if causal:
        info = BlockInfo(q.shape[2], k.shape[2], causal=True)
        last_rows = torch.clamp(torch.arange(q_tiles, device=tiles.device) * block_q + block_q, max=q.shape[2]) - 1
        key_end = info.key_end(last_rows)  # (query tiles,): keys past it are after every row's diagonal
        future = (tiles >= 0) & (tiles * block_k >= key_end.view(1, 1, -1, 1))
        if bool(future.any()):
            b, h, t, s = (int(i) for i in torch.nonzero(future)[0])
            raise ValueError(f"{name}[{b}, {h}, {t}] selects key tile {int(tiles[b, h, t, s])}, which no row of "
                             f"query tile {t} may see under the causal mask: a causal call selects past tiles only")
    return tiles


def selection_mask(key_tiles, seqlen_q: int, seqlen_k: int, block_q: int, block_k: int) -> torch.Tensor:
    """(B, H_kv, Nq, Nk) bool: True where a query's tile selects the key's tile (dense: references only)."""
    tiles = key_tiles.long()
    batch, heads_kv, q_tiles, _ = tiles.shape
    chosen = torch.zeros(batch, heads_kv, q_tiles, cdiv(seqlen_k, block_k) + 1, dtype=torch.bool)
    chosen.scatter_(-1, torch.where(tiles < 0, chosen.shape[-1] - 1, tiles), True)  # -1 lands in a spare column
    chosen = chosen[..., :-1]
    per_row = chosen.repeat_interleave(block_q, dim=2)[:, :, :seqlen_q]
    return per_row.repeat_interleave(block_k, dim=3)[..., :seqlen_k]


def check_impl(impl) -> str:
    """The implementation of a sparse call: "torch" (the references here) or "triton" (the kernel of
    :mod:`fa_lab.kernels.portable.sparse_select`)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}; got {impl!r}")
    return impl


def block_sparse_attention(q, k, v, key_tiles, block_q: int, block_k: int, causal: bool = False,
                           scale: float | None = None, impl: str = "torch"):
    """Attention of each query tile over its selected key tiles only. Returns (out (B, H, Nq, d) in
    q.dtype, lse (B, H, Nq) float32); a row that sees no selected key gets zeros and lse = -inf.

    impl="torch": each query tile gathers its S selected K/V tiles (S * block_k keys) and runs one
    softmax over them: memory O(block_q * S * block_k) per tile, never (Nq, Nk). Differentiable
    (through the gather). impl="triton": the selected-blocks kernel (float16/bfloat16), with the tile's
    query rows of the whole GQA group in one program (:func:`fa_lab.kernels.triton_block_select_attention`).
    """
    if check_impl(impl) == "triton":  # the launcher checks the same, naming the tiles as the caller does
        from .kernels import triton_block_select_attention
        return triton_block_select_attention(q, k, v, key_tiles, block_k, causal, scale, block_q=block_q,
                                             name="key_tiles")
    check_qkv(q, k, v, DTYPES)
    check_block_size("block_q", block_q)
    check_block_size("block_k", block_k)
    tiles = check_key_tiles(key_tiles, q, k, block_q, block_k, causal).to(q.device)
    scale = resolve_scale(scale, q.shape[-1])
    batch, heads, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k, group = k.shape[1], k.shape[2], heads // k.shape[1]
    info = BlockInfo(seqlen_q, seqlen_k, causal)
    dtype = _compute_dtype(q)
    outs, lses = [], []
    for t in range(tiles.shape[2]):
        i0, i1 = t * block_q, min(t * block_q + block_q, seqlen_q)
        keys = (tiles[:, :, t, :, None] * block_k + torch.arange(block_k, device=q.device)).flatten(2)  # (B, Hkv, S*bk)
        valid = (tiles[:, :, t, :, None] >= 0).expand(-1, -1, -1, block_k).flatten(2) & (keys < seqlen_k)
        index = torch.where(valid, keys, 0)[..., None].expand(-1, -1, -1, head_dim)
        k_sel, v_sel = k.to(dtype).gather(2, index), v.to(dtype).gather(2, index)  # (B, Hkv, S*bk, d)
        q_tile = q[:, :, i0:i1].to(dtype).reshape(batch, heads_kv, group * (i1 - i0), head_dim)
        s = torch.matmul(q_tile, k_sel.transpose(-2, -1)) * scale  # (B, Hkv, g * tq, S*bk)
        s = s.view(batch, heads_kv, group, i1 - i0, -1)
        visible = valid[:, :, None, None, :]
        if info.masked:
            rows = torch.arange(i0, i1, device=q.device)[:, None]
            visible = visible & (keys[:, :, None, None, :] < info.key_end(rows).view(1, 1, 1, -1, 1))
        p, lse = softmax_with_lse(s.masked_fill(~visible, float("-inf")))
        out = torch.matmul(p, v_sel[:, :, None])  # (B, Hkv, g, tq, d)
        outs.append(out.reshape(batch, heads, i1 - i0, head_dim))
        lses.append(lse.reshape(batch, heads, i1 - i0))
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2).float()


# ---------------------------------------------------------------- MoBA

def check_moba_gate(q, k, block: int, top_k: int, impl: str) -> None:
    """Refuse what :func:`moba_gate` cannot select from, before anything is computed."""
    check_qkv(q, k, k, DTYPES)
    check_impl(impl)
    check_block_size("block", block)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"MoBA is self-attention here: q has {q.shape[2]} tokens and k {k.shape[2]}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1 (the own block counts), got {top_k!r}")


@torch.no_grad()  # the selection is discrete: no gradient flows through the scores
def moba_gate(q, k, block: int, top_k: int, impl: str = "torch") -> torch.Tensor:
    """(B, H, N, top_k) int64: the key blocks each query keeps, own block first, then the best past blocks
    by q . mean(K_block) (-1 where a query has fewer past blocks than top_k - 1). Causal, self-attention.
    impl="triton" (float16/bfloat16): the scores and picks in one kernel that reads q once
    (:func:`fa_lab.kernels.triton_moba_gate`), up to its limit on blocks; the same picks up to ties of
    float32 rounding."""
    check_moba_gate(q, k, block, top_k, impl)
    seqlen, blocks = q.shape[2], cdiv(k.shape[2], block)
    picks = min(top_k - 1, blocks)  # past blocks picked (slots past the number of blocks are dropped)
    dtype = _compute_dtype(q)
    # Mean keys on K's own heads, summed in the compute dtype without a converted copy of K (the padding, a
    # copy, only when the last block is partial): (B, H_kv, blocks, d).
    padded = k if seqlen % block == 0 else torch.nn.functional.pad(k, (0, 0, 0, blocks * block - seqlen))
    counts = torch.clamp(seqlen - torch.arange(blocks, device=q.device) * block, max=block)
    pooled = padded.view(*k.shape[:2], blocks, block, k.shape[-1]).sum(3, dtype=dtype) / counts[:, None]
    if impl == "triton" and dtype == torch.float32:
        from .kernels import triton_moba_gate
        chosen = triton_moba_gate(q, pooled, block, picks + 1)
        if chosen is not None:
            return chosen
    scores = torch.matmul(q.to(dtype), expand_kv(pooled, q.shape[1]).transpose(-2, -1))  # (B, H, N, blocks)
    own = torch.arange(seqlen, device=q.device) // block
    past = torch.arange(blocks, device=q.device)[None, :] < own[:, None]  # strictly earlier blocks only
    scores = scores.masked_fill(~past, float("-inf"))
    chosen = [own.expand(*q.shape[:2], seqlen)]
    # The best past blocks one at a time, each then masked out: top_k - 1 passes over the few blocks of a row
    # cost less than a general top-k, which sorts each row (4.3 of the 34.6 ms of MoBA's forward at 64K on the
    # H200, docs/experiments/sparse_kernels.md). Order and result are topk's, up to ties.
    for _ in range(picks):
        value, index = scores.max(dim=-1)
        chosen.append(torch.where(torch.isinf(value), -1, index))
        scores.scatter_(-1, index[..., None], float("-inf"))
    return torch.stack(chosen, dim=-1)


def moba_mask(selected, seqlen: int, block: int) -> torch.Tensor:
    """(B, H, N, N) bool: the keys each query sees under MoBA (dense: references only)."""
    keys = torch.arange(seqlen)
    in_block = (keys[None, :] // block)[None, None, None] == selected.clamp(min=-1).cpu()[..., None]  # (B,H,N,K,N)
    return in_block.any(dim=-2) & BlockInfo(seqlen, seqlen, causal=True).mask()


def moba_attention(q, k, v, block: int, top_k: int, scale: float | None = None, impl: str = "torch"):
    """MoBA's output and LSE in two passes merged by their LSE. Returns (out (B, H, N, d), lse (B, H, N)),
    differentiable in q, k, v (the gate's selection is discrete). impl="triton": the own blocks on the dense
    causal kernel, each block a head (varlen when N is not a multiple of block), the past blocks on the varlen
    kernel (float16/bfloat16; lse detached)."""
    check_qkv(q, k, v, DTYPES)
    check_moba_gate(q, k, block, top_k, impl)
    scale = resolve_scale(scale, q.shape[-1])
    batch, heads, seqlen, head_dim = q.shape
    if impl == "triton":  # the kernels call the gate once their first pass is queued (it needs no selection)
        from .kernels import triton_moba_attention
        return triton_moba_attention(q, expand_kv(k, heads), expand_kv(v, heads),
                                     lambda: moba_gate(q, k, block, top_k, impl), block, scale)
    selected = moba_gate(q, k, block, top_k, impl)
    k, v = expand_kv(k, heads), expand_kv(v, heads)
    # Pass 1: every query over its own block, causally, all blocks at once in plain PyTorch. Not through
    # attention_varlen: its LSE is detached (as flash-attn's is), and the merge below differentiates
    # through the LSE. The kernel path gets the same gradients another way: it runs each pass's
    # backward with the merged output and LSE (fa_lab/kernels/portable/moba.py).
    dtype = _compute_dtype(q)
    blocks = cdiv(seqlen, block)
    q_b, k_b, v_b = (torch.nn.functional.pad(t.to(dtype), (0, 0, 0, blocks * block - seqlen))
                     .view(batch, heads, blocks, block, head_dim) for t in (q, k, v))
    inside = BlockInfo(block, block, causal=True).mask().to(q.device)  # padding keys follow every real query
    p, lse_own = softmax_with_lse((torch.matmul(q_b, k_b.transpose(-2, -1)) * scale).masked_fill(~inside,
                                                                                                float("-inf")))
    out_own = torch.matmul(p, v_b).view(batch, heads, blocks * block, head_dim)[:, :, :seqlen]
    lse_own = lse_own.view(batch, heads, blocks * block)[:, :, :seqlen]
    # Pass 2: every query over its selected past blocks, all of whose keys it sees.
    past = selected[..., 1:]  # (B, H, N, top_k - 1)
    if past.shape[-1] == 0:
        return out_own.to(q.dtype), lse_own.float()
    keys = (past[..., None] * block + torch.arange(block, device=q.device)).flatten(-2)  # (B, H, N, (top_k-1)*block)
    valid = (past[..., None] >= 0).expand(*past.shape, block).flatten(-2)
    index = torch.where(valid, keys, 0)
    k_sel = torch.gather(k.to(dtype)[:, :, None].expand(-1, -1, seqlen, -1, -1), 3,
                         index[..., None].expand(*index.shape, head_dim))
    v_sel = torch.gather(v.to(dtype)[:, :, None].expand(-1, -1, seqlen, -1, -1), 3,
                         index[..., None].expand(*index.shape, head_dim))
    s = (torch.einsum("bhnd,bhnkd->bhnk", q.to(dtype), k_sel) * scale).masked_fill(~valid, float("-inf"))
    p, lse_past = softmax_with_lse(s)
    out_past = torch.einsum("bhnk,bhnkd->bhnd", p, v_sel)
    out, lse = merge_splits(torch.stack([out_own.to(dtype), out_past]),
                            torch.stack([lse_own.to(dtype), lse_past]))
    return out.to(q.dtype), lse.float()


# ---------------------------------------------------------------- NSA

# nsa_select(impl="triton") keeps its top in the importance kernel instead of torch.topk over the stored scores
# (False: topk): NSA's forward at 64K 39.7 ms against 45.6 on an H100 (docs/experiments/sparse_kernels.md, "The top
# in the kernel, timed"; benchmarks/nsa_top_ab.py times both).
NSA_TOP_IN_KERNEL = True


def nsa_compress(t, block: int):
    """Mean-pool (B, H_kv, N, d) over non-overlapping blocks of ``block`` tokens: (B, H_kv, N // block, d).
    NSA learns this pooling (an MLP over the block with position encodings); the course's reference
    uses the mean, and only whole blocks (a partial last block is never wholly in any query's past)."""
    blocks = t.shape[2] // block
    return t[:, :, :blocks * block].reshape(*t.shape[:2], blocks, block, t.shape[-1]).mean(dim=3)


def _masked_attention(q, k, v, mask, scale):
    """(out, lse) of q (B, H, N, d) over k, v (B, H, M, d) under mask (B or 1, H or 1, N, M), in q's
    compute dtype; rows without keys give 0 and -inf."""
    dtype = _compute_dtype(q)
    s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-2, -1)) * scale
    p, lse = softmax_with_lse(s.masked_fill(~mask, float("-inf")))
    return torch.matmul(p, v.to(dtype)), lse


def _compressed_seen(seqlen: int, blocks: int, block_cmp: int, device) -> torch.Tensor:
    """(N, blocks) bool: compressed block j is wholly in query i's past, (j + 1) * block_cmp - 1 <= i."""
    ends = (torch.arange(blocks, device=device) + 1) * block_cmp - 1  # the last token of each block
    return ends[None, :] <= torch.arange(seqlen, device=device)[:, None]


def nsa_compressed_attention(q, k_cmp, v_cmp, block_cmp: int, scale: float, impl: str = "torch"):
    """NSA's compressed branch: (out (B, H, N, d), lse (B, H, N) float32) of q (B, H, N, d) over the compressed keys and
    values (B, H_kv, N // block_cmp, d) of the blocks wholly in each query's past (compressed key j is visible to
    query i iff (j + 1) * block_cmp - 1 <= i); rows that see none (i < block_cmp - 1) give zeros and lse = -inf.

    impl="torch": the masked dense reference. impl="triton": the dense kernels of
    ``fa_lab.attention(impl="triton_hopper")`` (the Gluon forward and backward on sm_90, the portable kernels
    elsewhere), no kernel of its own. With i = step * block_cmp + residue, query i sees the compressed keys before
    its step, and its own step's too at the last residue: the queries of one residue are a causal sequence over the
    compressed keys, a strided view of q, and a range of residues stands where the heads do. At most three launches
    read q and write O in place (:mod:`fa_lab.kernels.hopper.nsa_compressed`).
    """
    if k_cmp.shape[2] == 0:  # no whole block yet: every row sees nothing
        out = torch.zeros(q.shape, dtype=q.dtype if impl == "triton" else _compute_dtype(q), device=q.device)
        return out, torch.full(q.shape[:3], float("-inf"), device=q.device)
    if impl == "torch":
        heads = q.shape[1]
        seen = _compressed_seen(q.shape[2], k_cmp.shape[2], block_cmp, q.device)
        return _masked_attention(q, expand_kv(k_cmp, heads), expand_kv(v_cmp, heads), seen, scale)
    from .kernels import triton_nsa_compressed
    return triton_nsa_compressed(q, k_cmp, v_cmp, block_cmp, scale)


def _check_importance(impl, block_cmp: int, block_sel: int) -> None:
    check_impl(impl)
    if block_sel % block_cmp:
        raise ValueError(f"block_sel ({block_sel}) must be a multiple of block_cmp ({block_cmp})")


def _importance_kernel(q, k_cmp, block_cmp: int, block_sel: int, scale: float, lse_cmp, top_n: int = 0):
    """The importance kernel's scores, or with top_n > 0 its selection; lse_cmp computed when None."""
    from .kernels import triton_nsa_importance
    if lse_cmp is None:
        lse_cmp = nsa_compressed_attention(q, k_cmp, k_cmp, block_cmp, scale, "triton")[1]
    return triton_nsa_importance(q, k_cmp, lse_cmp, block_cmp, block_sel, scale, top_n)


def nsa_importance(q, k_cmp, block_cmp: int, block_sel: int, scale: float, impl: str = "torch", lse_cmp=None):
    """(B, H_kv, N, cdiv(N, block_sel)) float: how much each selection block (of ``block_sel`` tokens) matters to
    each query, shared by its GQA group: the compressed branch's attention probabilities, summed over the
    compressed blocks that the selection block covers (block_sel a multiple of block_cmp) and over the group's
    query heads; -inf for blocks that start after the query (never selectable).

    impl="torch" materializes the probabilities (B, H, N, N // block_cmp); impl="triton" recomputes them tile by
    tile in :mod:`fa_lab.kernels.portable.nsa_importance` from the compressed branch's lse (``lse_cmp``
    (B, H, N), computed here when not given) and returns float32.
    """
    _check_importance(impl, block_cmp, block_sel)
    if impl == "triton" and k_cmp.shape[2]:
        return _importance_kernel(q, k_cmp, block_cmp, block_sel, scale, lse_cmp)
    batch, heads, seqlen, _ = q.shape
    heads_kv, group = k_cmp.shape[1], heads // k_cmp.shape[1]
    rows = torch.arange(seqlen, device=q.device)[:, None]
    seen = _compressed_seen(seqlen, k_cmp.shape[2], block_cmp, q.device)
    s = torch.matmul(q.to(_compute_dtype(q)), expand_kv(k_cmp, heads).to(_compute_dtype(q)).transpose(-2, -1))
    if k_cmp.shape[2]:
        p, _ = softmax_with_lse((s * scale).masked_fill(~seen, float("-inf")))  # (B, H, N, compressed blocks)
    else:  # no whole block yet
        p = s
    per = block_sel // block_cmp
    sel_blocks = cdiv(seqlen, block_sel)
    p = torch.nn.functional.pad(p, (0, sel_blocks * per - p.shape[-1]))
    importance = p.view(batch, heads_kv, group, seqlen, sel_blocks, per).sum(dim=(2, 5))  # (B, Hkv, N, blocks)
    starts = torch.arange(sel_blocks, device=q.device) * block_sel
    return importance.masked_fill(starts[None, :] > rows, float("-inf"))  # future blocks: never


def nsa_select(q, k_cmp, block_cmp: int, block_sel: int, top_n: int, scale: float, impl: str = "torch",
               lse_cmp=None) -> torch.Tensor:
    """(B, H_kv, N, top_n) int64: the selection blocks (of ``block_sel`` tokens) each query keeps, the
    same for every query head of a GQA group (-1 where fewer blocks are in its past): the top_n blocks of
    :func:`nsa_importance` (impl and lse_cmp as it takes them) that start at or before the query, best first.
    impl="triton" keeps a running top in the importance kernel and never stores the scores (NSA_TOP_IN_KERNEL), or
    when that is off takes ``torch.topk`` of the kernel's scores.
    """
    if impl == "triton" and NSA_TOP_IN_KERNEL and k_cmp.shape[2] and top_n > 0:
        _check_importance(impl, block_cmp, block_sel)
        return _importance_kernel(q, k_cmp, block_cmp, block_sel, scale, lse_cmp,
                                  min(top_n, cdiv(q.shape[2], block_sel)))
    importance = nsa_importance(q, k_cmp, block_cmp, block_sel, scale, impl, lse_cmp)
    best = importance.topk(min(top_n, importance.shape[-1]), dim=-1)
    return torch.where(torch.isinf(best.values), -1, best.indices)


def nsa_attention(q, k, v, gates, block_cmp: int, block_sel: int, top_n: int, window: int,
                  scale: float | None = None, impl: str = "torch"):
    """NSA's output: gates[..., 0] * compressed + gates[..., 1] * selected + gates[..., 2] * window
    attention, each causal. q (B, H, N, d), k, v (B, H_kv, N, d), gates (B, H, N, 3) (the learned
    gate's outputs). Returns (out, branches), branches the three (B, H, N, d) outputs. Differentiable in q, k, v
    and gates (the selection is discrete).

    impl="torch": a dense reference, each branch as masked attention (memory quadratic in N). impl="triton"
    (float16/bfloat16): kernels throughout, memory linear in N: the compressed branch on the dense kernels
    (:func:`nsa_compressed_attention`), the selection scored by the importance kernel from its lse, the
    selected branch on the selected-blocks kernel (one program per query and KV head, the group's query heads
    packed into its tile), the window as ``fa_lab.attention(window=(window - 1, 0), impl="triton_hopper")``
    (on sm_90 the Gluon forward skips the tiles outside the band).
    """
    check_impl(impl)
    check_qkv(q, k, v, DTYPES)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"NSA is self-attention here: q has {q.shape[2]} tokens and k {k.shape[2]}")
    if not isinstance(gates, torch.Tensor) or tuple(gates.shape) != (*q.shape[:3], 3):
        raise ValueError(f"gates must be a tensor of shape {(*q.shape[:3], 3)}, got "
                         f"{tuple(gates.shape) if isinstance(gates, torch.Tensor) else type(gates).__name__}")
    if not gates.is_floating_point() or gates.device != q.device:
        raise TypeError(f"gates must be a floating-point tensor on q's device {q.device}, got {gates.dtype} on "
                        f"{gates.device}")
    check_block_size("block_cmp", block_cmp)
    check_block_size("block_sel", block_sel)
    check_block_size("top_n", top_n)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1 (the keys of the window branch, the query's own included), "
                         f"got {window!r}")
    if block_sel % block_cmp:
        raise ValueError(f"block_sel ({block_sel}) must be a multiple of block_cmp ({block_cmp})")
    if impl == "triton":  # every branch's kernel takes float16/bfloat16: refuse others before any runs
        from .kernels import load_triton
        load_triton()
        from .kernels.common import check_triton_inputs
        from .kernels.portable.nsa_importance import check_blocks_per_selection
        check_triton_inputs(q)
        check_blocks_per_selection(block_cmp, block_sel)
    scale = resolve_scale(scale, q.shape[-1])
    heads, seqlen = q.shape[1], q.shape[2]
    # Compressed branch: the query over the mean keys of the blocks wholly in its past.
    k_cmp, v_cmp = nsa_compress(k, block_cmp), nsa_compress(v, block_cmp)
    out_cmp, lse_cmp = nsa_compressed_attention(q, k_cmp, v_cmp, block_cmp, scale, impl)
    # Selected branch: the raw keys of the top_n blocks the group chose, causally.
    with torch.no_grad():
        selected = nsa_select(q.detach(), k_cmp.detach(), block_cmp, block_sel, top_n, scale, impl, lse_cmp)
    if impl == "triton":  # a per-query selection: one selection row per query, made above, so not checked again
        from . import attention
        from .kernels.portable.sparse_select import selected_blocks_attention
        out_sel, _ = selected_blocks_attention(q, k, v, selected, block_sel, True, scale)
        # Window branch: the last ``window`` keys, the query's own included.
        out_win = attention(q, k, v, causal=True, scale=scale, window=(window - 1, 0), impl="triton_hopper")
    else:
        cols = torch.arange(seqlen, device=q.device)[None, :]
        chosen = ((cols // block_sel)[None, None, None] == selected.clamp(min=-1)[..., None]).any(dim=-2)
        causal = BlockInfo(seqlen, seqlen, causal=True).mask(device=q.device)
        out_sel, _ = _masked_attention(q, expand_kv(k, heads), expand_kv(v, heads), expand_kv(chosen, heads) & causal,
                                       scale)
        band = BlockInfo(seqlen, seqlen, causal=True, window=(window - 1, -1)).mask(device=q.device)
        out_win, _ = _masked_attention(q, expand_kv(k, heads), expand_kv(v, heads), band, scale)
    branches = (out_cmp, out_sel, out_win)
    if impl == "triton":  # one pass, summed in float32
        from .kernels import triton_nsa_gate_mix
        return triton_nsa_gate_mix(gates, *branches), branches
    mixed = _compute_dtype(q)
    out = sum(gates[..., i:i + 1].to(mixed) * branch.to(mixed) for i, branch in enumerate(branches))
    return out.to(q.dtype), branches
