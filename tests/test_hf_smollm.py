"""kvcache.hf on the real SmolLM2-135M-Instruct as transformers loads it (fp32)."""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch
from transformers import DynamicCache

from kvcache.hf import make_cache

pytestmark = pytest.mark.slow

TEXT = " ".join(list(pydoc_data.topics.topics.values())[:4])


@pytest.fixture(scope="module")
def setup(hf_smollm):
    tok, model = hf_smollm
    ids = torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"][:192]])
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=DynamicCache(config=model.config),
                             pad_token_id=model.config.eos_token_id)
    return model, ids, ref


@pytest.mark.parametrize("spec", ["dynamic", "static,max_tokens=256", "offloaded", "fp16"])
def test_greedy_tokens_equal_dynamic_cache(setup, spec):
    model, ids, ref = setup
    cache = make_cache(model, spec)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=cache,
                             pad_token_id=model.config.eos_token_id)
    assert torch.equal(out, ref)
    cache.check_integrity()


@pytest.mark.parametrize("spec,floor", [("int8,residual=32", 0.97), ("int4,residual=32", 0.9),
                                        ("int4,sinks=4,window=128,residual=32", 0.75)])
def test_lossy_top1_agreement(setup, spec, floor):
    """Teacher-forced over the reference's tokens: the share of steps whose top-1 token is the full
    cache's (EVAL.md measures 99.9% for int8 and 96.9% for int4 over 2048 tokens)."""
    model, ids, ref = setup
    full, ours = DynamicCache(config=model.config), make_cache(model, spec)
    prompt, forced = ref[:, :96], ref[0, 96:160]  # 96 tokens of prompt, then 64 one at a time
    agree = []
    with torch.no_grad():
        a = model(prompt, past_key_values=full).logits[0, -1]
        b = model(prompt, past_key_values=ours).logits[0, -1]
        for t in forced:
            agree.append(int(a.argmax() == b.argmax()))
            x = t.view(1, 1)
            a = model(x, past_key_values=full).logits[0, -1]
            b = model(x, past_key_values=ours).logits[0, -1]
    share = sum(agree) / len(agree)
    assert share >= floor, share
    assert ours.stats().bytes_used < 0.6 * sum(layer.keys.nbytes * 2 for layer in full.layers)
