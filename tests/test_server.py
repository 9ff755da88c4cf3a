"""The OpenAI-compatible server: a real uvicorn on 127.0.0.1, the official ``openai`` client."""

from __future__ import annotations

import functools
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import forkserve
import openai
import pytest

from kvcache import LLM, SamplingParams
from kvcache.peers.process import free_port


@functools.cache
def _tls() -> ssl.SSLContext:
    """One default TLS context for every client the tests make: each new client would otherwise load
    the system's certificates again (20 ms, 1,400 clients a suite), for a server spoken to in plain
    HTTP."""
    return ssl.create_default_context()


class Server:
    def __init__(self, model: str, *extra: str, env: dict[str, str] | None = None, admin: str | None = None,
                 fresh: bool = False) -> None:
        """`kvcache serve` on a free port, forked from the tests' helper that has imported torch
        (tests/forkserve.py); `fresh` starts a new interpreter instead."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.admin = admin  # the key stats() sends
        args = ("serve", "--model", model, "--port", str(self.port), *extra)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcache", *args] if fresh else forkserve.command(*args),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 120
        while True:
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = self.proc.stdout.read() if self.proc.stdout else ""
                raise RuntimeError(f"server did not start: {out[-2000:]}")
            time.sleep(0.2)

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120,
                             http_client=openai.DefaultHttpxClient(verify=_tls()))

    def get(self, path: str, key: str | None = None) -> tuple[int, str]:
        req = urllib.request.Request(self.base + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: bytes, key: str | None = None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(self.base + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stats(self) -> dict:
        """The whole cache report with the integrity check (an admin's view)."""
        return json.loads(self.get("/v1/cache/stats?check=true", self.admin)[1])

    def flush(self) -> None:
        """Wait until every page queued for the server's disk/Redis tiers is written."""
        code, text = self.get("/v1/cache/stats?flush=true", self.admin)
        assert code == 200, text

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def tiny_path(tiny_dir):
    return str(tiny_dir("llama")[0])


@pytest.fixture(scope="module")
def server(tiny_path):
    s = Server(tiny_path, "--kv", "dynamic,page_size=4", "--max-batch-tokens", "32")
    yield s
    s.close()


def _model(server: Server) -> str:
    return server.client().models.list().data[0].id


def test_models_health_and_a_completion_equal_to_the_library(server, tiny_path):
    model = _model(server)
    assert server.get("/health") == (200, '{"status":"ok"}')
    r = server.client().completions.create(model=model, prompt="t5 t6 t7 t8", max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    want = LLM(tiny_path, kv="dynamic,page_size=4").generate(["t5 t6 t7 t8"],
                                                              SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 8 and r.usage.total_tokens == 12


def test_chat_streaming_equals_non_streaming(server):
    c, model = server.client(), _model(server)
    msgs = [{"role": "system", "content": "t9 t10"}, {"role": "user", "content": "t11 t12 t13"}]
    whole = c.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
    pieces, finish, roles = [], None, set()
    stream = c.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            roles.add(ch.delta.role)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason and "assistant" in roles
    assert whole.choices[0].message.role == "assistant"
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt a moment ago


def test_n_seed_and_stop(server):
    c, model = server.client(), _model(server)
    r = c.completions.create(model=model, prompt="t20 t21", max_tokens=6, n=3, temperature=1.0, seed=3,
                             extra_body={"ignore_eos": True})
    again = c.completions.create(model=model, prompt="t20 t21", max_tokens=6, n=3, temperature=1.0, seed=3,
                                 extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [ch.text for ch in again.choices]
    words = r.choices[0].text.split()
    stop = words[2]
    s = c.completions.create(model=model, prompt="t20 t21", max_tokens=6, n=1, temperature=1.0, seed=3, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert s.choices[0].finish_reason == "stop" and stop not in s.choices[0].text
    assert r.choices[0].text.startswith(s.choices[0].text.rstrip())
    batch = c.completions.create(model=model, prompt=["t30 t31", "t32"], max_tokens=3, temperature=0)
    assert sorted(ch.index for ch in batch.choices) == [0, 1]


def test_prefix_reuse_shows_in_usage(server):
    c, model = server.client(), _model(server)
    prompt = " ".join(f"t{i}" for i in range(40, 100))
    first = c.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    second = c.completions.create(model=model, prompt=prompt + " t7", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < 60 <= second.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("body,status,words", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "M", "prompt": "t5", "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"model": "M", "prompt": "t5", "max_tokens": -3}', 400, "max_tokens"),
    (b'{"model": "M", "prompt": "t5", "max_tokens": 1000000}', 400, "max_tokens=1000000"),
    (b'{"model": "M", "prompt": ""}', 400, "prompt must not be empty"),
    (b'{"model": "M", "prompt": [5, 99999]}', 400, "token ids"),
    (b'{"model": "nope", "prompt": "t5"}', 404, "does not exist"),
    (b'{"model": "M", "prompt": "t5", "temperature": 7}', 400, "temperature"),
])
def test_bad_completions_get_openai_errors_and_the_server_keeps_serving(server, body, status, words):
    body = body.replace(b'"M"', json.dumps(_model(server)).encode())
    code, err = server.post("/v1/completions", body)
    assert code == status and words in err["error"]["message"] and err["error"]["type"]


def test_bad_chat_requests(server):
    c, model = server.client(), _model(server)
    with pytest.raises(openai.BadRequestError, match="messages"):
        c.chat.completions.create(model=model, messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "t5"}])
    long = " ".join(["t5"] * 300)  # the tiny model's context is 256
    with pytest.raises(openai.BadRequestError, match="context"):
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": long}])
    code, err = server.post("/v1/nothing", b"{}")
    assert code == 404 and err["error"]["message"]
    ok = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "t5"}], max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_thirty_two_concurrent_streams_complete_without_leaks(server):
    c, model = server.client(), _model(server)

    def one(i: int) -> tuple[str, str | None]:
        text, finish = [], None
        stream = c.chat.completions.create(model=model, stream=True, max_tokens=12, temperature=0,
                                           messages=[{"role": "user", "content": f"t{i + 5} t{i + 6} t7"}],
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            for ch in chunk.choices:
                text.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        return "".join(text), finish

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(finish == "length" and len(text.split()) >= 6 for text, finish in results)
    stats = server.stats()
    assert stats["integrity"] == "ok"
    assert stats["kv"]["pages_in_use"] == 0 and stats["scheduler"]["running"] == 0


@pytest.fixture(scope="module")
def smollm_server():
    # the file's quantized weights; no prefix cache, so the same prompt takes the same path twice
    # (a prefix hit sums attention in another order, and int8 activations may round one value the
    # other way: tests/test_qmodels.py bounds that)
    s = Server("smollm2", "--no-prefix-cache")
    yield s
    s.close()


@pytest.mark.slow
def test_a_disconnected_client_frees_its_pages(smollm_server):
    import http.client

    server = smollm_server
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"model": _model(server), "prompt": "Once upon a time", "max_tokens": 4000, "stream": True,
                       "ignore_eos": True})  # half a minute of decoding here
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # the first event arrived: the request is running
    assert server.stats()["kv"]["pages_in_use"] > 0
    t0 = time.monotonic()
    conn.sock.shutdown(2)
    conn.close()
    while time.monotonic() - t0 < 5:
        stats = server.stats()
        if stats["scheduler"]["running"] == 0:
            break
        time.sleep(0.1)
    assert stats["scheduler"]["running"] == 0 and stats["kv"]["pages_in_use"] == 0  # long before 400 tokens
    assert stats["integrity"] == "ok"
    aborted = [line for line in server.get("/metrics")[1].splitlines()
               if line.startswith("kvcache_requests_aborted_total ")]
    assert float(aborted[0].split()[1]) == 1


def _wait_idle(server: Server, seconds: float) -> tuple[float, dict]:
    """Seconds until nothing runs and no page is in use (or the limit), and the last stats."""
    t0 = time.monotonic()
    while True:
        stats = server.stats()
        if (stats["scheduler"]["running"] == 0 and stats["scheduler"]["waiting"] == 0
                and stats["kv"]["pages_in_use"] == 0) or time.monotonic() - t0 > seconds:
            return time.monotonic() - t0, stats
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_non_streaming_client_that_leaves_is_aborted_within_a_second(smollm_server, route):
    import http.client

    server = smollm_server
    model = _model(server)
    body = {"model": model, "max_tokens": 6000, "ignore_eos": True}  # most of a minute of decoding here
    body.update({"prompt": "Once upon a time"} if "chat" not in route else
                {"messages": [{"role": "user", "content": "Tell me a long story."}]})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
    t0 = time.monotonic()
    while server.stats()["scheduler"]["running"] == 0:  # admitted and decoding
        assert time.monotonic() - t0 < 30
        time.sleep(0.05)
    conn.sock.shutdown(2)
    conn.close()
    took, stats = _wait_idle(server, 10)
    assert took < 2.5, f"the abandoned request ran on for {took:.1f} s"  # polled every 0.25 s
    assert stats["integrity"] == "ok" and stats["kv"]["pages_in_use"] == 0


@pytest.mark.slow
def test_real_model_chat_with_a_stop_string(smollm_server):
    c, model = smollm_server.client(), _model(smollm_server)
    msgs = [{"role": "user", "content": "Name three fruits."}]
    whole = c.chat.completions.create(model=model, messages=msgs, max_tokens=40, temperature=0)
    text = whole.choices[0].message.content
    assert "2." in text  # a numbered list
    cut = c.chat.completions.create(model=model, messages=msgs, max_tokens=40, temperature=0, stop=["2."])
    assert cut.choices[0].finish_reason == "stop" and "2." not in cut.choices[0].message.content
    assert text.startswith(cut.choices[0].message.content)


def test_metrics_expose_cache_and_latency(server):
    c = server.client()  # one request served, whichever tests ran before on this server
    c.completions.create(model=_model(server), prompt="Hi", max_tokens=2)
    code, text = server.get("/metrics")
    assert code == 200
    for name in ("kvcache_time_to_first_token_seconds_bucket", "kvcache_time_per_output_token_seconds_count",
                 "kvcache_kv_usage_ratio", "kvcache_prefix_hit_rate", "kvcache_requests_waiting",
                 "kvcache_preemptions_total", "kvcache_kv_pages", "kvcache_prefix_running_tokens_total"):
        assert name in text
    # a figure that can go down is a gauge (the pool shrinks when idle), never a counter
    assert "# TYPE kvcache_kv_pages gauge" in text and "kvcache_kv_pages_total" not in text
    served = [line for line in text.splitlines() if line.startswith("kvcache_requests_total ")]
    assert served and float(served[0].split()[1]) > 0


def test_api_keys_authenticate_and_salt_the_prefix_cache(tiny_path):
    s = Server(tiny_path, "--kv", "dynamic,page_size=4", "--api-key", "k1", "--api-key", "k2")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert s.get("/v1/models")[0] == 401
        model = s.client("k1").models.list().data[0].id
        prompt = " ".join(f"t{i}" for i in range(40, 80))

        def cached(key: str) -> int:
            r = s.client(key).completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
            return r.usage.prompt_tokens_details.cached_tokens

        assert cached("k1") == 0
        assert cached("k2") == 0  # another tenant never hits k1's entries
        assert cached("k1") == 39
    finally:
        s.close()
