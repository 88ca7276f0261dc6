"""The GPU benchmark: the FA3-paper protocol, every peer measured in the same run.

Protocol (docs/design.md, section 10, "Benchmarks"): 16K tokens in total (batch = 16384 / seqlen),
hidden 2048 (heads = 2048 / head_dim), head_dim 64 and 128, seqlen 512 to 16K,
causal and not, bf16; FLOPs by :func:`fa_lab.iomodel.attention_flops`; each time
is the median of ``triton.testing.do_bench``. The peers: SDPA restricted to its
FLASH_ATTENTION (FlashAttention-2), CUDNN_ATTENTION, EFFICIENT_ATTENTION and MATH
back ends (MATH only up to 4K), and FlexAttention under ``torch.compile``.

An impl is ``fn(q, k, v, causal) -> out`` on (batch, heads, seqlen, head_dim) bf16 CUDA tensors.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ..block_info import causal_visible
from ..iomodel import AttentionShape, attention_flops
from ..memory import peak_memory
from .schema import empty_row, environment, save_results

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOTAL_TOKENS, HIDDEN = 16384, 2048
MATH_MAX_SEQLEN = 4096
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}
GPU_IMPLS = ("triton", *SDPA_BACKENDS, "flex")


def protocol_shapes(seqlens=SEQLENS, head_dims=HEAD_DIMS, causals=(False, True)):
    """The FA3-paper shapes (bf16) as AttentionShapes, head_dim outermost, then causal, then seqlen."""
    return [AttentionShape(TOTAL_TOKENS // n, HIDDEN // d, n, d, causal=c, dtype="bf16")
            for d in head_dims for c in causals for n in seqlens]


def sdpa_impl(backend_name: str):
    """SDPA restricted to one back end (a name of ``torch.nn.attention.SDPBackend``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal):
        if causal and q.shape[2] != k.shape[2]:
            raise ValueError(f"SDPA's is_causal aligns the mask top-left, but the course's is bottom-right: "
                             f"causal needs seqlen_q == seqlen_k here, got {q.shape[2]} and {k.shape[2]}")
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def flex_impl():
    """FlexAttention under torch.compile, with a causal BlockMask per shape.

    Compiled for static shapes (one compile per shape): ``dynamic=True`` (one compile
    per head_dim) runs slower, which would flatter every kernel compared with it.
    """
    import torch._dynamo
    import torch._functorch.config
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.cache_size_limit = 64  # many shapes in one sweep
    torch._functorch.config.donated_buffer = False  # lets the backward be timed with retain_graph
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def causal_mod(offset):
        return lambda b, h, q_idx, kv_idx: causal_visible(q_idx, kv_idx, offset)

    def run(q, k, v, causal):
        mask = None
        if causal:
            key = (q.shape[2], k.shape[2])
            if key not in masks:
                masks[key] = create_block_mask(causal_mod(key[1] - key[0]), None, None, *key, device=q.device)
            mask = masks[key]
        return compiled(q, k, v, block_mask=mask)
    return run


def triton_impl(fwd_configs=None, bwd_configs=None):
    """fa_lab's Triton kernels, optionally with a TileConfig per (head_dim, causal) for each direction."""
    from ..kernels import triton_attention

    def run(q, k, v, causal):
        key = (q.shape[-1], causal)
        return triton_attention(q, k, v, causal, None, fwd_config=(fwd_configs or {}).get(key),
                                bwd_config=(bwd_configs or {}).get(key))[0]
    return run


def make_impls(names, fwd_configs=None, bwd_configs=None) -> dict:
    """name -> fn for the GPU_IMPLS in ``names``; the Triton kernels use the given tile configurations."""
    unknown = sorted(set(names) - set(GPU_IMPLS))
    if unknown:
        raise ValueError(f"unknown impls {unknown}; the GPU benchmark knows {list(GPU_IMPLS)}")
    makers = {"triton": lambda: triton_impl(fwd_configs, bwd_configs), "flex": flex_impl,
              **{name: (lambda b=backend: sdpa_impl(b)) for name, backend in SDPA_BACKENDS.items()}}
    return {name: makers[name]() for name in names}


def random_inputs(shape: AttentionShape, requires_grad: bool):
    """q, k, v: (batch, heads, seqlen, head_dim) standard normal bf16 on the GPU."""
    return [torch.randn(shape.batch, shape.heads, n, shape.head_dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=requires_grad) for n in (shape.seqlen_q, shape.seqlen_k, shape.seqlen_k)]


def time_fwd_bwd(fn, shape: AttentionShape, backward=True):
    """(fwd_ms, bwd_ms): medians of do_bench on fresh random inputs; bwd_ms is None when not asked."""
    from triton.testing import do_bench

    q, k, v = random_inputs(shape, requires_grad=backward)
    # Forward timed with grad enabled, as in training (and one compiled graph for FlexAttention).
    fwd_ms = do_bench(lambda: fn(q, k, v, shape.causal), return_mode="median")
    bwd_ms = None
    if backward:
        out = fn(q, k, v, shape.causal)
        grad = torch.randn_like(out)
        bwd_ms = do_bench(lambda: out.backward(grad, retain_graph=True), grad_to_none=[q, k, v],
                          return_mode="median")
    return fwd_ms, bwd_ms


def measure(impl: str, fn, shape: AttentionShape) -> dict:
    """One schema row of forward, backward and peak memory; null figures when the impl refuses the shape."""
    row = empty_row(impl, shape)
    try:
        fwd_ms, bwd_ms = time_fwd_bwd(fn, shape)
        peak = peak_memory(fn, *random_inputs(shape, requires_grad=True), shape.causal)
    except Exception as exc:  # a peer that does not support a shape must not end the sweep
        print(f"{impl} d={shape.head_dim} N={shape.seqlen_q} causal={shape.causal}: {exc!r:.200}",
              file=sys.stderr)
        return row
    row.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_peak_bytes=peak, fwd_peak_source="measured",
               fwd_tflops=attention_flops(shape) / (fwd_ms * 1e-3) / 1e12,
               bwd_tflops=attention_flops(shape, "bwd") / (bwd_ms * 1e-3) / 1e12)
    return row


def run_protocol(impls: dict, shapes, json_path=None) -> dict:
    """Every impl (name -> fn) on every shape, with a progress bar; ``sdpa_math`` only up to 4K.

    With ``json_path`` the results so far are saved after every shape, so that a
    run cut short still leaves what it measured.
    """
    from tqdm.auto import tqdm

    results = {**environment("cuda"), "rows": []}
    with tqdm(total=len(shapes) * len(impls), desc="bench", unit="run", file=sys.stderr) as bar:
        for shape in shapes:
            for name, fn in impls.items():
                bar.set_postfix_str(f"{name} d={shape.head_dim} N={shape.seqlen_q}")
                if not (name == "sdpa_math" and shape.seqlen_q > MATH_MAX_SEQLEN):
                    results["rows"].append(measure(name, fn, shape))
                bar.update()
            if json_path:
                save_results(results, json_path)
    return results
