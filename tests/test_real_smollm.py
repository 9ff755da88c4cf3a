"""The bundled SmolLM2-135M-Instruct against transformers on the same GGUF file."""

from __future__ import annotations

import json
import time

import pytest
import torch

from kvcache import LLM, SamplingParams
from kvcache.models.loading import fp32_folder, load_weights, model_fingerprint, resolve_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a KV cache in language models.",
    "Translate 'good morning' into Spanish and German.",
]


def test_converted_weights_equal_transformers_gguf_load(hf_smollm):
    """Our dequantization and Q/K un-permutation give exactly transformers' tensors."""
    _, hf = hf_smollm
    _, ours = load_weights(fp32_folder(None))
    ref = hf.state_dict()
    for name, t in ours.items():
        torch.testing.assert_close(t, ref[name].float(), atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    assert set(ours) <= set(ref)
    assert len(ours) == 30 * 9 + 2  # 9 tensors per layer + embeddings + final norm (lm_head tied)


def test_tokenizer_and_chat_template_match_transformers(hf_smollm, smollm):
    tok, _ = hf_smollm
    for p in PROMPTS + ["  leading spaces, émojis 🙂 and\nnewlines\t tabs"]:
        assert smollm.tokenizer.encode(p) == tok.encode(p)
        assert smollm.tokenizer.decode(tok.encode(p)) == tok.decode(tok.encode(p), skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a color."}]
    for msgs in (messages, messages[1:2]):
        ref = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert smollm.tokenizer.encode_chat(msgs) == list(ref)
    assert smollm.tokenizer.token_to_id("<|im_end|>") in smollm.tokenizer.eos_token_ids if hasattr(
        smollm.tokenizer, "token_to_id") else True


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm):
    """transformers' greedy 40 tokens after a prompt, generated once for every cache compared with it."""
    _, hf = hf_smollm
    made: dict[tuple[int, ...], list[int]] = {}

    def get(ids: list[int], eos: list[int]) -> list[int]:
        if tuple(ids) not in made:
            with torch.no_grad():
                made[tuple(ids)] = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                               eos_token_id=eos)[0, len(ids):].tolist()
        return list(made[tuple(ids)])

    return get


@pytest.mark.parametrize("kv", ["dynamic", "static,max_tokens=512"])
def test_greedy_output_identical_to_transformers_generate(hf_smollm, hf_greedy, smollm, kv):
    tok, _ = hf_smollm
    llm = smollm if kv == "dynamic" else LLM(kv=kv, weights="fp32")
    for p in PROMPTS[:3]:
        ids = llm.encode(p, chat=True)
        out = llm.generate([ids], SamplingParams(max_tokens=40))[0]
        ref = hf_greedy(ids, list(llm.tokenizer.eos_token_ids))
        if ref and ref[-1] in llm.tokenizer.eos_token_ids:
            ref = ref[:-1]
        assert out.token_ids == ref, p
        assert out.text == tok.decode(ref, skip_special_tokens=True)
    llm.check_integrity()


def test_streaming_pieces_join_to_the_text(smollm_q):
    params = SamplingParams(max_tokens=30)
    pieces = [d.text for d in smollm_q.stream("Tell me a fun fact about owls.", params, chat=True)]
    full = smollm_q.generate(["Tell me a fun fact about owls."], params, chat=True)[0]
    assert "".join(pieces) == full.text and len(pieces) > 3


def test_a_run_step_by_step_gives_one_token_a_step_after_the_prompt(smollm_q):
    """RequestRun.steps (what `bench decode --profile` times): after the step that gives the first
    token, each step gives one more, and the steps' Deltas join to the text iteration gives."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    run = smollm_q.request("Tell me a fun fact about owls.", params, chat=True)
    tokens, pieces = [], []
    for deltas in run.steps():
        tokens.append(sum(len(s.tokens) for s in run.request.samples))
        pieces += [d.text for d in deltas]
    first = next(i for i, n in enumerate(tokens) if n)
    assert tokens[first:] == list(range(1, 13))
    assert "".join(pieces) == run.result.outputs[0].text == "".join(
        d.text for d in smollm_q.stream("Tell me a fun fact about owls.", params, chat=True))


def test_stop_strings_cut_the_text(smollm):
    r = smollm.generate(["Count from one to ten in words: one, two,"],
                        SamplingParams(max_tokens=40, stop=["five"]))[0]
    assert r.finish_reason == "stop" and "five" not in r.text and "four" in r.text


def test_sampling_is_seeded(smollm_q):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=123)
    a = smollm_q.generate(["Write a sentence about rain."], p, chat=True)[0]
    b = smollm_q.generate(["Write a sentence about rain."], p, chat=True)[0]
    c = smollm_q.generate(["Write a sentence about rain."], SamplingParams(max_tokens=16, temperature=0.9, seed=5),
                        chat=True)[0]
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_chat_session_prefills_only_new_tokens(smollm_q):
    smollm_q.clear_prefix_cache()  # other tests' prompts share the template's first tokens
    s = smollm_q.chat_session(system="You are a terse assistant.")
    p = SamplingParams(max_tokens=12)
    first = s.send("Name a fruit.", p)
    second = s.send("Name a vegetable.", p)
    assert first.cached_tokens == 0
    assert second.cached_tokens >= len(first.prompt_token_ids)  # the whole first turn was reused
    ref = smollm_q.generate([s.messages[:-1]], p)[0]
    assert second.token_ids == ref.token_ids
    s.close()
    smollm_q.check_integrity()


@pytest.mark.parametrize("weights", ["file", "fp32"])
def test_second_load_is_fast_and_does_not_convert_again(weights):
    path = resolve_model(None).path
    LLM(weights=weights)  # converts (config, tokenizer; fp32 weights for fp32) if nothing did yet
    stamp = (path / "kvcache.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    llm = LLM(weights=weights)
    elapsed = time.perf_counter() - t0
    assert (path / "kvcache.json").stat().st_mtime_ns == stamp
    assert llm.model_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    info = json.loads((path / "kvcache.json").read_text())
    assert info["fingerprint"] == model_fingerprint(path) and len(info["fingerprint"]) == 64
    print(f"second load ({weights}): {elapsed:.2f} s")
    assert elapsed < 10  # a generous bound; the figure itself lives in the benchmark notes
