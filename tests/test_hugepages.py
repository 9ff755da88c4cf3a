"""Huge pages for what every decode step streams: the mapped weights file and the CPU KV pools ask
for them (madvise), and where this kernel maps a file's pages whole, a later load gets the weights
mapped whole even when the page cache held the file in small pages (dropped and read again)."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import fresh_home
from kvcache import hugepages
from kvcache.cache.placement import Placement
from kvcache.cache.pool import PagePool
from kvcache.models.repacked import VERSION

pytestmark = pytest.mark.skipif(not hugepages.enabled(), reason="transparent huge pages are off on this kernel")

SCRIPT = """
from kvcache import LLM, hugepages
llm = LLM(prefix=False)
at = llm.model.plan[0][0].qs.data_ptr()
for line in open("/proc/self/smaps").read().split("\\n"):
    head = line.split(None, 1)[0] if line.strip() else ""
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo <= at < hi and line.endswith(".kvq")
        if inside:
            start, size = lo, hi - lo
    elif head == "VmFlags:" and inside:
        print(size, int("hg" in line.split()), hugepages.huge_bytes(start, size))
"""


def _vm_flags(addr: int) -> list[str]:
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(None, 1)[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


def _files_map_whole(tmp_path: Path) -> bool:
    """This kernel and file system map an advised file's pages 2 MiB at a time (read after a drop)."""
    f = tmp_path / "probe.bin"
    f.write_bytes(os.urandom(8 << 20))
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        m = mmap.mmap(fd, 8 << 20, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    m.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(m, dtype=np.uint8)
    int(a[::4096].sum())
    got = hugepages.huge_bytes(a.ctypes.data, a.nbytes)
    del a
    m.close()
    return got >= 4 << 20


def _load(home: Path) -> tuple[int, bool, int]:
    env = {**os.environ, "KVCACHE_HOME": str(home)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    size, asked, huge = r.stdout.split()
    return int(size), asked == "1", int(huge)


def test_the_weights_file_is_mapped_with_huge_pages_even_after_a_small_page_read(tmp_path):
    from kvcache.models.loading import resolve_model
    from kvcache.paths import cache_home

    folder = resolve_model(None).path  # the bundled model, converted once for the whole suite
    home = fresh_home(tmp_path / "home")
    shutil.copytree(folder, home / Path(folder).relative_to(cache_home()))
    kvq = home / Path(folder).relative_to(cache_home()) / f"repacked-v{VERSION}.kvq"
    if not kvq.is_file():  # not repacked yet: a first load writes it
        env = {**os.environ, "KVCACHE_HOME": str(home)}
        first = subprocess.run([sys.executable, "-c", "from kvcache import LLM; LLM(prefix=False)"], env=env,
                               capture_output=True, text=True, timeout=300)
        assert first.returncode == 0 and kvq.is_file(), first.stderr[-2000:]
    fd = os.open(kvq, os.O_RDONLY)  # the page cache now holds it in 4 KiB pages: dropped, then read plainly
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    a = np.frombuffer(m, dtype=np.uint8)
    int(a[::4096].sum())
    del a
    m.close()
    size, asked, huge = _load(home)
    assert asked, "the weights' mapping did not ask for huge pages"
    whole = size // hugepages.HUGE * hugepages.HUGE
    if _files_map_whole(tmp_path):
        assert huge >= whole * 9 // 10, f"{huge >> 20} of {whole >> 20} MiB of the weights in huge pages"
    size2, _, huge2 = _load(home)  # the next load finds the file cached whole: nothing read again
    assert size2 == size and (huge2 >= whole * 9 // 10 or not _files_map_whole(tmp_path))


def test_cpu_kv_pools_ask_for_huge_pages_before_their_first_write(monkeypatch):
    made: list[int] = []
    real = hugepages.anon
    monkeypatch.setattr(hugepages, "anon", lambda n, huge=True: made.append(n) or real(n, huge))
    pool = PagePool(2, 4, 64, 16, 512, placement=Placement("device", torch.device("cpu")))  # 8 MiB a layer
    assert made and all(n >= 8 << 20 for n in made)  # mappings of their own, advised
    for t in pool.kv:
        assert "hg" in _vm_flags(t.data_ptr()) and not t.any()
        assert t.shape == (2, 4, 512, 16, 64) and t.dtype == torch.float32
    pool.kv[0][0, 1, 3, 2, 5] = 7.0  # writable, and the flat view is the same storage
    assert pool.flat[0][0, 1, 3 * 16 + 2, 5] == 7.0
    made.clear()
    small = PagePool(2, 4, 64, 16, 8, placement=Placement("device", torch.device("cpu")))  # 128 KiB: left alone,
    assert not made  # a tensor like any other (whether the heap's region carries the flag is the process's business)
    assert not hugepages.advise_wanted(small.kv[0].numel() * 4)


def test_a_dynamic_caches_first_pool_is_resident_only_where_written_and_a_grown_one_takes_huge_pages():
    """A dynamic pool's first size is room to grow into: in 4 KiB pages (no huge pages asked, and
    refused where THP is ``always``), so a short sequence makes resident only its own pages, where
    huge pages made every layer's whole pool resident at the first token (each head's run of pages
    is written at its start). The pool it grows into, and a pool made at its full size, take huge
    pages as before; the contents survive the growth."""
    from kvcache.cache.config import CacheConfig
    from kvcache.cache.paged import PagedKVCache
    from kvcache.models.config import ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=4, head_dim=64, max_position=8192, norm_eps=1e-6)
    cache = PagedKVCache(cfg, CacheConfig(page_size=16, initial_tokens=2048))  # 2 x 4 x 2048 x 64 x 4 = 8 MiB a layer
    pool = cache.pools[0]
    first = pool.kv[0]
    assert "hg" not in _vm_flags(first.data_ptr()) and "nh" in _vm_flags(first.data_ptr())
    before = hugepages.resident_bytes(first.data_ptr(), first.numel() * 4)
    for layer in pool.kv:  # one token at slot 0 of every head, as a sequence's first page is written
        layer[:, :, 0, 0] = 1.0
    written = hugepages.resident_bytes(first.data_ptr(), first.numel() * 4)
    assert written - before <= 2 * 4 * 16 * 64 * 4 + 16 * 4096, (before, written)  # a few 4 KiB pages, not 8 MiB
    pool.resize(pool.num_pages * 2)  # the pool a longer context grows into
    grown = pool.kv[0]
    assert "hg" in _vm_flags(grown.data_ptr()) and grown[:, :, 0, 0].eq(1.0).all() and not grown[:, :, 1:].any()
