"""fa_lab/bench/fa2_api.py: flash-attn 2's varlen calls (as fla's MoBA makes them) reach flash-attn-4's
functions with its argument conventions, against a stand-in for flash-attn-4 (no GPU, no package)."""
from __future__ import annotations

import sys
import types

import torch

from fa_lab.bench.fa2_api import FA4_THROUGH_FA2_API, install_fa2_varlen_api


def stand_in(calls: dict):
    """A module with flash-attn-4's two entry points, recording their arguments."""
    def forward(q, k, v, **kwargs):
        calls["forward"] = kwargs
        return q + 1, torch.zeros(q.shape[1], q.shape[0]), None, None, None

    def backward(q, k, v, out, dout, lse, **kwargs):
        calls["backward"] = kwargs
        for name in ("dq", "dk", "dv"):
            kwargs[name].fill_(2.0)

    return types.SimpleNamespace(_flash_attn_fwd=forward, _flash_attn_bwd=backward, flash_attn_varlen_func=forward)


def test_fla_mobas_imports_find_flash_attn_4_behind_flash_attn_2s_names(monkeypatch):
    calls = {}
    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    package.__path__, cute.__path__ = [], []
    cute.interface = stand_in(calls)
    modules = {"flash_attn": package, "flash_attn.cute": cute, "flash_attn.cute.interface": cute.interface,
               "flash_attn.flash_attn_interface": None}  # None: not importable (no flash-attn 2)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    assert install_fa2_varlen_api() == FA4_THROUGH_FA2_API
    from flash_attn import flash_attn_varlen_func  # noqa: F401  (the imports fla.ops.moba makes)
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward, _flash_attn_varlen_forward

    q = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10])  # int64, as fla passes them
    out, lse, *rest = _flash_attn_varlen_forward(q=q, k=q, v=q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                                                 max_seqlen_k=6, softmax_scale=0.5, causal=True, dropout_p=0.0)
    assert torch.equal(out, q + 1) and lse.shape == (2, 10) and rest == [None, None]
    sent = calls["forward"]
    assert sent["cu_seqlens_q"].dtype == torch.int32 and torch.equal(sent["cu_seqlens_k"], cu.int())
    assert sent["causal"] and sent["softmax_scale"] == 0.5 and sent["return_lse"]
    assert sent["window_size_left"] is None and sent["window_size_right"] is None  # flash-attn 2's -1
    grads = [torch.zeros_like(q) for _ in range(3)]
    _flash_attn_varlen_backward(dout=q, q=q, k=q, v=q, out=q, softmax_lse=lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6, dropout_p=0.0,
                                softmax_scale=0.5, causal=False, window_size_left=-1, window_size_right=-1,
                                softcap=0.0, alibi_slopes=None, deterministic=True)
    assert all(bool((g == 2.0).all()) for g in grads)  # written in place, as flash-attn 2 does
    assert calls["backward"]["dq"] is grads[0] and calls["backward"]["cu_seqlens_q"].dtype == torch.int32
    assert install_fa2_varlen_api() == FA4_THROUGH_FA2_API  # a second call finds the shim, not flash-attn 2


def test_without_either_package_nothing_is_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    assert install_fa2_varlen_api() is None
