"""PagedContext: one forward's view of the paged cache (writes new K/V, reads each sequence's).

Building it reserves pages for the new tokens (all sequences or none) and advances each
sequence's length; the forward that uses it then writes those tokens' K/V in every layer and
attends over what each layer's group keeps visible.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache import kernels
from kvcache.attention.dense import Mask, attend, attend_with_sinks, build_mask
from kvcache.cache.paged import PagedKVCache
from kvcache.cache.prefetch import Prefetcher
from kvcache.cache.pool import PagePool
from kvcache.cache.qpool import QuantPool
from kvcache.cache.sequence import HOLE, SeqKV, run_start
from kvcache.models.layers import Rotary
from kvcache.models.qweight import attn_block


EXTEND_MAX = 256  # most new tokens per sequence for the native extend attention (SDPA beyond)


def _page_tables(seqs: Sequence[SeqKV], group: int) -> torch.Tensor:
    """The sequences' page tables of one group, zero-padded: [B, max_pages] int64."""
    width = max(len(seq.tables[group]) for seq in seqs)
    t = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, seq in enumerate(seqs):
        t[b, : len(seq.tables[group])] = torch.tensor(seq.tables[group], dtype=torch.long)
    return t


class _GroupPlan:
    """What one sequence needs from one layer group in every layer of this forward."""

    __slots__ = ("first_page", "slots", "k_pos", "mask", "n_sink", "delta", "pages", "n_old", "new_pages",
                 "run")

    def __init__(self, cache: PagedKVCache, seq: SeqKV, gi: int, q_pos: torch.Tensor, old_len: int,
                 old_pages: int) -> None:
        g, ps = cache.groups[gi], cache.page_size
        table = seq.tables[gi]
        self.first_page = self.slots = self.pages = self.run = None
        self.n_old = 0
        if cache.quantized:
            live = [i for i in range(old_pages) if table[i] != HOLE]
            pages = [table[i] for i in live]
            self.n_old = len(pages)
            self.run = run_start(pages)
            if self.run is None:
                self.pages = torch.tensor(pages, dtype=torch.long)
            self.new_pages = torch.tensor(table[old_pages:], dtype=torch.long)
            idx = torch.tensor(live, dtype=torch.long)
            page_pos = (idx[:, None] * ps + torch.arange(ps)).reshape(-1)
            k_pos = torch.cat((page_pos, torch.arange(old_pages * ps, seq.length)))
        else:
            self.new_pages = None
            live = [i for i, p in enumerate(table) if p != HOLE]
            idx = torch.tensor(live, dtype=torch.long)
            k_pos = (idx[:, None] * ps + torch.arange(ps)).reshape(-1)
            k_pos = k_pos[k_pos < seq.length]
            self.first_page = seq.first_page_if_contiguous(gi) if len(live) == len(table) else None
            if self.first_page is None:
                t = torch.tensor(table, dtype=torch.long)
                self.slots = t[k_pos // ps] * ps + k_pos % ps  # [L]
        self.k_pos = k_pos  # [L] positions, increasing
        self.mask: Mask = build_mask(q_pos, k_pos, g.window, g.sinks)
        # attention sinks: a query at t sees the sink tokens as if they sat just before its window
        self.n_sink = int((k_pos < g.sinks).sum()) if g.sinks else 0
        self.delta = None
        if self.n_sink and g.window is not None:
            delta = (q_pos - (g.window - 1)).clamp(min=0)  # [T]
            if bool((delta > 0).any()):
                self.delta = delta


class PagedContext:
    def __init__(
        self,
        cache: PagedKVCache,
        seqs: Sequence[SeqKV],
        new_tokens: Sequence[int],
        positions: torch.Tensor,  # [N] int64
        rotaries: Sequence[Rotary | None] | None = None,  # per layer, for attention sinks
    ) -> None:
        self.cache = cache
        self.rotaries = rotaries
        start = 0
        for seq, n in zip(seqs, new_tokens):  # check everything before touching the cache
            q_pos = positions[start : start + n]
            if n and (int(q_pos[0]) != seq.length or int(q_pos[-1]) != seq.length + n - 1):
                raise ValueError(
                    f"positions {int(q_pos[0])}..{int(q_pos[-1])} do not continue a sequence of "
                    f"{seq.length} cached tokens")
            start += n
        before = cache.reserve_all(seqs, new_tokens)  # all reservations before any length moves
        self.rows: list[slice] = []
        self.plans: list[list[_GroupPlan]] = []  # [seq][group]
        write_slots: list[list[torch.Tensor]] = [[] for _ in cache.groups]
        start = 0
        for seq, n, lens in zip(seqs, new_tokens, before):
            q_pos = positions[start : start + n]
            old = seq.length
            seq.length += n
            if not cache.quantized:
                for gi in range(len(cache.groups)):
                    write_slots[gi].append(cache.slots(seq, gi, old, n))
            self.plans.append([_GroupPlan(cache, seq, gi, q_pos, old, lens[gi]) for gi in range(len(cache.groups))])
            self.rows.append(slice(start, start + n))
            start += n
        self.seqs = list(seqs)
        self.prefetcher = Prefetcher(self) if cache.placement.offloaded else None
        if self.prefetcher is not None:
            self.prefetcher.start(0)
        self.write_slots = [torch.cat(s) if len(s) > 1 else (s[0] if s else None) for s in write_slots]
        # decodes (one or many) over fp32 pages with full visibility: one native call per layer
        # reads every sequence's pages in place (no gathered copy, no per-sequence loop)
        # the same for a few new tokens per sequence (an extend after a prefix hit, a chat turn, a
        # short chunk of prefill): one native call per layer, causal among the new tokens
        self.tables: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(cache.groups)
        self.extend: list[tuple[torch.Tensor, ...] | None] = [None] * len(cache.groups)
        if cache.config.encoding == "fp32" and not cache.placement.offloaded and max(new_tokens) <= EXTEND_MAX:
            decodes = all(n == 1 for n in new_tokens)
            lens = torch.tensor([seq.length for seq in seqs], dtype=torch.long)
            for g in cache.groups:
                if g.window is None and not g.sinks:
                    t = _page_tables(seqs, g.index)
                    if decodes:
                        self.tables[g.index] = (t, lens)
                    elif kernels.xattn() is not None:
                        new = torch.tensor(list(new_tokens), dtype=torch.long)
                        self.extend[g.index] = (t, torch.cumsum(new, 0) - new, new, lens)

    def attend_packed(self, layer: int, qkv: torch.Tensor, heads: tuple[int, int, int], cos: torch.Tensor,
                      sin: torch.Tensor, qk_norm: torch.Tensor | None, eps: float, scale: float) -> torch.Tensor | None:
        """Decodes over fp32 pages with full visibility: norm, RoPE, the cache write and attention in
        one native call (kernels/dattn.c) from the projection's rows qkv [B, (Hq + 2 Hkv) D] ->
        [B, Hq D]; None otherwise."""
        gi, j = self.cache.where[layer]
        batched = self.tables[gi]
        if batched is None:
            return None
        pool = self.cache.pools[gi]
        return kernels.decode_attend(qkv, heads, cos, sin, qk_norm, eps, pool.flat[j], pool.page_size,  # type: ignore[union-attr]
                                     self.write_slots[gi], batched[0], batched[1], scale)  # type: ignore[arg-type]

    def attend_block(self, layer: int, x: torch.Tensor, weights: tuple, heads: tuple[int, int, int],
                     cos: torch.Tensor, sin: torch.Tensor, qk_norm: torch.Tensor | None, eps: float, scale: float,
                     post_norm: torch.Tensor | None) -> bool:
        """Decodes over fp32 pages with quantized weights: the whole attention half of the layer in
        one native call (kernels/dattn.c kv_q_attn_block); False otherwise."""
        gi, j = self.cache.where[layer]
        batched = self.tables[gi]
        if batched is None:
            return False
        pool = self.cache.pools[gi]
        return attn_block(x, weights, heads, cos, sin, qk_norm, eps, scale, post_norm, pool.flat[j],  # type: ignore[union-attr]
                          pool.page_size, self.write_slots[gi], batched[0], batched[1])  # type: ignore[arg-type]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] -> [N, Hq, D]."""
        gi, j = self.cache.where[layer]
        pool = self.cache.pools[gi]
        single = len(self.plans) == 1
        offloaded = self.cache.placement.offloaded
        olds: list[torch.Tensor | None] = [None] * len(self.plans)
        if self.prefetcher is not None:  # offloaded
            olds = list(self.prefetcher.take(layer))  # fetched while the previous layer computed
            if layer + 1 < len(self.cache.where):
                self.prefetcher.start(layer + 1)
        elif self.cache.placement.kind == "disk" and layer + 1 < len(self.cache.where):
            nxt_g, nxt_j = self.cache.where[layer + 1]  # read-ahead of the next layer's page files
            for t in self.cache.pools[nxt_g].layer_tensors(nxt_j):
                self.cache.placement.advise(t)
        outs = []
        if isinstance(pool, PagePool):
            pool.write(j, self.write_slots[gi], k, v)  # type: ignore[arg-type]
            batched = self.tables[gi]
            if batched is not None:
                b, hq, d = q.shape
                hkv = pool.num_kv_heads
                o = kernels.paged_decode((q * scale).view(b, hkv, hq // hkv, d), pool.flat[j], batched[0],
                                         batched[1], pool.page_size)
                if o is not None:
                    return o.view(b, hq, d)
            extend = self.extend[gi]
            if extend is not None:
                o = kernels.paged_extend((q * scale).contiguous(), pool.flat[j], *extend, pool.page_size)
                if o is not None:
                    return o
        for i, (rows, plans, seq) in enumerate(zip(self.rows, self.plans, self.seqs)):
            plan = plans[gi]
            qq = q if single else q[rows]
            if isinstance(pool, PagePool) and not offloaded:
                kv = pool.read(j, plan.first_page, plan.slots, plan.k_pos.shape[0])  # [2, Hkv, L, D]
                outs.append(self._attend(layer, qq, kv, plan, scale))
                continue
            kv_new = torch.stack((k[rows], v[rows])).transpose(1, 2)  # [2, Hkv, n, D]
            if isinstance(pool, QuantPool):
                outs.append(self._attend_quant(layer, gi, j, i, pool, qq, olds[i], kv_new, plan, seq, scale))
                continue
            kv = olds[i]  # [2, Hkv, L, D], the part stored before this forward filled in
            assert kv is not None
            kv[:, :, kv.shape[2] - kv_new.shape[2] :] = kv_new
            outs.append(self._attend(layer, qq, kv, plan, scale))
        return outs[0] if single else torch.cat(outs, 0)

    def load_old(self, layer: int) -> list[torch.Tensor]:
        """Per sequence, a fresh buffer [2, Hkv, L, D] fp32 on the compute device holding the
        layer's K/V stored before this forward (dequantized), with room after them for the fp32
        tail and the new tokens. Runs on the prefetch thread for offloaded caches."""
        return [self._load_old_one(layer, i) for i in range(len(self.plans))]

    def _load_old_one(self, layer: int, i: int) -> torch.Tensor:
        gi, j = self.cache.where[layer]
        pool = self.cache.pools[gi]
        hkv, d = self.cache.model.num_kv_heads, self.cache.model.head_dim
        plan, rows = self.plans[i][gi], self.rows[i]
        n = rows.stop - rows.start
        buf = torch.empty(2, hkv, plan.k_pos.shape[0], d, device=self.cache.placement.compute)
        if isinstance(pool, QuantPool):
            if plan.n_old:
                pool.read_into(j, plan.pages, plan.run or 0, plan.n_old, buf[:, :, : plan.n_old * pool.page_size])
            return buf
        m = plan.k_pos.shape[0] - n
        if m:
            if plan.first_page is not None:
                src = pool.flat[j][:, :, plan.first_page * pool.page_size :][:, :, :m]
            else:
                assert plan.slots is not None
                src = pool.flat[j].index_select(2, plan.slots[:m].to(pool.flat[j].device))
            buf[:, :, :m].copy_(src, non_blocking=True)
        return buf

    def _attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, plan: _GroupPlan, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; kv: [2, Hkv, L, D] -> [T, Hq, D]."""
        if plan.delta is not None:
            rot = self.rotaries[layer] if self.rotaries is not None else None
            if rot is not None:
                q_sink = rot.rotate(q, -plan.delta)  # [T, Hq, D]
                o = attend_with_sinks(q.transpose(0, 1), q_sink.transpose(0, 1), kv[0], kv[1], plan.mask,
                                      plan.n_sink, scale)
                return o.transpose(0, 1)
        return attend(q.transpose(0, 1), kv[0], kv[1], plan.mask, scale).transpose(0, 1)

    def _attend_quant(self, layer: int, gi: int, j: int, i: int, pool: QuantPool, q: torch.Tensor,
                      buf: torch.Tensor | None, kv_new: torch.Tensor, plan: _GroupPlan, seq: SeqKV,
                      scale: float) -> torch.Tensor:
        """Attend over the sealed pages, the fp32 tail and the new tokens, then seal the pages
        that left the residual window. A lone decode query with everything in view goes to the
        native kernel, which reads the codes in place; otherwise the pages are dequantized into
        ``buf`` ([2, Hkv, L, D], filled here unless the prefetcher did)."""
        tails = seq.tails[gi]
        assert tails is not None
        tail = tails[j]
        n_q = plan.n_old * pool.page_size
        rest = torch.cat((tail, kv_new), 2)  # [2, Hkv, t + n, D]
        out = None
        if buf is None and q.shape[0] == 1 and plan.mask is None and plan.delta is None and plan.n_old:
            hkv, d = kv_new.shape[1], kv_new.shape[3]
            pages = plan.pages if plan.pages is not None else torch.arange(plan.run, plan.run + plan.n_old)
            o = kernels.quant_decode((q[0] * scale).view(hkv, -1, d), pages, pool.parts[j], pool.page_size,
                                     pool.group, pool.bits, rest)
            out = None if o is None else o.view(1, -1, d)
        if out is None:
            if buf is None:
                buf = self._load_old_one(layer, i)
            buf[:, :, n_q:] = rest
            out = self._attend(layer, q, buf, plan, scale)
        tails[j] = pool.seal(j, plan.new_pages, rest)
        return out
