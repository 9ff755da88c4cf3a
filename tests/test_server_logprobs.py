"""Log-probabilities as OpenAI returns them and evaluation harnesses read them: ``logprobs`` and
``echo`` on completions (lm-eval's local-completions loglikelihood request), ``logprobs`` and
``top_logprobs`` on chat, streamed or not; the values are the model's, checked against
recomputation."""

from __future__ import annotations

import json

import pytest
import torch

from kvcache import LLM
from kvcache.cache.config import parse_kv_spec
from kvcache.engine.runner import ModelRunner

from test_server import Server, _model

PROMPT = [5, 17, 42, 8, 99, 23, 4, 61, 77, 12]  # a context of 6 tokens and a continuation of 4


@pytest.fixture(scope="module")
def tiny_path(tiny_dir):
    return str(tiny_dir("llama")[0])


@pytest.fixture(scope="module")
def server(tiny_path):
    s = Server(tiny_path, "--kv", "dynamic,page_size=4", "--max-batch-tokens", "32")
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(tiny_path):
    """log-softmax of recomputed logits after every prefix of PROMPT: [len, V]."""
    llm = LLM(tiny_path, kv="none")
    runner = ModelRunner(llm.model, parse_kv_spec("none"))
    return torch.log_softmax(runner.score(runner.new_sequence(), PROMPT), -1)


def test_lm_eval_loglikelihood_request(server, reference):
    """The request lm-eval's local-completions sends for a loglikelihood (token ids, echo, logprobs
    1, max_tokens 1, temperature 0), read the way lm-eval reads it."""
    body = {"model": _model(server), "prompt": [PROMPT], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    code, reply = server.post("/v1/completions", json.dumps(body).encode())
    assert code == 200, reply
    lp = reply["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(PROMPT) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [float(reference[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    assert lp["token_logprobs"][1 : len(PROMPT)] == pytest.approx(want, abs=1e-4)
    ctxlen = 6
    total = sum(lp["token_logprobs"][ctxlen:-1])
    assert total == pytest.approx(float(sum(reference[i - 1, PROMPT[i]] for i in range(ctxlen, len(PROMPT)))), abs=1e-3)
    greedy = all(tok == max(top.values()) for tok, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]))
    assert greedy == all(int(reference[i - 1].argmax()) == PROMPT[i] for i in range(ctxlen, len(PROMPT)))
    assert lp["token_logprobs"][-1] == pytest.approx(float(reference[-1].max()), abs=1e-4)  # the greedy new token
    assert reply["choices"][0]["text"].startswith(" ".join(f"t{t}" for t in PROMPT))


def test_completion_logprobs_with_the_openai_client_streamed_or_not(server, reference):
    c = server.client()
    r = c.completions.create(model=_model(server), prompt=[PROMPT], max_tokens=5, temperature=0, logprobs=3,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(len(t) == 3 for t in lp.top_logprobs)
    assert lp.token_logprobs[0] == pytest.approx(float(reference[-1].max()), abs=1e-4)
    assert all(v == pytest.approx(max(top.values())) for v, top in zip(lp.token_logprobs, lp.top_logprobs))
    streamed = []
    for chunk in c.completions.create(model=_model(server), prompt=[PROMPT], max_tokens=5, temperature=0, logprobs=3,
                                      stream=True, extra_body={"ignore_eos": True}):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                streamed += ch.logprobs.token_logprobs
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    plain = c.completions.create(model=_model(server), prompt=[PROMPT], max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_and_top_logprobs(server):
    c = server.client()
    msgs = [{"role": "user", "content": "t5 t6 t7"}]
    r = c.chat.completions.create(model=_model(server), messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                  top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert bytes(item.bytes).decode() == item.token and item.logprob <= 0
    assert r.choices[0].message.content.replace(" ", "") == "".join(i.token for i in content)
    streamed = []
    for chunk in c.chat.completions.create(model=_model(server), messages=msgs, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True}):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                streamed += [i.logprob for i in ch.logprobs.content]
    assert streamed == pytest.approx([i.logprob for i in content], abs=1e-6)
    sampled = c.chat.completions.create(model=_model(server), messages=msgs, max_tokens=4, temperature=1.0, seed=3,
                                        n=2, logprobs=True, extra_body={"ignore_eos": True})
    assert all(len(ch.logprobs.content) == 4 and not ch.logprobs.content[0].top_logprobs for ch in sampled.choices)


def test_logprob_arguments_are_checked(server):
    model = _model(server)
    for body, words in (({"prompt": "t5", "logprobs": 21}, "logprobs"),
                        ({"messages": [{"role": "user", "content": "t5"}], "top_logprobs": 2}, "needs logprobs"),
                        ({"messages": [{"role": "user", "content": "t5"}], "logprobs": 3}, "logprobs")):
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        code, err = server.post(route, json.dumps({"model": model, **body}).encode())
        assert code == 400 and words in err["error"]["message"], err
