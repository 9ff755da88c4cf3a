"""Engine replicas on Ray Serve behind one endpoint (`kvcache serve --replicas N`), on 127.0.0.1.

One local Ray instance for the whole module; the application is redeployed when a test needs
another router or tier. Two replicas of the bundled SmolLM2 (its file's own weights, one thread
each). What is checked:

- route keys are the single-process cache's chained keys (the very keys its Redis tier stores),
  salted per tenant, and a replica's summary holds them once it served the prompt;
- repeated prefixes land on the replica that holds them, with a measured hit rate, against
  round-robin on the same workload;
- with a shared Redis tier, a replica that misses in RAM restores what the other computed;
- a replica killed mid-run: its streams end with a clear error, the other's finish, new requests
  are served, and Ray Serve starts a replacement;
- the real openai client, streaming and not, with usage and cached tokens, and refused without a key.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from kvcache.engine.scheduler import SchedulerConfig
from kvcache.prefix.config import PrefixConfig
from kvcache.server.intake import Limits
from kvcache.server.routing import Candidate, KeySpace, Policy, held_pages, index_summary, key_space, route_keys, unpack

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
LIMIT = 64 << 10  # request bytes the replicas accept
QUESTIONS = ["Summarize the text in one sentence.", "Which language is the text about?",
             "Name one keyword of the text.", "Give the text a title."]


# -- routing without Ray -----------------------------------------------------------------------------
def test_route_keys_are_the_cache_keys_per_tenant(redis_url):
    """The router's keys for a prompt are the chained keys the single-process cache writes to its
    Redis tier under the same tenant salt; another tenant's keys for the same prompt share none."""
    import redis

    from kvcache import LLM
    from kvcache.engine.params import SamplingParams

    llm = LLM(prefix=PrefixConfig(redis=redis_url), threads=1)
    prompt = llm.encode(_system(0) + " " + QUESTIONS[0])
    llm.generate(prompt, SamplingParams(max_tokens=2), salt="tenant-1")
    llm.flush()
    prefix = llm.runner.prefix
    space = key_space(prefix)
    keys = route_keys(space, prompt, "tenant-1")
    assert len(keys) == (len(prompt) - 1) // space.page_size >= 4
    in_redis = {int.from_bytes(bytes.fromhex(k.decode()[len("kvcache:"):])[:8], "little")
                for k in redis.Redis.from_url(redis_url).scan_iter(match="kvcache:*")}
    assert set(keys) <= in_redis
    summary = unpack(index_summary(prefix))
    assert held_pages(keys, summary) == len(keys)
    other = route_keys(space, prompt, "tenant-2")
    assert not set(other) & summary and not set(other) & in_redis
    assert held_pages(route_keys(space, prompt[:40] + [7] + prompt[41:], "tenant-1"), summary) == 40 // space.page_size
    prefix.close()


def test_policy_weighs_held_prefix_against_queue():
    a, b = Candidate("a", held=10, load=3), Candidate("b", held=2, load=0)
    assert Policy("prefix", queue_cost=16).choose([a, b], page_size=16)[0].name == "a"  # 160 - 48 > 32 - 0
    assert Policy("prefix", queue_cost=64).choose([a, b], page_size=16)[0].name == "b"  # 160 - 192 < 32 - 0
    p = Policy("prefix", queue_cost=64)
    assert p.choose([Candidate("a", 0, 5), Candidate("b", 0, 1)], 16)[0].name == "b"  # two choices: less loaded
    rr = Policy("round-robin")
    firsts = [rr.choose([Candidate("a", 9), Candidate("b")], 16)[0].name for _ in range(4)]
    assert sorted(firsts) == ["a", "a", "b", "b"]
    with pytest.raises(ValueError, match="unknown routing policy"):
        Policy("random")
    assert route_keys(KeySpace("fp", "layout", 16), list(range(16)), None) == ()  # the last token is never reused


# -- replicas on Ray Serve -----------------------------------------------------------------------------
def _post(url: str, body: bytes | dict, key: str | None = KEY_A, timeout: float = 60):
    """POST (JSON) -> (status, headers, parsed body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


class Deployment:
    """The module's Ray instance and the application on it. Every test runs the same replicas (two
    SmolLM2 engines sharing a Redis tier); switching the router only reconfigures them."""

    def __init__(self, redis: str | None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.redis = redis
        self.policy: str | None = None
        self.url = ""

    def ensure(self, policy: str) -> str:
        from kvcache.server.replicas import ReplicaSpec, Topology, start

        if self.policy != policy:
            spec = ReplicaSpec(threads=1, api_keys=(KEY_A, KEY_B), scheduler=SchedulerConfig(max_running=8),
                               prefix=PrefixConfig(redis=self.redis), limits=Limits(max_request_bytes=LIMIT))
            self.url = start(spec, Topology(replicas=2, policy=policy, stats_period_s=0.5), port=self.port)
            self.policy = policy
        return self.url

    def _handle(self):
        from ray import serve

        from kvcache.server.replicas import APP, ENGINE

        return serve.get_deployment_handle(ENGINE, APP)

    def engines(self, want: int = 2, timeout: float = 90.0) -> dict[str, dict]:
        """describe() of ``want`` distinct running engine replicas (asked through the router)."""
        seen: dict[str, dict] = {}
        end = time.monotonic() + timeout
        while len(seen) < want and time.monotonic() < end:
            try:
                d = self._handle().describe.remote().result(timeout_s=10)
                seen[d["replica"]] = d
            except Exception:
                time.sleep(0.5)
        return seen

    def stats(self) -> dict[str, dict]:
        """Every engine replica's prefix counters, by replica."""
        out: dict[str, dict] = {}
        for _ in range(40):
            s = self._handle().stats.remote().result(timeout_s=10)
            out[s["replica"]] = s["prefix"]
            if len(out) == 2:
                break
        return out


@pytest.fixture(scope="module")
def ray_app(request):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'kvcache[ray]'; make setup-test)",
                        exc_type=ImportError)
    import ray

    try:
        redis = request.getfixturevalue("redis_url")
    except pytest.skip.Exception:
        redis = None  # the shared-tier test skips; the others run without a tier
    yield Deployment(redis)
    ray.shutdown()  # the local cluster and everything on it (Serve's graceful stop takes seconds)


def _system(i: int) -> str:
    """A distinct system prompt of about 150 tokens of real English text."""
    from kvcache.eval.fidelity import builtin_text

    text = builtin_text()
    return text[5000 + i * 2000 : 5000 + i * 2000 + 600]


def _workload(url: str, prefixes: int, rounds: int, key: str = KEY_A) -> list[dict]:
    """Chat requests, one after another: each round asks every prefix a new question."""
    out = []
    for r in range(rounds):
        for p in range(prefixes):
            msgs = [{"role": "system", "content": _system(p)}, {"role": "user", "content": QUESTIONS[r]}]
            status, headers, body = _post(f"{url}/chat/completions", {"model": "smollm2", "messages": msgs,
                                                                      "max_tokens": 2}, key)
            assert status == 200, body
            usage = body["usage"]
            out.append({"prefix": p, "replica": headers["x-kvcache-replica"], "prompt": usage["prompt_tokens"],
                        "cached": usage["prompt_tokens_details"]["cached_tokens"]})
    return out


def _hit_rate(rows: list[dict]) -> float:
    return sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows)


def test_openai_client_against_routed_endpoint(ray_app):
    import openai

    url = ray_app.ensure("prefix")
    client = openai.OpenAI(base_url=url, api_key=KEY_A, max_retries=0)
    assert [m.id for m in client.models.list()] == ["smollm2"]
    msgs = [{"role": "system", "content": _system(7)}, {"role": "user", "content": "Say hello."}]
    first = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0)
    assert first.choices[0].message.content and first.usage.completion_tokens >= 1
    again = client.chat.completions.with_raw_response.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0)
    body = again.parse()
    assert body.choices[0].message.content == first.choices[0].message.content  # greedy, same answer
    assert body.usage.prompt_tokens_details.cached_tokens >= body.usage.prompt_tokens - 16  # routed to the holder
    assert again.headers["x-kvcache-replica"]
    stream = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == first.usage.prompt_tokens
    comp = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert comp.choices[0].text and comp.usage.prompt_tokens > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=2)
    status, _, body = _post(f"{url}/chat/completions", {"model": "smollm2", "messages": msgs}, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, body = _post(f"{url}/completions", b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, _, body = _post(f"{url}/completions", {"model": "smollm2", "prompt": "x" * (LIMIT + 10)})
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_repeated_prefixes_stay_on_their_replica(ray_app):
    url = ray_app.ensure("prefix")
    before = ray_app.stats()
    rows = _workload(url, prefixes=3, rounds=4)
    after = ray_app.stats()
    for p in range(3):
        assert len({r["replica"] for r in rows if r["prefix"] == p}) == 1, rows
    later = [r for r in rows if r is not rows[r["prefix"]]]
    assert all(r["cached"] >= r["prompt"] - 40 for r in later), later  # the system prompt and template reused
    tier = sum(after[k]["tier_tokens"] - before[k]["tier_tokens"] for k in after)
    assert tier == 0  # every hit came from the replica's own RAM
    ray_app.prefix_hit = _hit_rate(rows)
    print(f"\nprefix-aware routing: hit rate {ray_app.prefix_hit:.1%} over {len(rows)} requests, all from RAM")


def test_killed_replica_fails_its_streams_clearly_and_is_replaced(ray_app):
    url = ray_app.ensure("prefix")
    before = ray_app.engines()
    assert len(before) == 2
    results: dict[int, dict] = {}
    started = threading.Barrier(7, timeout=60)

    def stream(i: int) -> None:
        body = {"model": "smollm2", "prompt": f"Story number {i}: once upon a time", "max_tokens": 96,
                "ignore_eos": True, "stream": True}
        events, replica, waited = [], None, False
        req = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(),
                                     headers={"authorization": f"Bearer {KEY_A}", "content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                replica = r.headers.get("x-kvcache-replica")
                for raw in r:
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if not waited:
                            waited = True
                            started.wait()
        except (OSError, http.client.HTTPException) as e:
            events.append(f"transport error: {type(e).__name__}")
        finally:
            if not waited:
                started.abort()
        results[i] = {"replica": replica, "events": events}

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait()  # every stream has text: all six are mid-generation
    victim = next(iter(before.values()))
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(120)
    on_victim = [r for r in results.values() if r["replica"] == victim["replica"]]
    others = [r for r in results.values() if r["replica"] != victim["replica"]]
    assert len(on_victim) + len(others) == 6 and on_victim and others, results
    for r in others:  # finished whole
        assert r["events"][-1] == "[DONE]"
        assert json.loads(r["events"][-2])["choices"][0]["finish_reason"] == "length"
    for r in on_victim:  # ended with an error that says what happened, never a silent [DONE]
        last = r["events"][-1]
        assert "[DONE]" not in r["events"]
        assert "transport error" in last or json.loads(last)["error"]["code"] == "replica_failed", last
    status, headers, _ = _post(f"{url}/completions", {"model": "smollm2", "prompt": "Hello", "max_tokens": 2})
    assert status == 200 and headers["x-kvcache-replica"] != victim["replica"]
    after = ray_app.engines(timeout=90)
    while set(after) == set(before) - {victim["replica"]} or victim["replica"] in after or len(after) < 2:
        time.sleep(1)
        after = ray_app.engines(timeout=30)
    assert len(after) == 2 and victim["replica"] not in after


def test_round_robin_with_shared_redis_tier(ray_app):
    """Round-robin spreads each prefix over both replicas: fewer RAM hits than prefix-aware routing
    on the same workload (another tenant's, so nothing is shared with the runs before); with the
    shared tier the replica that misses restores the other's pages."""
    if ray_app.redis is None:
        pytest.skip("redis-server is not installed (make setup-test installs Debian's redis-server)")
    url = ray_app.ensure("round-robin")
    before = ray_app.stats()
    rows = _workload(url, prefixes=3, rounds=4, key=KEY_B)
    for p in range(3):
        assert len({r["replica"] for r in rows if r["prefix"] == p}) == 2, rows
    after = ray_app.stats()
    assert set(after) == set(before)

    def delta(name: str) -> int:
        return sum(after[k][name] - before[k][name] for k in after)

    ram = (delta("hit_tokens") - delta("tier_tokens")) / delta("prompt_tokens")
    print(f"\nround-robin: RAM hit rate {ram:.1%}, with the Redis tier {_hit_rate(rows):.1%} "
          f"({delta('tier_tokens')} tokens restored from Redis)")
    assert delta("tier_tokens") >= 3 * 100  # each prefix's first visit to the second replica came from Redis
    second = [next(r for r in rows if r["prefix"] == p and r["replica"] != rows[p]["replica"]) for p in range(3)]
    assert all(r["cached"] >= r["prompt"] - 40 for r in second), second
    prefix_hit = getattr(ray_app, "prefix_hit", None)
    if prefix_hit is not None:
        assert prefix_hit > ram + 0.15, (prefix_hit, ram)
