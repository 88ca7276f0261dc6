"""NSA's compressed branch with q read and O written in place (residue views, fa_lab/kernels/hopper/nsa_compressed.py)
against the folded layout it replaced (`git show 4a36a68:fa_lab/sparse.py`: q gathered into (B * 32, H, steps, d),
one dense call, O gathered back): the sparse benchmark's NSA case (bf16, d = 128, 64 query heads over 4 KV heads,
compressed blocks of 32, 16 selected blocks of 64, window 512) at 16K-64K. The two are two trees of the code, so each
run of this script times the tree whose fa_lab comes first on PYTHONPATH, and the runs alternate (`run_device.sh
nsa-compressed OUT OLD_TREE`: old, new, old, new).

Each run adds one entry a length to $OUT/nsa_compressed_ab.json (a log): the tree's layout, do_bench medians (ms) of
the compressed branch alone and of NSA's forward, each without and with its backward, and SHA-256 digests of the
branch's out, lse and dq at 16K (the two trees' rows should agree to the bit).
"""
import hashlib
import json
import sys
from pathlib import Path


def digest(t) -> str:
    """The first 16 hex digits of the SHA-256 of t's bytes."""
    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def measure(seqlen: int, generator) -> dict:
    import torch
    from triton.testing import do_bench

    from fa_lab import sparse as nsa
    from fa_lab.bench import sparse

    q, k, v = sparse.bf16_inputs(sparse.HEADS, sparse.HEADS_KV, seqlen, generator)
    k_cmp, v_cmp = (nsa.nsa_compress(t, sparse.NSA_BLOCK_CMP).detach().requires_grad_() for t in (k, v))
    scale = sparse.HEAD_DIM ** -0.5
    grad = torch.randn(q.shape, device="cuda", generator=generator).to(q.dtype)

    def branch():
        return nsa.nsa_compressed_attention(q, k_cmp, v_cmp, sparse.NSA_BLOCK_CMP, scale, "triton")

    def branch_backward():
        out, lse = branch()
        return out, lse, torch.autograd.grad(out, (q, k_cmp, v_cmp), grad)

    nsa_forward = sparse.ours_nsa(q, k, v, None)[0]

    def nsa_backward():
        return torch.autograd.grad(nsa_forward(), (q, k, v), grad)

    entry = {"layout": "folded" if hasattr(nsa, "_Folding") else "residue views"}
    if seqlen == 16384:
        out, lse, (dq, dk, dv) = branch_backward()
        entry.update({f"{name} sha256": digest(t) for name, t in
                      (("out", out), ("lse", lse), ("dq", dq), ("dk_cmp", dk), ("dv_cmp", dv))})
    with torch.no_grad():
        entry["compressed forward ms"] = round(do_bench(branch, return_mode="median"), 3)
        entry["nsa forward ms"] = round(do_bench(nsa_forward, return_mode="median"), 3)
    entry["compressed forward + backward ms"] = round(do_bench(branch_backward, return_mode="median"), 3)
    entry["nsa forward + backward ms"] = round(do_bench(nsa_backward, return_mode="median"), 3)
    return entry


def main(out_dir: str) -> None:
    import torch

    from fa_lab.bench import sparse
    from fa_lab.bench.schema import environment, write_log
    from fa_lab.kernels import load_triton

    load_triton()
    # (sparse.log_by_length's loop, but adding to the log of the runs before: the other tree's process wrote them,
    # and the older tree's log_by_length has no way to keep them)
    path = Path(out_dir) / "nsa_compressed_ab.json"
    log = json.loads(path.read_text())["log"] if path.exists() else []
    generator = torch.Generator(device="cuda").manual_seed(0)
    for seqlen in sparse.SEQLENS:
        log.append({"seqlen": seqlen, **measure(seqlen, generator)})
        print(log[-1], flush=True)
        write_log({**environment("cuda"), "log": log}, path)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
