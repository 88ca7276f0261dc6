"""The host's time to issue one impl="triton_hopper" call, with Triton's ordinary launch and with
fa_lab.kernels.launch's cached one, next to SDPA's cuDNN backend.

On a (1, 1, 128, 128) bf16 input the kernel is a few microseconds, so back-to-back calls measure the host alone:
for each variant, 7 rounds of 100 calls after 10 warm-up calls, the median and the fastest round in microseconds
per call, with and without inputs that require grad; persistent=None is the default choice (one tile per CTA at
this size), False forces one tile per CTA. Then one eager decode step (:func:`decode_step`) beside SDPA's.

On the H200: ``PYTHONPATH=. python3 benchmarks/launch_overhead.py`` (its output is
benchmarks/h200_launch_overhead.log).
"""
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa_lab.kernels.hopper.attention as hopper
from fa_lab.bench import host
from fa_lab.kernels.hopper import HopperOptions, triton_hopper_attention
from fa_lab.kernels.launch import cached_launch


def host_us(call) -> tuple[float, float]:
    """(median, fastest) host microseconds per call: 7 rounds of 100 calls after 10 warm-up calls
    (:func:`fa_lab.bench.host.host_us`)."""
    return host.host_us(call, synchronize=torch.cuda.synchronize)


def cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main() -> None:
    for grad in (False, True):
        q, k, v = (torch.randn(1, 1, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                   for _ in range(3))
        for variant in ("ordinary", "cached"):
            hopper.cached_launch = (lambda kernel: kernel) if variant == "ordinary" else cached_launch
            for persistent in (None, False):
                call = functools.partial(triton_hopper_attention, q, k, v, True, None,
                                         options=HopperOptions(persistent=persistent))
                median, fastest = host_us(call)
                print(f"grad={grad} {variant} persistent={persistent}: host median {median:.1f} min {fastest:.1f} "
                      "us/call", flush=True)
        median, fastest = host_us(functools.partial(cudnn, q, k, v))
        print(f"grad={grad} sdpa cudnn: host median {median:.1f} min {fastest:.1f} us/call", flush=True)
    hopper.cached_launch = cached_launch
    decode_step()


def decode_step() -> None:
    """One eager decode step (batch 1, 32 / 8 heads, d = 128, a 4K dense cache, 4 splits: the split kernel and
    the merge) without the values' check, next to SDPA's GQA call on the same cache."""
    from fa_lab.kvcache import attention_with_kvcache

    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((1,), 4096, dtype=torch.int32, device="cuda")
    median, fastest = host_us(functools.partial(attention_with_kvcache, q, k_cache, v_cache, lengths, impl="triton",
                                                num_splits=4, check_values=False))
    print(f"decode step (triton, 4 splits): host median {median:.1f} min {fastest:.1f} us/call", flush=True)
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    median, fastest = host_us(functools.partial(F.scaled_dot_product_attention, qt, kt, vt, enable_gqa=True))
    print(f"decode step (sdpa, gqa): host median {median:.1f} min {fastest:.1f} us/call", flush=True)


if __name__ == "__main__":
    main()
