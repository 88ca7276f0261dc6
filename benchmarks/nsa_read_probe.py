"""How fast NSA's selected branch can read its blocks: the sparse benchmark's selection (16 blocks of 64 keys per query
and KV head, 4 KV heads, bf16, d = 128, causal) read by kernels that only load each selected K and V block and sum
it, with pointer loads as the selected-blocks kernel issues them and with TMA block copies, beside the
selected-blocks forward itself (``triton_block_select_attention``). Each is timed as the bytes of K and V its
selection names over its do_bench median (TB/s), in turn for two rounds, at 16K-64K; the probes' sums are checked
against PyTorch's first. If the bare reads run no faster than the kernel, the kernel is at what the cache delivers
to this access pattern, and only fewer bytes would make it faster.

On the device: ``PYTHONPATH=. python3 benchmarks/nsa_read_probe.py $OUT`` writes $OUT/<h100|h200>_nsa_read_probe.json
(a log).
"""
import functools
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _pointer_reads_kernel(k_ptr, v_ptr, index_ptr, out_ptr, seqlen, slots, BLOCK_N: tl.constexpr,
                          HEAD_DIM: tl.constexpr):
    """out[kv, row] = the float32 sum of K and V over the blocks selection row ``row`` of KV head ``kv`` lists
    (k, v: (Hkv * seqlen, HEAD_DIM) contiguous; index: int32 (Hkv, seqlen, slots), -1 unused)."""
    row, kv = tl.program_id(0), tl.program_id(1)
    selection = index_ptr + (kv * tl.num_programs(0) + row) * slots
    keys, cols = tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for slot in tl.range(0, slots):
        block = tl.load(selection + slot)
        rows = kv * seqlen + tl.maximum(block, 0) * BLOCK_N + keys
        offsets = rows[:, None].to(tl.int64) * HEAD_DIM + cols[None, :]
        used = (keys < tl.where(block >= 0, BLOCK_N, 0))[:, None]
        acc += tl.load(k_ptr + offsets, mask=used, other=0.0).to(tl.float32)
        acc += tl.load(v_ptr + offsets, mask=used, other=0.0).to(tl.float32)
    tl.store(out_ptr + kv * tl.num_programs(0) + row, tl.sum(acc))


@triton.jit
def _tma_reads_kernel(k_desc, v_desc, index_ptr, out_ptr, seqlen, slots, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr):
    """The same sums, each block brought by one TMA copy per tensor (descriptors over (Hkv * seqlen, HEAD_DIM),
    blocks (BLOCK_N, HEAD_DIM))."""
    row, kv = tl.program_id(0), tl.program_id(1)
    selection = index_ptr + (kv * tl.num_programs(0) + row) * slots
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for slot in tl.range(0, slots):
        block = tl.load(selection + slot)
        first = kv * seqlen + tl.maximum(block, 0) * BLOCK_N
        both = k_desc.load([first, 0]).to(tl.float32) + v_desc.load([first, 0]).to(tl.float32)
        acc += tl.where(block >= 0, both, 0.0)
    tl.store(out_ptr + kv * tl.num_programs(0) + row, tl.sum(acc))


def reads_reference(k, v, selection, block):
    """PyTorch's float32 sums of the probes: (Hkv, seqlen)."""
    blocks = (k.float() + v.float()).view(k.shape[0], -1, block, k.shape[-1]).sum(dim=(2, 3))  # (Hkv, blocks)
    picked = torch.gather(blocks, 1, selection.clamp(min=0).flatten(1).long()).view(selection.shape)
    return torch.where(selection >= 0, picked, 0.0).sum(-1)


def main(out_dir: str) -> None:
    from triton.testing import do_bench
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fa_lab.bench.schema import device_prefix, environment
    from fa_lab.bench.sparse import BLOCK_K, HEAD_DIM, HEADS, HEADS_KV, bf16_inputs, log_by_length, nsa_selection
    from fa_lab.kernels import triton_block_select_attention

    def measure(seqlen, generator):
        q, k, v = (t.detach() for t in bf16_inputs(HEADS, HEADS_KV, seqlen, generator))
        selection = nsa_selection(seqlen, generator)  # (1, Hkv, seqlen, slots)
        flat_k, flat_v = (t[0].reshape(-1, HEAD_DIM) for t in (k, v))
        index = selection[0].contiguous()
        slots = index.shape[-1]
        nbytes = int((index >= 0).sum()) * BLOCK_K * HEAD_DIM * 2 * k.element_size()
        sums = torch.empty(HEADS_KV, seqlen, device="cuda")
        grid = (seqlen, HEADS_KV)
        descriptors = [TensorDescriptor.from_tensor(t, [BLOCK_K, HEAD_DIM]) for t in (flat_k, flat_v)]
        launch = dict(BLOCK_N=BLOCK_K, HEAD_DIM=HEAD_DIM, num_warps=4, num_stages=3)
        calls = {
            "pointer reads": lambda: _pointer_reads_kernel[grid](flat_k, flat_v, index, sums, seqlen, slots, **launch),
            "tma reads": lambda: _tma_reads_kernel[grid](*descriptors, index, sums, seqlen, slots, **launch),
            "selected-blocks forward": functools.partial(triton_block_select_attention, q, k, v, selection, BLOCK_K,
                                                         True, HEAD_DIM ** -0.5, block_q=1),
        }
        entry = {"bytes": nbytes}
        want = reads_reference(k[0], v[0], index, BLOCK_K)
        for name in ("pointer reads", "tma reads"):
            calls[name]()
            entry[f"{name}: largest relative difference"] = float(((sums - want).abs() / want.abs().clamp(min=1))
                                                                  .max())
        for _round in range(2):
            for name, call in calls.items():
                ms = do_bench(call, return_mode="median")
                entry.setdefault(f"{name} ms", []).append(round(ms, 3))
                entry.setdefault(f"{name} TB/s", []).append(round(nbytes / ms * 1e-9, 2))
        return entry

    prefix = device_prefix(environment("cuda")["device"])
    log_by_length(os.path.join(out_dir, f"{prefix}_nsa_read_probe.json"), measure)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
