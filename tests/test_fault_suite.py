"""The fault-injection suite: real `kvcache serve` processes on 127.0.0.1, real redis-server, the real
openai client. Every hostile or failing request runs beside healthy streams that must finish with
all their tokens; processes are killed (-9), stopped (SIGSTOP) and restarted; tier entries are
corrupted and forged. Afterwards every page is back and the page accounting balances.
RELIABILITY.md lists what each case does and gets."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvcache import LLM, SamplingParams
from kvcache.prefix.entry import decode_entry, encode_entry, mac_key
from kvcache.peers.process import free_port

from test_server import Server, _model

POISON = 150  # "t150": KVCACHE_FAULTS makes the engine fail any request holding it
SECRET = "suite-secret"


def _stream(server: Server, i: int, tokens: int = 80) -> tuple[str, str | None, int]:
    """A healthy streaming completion: its text, finish reason and usage."""
    text, finish, used = [], None, 0
    stream = server.client().completions.create(
        model=_model(server), prompt=f"t{i % 90 + 5} t{i % 70 + 6} t7", max_tokens=tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.usage:
            used = chunk.usage.completion_tokens
        for ch in chunk.choices:
            text.append(ch.text or "")
            finish = ch.finish_reason or finish
    return "".join(text), finish, used


def _beside_streams(server: Server, work, streams: int = 4, tokens: int = 80):
    """Run ``work()`` while ``streams`` healthy streams run; all of them must finish in full."""
    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(_stream, server, i, tokens) for i in range(streams)]
        time.sleep(0.3)  # the streams are decoding
        out = work()
        results = [f.result(timeout=300) for f in futures]
    assert all(finish == "length" and used == tokens for _, finish, used in results), results
    return out


def _settled(server: Server) -> dict:
    stats = server.stats()
    assert stats["integrity"] == "ok" and stats["kv"]["pages_in_use"] == 0, stats
    assert stats["scheduler"]["running"] == 0 and stats["scheduler"]["waiting"] == 0
    return stats


@pytest.fixture(scope="module")
def tiny_path(tiny_dir):
    return str(tiny_dir("llama")[0])


# -- every hostile input and failure beside healthy streams ------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_path):
    s = Server(tiny_path, "--kv", "dynamic,page_size=4,initial_tokens=64", "--max-batch-tokens", "64",
               "--max-request-bytes", str(1 << 20), "--max-running", "64", env={"KVCACHE_FAULTS": f"sample:{POISON}"})
    yield s
    s.close()


def _hostile(model: str) -> list[tuple[bytes, int, str]]:
    m = json.dumps(model).encode()
    return [
        (b'{"model": ' + m + b', "prompt": "t5 t150 t7", "max_tokens": 8}', 500, "server_error"),  # engine fault
        (b'{"model": ' + m + b', "prompt": "hi \\ud800"}', 400, "lone surrogate"),
        (b'{"model": ' + m + b', "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested too deeply"),
        (b'{"model": ' + m + b', "prompt": "t5", "seed": ' + b"9" * 5000 + b"}", 400, "4300 digits"),
        (b'{"model": ' + m + b', "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', 400,
         "must be a string"),
        (b'{"model": ' + m + b', "prompt": "t5", "tools": [{"type": "function"}]}', 400, "'tools'"),
        (b'{"model": ' + m + b', "prompt": "t5", "logit_bias": {"5": 1000}}', 400, "logit_bias values"),
        (b'{"model": ' + m + b', "prompt": "t5", "response_format": {"type": "json_schema", "json_schema": '
         b'{"name": "x", "schema": {"type": "nope"}}}}', 400, "not a valid JSON Schema"),
        (b'{"model": ' + m + b', "prompt": "t5", "guided_regex": "(unclosed"}', 400, "regex"),
        (b'{"model": ' + m + b', "prompt": ' + json.dumps(["t5"] * 2000).encode() + b"}", 400, "--max-prompts"),
        (b'{"model": ' + m + b', "prompt": ' + json.dumps(["t5"] * 9).encode() + b', "n": 16}', 400, "--max-choices"),
        (b'{"model": ' + m + b', "prompt": "' + b"t5 " * 400_000 + b'"}', 413, "--max-request-bytes"),
        (b'{"model": ' + m + b', "prompt": [' + b"5," * 300 + b'5]}', 400, "context"),
        (b'{"model": ' + m + b', "prompt": "t5", "max_tokens": 8, "seed": 18446744073709551615, "n": 2, '
         b'"temperature": 0.8}', 200, ""),
        (b'{"model": ' + m + b', "prompt": "t5 t6", "max_tokens": 8, "temperature": 1e-40}', 200, ""),
        (b'{"model": ' + m + b', "prompt": "t5", "max_tokens": 4, "priority": 1000000}', 200, ""),
        (b'{"model": ' + m + b', "prompt": [[5, 6, 7]], "max_tokens": 1, "logprobs": 1, "echo": true}', 200, ""),
    ]


def test_every_hostile_request_fails_alone_beside_healthy_streams(server):
    cases = _hostile(_model(server))

    def fire() -> list[tuple[int, dict]]:
        out = []
        for body, _, _ in cases:
            route = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
            out.append(server.post(route, body))
        return out

    replies = _beside_streams(server, fire)
    for (body, status, words), (code, reply) in zip(cases, replies):
        assert code == status, (body[:80], reply)
        if status != 200:
            assert words in json.dumps(reply["error"]), reply
    _settled(server)


def test_clients_that_leave_take_their_pages_with_them(server):
    import http.client

    def leave() -> None:
        for route, body in (("/v1/completions", {"prompt": "t5 t6", "max_tokens": 2000, "ignore_eos": True}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}],
                                                      "max_tokens": 200, "ignore_eos": True, "stream": True})):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            conn.request("POST", route, json.dumps({"model": _model(server), **body}), {"Content-Type": "application/json"})
            time.sleep(0.3)
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()

    _beside_streams(server, leave)
    time.sleep(0.6)  # noticed within a poll of 0.25 s
    _settled(server)


def test_sixty_four_concurrent_streams_give_every_page_back_and_the_pool_shrinks(server):
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda i: _stream(server, i, 24), range(64)))
    assert all(finish == "length" and used == 24 for _, finish, used in results)
    grown = _settled(server)["kv"]
    deadline = time.monotonic() + 10
    while True:  # idle for a second, the pool gives back what it does not use
        now = _settled(server)["kv"]
        if now["pages_total"] < grown["pages_total"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert now["pages_total"] < grown["pages_total"] and now["bytes_allocated"] < grown["bytes_allocated"]
    assert now["pages_total"] >= 16 + now["pages_cached"] // 3  # the cached pages (three layers) stay


# -- kill -9 during write-through, then restart ----------------------------------------------------
def _long_prompts(k: int, length: int = 120) -> list[list[int]]:
    return [[(11 * i + 7 * j + 3) % 140 + 5 for j in range(length)] for i in range(k)]


def _reference(tiny_path: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    llm = LLM(tiny_path, kv="dynamic,page_size=4", prefix=False)
    return [llm.generate([p], SamplingParams(max_tokens=tokens, ignore_eos=True))[0].token_ids for p in prompts]


def _complete(server: Server, prompt: list[int], tokens: int) -> tuple[list[int], int]:
    """Greedy token ids (one prompt, through the logprobs tokens) and the cached prompt tokens."""
    body = {"model": _model(server), "prompt": prompt, "max_tokens": tokens, "temperature": 0, "logprobs": 0,
            "ignore_eos": True}
    code, reply = server.post("/v1/completions", json.dumps(body).encode())
    assert code == 200, reply
    return _ids(reply), reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _ids(reply: dict) -> list[int]:
    return [int(t[1:]) for t in reply["choices"][0]["logprobs"]["tokens"]]  # the tiny vocabulary: "t<id>"


def test_kill_9_during_write_through_then_restart_serves_no_corrupt_entry(tiny_path, tmp_path):
    prompts = _long_prompts(6)
    want = _reference(tiny_path, prompts, 6)
    args = ("--kv", "dynamic,page_size=4", "--prefix-dir", str(tmp_path), "--prefix-tokens", "0")
    first = Server(tiny_path, *args, env={"KVCACHE_TIER_SECRET": SECRET})
    try:
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda p: _complete(first, p, 6), prompts))
        first.proc.kill()  # SIGKILL while the writer thread still has pages queued
        first.proc.wait(timeout=20)
    finally:
        first.close()
    written = list(tmp_path.rglob("*.kv"))
    assert written  # some made it, some were lost with the process
    key = mac_key(SECRET)
    assert all(decode_entry(f.read_bytes(), bytes.fromhex(f.stem), key) is not None for f in written)  # none half-written
    again = Server(tiny_path, *args, env={"KVCACHE_TIER_SECRET": SECRET})
    try:
        got = [_complete(again, p, 6) for p in prompts]
        assert [ids for ids, _ in got] == want
        assert sum(cached for _, cached in got) > 0  # entries that survived were used
        _settled(again)
    finally:
        again.close()


# -- disk entries corrupted and forged -------------------------------------------------------------
def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x20
    f.write_bytes(bytes(data))


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _empty(f: Path) -> None:
    f.write_bytes(b"")


def _forge(f: Path) -> None:
    """Other K/V under the same key with a CRC recomputed by the forger (who lacks the secret)."""
    real = decode_entry(f.read_bytes(), bytes.fromhex(f.stem), mac_key(SECRET))
    if real is not None:
        f.write_bytes(encode_entry(bytes.fromhex(f.stem), {n: torch.randn_like(t) for n, t in real.items()}))


@pytest.fixture(scope="module")
def disk_server(tiny_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("tier")
    s = Server(tiny_path, "--kv", "dynamic,page_size=4", "--prefix-dir", str(d), "--prefix-tokens", "0",
               "--max-batch-tokens", "64", env={"KVCACHE_TIER_SECRET": SECRET})
    s.dir = d
    yield s
    s.close()


@pytest.mark.parametrize("damage", [_flip, _truncate, _empty, _forge], ids=["bit-flip", "truncated", "empty", "forged"])
def test_damaged_disk_entries_are_misses_never_wrong_output(tiny_path, disk_server, damage):
    s = disk_server
    prompt = _long_prompts(1, 60)[0]
    want = _reference(tiny_path, [prompt], 6)[0]
    ids, _ = _complete(s, prompt, 6)  # written through to disk (the RAM index keeps nothing)
    s.flush()  # the tier writes are done
    ids, cached = _complete(s, prompt, 6)
    assert ids == want and cached == 56  # restored from disk
    s.flush()  # the tier writes are done
    for f in s.dir.rglob("*.kv"):
        damage(f)

    def again() -> tuple[list[int], int]:
        return _complete(s, prompt, 6)

    ids, cached = _beside_streams(s, again, streams=2, tokens=40)
    assert ids == want and cached == 0  # every damaged entry refused: recomputed
    s.flush()  # the tier writes are done
    ids, cached = _complete(s, prompt, 6)
    assert ids == want and cached == 56  # rewritten by the request that recomputed them
    _settled(s)


# -- Redis killed and stopped mid-run ----------------------------------------------------------------
class Redis:
    """A redis-server process of this test's own, to stop, kill and restart on one port."""

    def __init__(self) -> None:
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            pytest.skip("redis-server is not installed (make setup-test installs Debian's redis-server)")
        self.port, self.dir = free_port(), tempfile.mkdtemp(prefix="kvcache-suite-redis-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _until_cached(server: Server, prompt: list[int], want: list[int], seconds: float, full: int = 44) -> int:
    """Ask again until all ``full`` cached tokens of the prompt come from Redis (the tier retries 5 s
    after a failure, and writes go through a queue: a read can find the first pages of a prompt
    before the writer has stored the rest)."""
    deadline = time.monotonic() + seconds
    while True:
        ids, cached = _complete(server, prompt, 4)
        assert ids == want
        if cached >= full or time.monotonic() > deadline:
            return cached
        time.sleep(0.5)


def test_redis_stopped_and_killed_mid_run_misses_then_hits_again(tiny_path):
    redis = Redis()
    redis.start()
    prompts = _long_prompts(4, 48)
    want = _reference(tiny_path, prompts, 4)
    s = Server(tiny_path, "--kv", "dynamic,page_size=4", "--redis", f"redis://127.0.0.1:{redis.port}/0",
               "--prefix-tokens", "0", "--max-batch-tokens", "64")
    try:
        assert _complete(s, prompts[0], 4) == (want[0], 0)
        assert _until_cached(s, prompts[0], want[0], 5) == 44  # written through, then read back
        redis.signal(signal.SIGSTOP)  # hangs: every call would wait for its timeout

        def while_stopped() -> list[tuple[list[int], int]]:
            t0 = time.monotonic()
            out = [_complete(s, p, 4) for p in prompts]
            assert time.monotonic() - t0 < 30
            return out

        got = _beside_streams(s, while_stopped, streams=2, tokens=40)
        assert [ids for ids, _ in got] == want and all(cached == 0 for _, cached in got)  # misses, right output
        redis.signal(signal.SIGCONT)
        assert _until_cached(s, prompts[0], want[0], 15) == 44  # hits resume once the tier retries
        redis.kill()
        got = _beside_streams(s, lambda: [_complete(s, p, 4) for p in prompts[1:]], streams=2, tokens=40)
        assert [ids for ids, _ in got] == want[1:] and all(cached == 0 for _, cached in got)
        redis.start()  # empty again, same port
        _complete(s, prompts[3], 4)
        assert _until_cached(s, prompts[3], want[3], 15) == 44
        _settled(s)
    finally:
        s.close()
        redis.close()
