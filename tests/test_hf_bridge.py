"""kvcache.hf: kvcache's strategies as transformers caches, against transformers' DynamicCache.

Tiny random-weight HF models (Llama; Gemma 3 with sliding and full layers; BART for
encoder–decoder). Exact strategies give DynamicCache's tokens and logits; lossy ones are measured;
attention sinks give what kvcache's own engine gives for the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcache import LLM
from kvcache.errors import InvalidParams, KVCacheError
from kvcache.hf import KVCache, PromptCache, UnsupportedTransformers, check_transformers_version, make_cache

PROMPT = [5, 17, 42, 8, 99, 23, 4, 61, 77, 12, 30, 3, 44, 90, 7, 15, 66, 120, 9, 33]  # > sliding window 8
NEW = 12
EXACT = ["dynamic,page_size=4", "static,max_tokens=64,page_size=4", "offloaded,page_size=4", "disk,page_size=4"]


def greedy(model, cache, ids=None, new=NEW, **kw):
    ids = torch.tensor([PROMPT]) if ids is None else ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache,
                             output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)  # [B, new], [B, new, V]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """family -> (HF model, DynamicCache's greedy tokens and logits)."""
    made = {}

    def get(family: str):
        if family not in made:
            _, hf = tiny_dir(family)
            made[family] = (hf, *greedy(hf, DynamicCache(config=hf.config)))
        return made[family]

    return get


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("spec", EXACT + ["fp16,page_size=4"])
def test_generate_matches_dynamic_cache(reference, family, spec):
    hf, tokens, logits = reference(family)
    cache = make_cache(hf, spec)
    got, got_logits = greedy(hf, cache)
    assert torch.equal(got, tokens)
    atol = 1e-4 if spec in EXACT else 2e-2  # fp16 storage rounds K/V
    torch.testing.assert_close(got_logits, logits, atol=atol, rtol=0)
    cache.check_integrity()
    if family == "gemma3":  # the sliding group gave its old pages back: fewer than the full group
        per_layer = cache.stats().per_layer
        assert per_layer[0].pages_used < per_layer[2].pages_used


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_forward_loop_matches_dynamic_cache(tiny_dir, family):
    _, hf = tiny_dir(family)
    ours, theirs = make_cache(hf, "dynamic,page_size=4"), DynamicCache(config=hf.config)
    ids = torch.tensor([PROMPT[:6]])
    with torch.no_grad():
        for _ in range(14):  # a prompt, then one token at a time past the sliding window
            a = hf(ids, past_key_values=ours, use_cache=True).logits[:, -1]
            b = hf(ids, past_key_values=theirs, use_cache=True).logits[:, -1]
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
            assert ours.get_seq_length() == theirs.get_seq_length()
            ids = a.argmax(-1, keepdim=True)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_padded_batch(reference, family):
    hf = reference(family)[0]
    pad = hf.config.pad_token_id
    ids = torch.tensor([PROMPT, [pad] * 7 + PROMPT[7:]])
    mask = (torch.arange(len(PROMPT)) >= torch.tensor([[0], [7]])).long()
    want, _ = greedy(hf, DynamicCache(config=hf.config), ids, attention_mask=mask)
    got, _ = greedy(hf, make_cache(hf, "dynamic"), ids, attention_mask=mask)
    assert torch.equal(got, want)


def test_beam_search_forks_rows(reference):
    hf = reference("llama")[0]
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False)
        cache = make_cache(hf, "dynamic,page_size=4")
        got = hf.generate(ids, max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False,
                          past_key_values=cache)
    assert torch.equal(got, want)
    cache.check_integrity()
    stats = cache.stats()
    # three beams of 27 tokens: the prompt's full pages are shared, not held three times
    assert stats.pages_used < 3 * -(-stats.tokens_stored // 3 // 4)


def test_sampling_several_sequences(reference):
    hf = reference("llama")[0]
    ids = torch.tensor([PROMPT])
    outs = []
    for cache in (DynamicCache(config=hf.config), make_cache(hf, "int8,group_size=8,residual=8")):
        torch.manual_seed(7)
        with torch.no_grad():
            outs.append(hf.generate(ids, max_new_tokens=6, do_sample=True, top_k=0, num_return_sequences=3,
                                    past_key_values=cache))
    assert outs[0].shape == outs[1].shape == (3, len(PROMPT) + 6)
    assert torch.equal(outs[0][:, : len(PROMPT) + 1], outs[1][:, : len(PROMPT) + 1])  # the first token: fp32 tail


def test_prompt_cache_fork_equals_recompute(reference):
    hf = reference("llama")[0]
    prefix = PROMPT[:14]  # 3.5 pages of 4: the last one partly filled, shared, copied on write
    pc = PromptCache(hf, "dynamic,page_size=4").prefill(prefix)
    root_pages = pc.stats().pages_used
    forks = [pc.fork(), pc.fork()]
    assert pc.stats().pages_used == root_pages  # forks share every page
    for fork, tail in zip(forks, ([61, 77, 12], [100, 101])):
        ids = torch.tensor([prefix + tail])
        got, _ = greedy(hf, fork, ids, new=6)
        want, _ = greedy(hf, DynamicCache(config=hf.config), ids, new=6)
        assert torch.equal(got, want)
    stats = pc.stats()
    assert stats.pages_used < 3 * root_pages  # the prefix's full pages are held once
    assert pc.root.store.cache.cow_copies == 2  # each fork copied the shared partial page once
    pc.root.check_integrity()
    pc.prefill(prefix + [61, 77])  # the next turn: only the new tokens are computed
    assert pc.root.get_seq_length() == 16
    with pytest.raises(InvalidParams, match="start with"):
        pc.fork(input_ids=torch.tensor([[1, 2, 3]]))
    del forks, fork
    import gc

    gc.collect()  # a collected fork gives its pages back
    assert pc.stats().pages_used == pc.root.stats().pages_used == 4


@pytest.mark.parametrize("spec,floor", [("int8,group_size=8,residual=8", 0.9), ("int4,group_size=8,residual=8", 0.5)])
def test_quantized_within_measured_tolerance(reference, spec, floor):
    hf = reference("llama")[0]
    _, want = greedy(hf, DynamicCache(config=hf.config), new=32)
    tokens, logits = greedy(hf, make_cache(hf, spec), new=32)
    # top-1 agreement of the logits at each step (teacher-free: each run follows its own tokens)
    agree = (logits.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= floor, agree


def _native_steps(path, spec: str, prompt: list[int], steps: int) -> list[torch.Tensor]:
    llm = LLM(str(path), kv=spec)
    runner = llm.runner
    seq = runner.new_sequence()
    feed, out = list(prompt), []
    for _ in range(steps):
        logits = runner.step([seq], [feed])[0]
        out.append(logits)
        feed = [int(logits.argmax())]
    return out


@pytest.mark.parametrize("spec", ["sinks=2,window=10,page_size=4", "int4,sinks=2,window=24,group_size=8,residual=8",
                                  "window=10,page_size=4", "int4,rotate,group_size=8,residual=8",
                                  "int8,rotate,sinks=2,window=24,group_size=8,residual=8"])
def test_sinks_and_windows_match_kvcache_engine(tiny_dir, spec):
    """A prompt inside the window, then one token at a time far past it: the bridge gives the
    logits of kvcache's own engine (sinks re-rotated to sit just before the window; rotated
    encodings turned and quantized as the engine does)."""
    path, hf = tiny_dir("llama")
    steps = 30
    native = _native_steps(path, spec, PROMPT[:6], steps)
    cache = make_cache(hf, spec)
    assert cache.config.rotate == ("rotate" in spec) == ("rotate" in repr(cache))
    ids = torch.tensor([PROMPT[:6]])
    with torch.no_grad():
        for step in range(steps):
            logits = hf(ids, past_key_values=cache, use_cache=True).logits[0, -1]
            torch.testing.assert_close(logits, native[step], atol=2e-4, rtol=0, msg=f"step {step}")
            ids = native[step].argmax().view(1, 1)
    cache.check_integrity()
    assert cache.stats().tokens_stored == 6 + steps - 1


def test_encoder_decoder_cache():
    from transformers import BartConfig, BartForConditionalGeneration, EncoderDecoderCache

    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128)
    model = BartForConditionalGeneration(cfg).eval()
    src = torch.tensor([PROMPT])
    with torch.no_grad():
        want = model.generate(src, max_new_tokens=10, do_sample=False, min_new_tokens=10)
        for spec in ("dynamic,page_size=4", "static,max_tokens=32,page_size=4"):
            cache = make_cache(model, spec)
            assert isinstance(cache, EncoderDecoderCache) and isinstance(cache.self_attention_cache, KVCache)
            got = model.generate(src, max_new_tokens=10, do_sample=False, min_new_tokens=10, past_key_values=cache)
            assert torch.equal(got, want)
            beams = model.generate(src, max_new_tokens=6, num_beams=2, past_key_values=make_cache(model, spec))
            assert torch.equal(beams, model.generate(src, max_new_tokens=6, num_beams=2))


def test_clear_errors(reference):
    hf = reference("llama")[0]
    with pytest.raises(InvalidParams, match="use_cache=False"):
        make_cache(hf, "none")
    with pytest.raises(InvalidParams, match="unknown --kv item"):
        make_cache(hf, "fastest")
    with pytest.raises(InvalidParams, match="one row at a time"):
        greedy(hf, make_cache(hf, "sinks=2,window=10"), torch.tensor([PROMPT, PROMPT]))
    cache = make_cache(hf, "static,max_tokens=24")
    with pytest.raises(KVCacheError, match="static cache capacity"):
        greedy(hf, cache, new=8)


def test_version_check():
    assert check_transformers_version("5.23.0") == "5.23.0"
    for bad in ("4.57.1", "6.0.0.dev0", "3"):
        with pytest.raises(UnsupportedTransformers, match=r"transformers>=5\.0,<6"):
            check_transformers_version(bad)
    import tomllib
    from pathlib import Path

    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "transformers>=5.0,<6" in deps  # the pin and the check agree
    check_transformers_version()  # the installed one (CI tests the pinned range)


def test_bench_rows(tiny_dir):
    from kvcache.bench.hfbridge import bench_hf

    path, _ = tiny_dir("llama")
    rows = bench_hf(str(path), [24], ["dynamic", "int4,group_size=8,residual=8"], ["dynamic", "static", "quantized"],
                    new=3, repeats=1)
    got = {(r.system, r.cache): r.summary() for r in rows}
    assert all(r["tok_s"] for r in got.values()), got
    assert got[("kvcache.hf", "dynamic")]["kv_bytes"] == got[("transformers", "DynamicCache")]["kv_bytes"] == 26 * 768


def test_sinks_leave_smollm3s_nope_layers_unturned():
    """SmolLM3 in transformers: the bridge re-positions sink keys with the model's RoPE on the layers
    that use it, and not on its NoPE layers (every fourth), whose keys carry no position."""
    from transformers import SmolLM3Config

    from kvcache.hf.layout import layout_of

    rots = layout_of(SmolLM3Config(num_hidden_layers=8, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=96)).rotaries()
    assert [r is None for r in rots] == [False, False, False, True] * 2
    assert rots[0].rot_dim == 16
