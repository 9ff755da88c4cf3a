"""Entries and files that cannot be forged or misread: keyed MACs on tier entries, validation before
promotion, digests on prompt-cache and session files, private file modes, and disk placement's
private folder."""

from __future__ import annotations

import os
import stat
import uuid

import pytest
import torch

from kvcache import LLM, SamplingParams
from kvcache.cache.placement import Placement
from kvcache.prefix.config import PrefixConfig
from kvcache.prefix.entry import decode_entry, encode_entry, entry_meta, mac_key
from kvcache.prefix.keys import page_key, root_key
from kvcache.prefix.tiers import DiskTier, RedisTier, TierChain

from conftest import run_kvcache

KEY = page_key(root_key("model", "layout"), [1, 2, 3, 4])
PROMPT = [5 + (i * 7) % 140 for i in range(44)]  # 11 full pages of 4


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"layer0.kv": torch.randn(2, 2, 1, 4, 16, generator=g)}


def test_a_mac_entry_decodes_only_with_its_secret():
    s1, s2 = mac_key("first secret"), mac_key("second secret")
    blob = encode_entry(KEY, _tensors(), secret=s1)
    assert entry_meta(blob)["digest"].startswith("b2mac:")
    assert torch.equal(decode_entry(blob, KEY, s1)["layer0.kv"], _tensors()["layer0.kv"])
    assert decode_entry(blob, KEY, s2) is None  # another secret
    assert decode_entry(blob, KEY) is None  # no secret: a MAC cannot stand in for the CRC
    assert decode_entry(encode_entry(KEY, _tensors()), KEY, s1) is None  # a CRC entry where a MAC is due
    small = encode_entry(KEY, {"kv": torch.arange(6, dtype=torch.float32)}, secret=s1)
    for bit in range(len(small) * 8):  # every flipped bit
        b = bytearray(small)
        b[bit // 8] ^= 1 << (bit % 8)
        assert decode_entry(bytes(b), KEY, s1) is None, bit


def test_an_empty_tier_secret_is_refused():
    with pytest.raises(ValueError, match="secret is empty"):
        PrefixConfig(disk="/tmp/x", secret=" ")
    assert "hunter2" not in repr(PrefixConfig(secret="hunter2"))


def _fill(path: str, tmp_path, secret: str | None) -> LLM:
    llm = LLM(path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path), secret=secret))
    llm.generate([PROMPT], SamplingParams(max_tokens=2, ignore_eos=True))
    llm.flush()
    return llm


def _forge(tmp_path, secret: str | None) -> int:
    """Rewrite every entry with other K/V and a digest of the forger's own making (a CRC, or a MAC
    under a guessed secret): what anyone who can write to the folder can do."""
    forged = 0
    for f in tmp_path.rglob("*.kv"):
        key = bytes.fromhex(f.stem)
        blob = f.read_bytes()
        real = decode_entry(blob, key, mac_key("s3cret"))
        assert real is not None
        fake = {n: torch.randn_like(t) * 3 for n, t in real.items()}
        f.write_bytes(encode_entry(key, fake, secret=None if secret is None else mac_key(secret)))
        forged += 1
    return forged


@pytest.mark.parametrize("forger", [None, "guessed"])
def test_forged_entries_are_misses_and_removed(tiny_dir, tmp_path, forger):
    path = str(tiny_dir("llama")[0])
    _fill(path, tmp_path, "s3cret")
    assert _forge(tmp_path, forger) == 11  # the prompt and the generated tokens: 46 tokens
    victim = LLM(path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path), secret="s3cret"))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got = victim.generate([PROMPT[:-1] + [9]], params)[0]
    want = LLM(path, kv="dynamic,page_size=4", prefix=False).generate([PROMPT[:-1] + [9]], params)[0]
    assert got.cached_tokens == 0 and got.token_ids == want.token_ids
    assert victim.prefix_stats().rejected == 10  # every page the lookup asked for, each removed
    assert victim.runner.prefix.tiers.stats.rejected == 10
    victim.close()  # the rewrites are on disk once it returns (its writer thread drains first)
    again = LLM(path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path), secret="s3cret"))
    assert again.generate([PROMPT[:-1] + [9]], params)[0].cached_tokens == 40  # rewritten by the victim


def test_secret_entries_hit_with_the_secret_only(tiny_dir, tmp_path):
    path = str(tiny_dir("llama")[0])
    _fill(path, tmp_path, "s3cret")
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    ok = LLM(path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path), secret="s3cret"))
    assert ok.generate([PROMPT[:-1] + [9]], params)[0].cached_tokens == 40
    for secret in (None, "other"):
        d = tmp_path / f"copy-{secret}"
        d.mkdir()
        for f in tmp_path.glob("??/*.kv"):
            (d / f.parent.name).mkdir(exist_ok=True)
            (d / f.parent.name / f.name).write_bytes(f.read_bytes())
        llm = LLM(path, kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(d), secret=secret))
        assert llm.generate([PROMPT[:-1] + [9]], params)[0].cached_tokens == 0


def _decode(key: bytes, blob: bytes):
    return decode_entry(blob, key)


def test_a_corrupt_redis_entry_is_never_promoted_to_disk(tmp_path, redis_url):
    good = encode_entry(KEY, _tensors())
    bad = bytearray(good)
    bad[-5] ^= 0x10
    redis_tier = RedisTier(redis_url, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    disk = DiskTier(tmp_path)
    with TierChain([disk, redis_tier]) as chain:
        redis_tier.put(KEY, bytes(bad))
        assert chain.get_many([KEY], _decode) == [None]
        chain.flush()
        assert KEY not in disk and redis_tier.get(KEY) is None  # removed where it lay, never copied
        assert chain.stats.rejected == 1
        disk.put(KEY, bytes(bad))  # now the disk's copy rots and Redis holds a good one
        redis_tier.put(KEY, good)
        (got,) = chain.get_many([KEY], _decode)
        assert got is not None and torch.equal(got["layer0.kv"], _tensors()["layer0.kv"])
        chain.flush()
        assert disk.get(KEY) == good  # the good copy replaced the rotten one
        redis_tier.clear()


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_files_are_private_whatever_the_umask(tiny_dir, tmp_path):
    old = os.umask(0o022)
    try:
        llm = _fill(str(tiny_dir("llama")[0]), tmp_path / "tier", None)
        entries = list((tmp_path / "tier").rglob("*.kv"))
        assert entries and all(_mode(f) == 0o600 for f in entries)
        assert _mode(tmp_path / "tier") == 0o700 and all(_mode(f.parent) == 0o700 for f in entries)
        llm.save_cache(str(tmp_path / "p.kv"), PROMPT)
        assert _mode(tmp_path / "p.kv") == 0o600
        session = llm.chat_session(system="t5 t6")
        session.send("t7 t8", SamplingParams(max_tokens=2))
        session.save(str(tmp_path / "s.kv"))
        assert _mode(tmp_path / "s.kv") == 0o600
    finally:
        os.umask(old)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to make a folder another user owns")
def test_a_tier_folder_of_another_user_is_refused(tmp_path):
    from kvcache.errors import KVCacheError

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(KVCacheError, match="belongs to another user"):
        DiskTier(theirs)


def test_disk_placement_gets_a_private_folder_of_its_own(tmp_path):
    planted = tmp_path / "kvcache-pages"  # what a folder at the old fixed name could be
    planted.mkdir(mode=0o777)
    p = Placement("disk", torch.device("cpu"))
    assert p.dir is not None and p.dir.name.startswith("kvcache-pages-") and _mode(p.dir) == 0o700
    t = p.zeros((4, 1024), torch.float32)
    t += 2
    assert float(t.sum()) == 8192 and list(p.dir.iterdir()) == []  # mapped, then unlinked


def _rot(path, offset_from_end: int = 20) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x04  # one bit of the K/V data
    path.write_bytes(bytes(data))


def test_prompt_cache_bit_rot_exits_2(tiny_dir, tmp_path):
    model = str(tiny_dir("llama")[0])
    f = tmp_path / "pre.txt"
    f.write_text(" ".join(f"t{i}" for i in range(10, 40)))
    out = tmp_path / "pre.kv"
    p = run_kvcache("cache-prompt", "--prompt-file", str(f), "--out", str(out), "--model", model)
    assert p.returncode == 0, p.stderr
    ok = run_kvcache("generate", "--prompt-cache", str(out), " t7", "--model", model, "-n", "3")
    assert ok.returncode == 0 and "reused" in ok.stderr, ok.stderr
    _rot(out)
    p = run_kvcache("generate", "--prompt-cache", str(out), " t7", "--model", model, "-n", "3")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "corrupt" in p.stderr and "digest" in p.stderr and "Traceback" not in p.stderr


def test_session_file_bit_rot_is_refused(tiny_dir, tmp_path):
    from kvcache.errors import KVCacheError

    llm = LLM(str(tiny_dir("llama")[0]), kv="dynamic,page_size=4")
    session = llm.chat_session(system="t5 t6 t7")
    session.send("t8 t9", SamplingParams(max_tokens=3))
    path = tmp_path / "talk.kv"
    session.save(str(path))
    assert llm.chat_session(resume=str(path)).messages == session.messages
    original = path.read_bytes()
    _rot(path)
    with pytest.raises(KVCacheError, match="does not match its digest"):
        llm.chat_session(resume=str(path))
    i = original.find(b"t8 t9")  # the saved messages, edited: the digest covers them too
    path.write_bytes(original[:i] + b"t8 t0" + original[i + 5 :])
    with pytest.raises(KVCacheError, match="does not match its digest"):
        llm.chat_session(resume=str(path))
    assert llm.kv_stats().pages_in_use == 0


def test_the_secret_comes_from_a_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    from kvcache.errors import InvalidParams
    from kvcache.prefix.config import tier_secret

    monkeypatch.delenv("KVCACHE_TIER_SECRET", raising=False)
    assert tier_secret() is None
    f = tmp_path / "secret"
    f.write_text("from-a-file\nignored\n")
    assert tier_secret(None, str(f)) == "from-a-file"
    monkeypatch.setenv("KVCACHE_TIER_SECRET", "from-the-env")
    assert tier_secret() == "from-the-env" and tier_secret("inline") == "inline"
    for bad in ({"inline": ""}, {"file": str(tmp_path / "missing")}):
        with pytest.raises(InvalidParams, match="tier secret"):
            tier_secret(**bad)
    monkeypatch.setenv("KVCACHE_TIER_SECRET", "")
    with pytest.raises(InvalidParams, match="KVCACHE_TIER_SECRET is empty"):
        tier_secret()
