"""Peak extra memory of one training step of attention (the forward, then the backward) against the sequence
length: ours (``triton_hopper``, ``triton``) next to SDPA's FlashAttention-2 and cuDNN backends and, where
installed, the upstream flash-attn-4 (``fa4``; benchmarks/run_device.sh's ``interfaces`` step says how to
install it). bf16, head_dim 128, 16 heads, batch 1, causal and not, 8K to 64K tokens: the question is whether
the memory grows linearly in N (FlashAttention's O(N)) and by how much per token.

Each figure is :func:`fa_lab.memory.peak_memory` of a call that runs the forward and the backward on q, k, v
(leaves that require grad, allocated before) and an output gradient: every byte allocated beyond them during
the step, the output, the LSE, workspaces (the float32 dQ accumulator, D = rowsum(dO * O)) and the three
gradients included. ``bytes_per_token`` is that peak over N.

On the H200: ``PYTHONPATH=. python3 benchmarks/training_memory.py run $OUT`` writes
$OUT/h200_training_memory.json; anywhere: ``python3 benchmarks/training_memory.py plot JSON PNG``.
"""
import json
import os
import sys

IMPLS = ("triton_hopper", "triton", "sdpa_flash", "sdpa_cudnn", "fa4")
SEQLENS = (8192, 16384, 32768, 65536)
HEADS, HEAD_DIM = 16, 128


def step_for(impl: str, causal: bool):
    """(make, step): make(seqlen, device) returns the step's arguments (leaves in the impl's layout and the
    output gradient); step(*arguments) runs forward and backward. Raises ImportError for a missing peer."""
    import torch

    def leaves(seqlen, device, token_major=False):
        shape = (1, seqlen, HEADS, HEAD_DIM) if token_major else (1, HEADS, seqlen, HEAD_DIM)
        tensors = [torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        return (*tensors, torch.randn(shape, device=device, dtype=torch.bfloat16))

    if impl == "fa4":
        from flash_attn.cute import flash_attn_func

        from fa_lab.bench.interfaces import fa4_output

        def fa4_step(q, k, v, grad):
            fa4_output(flash_attn_func(q, k, v, causal=causal)).backward(grad)
        return (lambda seqlen, device: leaves(seqlen, device, token_major=True)), fa4_step
    if impl.startswith("sdpa_"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[impl]

        def sdpa_step(q, k, v, grad):
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad)
        return leaves, sdpa_step
    import fa_lab

    def ours_step(q, k, v, grad):
        fa_lab.attention(q, k, v, causal=causal, impl=impl).backward(grad)
    return leaves, ours_step


def run(out_dir: str, impls=IMPLS, seqlens=SEQLENS, device: str = "cuda") -> list[dict]:
    import torch

    from fa_lab.bench.schema import environment, write_log
    from fa_lab.memory import peak_memory

    log = []
    for causal in (False, True):
        for impl in impls:
            try:
                make, step = step_for(impl, causal)
            except ImportError as exc:
                print(f"{impl}: not installed ({exc})", file=sys.stderr)
                continue
            for seqlen in seqlens:
                arguments = make(seqlen, device)
                step(*arguments)  # compiled and warmed up: the measured call allocates what a training step does
                for leaf in arguments[:3]:
                    leaf.grad = None
                peak = peak_memory(step, *arguments)
                log.append(dict(impl=impl, causal=causal, seqlen=seqlen, heads=HEADS, head_dim=HEAD_DIM,
                                peak_bytes=peak, bytes_per_token=peak / seqlen))
                print(f"{impl} causal={causal} N={seqlen}: {peak / 2**20:.0f} MiB, {peak / seqlen:.0f} B/token",
                      flush=True)
                del arguments
                if device == "cuda":
                    torch.cuda.empty_cache()
    if out_dir:
        write_log({**environment(device), "log": log}, os.path.join(out_dir, "h200_training_memory.json"))
    return log


def plot(results_path: str, png_path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fa_lab.memory import use_byte_ticks, use_seqlen_ticks

    with open(results_path) as file:
        results = json.load(file)
    seqlens = sorted({e["seqlen"] for e in results["log"]})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        for impl in IMPLS:
            points = sorted((e["seqlen"], e["peak_bytes"]) for e in results["log"]
                            if e["impl"] == impl and e["causal"] == causal)
            if points:
                ax.plot(*zip(*points), "o-", label=impl)
        ax.set(title="causal" if causal else "not causal", xlabel="sequence length")
        use_seqlen_ticks(ax.xaxis, seqlens)
        use_byte_ticks(ax.yaxis)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("peak extra memory, forward + backward")
    axes[0].legend(frameon=False, fontsize=8)
    fig.suptitle(f"One training step of attention, bf16, d = 128, 16 heads: {results['device']}, {results['date']}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        plot(sys.argv[2], sys.argv[3])
