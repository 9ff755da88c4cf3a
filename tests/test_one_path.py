"""One generation path: a prompt gives the same tokens and finish reasons whichever way it runs.

LLM.generate of one prompt and of several, LLM.stream, a chat session and the OpenAI-compatible
server (a real uvicorn, the official client) all run through the engine's scheduler. The real
SmolLM2 (its file's own weights: another batch, prefill chunks or a prefix hit give the same bits,
test_batch_invariance.py) runs in a static cache of CAP tokens, so the context limit comes within a
dozen new tokens: a prompt and its completion together hold at most CAP tokens, on every path.
"""

from __future__ import annotations

import pytest
import torch

from kvcache import LLM, SamplingParams
from test_server import Server, _model

CAP = 48  # tokens one sequence may hold: prompt + completion
KV = f"static,max_tokens={CAP},max_seqs=6,page_size=8"
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


# One thread each for the library and the server: they take turns, and on a busy two-core machine
# two threads per process wait on each other far longer than they compute.
@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()
    yield LLM(kv=KV, threads=1)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server():
    # prompts prefill in chunks of 16 tokens here (the library feeds a lone prompt in one forward)
    s = Server("smollm2", "--kv", KV, "--max-batch-tokens", "16", "--threads", "1")
    yield s
    s.close()


def _outcome(out) -> list[tuple[list[int], str]]:
    """Each sample's tokens and finish reason."""
    return [(o.token_ids, o.finish_reason) for o in out.outputs]


def _streamed(llm: LLM, messages: list, params: SamplingParams) -> list[tuple[str, str | None]]:
    """Each sample's streamed text and the finish reason on its last piece."""
    texts: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    for d in llm.stream(messages, params):
        assert finish.get(d.index) is None, "a piece after the last one"
        texts.setdefault(d.index, []).append(d.text)
        finish[d.index] = d.finish_reason
    return [("".join(texts[i]), finish[i]) for i in sorted(texts)]


def _server_chat(server: Server, messages: list, stream: bool, **kw) -> tuple[list[tuple[str, str]], int]:
    """Each choice's text and finish reason from /v1/chat/completions, and the completion tokens."""
    c, model = server.client(), _model(server)
    if not stream:
        r = c.chat.completions.create(model=model, messages=messages, **kw)
        choices = sorted(r.choices, key=lambda ch: ch.index)
        return [(ch.message.content, ch.finish_reason) for ch in choices], r.usage.completion_tokens
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in c.chat.completions.create(model=model, messages=messages, stream=True,
                                           stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts.setdefault(ch.index, []).append(ch.delta.content or "")
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    return [("".join(texts[i]), finish[i]) for i in sorted(texts)], usage.completion_tokens


def test_the_context_limit_is_the_same_everywhere(llm, server):
    """Greedy until the static cache is full: finish reason "length" with prompt + completion ==
    CAP through one prompt, several, a stream, a chat session and the server's chat and
    completions (streamed or not, prefilled in chunks)."""
    params = SamplingParams(max_tokens=4 * CAP, ignore_eos=True)
    one = llm.generate(POEM, params)[0]
    prompt = one.prompt_token_ids
    room = CAP - len(prompt)
    assert one.finish_reason == "length" and len(one.token_ids) == room
    other = llm.generate(CAPITAL, params)[0]
    both = llm.generate([POEM, CAPITAL], params)
    assert [_outcome(r) for r in both] == [_outcome(one), _outcome(other)]
    assert len(both[1].prompt_token_ids) + len(both[1].token_ids) == CAP
    assert _streamed(llm, POEM, params) == [(one.text, "length")]
    session = llm.chat_session()
    turn = session.send(POEM[0]["content"], params)
    session.close()
    assert turn.prompt_token_ids == prompt and _outcome(turn) == _outcome(one)

    want = ([(one.text, "length")], room)
    for stream in (False, True):  # no max_tokens: the server's default is what the context leaves
        assert _server_chat(server, POEM, stream, temperature=0, extra_body={"ignore_eos": True}) == want
    r = server.client().completions.create(model=_model(server), prompt=prompt, max_tokens=room, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (one.text, "length") and r.usage.total_tokens == CAP
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0


def test_a_stop_string_ends_every_path_at_the_same_place(llm, server):
    free = llm.generate(POEM, SamplingParams(max_tokens=10, ignore_eos=True))[0]
    words = free.text.split()
    # two words well inside the text: the stop string spans tokens, so a stream holds text back
    pairs = (f"{a} {b}" for a, b in zip(words[1:], words[2:]))
    stop = next(s for s in pairs if free.text.find(s) > len(words[0]))
    params = SamplingParams(max_tokens=10, stop=(stop,), ignore_eos=True)
    one = llm.generate(POEM, params)[0]
    assert one.finish_reason == "stop" and one.text == free.text[: free.text.find(stop)]
    assert one.token_ids == free.token_ids[: len(one.token_ids)] and len(one.token_ids) < len(free.token_ids)
    both = llm.generate([CAPITAL, POEM], params)
    assert _outcome(both[1]) == _outcome(one)
    assert _streamed(llm, POEM, params) == [(one.text, "stop")]
    session = llm.chat_session()
    assert _outcome(session.send(POEM[0]["content"], params)) == _outcome(one)
    session.close()

    for stream in (False, True):
        got = _server_chat(server, POEM, stream, temperature=0, max_tokens=10, stop=[stop],
                           extra_body={"ignore_eos": True})
        assert got == ([(one.text, "stop")], len(one.token_ids))


def test_two_seeded_samples_fork_and_reach_the_limit_alike(llm, server):
    """n=2 with a seed: sample i draws from seed + i wherever the request runs; both share the
    prompt's pages and end at the context limit."""
    params = SamplingParams(max_tokens=4 * CAP, n=2, temperature=0.9, seed=11, ignore_eos=True)
    one = llm.generate(POEM, params)[0]
    prompt = one.prompt_token_ids
    room = CAP - len(prompt)
    assert [(len(o.token_ids), o.finish_reason) for o in one.outputs] == [(room, "length")] * 2
    assert one.outputs[0].token_ids != one.outputs[1].token_ids  # seeds 11 and 12
    assert _outcome(llm.generate([POEM, CAPITAL], params)[0]) == _outcome(one)
    want = [(o.text, "length") for o in one.outputs]
    assert _streamed(llm, POEM, params) == want

    r = server.client().completions.create(model=_model(server), prompt=prompt, max_tokens=room, n=2,
                                           temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    assert [(ch.text, ch.finish_reason) for ch in sorted(r.choices, key=lambda ch: ch.index)] == want
    got = _server_chat(server, POEM, True, n=2, temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    assert got == (want, 2 * room)
    llm.check_integrity()
