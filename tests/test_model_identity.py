"""Model identity: two models that differ only in their weights never share a prefix-tier entry or
a prompt-cache file (the fingerprint covers the weight data, not only shapes and config)."""

from __future__ import annotations

import os

import pytest

from kvcache import LLM, SamplingParams
from kvcache.errors import KVCacheError
from kvcache.models.fingerprint import fingerprint
from kvcache.prefix.config import PrefixConfig

from conftest import make_tiny_hf, write_tiny_tokenizer

PROMPT = [5 + (i * 7) % 140 for i in range(40)]


@pytest.fixture(scope="module")
def twins(tiny_dir, tmp_path_factory):
    """The shared tiny Llama and one built from the same config with other random weights."""
    first = tiny_dir("llama")[0]
    second = tmp_path_factory.mktemp("tiny-llama-other-weights")
    make_tiny_hf("llama", seed=1).save_pretrained(second, safe_serialization=True)
    write_tiny_tokenizer(second)
    assert (first / "config.json").read_bytes() == (second / "config.json").read_bytes()
    return first, second


def test_fingerprints_differ_when_only_the_weights_do(twins):
    a, b = twins
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) == fingerprint(a)


def test_a_file_rewritten_in_place_gets_a_new_fingerprint(twins, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(twins[0], copy)
    before = fingerprint(copy)
    f = copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01  # one bit of one weight, same size
    st = f.stat()
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert fingerprint(copy) != before


def test_twins_never_share_a_tier_entry(twins, tmp_path):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = LLM(str(twins[0]), kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path)))
    first.generate([PROMPT], params)
    first.flush()
    written = len(list(tmp_path.rglob("*.kv")))
    assert written >= 9
    second = LLM(str(twins[1]), kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path)))
    alone = LLM(str(twins[1]), kv="dynamic,page_size=4", prefix=False)
    got = second.generate([PROMPT], params)[0]
    assert got.cached_tokens == 0 and second.prefix_stats().tier_tokens == 0
    assert got.token_ids == alone.generate([PROMPT], params)[0].token_ids
    second.flush()
    assert len(list(tmp_path.rglob("*.kv"))) == 2 * written  # its own entries, beside the other's
    third = LLM(str(twins[0]), kv="dynamic,page_size=4", prefix=PrefixConfig(disk=str(tmp_path)))
    assert third.generate([PROMPT], params)[0].cached_tokens == 36  # the same weights do hit


def test_twins_never_share_a_prompt_cache_file(twins, tmp_path):
    path = str(tmp_path / "p.kv")
    LLM(str(twins[0]), kv="dynamic,page_size=4").save_cache(path, PROMPT)
    other = LLM(str(twins[1]), kv="dynamic,page_size=4")
    with pytest.raises(KVCacheError, match="another model"):
        other.generate([[7, 9]], SamplingParams(max_tokens=2), prompt_cache=path)
    assert other.kv_stats().pages_in_use == 0
