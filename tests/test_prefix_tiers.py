"""Prefix-cache tiers on their own: chained keys, the page entry codec, the disk and Redis stores
and the chain over them (RAM-free, model-free; the Redis tests use a real redis-server)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import uuid
import warnings

import forkserve
import pytest
import torch

from kvcache.errors import KVCacheError
from kvcache.prefix.entry import FORMAT, decode_entry, encode_entry, entry_meta
from kvcache.prefix.keys import page_key, root_key
from kvcache.peers.process import free_port
from kvcache.prefix.tiers import DiskTier, RedisTier, TierChain, TierStats, TierUnavailable

KEY = page_key(root_key("model", "layout"), [1, 2, 3, 4])


def key(i: int) -> bytes:
    return page_key(root_key("m", "l"), [i])


# -- keys -------------------------------------------------------------------------------------------
def test_keys_name_every_input_and_only_those():
    root = root_key("weights-a", "fp32/16/2x64")
    assert root == root_key("weights-a", "fp32/16/2x64") and len(root) == 20
    roots = {root, root_key("weights-b", "fp32/16/2x64"), root_key("weights-a", "fp16/16/2x64"),
             root_key("weights-a", "fp32/16/2x64", salt="tenant"), root_key("weights-a", "fp32/16/2x64", salt="x"),
             root_key("weights-a" + "fp32", "/16/2x64"), root_key("", "")}
    assert len(roots) == 7
    p = page_key(root, [1, 2, 3])
    assert p == page_key(root, (1, 2, 3)) and bytes.fromhex(p.hex()) == p
    pages = {p, page_key(root, [1, 2, 4]), page_key(root, [3, 2, 1]), page_key(root, [1, 2]),
             page_key(root_key("weights-a", "fp32/16/2x64", "tenant"), [1, 2, 3]), page_key(p, [1, 2, 3])}
    assert len(pages) == 6
    a_then_b = page_key(page_key(root, [1, 2]), [3, 4])
    assert a_then_b != page_key(page_key(root, [3, 4]), [1, 2]) and a_then_b != page_key(root, [1, 2, 3, 4])
    assert page_key(root, [2**31 - 1, 0]) != page_key(root, [0, 2**31 - 1])


# -- entries ----------------------------------------------------------------------------------------
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int32, torch.int64,
          torch.bool, torch.float64] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in DTYPES:
        x = torch.randn(2, 3, 4, generator=g) * 50
        out[f"layer0.{str(dt).split('.')[1]}"] = x.to(dt) if dt.is_floating_point else (x % 100).to(dt)
    out["scalar"] = torch.tensor(3.5, dtype=torch.bfloat16)
    out["empty"] = torch.zeros(0, 4, dtype=torch.float16)
    out["view"] = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, 1:3]  # not contiguous
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_entry_round_trip_keeps_dtypes_shapes_and_bytes():
    tensors = _tensors()
    blob = encode_entry(KEY, tensors, {"tokens": "4", "layout": "x"})
    out = decode_entry(blob, KEY)
    assert out is not None and set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        assert torch.equal(_raw(out[name]), _raw(t)), name
    meta = entry_meta(blob)
    assert meta["format"] == FORMAT and meta["key"] == KEY.hex() and meta["tokens"] == "4" and "digest" in meta
    # the caller's fields cannot overwrite the reserved ones
    assert entry_meta(encode_entry(KEY, tensors, {"key": "00", "format": "x"}))["key"] == KEY.hex()
    assert decode_entry(encode_entry(KEY, {}), KEY) == {}


def test_damaged_foreign_or_misplaced_entries_decode_to_none():
    from safetensors.torch import save

    tensors = {"k": torch.randn(2, 4), "codes": torch.arange(8, dtype=torch.uint8)}
    blob = encode_entry(KEY, tensors, {"tokens": "4"})
    assert decode_entry(blob, KEY) is not None
    assert all(decode_entry(blob[:n], KEY) is None for n in range(len(blob)))  # every truncation
    flipped = []
    for bit in range(len(blob) * 8):  # every single flipped bit: header, metadata or data
        b = bytearray(blob)
        b[bit // 8] ^= 1 << (bit % 8)
        if decode_entry(bytes(b), KEY) is not None:
            flipped.append(bit)
    assert flipped == []
    assert decode_entry(blob + b"\0", KEY) is None
    assert decode_entry(blob, page_key(KEY, [5])) is None  # stored under another key
    assert decode_entry(save(tensors, metadata={"format": "other/1", "key": KEY.hex()}), KEY) is None
    assert decode_entry(save(tensors), KEY) is None  # plain safetensors: no format at all
    for junk in (b"", b"\xff" * 8, os.urandom(300), b"\x10" + b"\0" * 7 + b"{not json}!!!!!!"):
        assert decode_entry(junk, KEY) is None


# -- disk -------------------------------------------------------------------------------------------
def test_disk_tier_stores_files_by_key_with_fan_out(tmp_path):
    d = DiskTier(tmp_path / "tier")
    assert d.get(key(1)) is None and key(1) not in d and d.nbytes == 0
    d.put(key(1), b"a" * 100)
    d.put(key(2), b"b" * 50)
    h = key(1).hex()
    assert (tmp_path / "tier" / h[:2] / f"{h}.kv").read_bytes() == b"a" * 100
    assert d.get(key(1)) == b"a" * 100 and key(1) in d and d.nbytes == 150 and len(d) == 2
    d.put(key(1), b"c" * 10)  # replaced
    assert d.get(key(1)) == b"c" * 10 and d.nbytes == 60
    assert not [f for f in (tmp_path / "tier").rglob("*") if f.is_file() and not f.name.endswith(".kv")]
    again = DiskTier(tmp_path / "tier")  # another process, or a later run
    assert again.get(key(2)) == b"b" * 50 and again.nbytes == 60
    d.discard(key(2))
    assert key(2) not in again and d.nbytes == 10
    again.put(key(3), b"x")
    d.clear()  # everything in the folder, whoever wrote it
    assert d.nbytes == 0 and not list((tmp_path / "tier").rglob("*.kv"))


def test_disk_tier_evicts_least_recently_used(tmp_path):
    d = DiskTier(tmp_path, max_bytes=300)
    for i in range(3):
        d.put(key(i), bytes([i]) * 100)
    assert d.get(key(0)) is not None  # 0 used after 1 and 2 were written
    d.put(key(3), b"3" * 100)
    assert key(1) not in d and all(key(i) in d for i in (0, 2, 3)) and d.nbytes == 300
    d.put(key(4), b"4" * 250)
    assert [i for i in range(5) if key(i) in d] == [4] and d.nbytes == 250
    d.put(key(5), b"5" * 301)  # larger than the whole bound: not stored, nothing evicted for it
    assert key(5) not in d and key(4) in d
    # a later run orders what it finds by the recorded use times
    for i, t in ((6, 1000), (7, 3000), (8, 2000)):
        d.put(key(i), b"." * 10)
        os.utime(d._file(key(i)), (t, t))
    d.discard(key(4))
    later = DiskTier(tmp_path, max_bytes=30)
    later.put(key(9), b"9" * 10)
    assert key(6) not in later and all(key(i) in later for i in (7, 8, 9))
    with pytest.raises(KVCacheError, match="positive"):
        DiskTier(tmp_path, max_bytes=0)


def test_disk_tier_refuses_a_folder_it_cannot_write(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    for bad in (blocker / "sub", blocker):
        with pytest.raises(KVCacheError) as e:
            DiskTier(bad)
        msg = str(e.value)
        assert str(bad) in msg and "is not writable" in msg and "\n" not in msg
    assert "not a folder" in msg


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="permissions do not stop root")
def test_disk_tier_refuses_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(KVCacheError, match="is not writable: Permission denied"):
            DiskTier(ro)
    finally:
        ro.chmod(0o700)


def test_unreadable_disk_entries_are_misses_and_removed(tmp_path):
    d = DiskTier(tmp_path)
    f = d._file(key(1))
    f.parent.mkdir(parents=True)
    f.mkdir()  # a folder where the entry file should be: cannot be read
    assert d.get(key(1)) is None and not f.exists() and d.errors == 1
    # readable but damaged bytes: the entry digest refuses them and the chain removes the file
    blob = encode_entry(key(2), {"kv": torch.randn(4, 4)})
    chain = TierChain([d])
    chain.put(key(2), blob)
    raw = bytearray(d._file(key(2)).read_bytes())
    raw[-3] ^= 0x40
    d._file(key(2)).write_bytes(bytes(raw))
    got = chain.get(key(2))
    assert got is not None and decode_entry(got, key(2)) is None
    chain.discard(key(2))
    assert key(2) not in d and chain.get(key(2)) is None
    chain.close()


# -- Redis ------------------------------------------------------------------------------------------
def _prefix() -> str:
    return f"test-{uuid.uuid4().hex[:8]}:"


def test_redis_tier_put_get_clear(redis_url):
    r = RedisTier(redis_url, prefix=_prefix())
    other = RedisTier(redis_url, prefix=_prefix())
    assert r.get(key(1)) is None and key(1) not in r
    r.put(key(1), b"\0binary\xff" * 1000)
    r.put(key(2), b"two")
    other.put(key(1), b"other")
    r.client.set("unrelated", b"keep")
    assert r.get(key(1)) == b"\0binary\xff" * 1000 and key(1) in r and other.get(key(1)) == b"other"
    assert r.client.get(r.prefix + key(2).hex()) == b"two"  # readable names: prefix + key hex
    r.discard(key(2))
    assert r.get(key(2)) is None
    r.clear()
    assert r.get(key(1)) is None and other.get(key(1)) == b"other" and r.client.get("unrelated") == b"keep"
    glob = RedisTier(redis_url, prefix="a*[b]?")  # glob characters in the prefix are literal in clear
    glob.put(key(3), b"3")
    glob.clear()
    assert glob.get(key(3)) is None and other.get(key(1)) == b"other"
    other.clear()
    r.client.delete("unrelated")
    with_ttl = RedisTier(redis_url, prefix=_prefix(), ttl=60)
    with_ttl.put(key(4), b"4")
    assert 0 < with_ttl.client.ttl(with_ttl.prefix + key(4).hex()) <= 60
    with_ttl.clear()


def test_two_clients_and_two_processes_share_entries(redis_url):
    prefix = _prefix()
    first, second = RedisTier(redis_url, prefix=prefix), RedisTier(redis_url, prefix=prefix)
    first.put(key(1), b"from the first")
    assert second.get(key(1)) == b"from the first"
    code = (
        "import sys\n"
        "from kvcache.prefix.tiers import RedisTier\n"
        "url, prefix, k1, k2 = sys.argv[1:]\n"
        "t = RedisTier(url, prefix=prefix)\n"
        "print(t.get(bytes.fromhex(k1)).decode())\n"
        "t.put(bytes.fromhex(k2), b'from the other process')\n"
    )
    out = subprocess.run(forkserve.python_command("-c", code, redis_url, prefix, key(1).hex(), key(2).hex()),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "from the first"
    assert first.get(key(2)) == b"from the other process"
    first.clear()


def _silent_port() -> tuple[socket.socket, int]:
    """A port that accepts connections and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s, s.getsockname()[1]


def test_a_redis_that_is_down_is_a_quick_miss_with_one_warning():
    r = RedisTier(f"redis://:secret@127.0.0.1:{free_port()}/0", retry_after=0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        for i in range(10):
            assert r.get(key(i)) is None and key(i) not in r
            r.put(key(i), b"dropped")
            r.clear()
        time.sleep(0.25)  # down time over: it tries again, fails again, says nothing more
        assert r.get(key(0)) is None
        assert time.perf_counter() - t0 < 2
    warned = [w for w in caught if issubclass(w.category, TierUnavailable)]
    assert len(warned) == 1 and "did not answer" in str(warned[0].message)
    assert "secret" not in str(warned[0].message) and "secret" not in repr(r)
    assert r.errors == 2 and r.down

    s, port = _silent_port()
    try:
        slow = RedisTier(f"redis://127.0.0.1:{port}/0", timeout=0.2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            for i in range(5):
                assert slow.get(key(i)) is None
                slow.put(key(i), b"x")
            assert time.perf_counter() - t0 < 1.5  # one timeout, then down: no more waiting
        assert len([w for w in caught if issubclass(w.category, TierUnavailable)]) == 1
    finally:
        s.close()


def test_redis_tier_warns_again_only_after_it_recovered(redis_url, monkeypatch):
    import redis

    r = RedisTier(redis_url, prefix=_prefix(), retry_after=0.05)
    real_get = r.client.get

    def broken(*a, **k):
        raise redis.ConnectionError("gone")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r.put(key(1), b"1")
        monkeypatch.setattr(r.client, "get", broken)
        assert r.get(key(1)) is None
        time.sleep(0.06)
        assert r.get(key(1)) is None  # still failing: no second warning
        monkeypatch.setattr(r.client, "get", real_get)
        time.sleep(0.06)
        assert r.get(key(1)) == b"1"  # back
        monkeypatch.setattr(r.client, "get", broken)
        assert r.get(key(1)) is None  # a new outage: a new warning
    assert len([w for w in caught if issubclass(w.category, TierUnavailable)]) == 2
    r.clear()


def test_bad_redis_urls_are_clear_errors():
    for url, what in (("http://localhost:6379", "must start with redis://"), ("localhost:6379", "must start"),
                      ("redis://localhost:notaport/0", "bad Redis URL"), ("unix://", "no socket path")):
        with pytest.raises(KVCacheError, match=what) as e:
            RedisTier(url)
        assert "\n" not in str(e.value)
    with pytest.raises(KVCacheError, match="bad Redis URL") as e:
        RedisTier("redis://:secret@localhost:notaport/0")
    assert "secret" not in str(e.value)
    with pytest.raises(KVCacheError, match="ttl"):
        RedisTier("redis://localhost", ttl=0)


# -- the chain --------------------------------------------------------------------------------------
class MemTier:
    """A dict as a tier; ``fail`` makes every call raise, ``gate`` holds puts until it is set."""

    def __init__(self, name: str = "mem", fail: bool = False, gate: threading.Event | None = None) -> None:
        self.name, self.fail, self.gate, self.data = name, fail, gate, {}

    def get(self, k):
        if self.fail:
            raise OSError("broken")
        return self.data.get(k)

    def put(self, k, blob):
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise OSError("disk full")
        self.data[k] = blob

    def discard(self, k):
        self.data.pop(k, None)

    def __contains__(self, k):
        return k in self.data


def test_chain_asks_tiers_in_order_and_promotes_hits(tmp_path):
    disk, far = DiskTier(tmp_path), MemTier("far")
    chain = TierChain([disk, far])
    chain.put(key(1), b"both")
    assert chain.get(key(1)) == b"both" and key(1) in disk and key(1) in far
    far.data[key(2)] = b"far only"
    assert chain.get(key(2)) == b"far only"
    chain.flush()
    assert disk.get(key(2)) == b"far only"  # promoted: the next lookup stops at the disk
    assert chain.get(key(2)) == b"far only" and chain.get(key(3)) is None and key(3) not in chain
    s = chain.stats
    assert isinstance(s, TierStats)
    assert s.hits == {"disk": 2, "far": 1} and s.misses == 1 and s.writes == 1 and s.errors == 0
    assert chain.stats_dict()["hits"] == {"disk": 2, "far": 1}
    assert TierChain([MemTier(), MemTier()]).names == ["mem", "mem1"]
    chain.close()


def test_chain_promotes_a_redis_hit_to_disk(tmp_path, redis_url):
    redis_tier = RedisTier(redis_url, prefix=_prefix())
    redis_tier.put(key(1), b"written by another machine")
    with TierChain([DiskTier(tmp_path), redis_tier]) as chain:
        assert chain.get(key(1)) == b"written by another machine"
        chain.flush()
        assert chain.tiers[0].get(key(1)) == b"written by another machine"
        assert chain.stats.hits == {"disk": 0, "redis": 1}
        redis_tier.clear()


def test_put_async_does_not_wait_and_flush_does(tmp_path):
    gate = threading.Event()
    slow, disk = MemTier("slow", gate=gate), DiskTier(tmp_path)
    chain = TierChain([disk, slow], queue_size=4)
    t0 = time.perf_counter()
    chain.put_async(key(0), b"0")
    time.sleep(0.05)  # the writer takes it and waits at the gate
    for i in range(1, 8):
        chain.put_async(key(i), lambda i=i: str(i).encode())  # encoded on the writer thread
    assert time.perf_counter() - t0 < 1
    assert chain.stats.dropped == 3  # four queued, the rest dropped rather than waited for
    gate.set()
    chain.flush()
    assert [disk.get(key(i)) for i in range(5)] == [b"0", b"1", b"2", b"3", b"4"] and key(5) not in slow
    assert chain.stats.writes == 5
    chain.close()
    chain.close()  # idempotent
    chain.put_async(key(9), b"9")  # after close: written at once
    assert disk.get(key(9)) == b"9"


def test_chain_counts_errors_warns_once_and_keeps_going(tmp_path):
    disk, broken = DiskTier(tmp_path), MemTier("broken", fail=True)
    chain = TierChain([broken, disk])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            chain.put_async(key(i), bytes([i]))
        chain.put_async(key(9), lambda: 1 / 0)  # an encoder that fails
        chain.flush()
        assert [chain.get(key(i)) for i in range(3)] == [b"\0", b"\1", b"\2"]  # the disk still answers
        chain.flush()  # the hits' promotions to the broken tier fail too
    s = chain.stats
    assert s.errors == 3 + 1 + 3 + 3 and s.writes == 3 and s.hits == {"broken": 0, "disk": 3}
    messages = [str(w.message) for w in caught if issubclass(w.category, TierUnavailable)]
    assert len(messages) == 3  # one per kind of failure: write, encode, read
    chain.close()
    assert json.dumps(chain.stats_dict())
