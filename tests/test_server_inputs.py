"""Bad input is refused before any work, with 400 (or 413) and one line naming the problem: bodies
that are not JSON or not valid Unicode, wrong content parts, parameters kvcache does not implement,
and the server's limits on body size, prompts, choices and stops. Tokenizing a huge prompt does
not stall the event loop."""

from __future__ import annotations

import json
import threading
import time

import pytest

from test_server import Server, _model


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = Server(str(tiny_dir("llama")[0]), "--kv", "dynamic,page_size=4", "--max-batch-tokens", "32",
               "--max-request-bytes", str(8 << 20), "--max-prompts", "8", "--max-choices", "12")
    yield s
    s.close()


def _post(server: Server, body: bytes) -> tuple[int, dict]:
    route = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
    return server.post(route, body.replace(b'"M"', json.dumps(_model(server)).encode()))


F6 = [  # body, words in the message, param
    (b'{"model": "M", "prompt": "hi \\ud800"}', "lone surrogate (\\ud800)", "prompt"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "a \\udfff b"}]}', "lone surrogate",
     "messages.0.content"),
    (b'{"model": "M", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply", None),
    (b'{"model": "M", "prompt": "t5", "max_tokens": ' + b"7" * 5000 + b"}", "more than 4300 digits", None),
    (b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "'text' must be a string", "messages.0"),
    (b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
     "text parts only", "messages.0"),
    (b'{"model": "M", "prompt": "t5", "temperature": NaN}', "NaN is not a JSON number", None),
    (b'{"model": "M", "prompt": "t5 \xff\xfe"}', "not valid JSON", None),
    (b'{"model": "M", "prompt": 5}', "prompt", "prompt.str"),
    (b'{"model": "M", "prompt": "t5", "stream": "yes"}', "stream", "stream"),
]


@pytest.mark.parametrize("body,words,param", F6)
def test_hostile_bodies_get_400_naming_the_problem(server, body, words, param):
    code, err = _post(server, body)
    assert code == 400, err
    assert words in err["error"]["message"] and "\n" not in err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param


@pytest.mark.parametrize("extra,param", [
    ({"best_of": 3}, "best_of"),
    ({"suffix": " the end"}, "suffix"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"audio": {"voice": "alloy"}}, "audio"),
])
def test_unsupported_parameters_are_named_not_ignored(server, extra, param):
    body = {"model": _model(server), "prompt": "t5 t6", "max_tokens": 2, **extra}
    code, err = server.post("/v1/completions", json.dumps(body).encode())
    assert code == 400 and err["error"]["param"] == param and err["error"]["code"] == "unsupported_parameter"
    assert repr(param) in err["error"]["message"]


def test_tools_on_completions_are_refused_by_name(server):
    body = {"model": _model(server), "prompt": "t5 t6", "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    code, err = server.post("/v1/completions", json.dumps(body).encode())
    assert code == 400 and err["error"]["param"] == "tools" and "/v1/chat/completions" in err["error"]["message"]


def test_parameters_at_their_off_values_are_accepted(server):
    body = {"model": _model(server), "prompt": "t5 t6", "max_tokens": 2, "n": 2, "best_of": 2, "logit_bias": {},
            "frequency_penalty": 0, "presence_penalty": 0.0, "response_format": {"type": "text"}, "tools": [],
            "tool_choice": "none", "user": "someone", "metadata": {"a": "b"}}
    code, reply = server.post("/v1/completions", json.dumps(body).encode())
    assert code == 200 and len(reply["choices"]) == 2


@pytest.mark.parametrize("extra,status,words", [
    ({"prompt": ["t5"] * 9}, 400, "9 prompts, over the limit of 8 per request (--max-prompts)"),
    ({"prompt": ["t5"] * 4, "n": 4}, 400, "16 choices, over the limit of 12 per request (--max-choices)"),
    ({"prompt": "t5", "stop": [f"s{i}" for i in range(17)]}, 400, "stop has 17 strings, over the limit of 16"),
    ({"prompt": "t5", "stop": "x" * 257}, 400, "257 characters, over the limit of 256"),
])
def test_limits_before_work(server, extra, status, words):
    code, err = server.post("/v1/completions", json.dumps({"model": _model(server), **extra}).encode())
    assert code == status and words in err["error"]["message"], err


def test_a_body_over_the_size_limit_gets_413(server):
    import http.client

    big = json.dumps({"model": _model(server), "prompt": "t5 " * (3 << 20)}).encode()  # 9 MiB
    code, err = server.post("/v1/completions", big)
    assert code == 413 and "--max-request-bytes" in err["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)  # no Content-Length: chunked
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    for i in range(0, len(big), 1 << 20):
        part = big[i : i + (1 << 20)]
        try:
            conn.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        except OSError:  # the server answered and closed before the rest was sent
            break
    try:
        conn.send(b"0\r\n\r\n")
    except OSError:
        pass
    resp = conn.getresponse()
    assert resp.status == 413 and b"--max-request-bytes" in resp.read()


def test_a_too_long_token_id_prompt_names_the_prompt(server):
    code, err = server.post("/v1/completions", json.dumps({"model": _model(server), "prompt": [5] * 300}).encode())
    assert code == 400 and err["error"]["param"] == "prompt" and err["error"]["code"] == "context_length_exceeded"


def test_tokenizing_a_huge_prompt_leaves_the_event_loop_free(server):
    """A 6 MB prompt takes seconds to tokenize; /health answers at once meanwhile."""
    body = json.dumps({"model": _model(server), "prompt": "t5 t6 " * (1 << 20) + "t7", "max_tokens": 1}).encode()
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=server.post("/v1/completions", body)))
    t0 = time.monotonic()
    t.start()
    worst = 0.0
    while t.is_alive():
        h0 = time.monotonic()
        assert server.get("/health")[0] == 200
        worst = max(worst, time.monotonic() - h0)
        time.sleep(0.02)
    took = time.monotonic() - t0
    code, err = result["r"]
    assert code == 400 and "context" in err["error"]["message"]  # 4 million tokens: tokenized, then refused
    assert took > 1.0 and worst < 0.5, (took, worst)
