"""NSA's forward (and forward with backward) with the selection checked as a caller's would be (``check_key_tiles``:
a sort and three reads back to the host before the selected-blocks kernel) against passed on unchecked, as
``nsa_attention`` now does with the selection its importance kernel made: the sparse benchmark's NSA case (bf16,
d = 128, 64 query heads over 4 KV heads, compressed blocks of 32, 16 selected blocks of 64, window 512) at 16K-64K,
both ways in turn for two rounds (do_bench medians, ms), dense attention's forward beside them.

On the device: ``PYTHONPATH=. python3 benchmarks/nsa_checks_ab.py $OUT`` writes $OUT/nsa_checks_ab.json (a log;
committed as <h100|h200>_nsa_checks_ab.json; `run_device.sh nsa-checks`).
"""
import os
import sys


def checked(q, k, v, indices, block_k, causal, scale, block_q=1, *, unchecked):
    """selected_blocks_attention after the checks a caller's selection gets."""
    from fa_lab.sparse import check_key_tiles

    check_key_tiles(indices, q, k, block_q, block_k, causal)
    return unchecked(q, k, v, indices, block_k, causal, scale, block_q)


def both_ways(seqlen: int, generator) -> dict:
    import functools

    import torch

    from fa_lab.bench import in_turn, sparse
    from fa_lab.kernels.portable import sparse_select

    leaves = sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator)
    forward = sparse.ours_nsa(*leaves, None)[0]
    grad = torch.randn(leaves[0].shape, device="cuda", generator=generator).to(torch.bfloat16)

    def forward_backward():
        for leaf in leaves:
            leaf.grad = None
        forward().backward(grad)
    with_checks = functools.partial(checked, unchecked=sparse_select.selected_blocks_attention)
    calls = {}
    for name, value in (("unchecked", sparse_select.selected_blocks_attention), ("checked", with_checks)):
        calls[f"nsa forward, {name}"] = functools.partial(sparse.called_with, sparse_select,
                                                          "selected_blocks_attention", value, forward)
        calls[f"nsa forward and backward, {name}"] = functools.partial(
            sparse.called_with, sparse_select, "selected_blocks_attention", value, forward_backward)
    entry = {}
    in_turn.medians_in_turn(calls, entry)
    entry["dense forward ms"] = sparse.dense_forward_ms(*(t.detach() for t in leaves))
    return entry


def main(out_dir: str) -> None:
    from fa_lab.bench import sparse

    sparse.log_by_length(os.path.join(out_dir, "nsa_checks_ab.json"), both_ways)


if __name__ == "__main__":
    main(sys.argv[1])
