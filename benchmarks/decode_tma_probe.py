"""Decode at batch 32 (one split, dense cache): K/V tiles read by TMA (tensor descriptors, a probe kernel at six
configs) against the decode kernel's asynchronous copies (``ours``: its config without TMA), beside SDPA, in
interleaved rounds (CUDA graphs, as `fa-lab bench decode` times them). The question: whether bulk tensor copies
read HBM faster where every kernel sits at the roofline (docs/experiments/interfaces.md, "Decode: TMA reads in
one split").

Usage on the device, from the repository root:  PYTHONPATH=. python3 benchmarks/decode_tma_probe.py OUT.json
"""
import statistics
import sys

import torch

from fa_lab.bench import decode as bench
from fa_lab.bench.schema import environment, write_log
from fa_lab.kernels import load_triton

load_triton()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def tma_decode_kernel(q_ptr, k_desc, v_desc, lengths_ptr, out_ptr, capacity, heads, group, qk_scale,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                      NUM_STAGES: tl.constexpr):
    """One (sequence, KV head) of a dense cache, seqlen_q = 1: the group's query rows packed in one tile,
    K and V tiles by TMA from the (B * capacity, heads_kv * d) views; out (B, 1, H, d) in q's dtype."""
    heads_kv = heads // group
    batch = tl.program_id(0) // heads_kv
    kv_head = tl.program_id(0) % heads_kv
    rows = tl.arange(0, BLOCK_M)
    valid = rows < group
    head = kv_head * group + rows
    cols = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (batch * heads + head)[:, None] * HEAD_DIM + cols[None, :], mask=valid[:, None], other=0.0)
    length = tl.load(lengths_ptr + batch)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    first_row = batch * capacity
    for start_n in tl.range(0, length, BLOCK_N, num_stages=NUM_STAGES):
        k = k_desc.load([first_row + start_n, kv_head * HEAD_DIM])
        v = v_desc.load([first_row + start_n, kv_head * HEAD_DIM])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        keys = start_n + tl.arange(0, BLOCK_N)
        s = tl.where((keys < length)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (batch * heads + head)[:, None] * HEAD_DIM + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=valid[:, None])


def tma_calls(caches, block_n, num_warps, num_stages):
    calls = []
    for q, k, v, _table, seqlens in caches:
        batch, capacity, heads_kv, head_dim = k.shape
        heads = q.shape[2]
        k2, v2 = (t.view(batch * capacity, heads_kv * head_dim) for t in (k, v))
        k_desc, v_desc = (TensorDescriptor.from_tensor(t, [block_n, head_dim]) for t in (k2, v2))
        out = torch.empty_like(q)
        scale = head_dim ** -0.5 * LOG2E

        def call(q=q, k_desc=k_desc, v_desc=v_desc, seqlens=seqlens, out=out, capacity=capacity, heads=heads,
                 group=heads // heads_kv, scale=scale, head_dim=head_dim):
            tma_decode_kernel[(q.shape[0] * (heads // group),)](
                q, k_desc, v_desc, seqlens, out, capacity, heads, group, scale, BLOCK_M=16, BLOCK_N=block_n,
                HEAD_DIM=head_dim, NUM_STAGES=num_stages, num_warps=num_warps)
            return out
        calls.append(call)
    return calls


def copies_calls(caches):
    """bench.ours's calls with decode_config's choice as it is without TMA (asynchronous copies)."""
    from fa_lab.kernels.portable import decode

    chosen = decode.decode_config

    def without_tma(call):
        def run():
            decode.decode_config = lambda layout, splits, tma=False: chosen(layout, splits)
            try:
                return call()
            finally:
                decode.decode_config = chosen
        return run
    return [without_tma(call) for call in bench.ours(caches, 0)]


def check(caches):
    import torch.nn.functional as F
    q, k, v, _table, _seqlens = caches[0]
    want = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                          v.transpose(1, 2).float(), enable_gqa=True).transpose(1, 2)
    errors = {}
    for config in CONFIGS:
        got = tma_calls(caches[:1], *config)[0]().float()
        errors[str(config)] = (got - want).abs().max().item()
    return errors


CONFIGS = ((128, 4, 3), (128, 4, 2), (128, 8, 3), (64, 4, 3), (64, 4, 4), (64, 8, 4))
ROUNDS = 3


def main(path):
    log = []
    for seqlen in (4096, 16384, 65536):
        nbytes = bench.kv_bytes(32, seqlen)
        caches = [bench.make_cache(32, seqlen, None) for _ in range(bench.copies_for(nbytes))]
        errors = check(caches)
        print(seqlen, errors, file=sys.stderr)
        calls = {"sdpa_gqa": bench.sdpa_gqa(caches), "ours": copies_calls(caches)}
        for config in CONFIGS:
            calls[f"tma {config}"] = tma_calls(caches, *config)
        times = {name: [] for name in calls}
        for _ in range(ROUNDS):
            for name, group in calls.items():
                times[name].append(bench.graph_ms(group))
        tbps = {name: round(nbytes / (statistics.median(ms) * 1e-3) / 1e12, 4) for name, ms in times.items()}
        entry = dict(batch=32, seqlen_k=seqlen, max_abs_error=errors, tbps=tbps,
                     us_per_round={name: [round(t * 1e3, 2) for t in ms] for name, ms in times.items()})
        print(entry, file=sys.stderr)
        log.append(entry)
        calls = caches = None
        torch.cuda.empty_cache()
    write_log({**environment("cuda"), "log": log}, path)


if __name__ == "__main__":
    main(sys.argv[1])
