"""Save/load files and disk placement: bad input is a clear error and nothing is left half-written."""

from __future__ import annotations

import os
import subprocess

import forkserve
import pytest
import torch

from kvcache import LLM, SamplingParams
from kvcache.cache.config import parse_kv_spec
from kvcache.engine.runner import ModelRunner
from kvcache.errors import KVCacheError

PROMPT = [5, 17, 42, 8, 99, 23, 4, 61, 77, 12, 30, 3, 9, 14]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    path, _ = tiny_dir("llama")
    return LLM(str(path), kv="dynamic,page_size=4")


@pytest.fixture()
def saved(tiny, tmp_path):
    path = tmp_path / "p.kv"
    tiny.save_cache(str(path), PROMPT)
    return path


def test_resume_from_file_equals_one_pass(tiny, saved):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    direct = tiny.generate([PROMPT + [7, 21]], params)[0]
    resumed = tiny.generate([[7, 21]], params, prompt_cache=str(saved))[0]
    assert resumed.token_ids == direct.token_ids
    assert resumed.cached_tokens == len(PROMPT)
    tiny.check_integrity()
    assert tiny.kv_stats().pages_in_use == 0


def test_truncated_and_garbage_files_are_refused(tiny, saved, tmp_path):
    data = saved.read_bytes()
    cut = tmp_path / "cut.kv"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(KVCacheError, match="corrupt or truncated"):
        tiny.runner.load(str(cut), tiny.fingerprint)
    junk = tmp_path / "junk.kv"
    junk.write_bytes(os.urandom(200))
    with pytest.raises(KVCacheError, match="corrupt or truncated"):
        tiny.runner.load(str(junk), tiny.fingerprint)
    with pytest.raises(KVCacheError, match="does not exist"):
        tiny.runner.load(str(tmp_path / "missing.kv"), tiny.fingerprint)
    tiny.check_integrity()
    assert tiny.kv_stats().pages_in_use == 0  # nothing leaked by the failed loads


def test_other_model_or_encoding_is_refused(tiny, saved):
    with pytest.raises(KVCacheError, match="another model"):
        tiny.runner.load(str(saved), "0" * 64)
    other = ModelRunner(tiny.model, parse_kv_spec("int8,page_size=8,group_size=8"))
    with pytest.raises(KVCacheError, match="encoding='fp32' \\(here 'int8'\\)"):
        other.load(str(saved), tiny.fingerprint)
    paged = ModelRunner(tiny.model, parse_kv_spec("dynamic,page_size=8"))
    with pytest.raises(KVCacheError, match="page_size=4 \\(here 8\\)"):
        paged.load(str(saved), tiny.fingerprint)


def test_a_missing_folder_is_refused_before_anything_is_written(tiny, tmp_path):
    target = tmp_path / "no-such-dir" / "x.kv"
    with pytest.raises(KVCacheError, match="cannot write cache file"):
        tiny.save_cache(str(target), PROMPT)
    assert not target.parent.exists()
    assert tiny.kv_stats().pages_in_use == 0


FAILED_WRITE = r"""
import os, resource, signal, sys
from kvcache import LLM
from kvcache.errors import KVCacheError
llm = LLM(sys.argv[1], kv="dynamic,page_size=4")
target = sys.argv[2]
llm.save_cache(target, list(range(5, 13)))  # a good file of 8 tokens (about 7 KiB)
before = open(target, "rb").read()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))  # the disk "fills up" at 16 KiB per file
try:
    llm.save_cache(target, list(range(5, 125)))  # 120 tokens: about 92 KiB
    print("SAVED")
except KVCacheError as e:
    print("ERR", e)
print("SAME", open(target, "rb").read() == before)
print("PAGES", llm.kv_stats().pages_in_use)
print("FILES", sorted(os.listdir(os.path.dirname(target))))
"""


def test_a_write_that_fails_half_way_leaves_the_old_file_and_nothing_else(tiny_dir, tmp_path):
    """The disk fills up in the middle of writing a cache file: a one-line error, the file that
    was there before is untouched, no temporary file is left and no page stays allocated."""
    target = tmp_path / "x.kv"
    out = subprocess.run(forkserve.python_command("-c", FAILED_WRITE, str(tiny_dir("llama")[0]), str(target)),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "ERR cannot write cache file" in out.stdout and "SAVED" not in out.stdout, out.stdout
    assert "SAME True" in out.stdout and "PAGES 0" in out.stdout
    assert "FILES ['x.kv']" in out.stdout


def test_none_strategy_has_nothing_to_save(tiny, tmp_path):
    runner = ModelRunner(tiny.model, parse_kv_spec("none"))
    seq = runner.new_sequence()
    runner.step([seq], [PROMPT])
    with pytest.raises(KVCacheError, match="keeps no cache to save"):
        runner.save(seq, str(tmp_path / "x.kv"), "fp")


def test_disk_dir_not_writable(tiny, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    with pytest.raises(KVCacheError, match="disk placement: cannot write to"):
        ModelRunner(tiny.model, parse_kv_spec(f"disk,dir={blocker}/sub"))


def test_disk_pages_leave_no_files(tiny, tmp_path):
    runner = ModelRunner(tiny.model, parse_kv_spec(f"disk,dir={tmp_path},page_size=4,initial_tokens=4"))
    seq = runner.new_sequence()
    runner.step([seq], [PROMPT * 3])  # grows the mapped pool several times
    assert list(tmp_path.iterdir()) == []  # mapped files are unlinked once mapped


FULL_DISK = r"""
import resource, signal, sys
from kvcache.cache.config import parse_kv_spec
from kvcache.cache.paged import PagedKVCache
from kvcache.models.config import ModelConfig
from kvcache.errors import KVCacheError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # the disk "fills up" at 1 MiB per file
cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=4, head_dim=64, max_position=1 << 20, layer_windows=(None, None))
cache = PagedKVCache(cfg, parse_kv_spec(f"disk,dir={sys.argv[1]},initial_tokens=64"))
seq = cache.new_sequence()
try:
    cache.reserve(seq, 100000)
except KVCacheError as e:
    print("ERR", e)
cache.check_integrity()
print("PAGES", cache.pages.used(0))
"""


def test_disk_full_is_a_clear_error(tmp_path):
    out = subprocess.run(forkserve.python_command("-c", FULL_DISK, str(tmp_path)), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR disk placement: cannot reserve" in out.stdout
    assert "PAGES 0" in out.stdout  # the failed reservation took nothing
    assert list(tmp_path.iterdir()) == []


def test_static_capacity_ends_with_length(tiny):
    llm = LLM.__new__(LLM)
    llm.__dict__.update(tiny.__dict__)
    llm.runner = ModelRunner(tiny.model, parse_kv_spec("static,max_tokens=20,page_size=4"))
    r = llm.generate([PROMPT], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    # documented: a full static cache ends the request with finish_reason "length" (prompt and
    # completion together fill it)
    assert r.finish_reason == "length" and len(PROMPT) + len(r.token_ids) == 20
    llm.runner.check_integrity()


def test_tiny_rotary_model_runs_past_its_context_with_sinks(tiny_dir):
    path, _ = tiny_dir("llama")  # max_position_embeddings = 256
    llm = LLM(str(path), kv="sinks=4,window=32,page_size=8")
    r = llm.generate([PROMPT], SamplingParams(max_tokens=300, ignore_eos=True))[0]
    assert len(r.token_ids) == 300 and r.finish_reason == "length"
    assert r.kv_stats.pages_used <= 1 + 32 // 8 + 1  # memory stays bounded by the window
    full = LLM(str(path), kv="dynamic")
    r = full.generate([PROMPT], SamplingParams(max_tokens=300, ignore_eos=True))[0]
    assert len(PROMPT) + len(r.token_ids) == 256  # a full cache stops at the context
    gpt2_path, _ = tiny_dir("gpt2")  # learned absolute positions: the window does not lift the limit
    g = LLM(str(gpt2_path), kv="sinks=4,window=32")
    r = g.generate([PROMPT], SamplingParams(max_tokens=300, ignore_eos=True))[0]
    assert len(PROMPT) + len(r.token_ids) == 256
    assert torch.get_num_threads() >= 1


def test_layer_ahead_prefetch_is_exact(tiny, tmp_path, monkeypatch):
    """The path a GPU takes for host/disk pages (fetch layer i+1 on a worker while layer i
    computes), forced on here: same logits as the plain cache."""
    from kvcache.cache.placement import Placement

    plain = ModelRunner(tiny.model, parse_kv_spec("dynamic,page_size=4"))
    monkeypatch.setattr(Placement, "offloaded", property(lambda self: self.kind != "device"))
    for spec in (f"disk,dir={tmp_path},page_size=4", "host,int8,page_size=8,group_size=8,residual=0"):
        ref = plain if "int8" not in spec else ModelRunner(tiny.model, parse_kv_spec("int8,page_size=8,group_size=8,residual=0"))
        off = ModelRunner(tiny.model, parse_kv_spec(spec))
        assert off.cache.placement.offloaded
        a, b = ref.new_sequence(), off.new_sequence()
        for feed in (PROMPT, [7], [21], [33]):
            torch.testing.assert_close(off.step([b], [feed]), ref.step([a], [feed]), atol=1e-5, rtol=1e-5)
        ref.free(a)
        off.free(b)
        off.check_integrity()
