"""PageStore: the kvcache pages behind one transformers cache.

One kvcache sequence per batch row. A forward is the run of ``update`` calls from the model's
first layer to its last: the first reserves pages for the new tokens in every row (all rows or
none), each layer then writes its K/V into its group's pool and reads back what its queries may
see (planned by cache/plan.py, the planner the engine uses too: ``reads="window"``). Lengths are counters, per layer; a layer that receives tokens out of turn is
refused. Several stores may share one PagedKVCache (forks share pages, copy-on-write).
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from kvcache.cache.paged import PagedKVCache
from kvcache.cache.plan import ForwardPlan, ReadPlan, mask_sizes
from kvcache.cache.pool import PagePool
from kvcache.cache.qpool import QuantPool
from kvcache.cache.sequence import SeqKV
from kvcache.cache.config import CacheConfig
from kvcache.errors import InvalidParams, KVCacheError
from kvcache.hf.layout import Layout
from kvcache.kernels.rotary import Rotary


def _free_rows(cache: PagedKVCache, rows: list[SeqKV]) -> None:
    for seq in rows:
        cache.free(seq)
    rows.clear()


class PageStore:
    def __init__(self, layout: Layout, config: CacheConfig, cache: PagedKVCache | None = None) -> None:
        self.layout, self.config = layout, config
        self.cache = cache
        self.rows: list[SeqKV] = []
        self.written = [0] * layout.num_layers  # tokens each layer has stored (per row)
        self.length = 0  # tokens every row holds once the current forward is through
        self.pending = 0  # layers still to write in the current forward
        self.plan: ForwardPlan | None = None  # the current forward's writes and reads
        self.rotaries: list[Rotary | None] | None = None
        self.dtype: torch.dtype | None = None
        self._finalizer: weakref.finalize | None = None
        if config.sinks:
            self.rotaries = layout.rotaries()

    # -- set-up ---------------------------------------------------------------------------------
    def _build(self, k: torch.Tensor) -> None:
        """k: [B, Hkv, T, D], the first K a layer hands the cache."""
        self.dtype = k.dtype
        if self.cache is None:
            cfg = self.config
            if cfg.capacity == "static":
                cfg = replace(cfg, max_seqs=max(cfg.max_seqs, k.shape[0]))
            self.cache = PagedKVCache(self.layout.model_config(k.shape[1], k.shape[3]), cfg, k.device)
        self._finalizer = weakref.finalize(self, _free_rows, self.cache, self.rows)

    def adopt(self, other: "PageStore", rows: list[SeqKV]) -> None:
        """Take ``rows`` (sequences of ``other``'s cache, e.g. forks) as this store's rows."""
        assert other.cache is not None
        self.cache, self.dtype, self.rotaries = other.cache, other.dtype, other.rotaries
        self.rows[:] = rows
        self.written = [other.length] * self.layout.num_layers
        self.length = other.length
        self._finalizer = weakref.finalize(self, _free_rows, self.cache, self.rows)

    # -- a forward ------------------------------------------------------------------------------
    def _begin(self, batch: int, n: int) -> None:
        cache = self.cache
        assert cache is not None
        if not self.rows:
            self.rows[:] = [cache.new_sequence() for _ in range(batch)]
        if batch != len(self.rows):
            raise InvalidParams(f"the cache holds {len(self.rows)} rows but the model passed a batch of {batch}; "
                                "use one cache per batch (or fork a PromptCache into as many rows)")
        if batch > 1 and self.config.sinks:
            raise InvalidParams("attention sinks in kvcache.hf take one row at a time (left padding would turn pad "
                                "tokens into sinks); run prompts one by one, or use window=N without sinks")
        self.plan = ForwardPlan(cache, self.rows, [n] * batch, reads="window")
        self.length += n
        self.pending = self.layout.num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, Hkv, T, D] new tokens of one layer -> the visible K, V: [B, Hkv, L, D]."""
        if self.cache is None:
            self._build(k)
        batch, n = k.shape[0], k.shape[2]
        if self.pending == 0:
            if self.written[layer] != self.length:
                raise KVCacheError(f"layer {layer} is behind the others; the cache is inconsistent (reset it)")
            self._begin(batch, n)
        elif self.written[layer] + n != self.length or batch != len(self.rows):
            raise KVCacheError(f"layer {layer} received {n} tokens out of turn: a previous forward stopped "
                               "part-way; reset the cache (cache.reset()) or make a new one")
        cache = self.cache
        assert cache is not None
        gi, j = cache.where[layer]
        pool = cache.pools[gi]
        reads = self.plan.reads  # type: ignore[union-attr]
        if isinstance(pool, QuantPool):
            kv = torch.stack([self._quant_row(b, gi, j, pool, k[b], v[b]) for b in range(batch)], 1)
        else:
            slots = self.plan.write_slots[gi]  # type: ignore[union-attr]
            assert slots is not None  # [B*T], row by row
            pool.write(j, slots, k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1))  # [B*T, Hkv, D]
            kv = torch.stack([self._read_float(pool, j, reads[b][gi]) for b in range(batch)], 1)
        # kv: [2, B, Hkv, L, D]
        plan = reads[0][gi]
        if plan.shift and self.rotaries is not None and self.rotaries[layer] is not None:
            kv = self._shift_sinks(layer, kv, plan)
        self.written[layer] += n
        self.pending -= 1
        if kv.dtype != k.dtype or kv.device != k.device:
            kv = kv.to(k.device, k.dtype)
        return kv[0], kv[1]

    @staticmethod
    def _read_float(pool: PagePool, j: int, plan: ReadPlan) -> torch.Tensor:
        """-> [2, Hkv, L, D], a view of the pool when the slots are consecutive."""
        flat = pool.flat[j]
        if plan.first_slot is not None:
            kv = flat[:, :, plan.first_slot : plan.first_slot + plan.positions.shape[0]]
        else:
            assert plan.slots is not None
            kv = flat.index_select(2, plan.slots.to(flat.device))
        return pool.placement.fetch(kv)

    def _quant_row(self, b: int, gi: int, j: int, pool: QuantPool, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v: [Hkv, T, D] of row b -> its visible K/V [2, Hkv, L, D] fp32; then seals the pages
        that left the fp32 residual window (as kvcache's own forward does)."""
        seq, plan, ps = self.rows[b], self.plan.reads[b][gi], pool.page_size  # type: ignore[union-attr]
        tails = seq.tails[gi]
        assert tails is not None
        rest = torch.cat((tails[j].to(k.device), torch.stack((k, v)).float()), 2)  # [2, Hkv, t + T, D]
        m_old = plan.n_pages * ps
        buf = torch.empty(2, pool.num_kv_heads, m_old + rest.shape[2], pool.head_dim, device=k.device)
        if plan.n_pages:
            pool.read_into(j, plan.pages, plan.page_run or 0, plan.n_pages, buf[:, :, :m_old])
        buf[:, :, m_old:] = rest
        if plan.index_start is not None:
            out = buf[:, :, plan.index_start : plan.index_start + plan.positions.shape[0]]
        else:
            assert plan.index is not None
            out = buf.index_select(2, plan.index.to(buf.device))
        tails[j] = pool.seal(j, plan.new_pages, rest)
        return out

    def _shift_sinks(self, layer: int, kv: torch.Tensor, plan: ReadPlan) -> torch.Tensor:
        """kv: [2, B, Hkv, L, D] -> the same with the sink keys turned by ``plan.shift`` positions."""
        rot = self.rotaries[layer]  # type: ignore[index]
        assert rot is not None
        ns, (_, batch, hkv, _, d) = plan.n_sink, kv.shape
        sink = kv[0, :, :, :ns].permute(2, 0, 1, 3).reshape(ns, batch * hkv, d)  # [ns, B*Hkv, D]
        turned = rot.rotate(sink.float().cpu(), torch.full((ns,), plan.shift, dtype=torch.long))  # tables on CPU
        turned = turned.reshape(ns, batch, hkv, d).permute(1, 2, 0, 3).to(kv.device, kv.dtype)  # [B, Hkv, ns, D]
        keys = torch.cat((turned, kv[0, :, :, ns:]), 2)
        return torch.stack((keys, kv[1]))

    # -- what transformers asks -------------------------------------------------------------------
    def mask_sizes(self, layer: int, query_length: int) -> tuple[int, int]:
        if self.cache is None:
            return query_length, 0
        gi, _ = self.cache.where[layer]
        return mask_sizes(self.cache.groups[gi], self.written[layer], query_length)

    def max_length(self) -> int:
        if self.config.capacity != "static":
            return -1
        return self.config.with_capacity(self.layout.max_position).max_tokens or -1

    # -- rows -----------------------------------------------------------------------------------
    def _idle(self, what: str) -> PagedKVCache | None:
        if self.pending:
            raise KVCacheError(f"cannot {what} in the middle of a forward")
        return self.cache

    def select(self, indices: list[int]) -> None:
        """Rows become ``[rows[i] for i in indices]``: forks share pages, nothing is copied."""
        cache = self._idle("reorder rows")
        if cache is None or not self.rows:
            return
        if indices == list(range(len(self.rows))):
            return
        new = [cache.fork(self.rows[i]) for i in indices]
        _free_rows(cache, self.rows)
        self.rows[:] = new

    def crop(self, tokens_to_remove: int) -> None:
        cache = self._idle("crop")
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number: the tokens to remove from the end")
        if cache is None or tokens_to_remove == 0:
            return
        length = max(0, self.length + tokens_to_remove)
        if not all(cache.can_truncate(seq, length) for seq in self.rows):
            raise KVCacheError(f"cannot crop to {length} tokens: the window has dropped keys those tokens see")
        for seq in self.rows:
            cache.truncate(seq, length)
        self.length = length
        self.written = [length] * self.layout.num_layers

    def reset(self) -> None:
        if self.cache is not None:
            _free_rows(self.cache, self.rows)
        self.length = self.pending = 0
        self.written = [0] * self.layout.num_layers
