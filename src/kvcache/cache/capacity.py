"""What a cache may hold: the page arithmetic of its capacity and of a dynamic pool's budget.

Pure functions over a CacheConfig, its layer groups, its pools and a sequence's page tables; they
take no pages and hold no cache (PagedKVCache and its page manager call them):

- ``check_preallocation``: refuse a pool whose first allocation would not fit in RAM.
- ``room(config, pools, group)``: how many pages a group's pool may still grow by under the budget
  (None: no budget; a static pool: 0). A dynamic pool never grows past its budget: beyond it,
  cached prefix pages are evicted, then the allocation fails with CacheFull, which the scheduler
  answers by making requests wait or by preempting the latest one (it resumes later).
- ``initial_pages``: a dynamic pool's first size, fewer pages when the budget is smaller.
- ``capacity_per_sequence``: the most tokens one sequence can hold (static: ``max_tokens``;
  dynamic: what the budget holds, ``tokens_per_sequence``; None: unbounded, e.g. every layer
  windowed); the runner's capacity, so a request that could never fit is refused up front.
- ``pages_after``: the logical pages a group's table holds once a sequence has a given length.

Giving pages back once idle (``PagedKVCache.shrink``) is the page manager's ``shrink``.

Locking: none; called on the thread that owns the cache (the engine thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcache.cache.budget import ram_bytes
from kvcache.cache.config import CacheConfig
from kvcache.cache.groups import LayerGroup
from kvcache.cache.pool import PagePool
from kvcache.cache.qpool import QuantPool
from kvcache.cache.quant import bytes_per_token
from kvcache.cache.sequence import SeqKV
from kvcache.errors import InvalidParams

if TYPE_CHECKING:  # the model's shape comes in; the cache imports nothing of models/
    from kvcache.models.config import ModelConfig

Pools = Sequence[PagePool | QuantPool]
PREFILL_SLACK = 512  # tokens a windowed group may hold beyond its window while a chunk prefills


def check_preallocation(config: CacheConfig, model: "ModelConfig", layers: int, pages: int) -> None:
    """Refuse a pool whose first allocation (``pages`` pages in each of ``layers`` layers) would
    not fit in this machine's RAM, naming what asked for it and the bytes, instead of failing
    inside the allocator (a disk-placed pool is memory-mapped: its bound is the disk)."""
    if config.placement == "disk":
        return
    if config.quantized:
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


def pool_bytes(pools: Pools) -> int:
    """Bytes the pools hold (every page, in use or free)."""
    return sum(p.nbytes for p in pools)


def room(config: CacheConfig, pools: Pools, group: int) -> int | None:
    """Pages the group's pool may still grow by (None: unbounded)."""
    if config.capacity == "static":
        return 0
    if config.budget is None:
        return None
    return max(0, (config.budget - pool_bytes(pools)) // pools[group].page_bytes)


def initial_pages(config: CacheConfig, pools: Pools, wanted: int) -> int:
    """A dynamic pool's first size: ``wanted`` pages per group, fewer when the budget is smaller."""
    budget = config.budget
    if budget is None:
        return wanted
    per_page = sum(p.page_bytes for p in pools) if pools else 0
    if per_page and budget < per_page:
        raise InvalidParams(f"KV budget of {budget} bytes is smaller than one page of every layer "
                            f"({per_page} bytes); raise --kv-budget")
    return max(1, min(wanted, budget // per_page)) if per_page else wanted


def tokens_per_sequence(config: CacheConfig, groups: Sequence[LayerGroup], pools: Pools) -> int | None:
    """Most tokens one sequence can hold within the budget (None: no budget, or no bound)."""
    budget = config.budget
    if budget is None or all(g.window is not None for g in groups):
        return None
    ps = config.pages_of

    def need(tokens: int) -> int:
        total = 0
        for g in groups:
            held = tokens if g.window is None else min(tokens, g.window + PREFILL_SLACK + ps)
            total += (-(-held // ps) + (-(-g.sinks // ps))) * pools[g.index].page_bytes
        return total

    lo, hi = 0, 1
    while need(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid)
    return lo


def capacity_per_sequence(config: CacheConfig, groups: Sequence[LayerGroup], pools: Pools) -> int | None:
    """Most tokens one sequence can hold (None: unbounded, every group has a window)."""
    if config.capacity == "dynamic":
        return tokens_per_sequence(config, groups, pools)
    if all(g.window is not None for g in groups):
        return None
    return config.max_tokens


def pages_after(config: CacheConfig, seq: SeqKV, group: int, length: int) -> int:
    """Logical pages the group's table holds once the sequence has ``length`` tokens (slots,
    with a press). A quantized press sequence reading a prompt seals nothing until the press
    has chosen (evict, then quantize what stays)."""
    ps = config.pages_of
    if not config.quantized:
        return -(-length // ps)
    if seq.press is not None and seq.press.observing:
        return len(seq.tables[group])
    sealed = len(seq.tables[group]) * ps
    return len(seq.tables[group]) + max(0, (length - sealed - config.residual) // ps)
