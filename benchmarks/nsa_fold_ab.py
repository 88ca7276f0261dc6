"""NSA's compressed-branch relayout: the fold and unfold as one gather kernel each
(``fa_lab/kernels/portable/nsa_fold.py``, the default) against the strided PyTorch copies they replaced
(:class:`StridedCopies`, three rectangles a direction). At the sparse benchmark's NSA case (bf16, d = 128, 64 query
heads over 4 KV heads, compressed blocks of 32, 16 selected blocks of 64, window 512) and 16K-64K: the fold of q
and the unfold of the branch's output alone, then NSA's forward and its forward + backward with either relayout,
in turn for two rounds (do_bench medians, ms), each result compared with the kernel's to the bit first.

On the device: ``PYTHONPATH=. python3 benchmarks/nsa_fold_ab.py $OUT`` writes $OUT/h200_nsa_fold_ab.json (a log;
committed as h100_* when the machine was an H100).
"""
import functools
import os
import sys

import torch


class StridedCopies:
    """The folded layout as fa_lab.sparse._Folding built it before nsa_fold_kernel: query i of (B, H, N, ...) sits at
    row r = i + 1 = step * block + residue, in (B * block, H, steps, ...) at [b * block + residue, h, step]. Seen
    as (B, H, steps, block, ...) (a view of the folded tensor), the queries fill at most three rectangles of
    (steps, residues): the rest of step 0, the whole steps after it, the start of the last step. Each direction
    is one strided copy per rectangle (whole rows of d elements); the folded rows that hold no query (r = 0,
    r > N) are zeros, and their outputs are dropped, so fold is also unfold's gradient and unfold fold's."""

    def __init__(self, seqlen: int, block: int, steps: int):
        whole = (seqlen + 1) // block  # rows 0 .. whole * block - 1 fill whole steps
        tail = seqlen + 1 - whole * block  # rows of the last, partial step
        # (first step, steps, first residue, residues, first query) of each rectangle
        pieces = [(0, 1, 1, min(block, seqlen + 1) - 1, 0), (1, whole - 1, 0, block, block - 1)]
        if whole:  # else the rows of step 0 are all of them
            pieces.append((whole, 1, 0, tail, whole * block - 1))
        self.pieces = [piece for piece in pieces if piece[1] > 0 and piece[3] > 0]
        self.empty = [(0, 0, 1)] + ([(whole, tail, block)] if whole < steps else [])  # (step, residues from, to)
        self.seqlen, self.block, self.steps = seqlen, block, steps

    def _grid(self, folded):
        """(B * block, H, steps, ...) -> its view (B, H, steps, block, ...)."""
        return folded.view(-1, self.block, *folded.shape[1:]).movedim(1, 3)

    def fold(self, t):
        """(B, H, N, ...) -> (B * block, H, steps, ...), zeros in the rows that hold no query."""
        batch, heads, _, *rest = t.shape
        t = t.contiguous()
        folded = t.new_empty(batch * self.block, heads, self.steps, *rest)
        grid = self._grid(folded)
        for step, steps, residue, residues, query in self.pieces:
            grid[:, :, step:step + steps, residue:residue + residues] = \
                t[:, :, query:query + steps * residues].view(batch, heads, steps, residues, *rest)
        for step, first, last in self.empty:
            grid[:, :, step, first:last] = 0
        return folded

    def unfold(self, t):
        """(B * block, H, steps, ...) -> (B, H, N, ...), the rows that hold no query dropped."""
        grid = self._grid(t.contiguous())
        batch, heads, _, _, *rest = grid.shape
        out = t.new_empty(batch, heads, self.seqlen, *rest)
        for step, steps, residue, residues, query in self.pieces:
            out[:, :, query:query + steps * residues].view(batch, heads, steps, residues, *rest).copy_(
                grid[:, :, step:step + steps, residue:residue + residues])
        return out


def both_ways(seqlen: int, generator) -> dict:

    from fa_lab import sparse as nsa
    from fa_lab.bench import sparse
    from fa_lab.kernels import triton_nsa_fold, triton_nsa_unfold

    q, k, v = sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator)
    block, steps = sparse.NSA_BLOCK_CMP, seqlen // sparse.NSA_BLOCK_CMP + 1
    strided, folded = StridedCopies(seqlen, block, steps), triton_nsa_fold(q.detach(), block, steps)
    entry = {}
    sparse.checked_in_turn({"fold, kernel": lambda: triton_nsa_fold(q.detach(), block, steps),
                            "fold, strided copies": lambda: strided.fold(q.detach())}, entry, lambda t: t.float(),
                           "max difference")
    sparse.checked_in_turn({"unfold, kernel": lambda: triton_nsa_unfold(folded, block, seqlen),
                            "unfold, strided copies": lambda: strided.unfold(folded)}, entry, lambda t: t.float(),
                           "max difference")
    run, _ = sparse.ours_nsa(q, k, v, None)
    grad = torch.randn(q.shape, device="cuda", generator=generator).to(q.dtype)

    def forward_backward():
        out = run()
        q_grad, = torch.autograd.grad(out, q, grad)
        return q_grad

    for label, call in (("nsa forward", run), ("nsa forward + backward", forward_backward)):
        calls = {f"{label}, {name}": functools.partial(sparse.called_with, nsa, "_Folding", layout, call)
                 for name, layout in (("kernel", nsa._Folding), ("strided copies", StridedCopies))}
        sparse.checked_in_turn(calls, entry, lambda t: t.float(), "max difference (out or dq)")
    entry["dense forward ms"] = sparse.dense_forward_ms(q, k, v)
    return entry


def main(out_dir: str) -> None:
    from fa_lab.bench import sparse

    sparse.log_by_length(os.path.join(out_dir, "h200_nsa_fold_ab.json"), both_ways)


if __name__ == "__main__":
    main(sys.argv[1])
