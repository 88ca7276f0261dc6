"""Can NSA's window branch run beside its selected branch? The selected-blocks forward is bound by the L2 cache's
bandwidth, the window's Gluon forward by the tensor cores: on SMs of their own, on two streams, the pair might take
little more than the selected branch alone. At the sparse benchmark's NSA case at 64K (bf16, d = 128, 64 query heads
over 4 KV heads, the selection NSA's importance kernel makes, window 512): the selected-blocks forward alone, the
window branch alone (persistent, on all SMs or leaving ``spare`` of them idle), and both at once (the window on a
high-priority second stream, queued first, so that its CTAs take their SMs and the selected programs the rest), in
turn for two rounds, do_bench medians in ms.

On the device: ``PYTHONPATH=. python3 benchmarks/nsa_overlap_probe.py $OUT`` writes $OUT/nsa_overlap_probe.json
(a log; committed as <h100|h200>_nsa_overlap_probe.json; `run_device.sh nsa-overlap`).
"""
import os
import sys

SPARES = (0, 92, 112, 120)  # SMs the window's persistent CTAs leave idle (132 on an H100 and an H200)


def measure(seqlen: int, generator) -> dict:
    import functools

    import torch

    from fa_lab.bench import in_turn, sparse
    from fa_lab.kernels.common import SideWork
    from fa_lab.kernels.hopper.attention import HopperOptions, triton_hopper_attention
    from fa_lab.kernels.portable.sparse_select import selected_blocks_attention

    q, k, v = (t.detach() for t in sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator))
    selection = sparse.nsa_end_to_end_selection(q, k)
    scale = sparse.HEAD_DIM ** -0.5

    def selected():
        return selected_blocks_attention(q, k, v, selection, sparse.BLOCK_K, True, scale)[0]

    def window(spare):
        options = HopperOptions(persistent=True, spare_sms=spare)
        return triton_hopper_attention(q, k, v, True, scale, options=options, window=(sparse.NSA_WINDOW - 1, 0))[0]

    def both(spare):
        side = SideWork(q.device)
        with side:
            out_win = window(spare)
        out_sel = selected()
        side.join(out_win)
        return out_sel, out_win

    reference = (selected(), window(0))
    entry = {"largest difference, both at once": max(
        float((a.float() - b.float()).abs().max()) for spare in SPARES for a, b in zip(both(spare), reference))}
    calls = {"selected alone": selected}
    calls.update({f"window alone, {spare} SMs spare": functools.partial(window, spare) for spare in SPARES})
    calls.update({f"both, window with {spare} SMs spare": functools.partial(both, spare) for spare in SPARES})
    with torch.no_grad():
        in_turn.medians_in_turn(calls, entry)
    return entry


def main(out_dir: str) -> None:
    from fa_lab.bench import sparse

    sparse.log_by_length(os.path.join(out_dir, "nsa_overlap_probe.json"), measure, seqlens=(65536,))


if __name__ == "__main__":
    main(sys.argv[1])
