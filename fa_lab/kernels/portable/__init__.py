"""The plain-Triton kernels (impl "triton", and the portable path of the Hopper impls).

:mod:`.forward` and :mod:`.backward` (FlashAttention-2), :mod:`.pipelined_forward` (FA3's
pipelining and FP8 in plain Triton), their loop bounds (:mod:`.block_range`), tile table
(:mod:`.configs`), launchers and autograd.Function (:mod:`.attention`), and :mod:`.sparse_select`
(chapter 07: attention over selected key blocks, NSA's selected branch and block-sparse attention,
with its own launcher), and chapter 08's linear attention (:mod:`.linear_chunk`, :mod:`.linear_delta`,
:mod:`.linear_recurrent`: the chunkwise h and o passes and the fused recurrence). They run compiled
on any CUDA GPU and in Triton's interpreter on a CPU; the kernel modules import triton, so import
them after :func:`fa_lab.kernels.load_triton`.
"""
