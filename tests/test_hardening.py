"""Second hardening round: sampling parameters that act or are refused, unknown fields that are
named, tier entries that cannot block the engine, entries nobody forged served by default, --kv
values that conflict or cannot fit, press rows that really pressed, slow clients timed out."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvcache import SamplingParams
from kvcache.errors import InvalidParams
from kvcache.prefix.entry import decode_entry, encode_entry, mac_key
from kvcache.prefix.tiers import DiskTier, TierChain
from kvcache.peers.process import free_port

from conftest import fresh_home
from test_cli_errors import assert_one_line_error, run_cli
from test_fault_suite import _beside_streams, _complete, _long_prompts, _reference, _settled
from test_server import Server, _model


@pytest.fixture(scope="module")
def tiny_path(tiny_dir):
    return str(tiny_dir("llama")[0])


# -- 1. sampling parameters: bad values refused (the distributions: tests/test_sampling_set.py) ----------
def test_bad_sampling_values_are_refused():
    for kw in (dict(top_k=-5), dict(min_p=1.5), dict(min_p=-0.1), dict(top_k=True)):
        with pytest.raises(InvalidParams):
            SamplingParams(**kw)


@pytest.fixture(scope="module")
def server(tiny_path):
    s = Server(tiny_path, "--kv", "dynamic,page_size=4")
    yield s
    s.close()


def _text(server: Server, **extra) -> tuple[int, str]:
    body = {"model": _model(server), "prompt": "t5 t9 t14 t3", "max_tokens": 12, "ignore_eos": True, **extra}
    code, reply = server.post("/v1/completions", json.dumps(body).encode())
    return code, (reply["choices"][0]["text"] if code == 200 else reply["error"]["message"])


def test_top_k_and_min_p_act_in_the_server(server):
    greedy = _text(server, temperature=0)[1]
    free = [_text(server, temperature=1.5, seed=s)[1] for s in range(4)]
    assert any(t != greedy for t in free)  # at this temperature sampling leaves the greedy path
    for s in range(4):
        assert _text(server, temperature=1.5, seed=s, top_k=1) == (200, greedy)
        assert _text(server, temperature=1.5, seed=s, min_p=0.99) == (200, greedy)
    assert _text(server, temperature=1.5, seed=0, top_k=-1)[1] == free[0]  # -1 and 0 are "off"
    for bad, field in ((dict(top_k=-5), "top_k"), (dict(min_p=1.5), "min_p"), (dict(top_k="3"), "top_k")):
        code, message = _text(server, temperature=1.0, **bad)
        assert code == 400 and field in message


def test_chat_takes_top_k_too(server):
    c = server.client()
    msgs = [{"role": "user", "content": "t7 t8 t9"}]
    greedy = c.chat.completions.create(model=_model(server), messages=msgs, max_tokens=10, temperature=0)
    topk = c.chat.completions.create(model=_model(server), messages=msgs, max_tokens=10, temperature=1.5, seed=3,
                                     extra_body={"top_k": 1})
    assert topk.choices[0].message.content == greedy.choices[0].message.content


def _raw_post(server: Server, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(server.base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


def test_unknown_fields_are_named_not_silently_dropped(server, tiny_path):
    body = {"model": _model(server), "prompt": "t5 t6", "max_tokens": 2, "foo": 1, "bar\r\nX-Evil: 1": 2}
    code, headers, _ = _raw_post(server, body)
    assert code == 200
    named = headers.get("x-kvcache-ignored-fields", "")
    assert "foo" in named and "bar" in named and "x-evil" not in headers  # no header injection
    code, headers, _ = _raw_post(server, {"model": _model(server), "prompt": "t5", "max_tokens": 2, "user": "u"})
    assert code == 200 and "x-kvcache-ignored-fields" not in headers  # OpenAI's own no-op fields are quiet
    strict = Server(tiny_path, "--kv", "dynamic,page_size=4", "--unknown-fields", "reject")
    try:
        code, _, reply = _raw_post(strict, {**body, "bar\r\nX-Evil: 1": None, "model": _model(strict)})
        assert code == 400 and reply["error"]["message"] == "Unrecognized request argument supplied: bar\r\nX-Evil: 1"
        code, _, _ = _raw_post(strict, {"model": _model(strict), "prompt": "t5", "max_tokens": 2, "top_k": 3})
        assert code == 200
    finally:
        strict.close()


# -- 2. nothing found in a tier blocks the engine ----------------------------------------------------
def _in_time(fn, seconds: float):
    """``fn()``'s result, failing (not hanging) when it takes longer than ``seconds``."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds} s"
    return out[0]


def _plant(f: Path, kind: str) -> None:
    f.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(f)
    elif kind == "device":  # /dev/zero's numbers: an endless read
        if os.geteuid() == 0:
            os.mknod(f, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
        else:
            os.symlink("/dev/zero", f)
    elif kind == "link":
        os.symlink("/dev/zero", f)
    elif kind == "huge":
        with open(f, "wb") as fh:
            fh.truncate(300 << 20)  # sparse: larger than any entry may be
    else:
        raise ValueError(kind)


@pytest.mark.parametrize("kind", ["fifo", "device", "link", "huge"])
def test_a_disk_entry_that_is_not_a_plain_file_is_a_quick_miss(tmp_path, kind):
    tier = DiskTier(tmp_path)
    key = bytes(range(32))
    tier.put(key, b"entry")
    f = tier._file(key)
    _plant(f, kind)
    assert _in_time(lambda: tier.get(key), 5) is None
    assert not f.exists() and not f.is_symlink()  # removed
    tier.put(key, b"again")
    assert tier.get(key) == b"again"


class SlowDisk(DiskTier):
    """A disk tier on storage that takes ``delay`` seconds to answer a read (a hung network mount)."""

    name = "slow"

    def __init__(self, path: Path, delay: float) -> None:
        super().__init__(path)
        self.delay = delay

    def get(self, key: bytes) -> bytes | None:
        time.sleep(self.delay)
        return super().get(key)


def test_a_tier_that_does_not_answer_is_waited_for_a_bounded_time(tmp_path):
    slow, disk = SlowDisk(tmp_path / "slow", 10.0), DiskTier(tmp_path / "disk")
    key = b"k" * 32
    slow.put(key, b"from slow")
    disk.put(key, b"from disk")
    with pytest.warns(Warning):
        chain = TierChain([slow, disk], read_timeout_s=0.5, retry_after_s=60)
        t0 = time.monotonic()
        assert chain.get(key) == b"from disk"  # the slow tier gave up on, the next one answered
        assert time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    assert chain.get(key) == b"from disk"  # the slow tier's read is still running: skipped at once
    assert time.monotonic() - t0 < 0.3
    assert chain.stats.errors >= 2
    quick = TierChain([SlowDisk(tmp_path / "quick", 0.05)], read_timeout_s=2.0)
    quick.tiers[0].put(key, b"quick")
    assert quick.get(key) == b"quick"  # a tier within its time is read as before


@pytest.fixture(scope="module")
def disk_server(tiny_path, tmp_path_factory):
    d, home = tmp_path_factory.mktemp("tier"), tmp_path_factory.mktemp("home")
    s = Server(tiny_path, "--kv", "dynamic,page_size=4", "--prefix-dir", str(d), "--prefix-tokens", "0",
               "--max-batch-tokens", "64", env={"KVCACHE_HOME": str(fresh_home(home))})
    s.dir, s.home = d, home
    yield s
    s.close()


@pytest.mark.parametrize("kind", ["fifo", "device", "link"])
def test_fifos_and_devices_in_the_disk_tier_never_stop_the_engine(tiny_path, disk_server, kind):
    s = disk_server
    prompt = _long_prompts(1, 60)[0]
    want = _reference(tiny_path, [prompt], 6)[0]
    _complete(s, prompt, 6)  # written through to disk (the RAM index keeps nothing)
    s.flush()  # the tier writes are done
    assert _complete(s, prompt, 6) == (want, 56)  # restored from disk
    s.flush()  # the tier writes are done
    for f in list(s.dir.rglob("*.kv")):
        _plant(f, kind)
    assert s.get("/health")[0] == 200
    ids, cached = _beside_streams(s, lambda: _complete(s, prompt, 6), streams=2, tokens=40)
    assert ids == want and cached == 0  # every planted entry refused: recomputed
    s.flush()  # the tier writes are done
    assert _complete(s, prompt, 6) == (want, 56)  # rewritten as plain files
    _settled(s)


def _redis_with_debug() -> tuple[subprocess.Popen, int]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (make setup-test installs Debian's redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--enable-debug-command", "local"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            pass
        assert time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.05)


def _until_asleep(port: int) -> None:
    """Return once the Redis on ``port`` no longer answers a PING within 0.2 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                c.sendall(b"PING\r\n")
                c.recv(16)
        except OSError:  # a timeout: it sleeps
            return
        time.sleep(0.05)
    raise AssertionError("redis-server never went to sleep")


def test_a_redis_that_sleeps_ten_seconds_never_stops_the_engine(tiny_path, tmp_path):
    proc, port = _redis_with_debug()
    s = Server(tiny_path, "--kv", "dynamic,page_size=4", "--redis", f"redis://127.0.0.1:{port}/0",
               "--prefix-tokens", "0", env={"KVCACHE_HOME": str(fresh_home(tmp_path / "home"))})
    try:
        prompt = _long_prompts(1, 60)[0]
        want = _reference(tiny_path, [prompt], 6)[0]
        _complete(s, prompt, 6)
        s.flush()  # the tier writes are done
        assert _complete(s, prompt, 6) == (want, 56)  # restored from Redis
        sleeper = threading.Thread(target=lambda: subprocess.run(
            ["redis-cli", "-p", str(port), "DEBUG", "SLEEP", "10"], capture_output=True, timeout=30), daemon=True)
        sleeper.start()
        _until_asleep(port)
        t0 = time.monotonic()
        ids, cached = _beside_streams(s, lambda: _complete(s, prompt, 6), streams=2, tokens=40)
        assert ids == want and cached == 0 and time.monotonic() - t0 < 8.0
        sleeper.join(30)
        _settled(s)
    finally:
        s.close()
        proc.kill()
        proc.wait(timeout=10)


def test_health_reports_an_engine_that_stopped_stepping(tiny_path):
    trigger = 150
    s = Server(tiny_path, "--kv", "dynamic,page_size=4", "--stall-after", "1",
               env={"KVCACHE_FAULTS": f"stall:{trigger}", "KVCACHE_FAULT_STALL_S": "4"})
    try:
        assert s.get("/health")[0] == 200
        body = {"model": _model(s), "prompt": [5, 6, trigger], "max_tokens": 2}
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(s.post, "/v1/completions", json.dumps(body).encode())
            seen, deadline = [], time.monotonic() + 3.5
            while time.monotonic() < deadline:
                code, text = s.get("/health")
                seen.append(code)
                if code == 503:
                    assert json.loads(text)["status"] == "stalled"
                    break
                time.sleep(0.2)
            assert 503 in seen, seen
            assert fut.result(timeout=60)[0] == 200  # the step ends after its stall; the request is served
        assert s.get("/health")[0] == 200
    finally:
        s.close()


# -- 3. by default an entry this installation did not write is never served ----------------------------
def test_default_tiers_carry_a_mac_with_the_installations_secret(tiny_path, disk_server):
    s = disk_server
    prompt = _long_prompts(1, 48)[0]
    want = _reference(tiny_path, [prompt], 6)[0]
    _complete(s, prompt, 6)
    s.flush()  # the tier writes are done
    secret_file = s.home / "tier-secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    key = mac_key(secret_file.read_text().strip())
    entries = list(s.dir.rglob("*.kv"))
    assert entries
    for f in entries:
        blob, k = f.read_bytes(), bytes.fromhex(f.stem)
        real = decode_entry(blob, k, key)
        assert real is not None and decode_entry(blob, k) is None  # a MAC, not a CRC
        # the forger: other K/V under the same key, with the project's own encoder's CRC
        f.write_bytes(encode_entry(k, {n: torch.zeros_like(t) for n, t in real.items()}))
    assert _complete(s, prompt, 6) == (want, 0)  # every forged entry refused
    _settled(s)


def test_unsigned_tiers_are_an_explicit_choice(tiny_path, tmp_path):
    prompt = _long_prompts(1, 48)[0]
    s = Server(tiny_path, "--kv", "dynamic,page_size=4", "--prefix-dir", str(tmp_path / "d"), "--prefix-tokens", "0",
               "--tier-unsigned", env={"KVCACHE_HOME": str(fresh_home(tmp_path / "home"))})
    try:
        _complete(s, prompt, 6)
        s.flush()  # the tier writes are done
        assert not (tmp_path / "home" / "tier-secret").exists()
        for f in (tmp_path / "d").rglob("*.kv"):
            assert decode_entry(f.read_bytes(), bytes.fromhex(f.stem)) is not None  # a CRC: forgeable, as chosen
        assert _complete(s, prompt, 6)[1] == 44
    finally:
        s.close()
    r = run_cli("serve", "--model", tiny_path, "--prefix-dir", str(tmp_path / "d"), "--tier-unsigned",
                "--tier-secret", "x" * 40)
    assert_one_line_error(r, "exclude each other")


def test_a_secret_file_others_can_read_is_refused(tmp_path, monkeypatch):
    from kvcache.prefix.config import installation_secret

    monkeypatch.setenv("KVCACHE_HOME", str(tmp_path))
    first = installation_secret()
    assert installation_secret() == first and len(first) == 64
    os.chmod(tmp_path / "tier-secret", 0o644)
    with pytest.raises(InvalidParams, match="open to other users"):
        installation_secret()


# -- 4. --kv values that conflict or cannot fit ---------------------------------------------------------
@pytest.mark.parametrize("spec,needle", [
    ("static,max_tokens=99999999999999999999", "out of range"),
    ("static,max_tokens=1000000000", "would preallocate"),
])
def test_kv_values_that_conflict_or_cannot_fit_exit_2(tiny_path, spec, needle):
    """Through `kvcache generate`: a value out of range (the spec's parser) and a static cache the
    machine cannot hold (at load); the parser's other refusals below, where the command takes them."""
    assert_one_line_error(run_cli("generate", "t5 t6", "--model", tiny_path, "--kv", spec, "-n", "2"), needle)


@pytest.mark.parametrize("spec,needle", [
    ("int4,int8", "'int4' and 'int8' both set encoding"),
    ("static,dynamic", "'static' and 'dynamic' both set capacity"),
    ("window=64,window=128", "both set window"),
])
def test_kv_values_that_conflict_are_refused(spec, needle):
    from kvcache.cache.config import parse_kv_spec

    with pytest.raises(InvalidParams, match=needle) as e:
        parse_kv_spec(spec)
    assert "\n" not in str(e.value)


def test_a_preset_may_be_refined():
    from kvcache.cache.config import parse_kv_spec

    assert parse_kv_spec("sliding_window,window=512").window == 512
    assert parse_kv_spec("static,static").capacity == "static"


# -- 5. press rows of eval are measured where the press acts ---------------------------------------
def test_eval_press_rows_are_pressed():
    r = run_cli("eval", "--kv", "press=snapkv,ratio=0.5;int8", "--tokens", "256", "--passkey-tokens", "0",
                "--greedy-tokens", "0")
    assert r.returncode == 0, r.stderr
    assert "--continuation 128" in r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.startswith("dynamic,")}
    press = rows["dynamic,press=snapkv,ratio=0.5"]
    assert float(press[3]) > 0.01 and float(press[-1].rstrip("x")) < 0.7  # KL and bytes of a cache that pressed


# -- 6. slow and vanishing clients -------------------------------------------------------------------------
def test_slowloris_clients_are_timed_out_without_tracebacks(tiny_path):
    s = Server(tiny_path, "--kv", "dynamic,page_size=4", "--head-timeout", "1", "--body-timeout", "1")
    socks = []
    try:
        for i in range(40):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            if i % 2:  # half a head
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            else:  # a whole head, then a tenth of the body
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"model\": ")
            socks.append(c)
        for i in range(10):  # clients that leave half-way through their body
            c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mo")
            c.close()
        assert _text(s, temperature=0)[0] == 200  # served meanwhile
        time.sleep(3)
        for c in socks:  # the server has closed every one of them (a 408 first, for a stalled body)
            c.settimeout(5)
            data = b""
            while chunk := c.recv(4096):
                data += chunk
            assert data == b"" or data.startswith(b"HTTP/1.1 408")
    finally:
        for c in socks:
            c.close()
        s.close()
    log = s.proc.stdout.read() if s.proc.stdout else ""
    assert "Traceback" not in log and "ClientDisconnect" not in log, log[-3000:]
