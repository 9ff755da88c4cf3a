"""The memory budget of a dynamic pool (``--kv-budget``, ``--kv ...,budget=``) and giving pages back.

- ``parse_budget``: "2" or "2GiB" (GiB when no unit), "512MiB", "1.5GB", "4096B", or "25%" of
  the machine's RAM, to bytes.
- ``room(cache, group)``: how many pages a group's pool may still grow by under the budget (None:
  no budget; a static pool: 0). A dynamic pool never grows past its budget: beyond it, cached
  prefix pages are evicted, then the allocation fails with CacheFull, which the scheduler answers
  by making requests wait or by preempting the latest one (it resumes later).
- ``tokens_per_sequence(cache)``: the most tokens one sequence can hold within the budget (None:
  unbounded, e.g. every layer windowed); the runner's capacity, so a request that could never fit
  is refused up front, naming the budget.
- ``shrink(cache)``: give pages back once idle: the pages in use move to the lowest ids (their
  holders' page tables follow) and each pool is cut to what is in use, but not below its initial
  size.

Locking: none; called on the thread that owns the cache (the engine thread).
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from kvcache.errors import InvalidParams

if TYPE_CHECKING:
    from kvcache.cache.config import CacheConfig
    from kvcache.cache.paged import PagedKVCache
    from kvcache.models.config import ModelConfig

_UNITS = {"": 2**30, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
PREFILL_SLACK = 512  # tokens a windowed group may hold beyond its window while a chunk prefills


def ram_bytes() -> int:
    """Physical memory of this machine."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def parse_budget(text: str | int | float) -> int:
    """Bytes of a budget written as GiB, with a unit, or as a percentage of RAM."""
    raw = str(text).strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?|\.\d+)(%|[a-z]*)", raw)
    if m is None or (m.group(2) not in _UNITS and m.group(2) != "%"):
        raise InvalidParams(f"KV budget {text!r} is not a size: give GiB (2), a unit (512MiB, 1.5GB) or a share "
                            "of RAM (25%)")
    value = float(m.group(1))
    if m.group(2) == "%":
        if not 0 < value <= 100:
            raise InvalidParams(f"KV budget {text!r}: a share of RAM must be above 0% and at most 100%")
        return int(ram_bytes() * value / 100)
    out = int(value * _UNITS[m.group(2)])
    if out < 1:
        raise InvalidParams(f"KV budget {text!r} is zero")
    return out


def check_preallocation(config: "CacheConfig", model: "ModelConfig", layers: int, pages: int) -> None:
    """Refuse a pool whose first allocation (``pages`` pages in each of ``layers`` layers) would
    not fit in this machine's RAM, naming what asked for it and the bytes, instead of failing
    inside the allocator (a disk-placed pool is memory-mapped: its bound is the disk)."""
    if config.placement == "disk":
        return
    if config.quantized:
        from kvcache.cache.quant import bytes_per_token

        per_token = bytes_per_token(model.num_kv_heads, model.head_dim, config.bits, config.group_size)
    else:
        size = {"fp32": 4, "fp16": 2, "bf16": 2}[config.encoding]
        per_token = 2 * model.num_kv_heads * model.head_dim * size
    need = int(per_token * config.pages_of * pages * layers)
    ram = ram_bytes()
    if need > ram:
        from kvcache.fmt import human_bytes

        asked = (f"static,max_tokens={config.max_tokens} x max_seqs={config.max_seqs}" if config.capacity == "static"
                 else f"initial_tokens={config.initial_tokens}")
        raise InvalidParams(f"--kv {asked} would preallocate {human_bytes(need)} of K/V, more than this machine's "
                            f"{human_bytes(ram)} of RAM; ask for fewer tokens" +
                            (" or use the dynamic capacity" if config.capacity == "static" else ""))


def pool_bytes(cache: "PagedKVCache") -> int:
    return sum(p.nbytes for p in cache.pools)


def room(cache: "PagedKVCache", group: int) -> int | None:
    """Pages the group's pool may still grow by (None: unbounded)."""
    if cache.config.capacity == "static":
        return 0
    if cache.config.budget is None:
        return None
    return max(0, (cache.config.budget - pool_bytes(cache)) // cache.pools[group].page_bytes)


def initial_pages(cache: "PagedKVCache", wanted: int) -> int:
    """A dynamic pool's first size: ``wanted`` pages per group, fewer when the budget is smaller."""
    budget = cache.config.budget
    if budget is None:
        return wanted
    per_page = sum(p.page_bytes for p in cache.pools) if cache.pools else 0
    if per_page and budget < per_page:
        raise InvalidParams(f"KV budget of {budget} bytes is smaller than one page of every layer "
                            f"({per_page} bytes); raise --kv-budget")
    return max(1, min(wanted, budget // per_page)) if per_page else wanted


def tokens_per_sequence(cache: "PagedKVCache") -> int | None:
    """Most tokens one sequence can hold within the budget (None: no budget, or no bound)."""
    budget = cache.config.budget
    if budget is None or all(g.window is not None for g in cache.groups):
        return None
    ps = cache.page_size

    def need(tokens: int) -> int:
        total = 0
        for g in cache.groups:
            held = tokens if g.window is None else min(tokens, g.window + PREFILL_SLACK + ps)
            total += (-(-held // ps) + (-(-g.sinks // ps))) * cache.pools[g.index].page_bytes
        return total

    lo, hi = 0, 1
    while need(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid)
    return lo


def shrink(cache: "PagedKVCache", floor: int) -> int:
    """Give back every page beyond what is in use (at least ``floor`` pages per pool stay);
    returns the bytes given back. Pages in use above the cut move below it first."""
    if cache.config.capacity != "dynamic":
        return 0
    before = pool_bytes(cache)
    cache.pages.shrink(floor)
    return before - pool_bytes(cache)
