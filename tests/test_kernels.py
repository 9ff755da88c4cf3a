"""The native quantized decode attention equals the torch path (dequantize, then attend)."""

from __future__ import annotations

import pytest
import torch

from kvcache import kernels
from kvcache.cache import PagedContext, PagedKVCache
from kvcache.config import parse_kv_spec
from kvcache.models.config import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=16, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=32, max_position=4096, layer_windows=(None, None))


def decode_outputs(spec: str, use_kernel: bool, monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setattr(kernels, "_LIBS", {} if use_kernel else {"qattn": False, "pattn": False})
    torch.manual_seed(0)
    cache = PagedKVCache(CFG, parse_kv_spec(spec))
    a, b = cache.new_sequence(), cache.new_sequence()
    for s, n in ((a, 150), (b, 77)):  # two sequences: page tables interleave, not contiguous
        k = torch.randn(n, 2, 32) * torch.linspace(0.5, 4, 32)  # channels of different ranges
        PagedContext(cache, [s], [n], torch.arange(n)).attend(0, torch.randn(n, 6, 32), k, torch.randn(n, 2, 32), 0.2)
    outs = []
    for step in range(6):
        for s in (a, b):
            ctx = PagedContext(cache, [s], [1], torch.tensor([s.length]))
            outs.append(ctx.attend(0, torch.randn(1, 6, 32), torch.randn(1, 2, 32), torch.randn(1, 2, 32), 0.2))
    cache.check_integrity()
    return outs


@pytest.mark.parametrize("spec", ["int8,page_size=16,group_size=8,residual=16", "int4,group_size=16,residual=0",
                                  "int2,page_size=32,group_size=16,residual=40"])
def test_kernel_equals_torch_path(spec, monkeypatch):
    if kernels.qattn() is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    calls = []
    real = kernels.quant_decode

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(kernels, "quant_decode", counted)
    fast = decode_outputs(spec, True, monkeypatch)
    assert calls and all(calls)  # the decode steps went through the kernel
    slow = decode_outputs(spec, False, monkeypatch)
    for x, y in zip(fast, slow):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


def batched_decode_outputs(spec: str, use_kernel: bool, monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setattr(kernels, "_LIBS", {} if use_kernel else {"qattn": False, "pattn": False})
    torch.manual_seed(1)
    cache = PagedKVCache(CFG, parse_kv_spec(spec))
    seqs = [cache.new_sequence() for _ in range(3)]
    for s, n in zip(seqs, (40, 9, 23)):  # page tables interleave
        PagedContext(cache, [s], [n], torch.arange(n)).attend(0, torch.randn(n, 6, 32), torch.randn(n, 2, 32),
                                                             torch.randn(n, 2, 32), 0.2)
    outs = []
    for _ in range(5):
        pos = torch.tensor([s.length for s in seqs])
        ctx = PagedContext(cache, seqs, [1, 1, 1], pos)
        outs.append(ctx.attend(0, torch.randn(3, 6, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32), 0.2))
    cache.check_integrity()
    return outs


@pytest.mark.parametrize("spec", ["dynamic,page_size=4", "static,max_tokens=64,max_seqs=3,page_size=16"])
def test_batched_float_decode_kernel_equals_torch_path(spec, monkeypatch):
    if kernels.pattn() is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    calls = []
    real = kernels.paged_decode

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(kernels, "paged_decode", counted)
    fast = batched_decode_outputs(spec, True, monkeypatch)
    assert calls and all(calls)
    slow = batched_decode_outputs(spec, False, monkeypatch)
    for x, y in zip(fast, slow):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)
