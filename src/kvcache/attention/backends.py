"""PagedContext: attention over the paged cache, the one place that chooses an attention backend.

Per layer group, once per forward (from cache/plan.py's ForwardPlan), then per layer:

- fused (``attend_packed``, ``attend_block``): every new token of every sequence over fp32 pages
  with full visibility or a sliding window without sinks (the model's own sliding layers, a cache
  window; decodes, extends, prefill chunks, verifying forwards): norm, RoPE, the cache write and
  attention in one native call (kernels/dattn.c over cattn.c), or the layer's whole attention
  half with quantized weights;
- cattn: the same attention from q, k, v computed in torch (a press sequence recording its queries);
- qattn: a lone decode query over quantized pages with everything in view, codes read in place;
- dense: everything else (sinks, fp16/bf16, offloaded pools, no compiler): each sequence's
  keys gathered (quantized pages dequantized) and attention/dense.py's math.

cattn.c reduces every query row in one canonical order, so the fused path gives a row the same
bits whatever else the forward holds (batch invariance; recompute runs it too).

Every native path returns None when it cannot take its inputs, and the next one down runs: all
give the same result. Owns the choice and the calls; may not plan (cache/plan.py decides which
keys a sequence reads) or change the cache beyond writing this forward's K/V and sealing
quantized pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache import kernels
from kvcache.attention.dense import attend, attend_with_sinks
from kvcache.attention.interface import LayerPages
from kvcache.attention.masked import attend_heads, press_mask
from kvcache.cache import retention
from kvcache.cache.paged import PagedKVCache
from kvcache.cache.plan import ForwardPlan, ReadPlan
from kvcache.cache.pool import PagePool
from kvcache.cache.prefetch import Prefetcher
from kvcache.cache.qpool import QuantPool
from kvcache.cache.sequence import SeqKV
from kvcache.kernels.rotary import Rotary
from kvcache.kernels.qweight import attn_block
from kvcache.press.kvzip import replay_peaks



class PagedContext:
    """One forward's attention over ``cache``: building it plans the forward (reserves pages for
    the new tokens, all sequences or none, and advances each sequence's length); the forward then
    writes those tokens' K/V in every layer and attends over what each layer's group keeps visible."""

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
        self.plan = plan = ForwardPlan(cache, seqs, new_tokens, positions)
        self.prefetcher = Prefetcher(self.load_old, cache.placement.compute) if cache.placement.offloaded else None
        if self.prefetcher is not None:
            self.prefetcher.start(0)
        # per group, the native path every sequence takes (fp32 pages, full visibility or a window
        # without sinks): page tables, each sequence's first row and new tokens, and its length
        # after this forward; ``windows``: the group's window (0: none).
        # cattn.c attends every row in one canonical order, so a row's bits do not depend on the
        # batch, the chunk, a prefix hit or a recompute.
        self.rows: list[tuple[torch.Tensor, ...] | None] = [None] * len(cache.groups)
        self.windows = [g.window or 0 for g in cache.groups]
        # the model's attention logit soft cap (Gemma 2): no native kernel takes it, so every read
        # goes to dense attention (attention/dense.py), capped
        self.softcap: float | None = cache.model.attn_softcap
        # a press reading a prompt records its queries, which the fused path never exposes
        self.observing = [i for i, seq in enumerate(plan.seqs) if seq.press is not None and seq.press.observing]
        self._plains: dict[tuple[int, int], bool] = {}  # (sequence, group) -> _plain's answer, one per forward
        # KVzip's replay scores from every slot's keys: the dense path, where they are at hand
        replaying = any(seq.press is not None and seq.press.replay is not None for seq in plan.seqs)
        if (cache.config.encoding == "fp32" and not replaying and not cache.placement.offloaded
                and self.softcap is None):
            new = torch.tensor(list(new_tokens), dtype=torch.long)
            row0 = torch.cumsum(new, 0) - new
            pressed = any(seq.press is not None for seq in plan.seqs)  # else no read is a press's (plan.py)
            for g in cache.groups:
                if not g.sinks and not (pressed and any(r[g.index].press for r in plan.reads)):
                    self.rows[g.index] = (plan.page_tables(g.index), row0, new, plan.lengths(g.index))

    # -- fused paths -----------------------------------------------------------------------------
    def attend_packed(self, layer: int, qkv: torch.Tensor, heads: tuple[int, int, int], cos: torch.Tensor,
                      sin: torch.Tensor, qk_norm: torch.Tensor | None, eps: float, scale: float,
                      sink_logits: torch.Tensor | None = None) -> torch.Tensor | None:
        """Every new token over fp32 pages (full visibility or a window without sinks): norm, RoPE,
        the cache write and attention in one native call (kernels/dattn.c) from the projection's
        rows qkv [N, (Hq + 2 Hkv) D] -> [N, Hq D] (gpt-oss's learned sink logits [Hq] in the
        softmax); None otherwise."""
        gi, j = self.cache.where[layer]
        rows = self.rows[gi]
        if rows is None or self.observing:
            return None
        pool = self.cache.pools[gi]
        return kernels.decode_attend(qkv, heads, cos, sin, qk_norm, eps, pool.flat[j], pool.page_size,  # type: ignore[union-attr]
                                     self.plan.write_slots[gi], rows, scale, self.windows[gi],  # type: ignore[arg-type]
                                     sink_logits)

    def attend_block(self, layer: int, x: torch.Tensor, weights: tuple, heads: tuple[int, int, int],
                     cos: torch.Tensor, sin: torch.Tensor, qk_norm: torch.Tensor | None, eps: float, scale: float,
                     post_norm: torch.Tensor | None) -> bool:
        """Every new token over fp32 pages with quantized weights: the whole attention half of the
        layer in one native call (kernels/dattn.c kv_q_attn_block); False otherwise."""
        gi, j = self.cache.where[layer]
        rows = self.rows[gi]
        if rows is None or self.observing:
            return False
        pool = self.cache.pools[gi]
        return attn_block(x, weights, heads, cos, sin, qk_norm, eps, scale, post_norm, pool.flat[j],  # type: ignore[union-attr]
                          pool.page_size, self.plan.write_slots[gi], rows, self.windows[gi])  # type: ignore[arg-type]

    def layer_pages(self) -> LayerPages | None:
        """Every layer's pool layer and its group's pages, when every layer takes the fused path
        (fp32 pages, no press recording queries, not offloaded); None otherwise."""
        if self.observing or any(r is None for r in self.rows):
            return None
        cache, plan = self.cache, self.plan
        groups = []
        for g in cache.groups:
            tables, row0, new, lens = self.rows[g.index]  # type: ignore[misc]
            pool = cache.pools[g.index]
            slots = plan.write_slots[g.index]
            if not isinstance(pool, PagePool) or slots is None:
                return None
            groups.append([slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                           self.windows[g.index], pool.flat[0].shape[2], pool.page_size])
        flats = [cache.pools[gi].flat[j] for gi, j in cache.where]  # type: ignore[union-attr]
        kvs = torch.tensor([[f.data_ptr(), gi] for f, (gi, _) in zip(flats, cache.where)], dtype=torch.long)
        return LayerPages(flats, kvs, torch.tensor(groups, dtype=torch.long), len(plan.seqs), row0, new)

    # -- the general call -------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] -> [N, Hq, D]. ``sink_logits`` [Hq] (gpt-oss's learned
        sinks): no native kernel takes them, so every read goes to dense attention."""
        cache, plan = self.cache, self.plan
        gi, j = cache.where[layer]
        pool = cache.pools[gi]
        single = len(plan.reads) == 1
        for i in self.observing:
            rot = self.rotaries[layer] if self.rotaries is not None else None
            retention.observe(plan.seqs[i], layer, q[plan.rows[i]], rot, scale)
        offloaded = cache.placement.offloaded
        olds: list[torch.Tensor | None] = [None] * len(plan.reads)
        if self.prefetcher is not None:  # offloaded
            olds = list(self.prefetcher.take(layer))  # fetched while the previous layer computed
            if layer + 1 < len(cache.where):
                self.prefetcher.start(layer + 1)
        elif cache.placement.kind == "disk" and layer + 1 < len(cache.where):
            nxt_g, nxt_j = cache.where[layer + 1]  # read-ahead of the next layer's page files
            for t in cache.pools[nxt_g].layer_tensors(nxt_j):
                cache.placement.advise(t)
        outs = []
        if isinstance(pool, PagePool):
            pool.write(j, plan.write_slots[gi], k, v)  # type: ignore[arg-type]
            rows = self.rows[gi]
            if rows is not None and sink_logits is None:  # cattn.c, in place through the page tables
                o = kernels.paged_extend((q * scale).contiguous(), pool.flat[j], *rows, pool.page_size,
                                         self.windows[gi])
                if o is not None:
                    return o
        for i, (rows, reads, seq) in enumerate(zip(plan.rows, plan.reads, plan.seqs)):
            read = reads[gi]
            qq = q if single else q[rows]
            if isinstance(pool, PagePool) and not offloaded:
                if (pool.dtype != torch.float32 and self.softcap is None and sink_logits is None
                        and self._plain(gi, i)):  # fp16/bf16 in place
                    o = kernels.half_attend((qq * scale).contiguous(), pool.flat[j], read.slots, read.first_slot or 0,
                                            read.positions.shape[0])
                    if o is not None:
                        outs.append(o)
                        continue
                kv = pool.read(j, read.first_slot, read.slots, read.positions.shape[0])  # [2, Hkv, L, D]
                outs.append(self._dense(layer, qq, kv, read, scale, i, sink_logits))
                continue
            kv_new = torch.stack((k[rows], v[rows])).transpose(1, 2)  # [2, Hkv, n, D]
            if isinstance(pool, QuantPool):
                outs.append(self._quant(layer, gi, j, i, pool, qq, olds[i], kv_new, read, seq, scale, sink_logits))
                continue
            kv = olds[i]  # [2, Hkv, L, D], the part stored before this forward filled in
            assert kv is not None
            kv[:, :, kv.shape[2] - kv_new.shape[2] :] = kv_new
            outs.append(self._dense(layer, qq, kv, read, scale, i, sink_logits))
        return outs[0] if single else torch.cat(outs, 0)

    def load_old(self, layer: int) -> list[torch.Tensor]:
        """Per sequence, a fresh buffer [2, Hkv, L, D] fp32 on the compute device holding the
        layer's K/V stored before this forward (dequantized), with room after them for the fp32
        tail and the new tokens. Runs on the prefetch thread for offloaded caches."""
        return [self._load_old_one(layer, i) for i in range(len(self.plan.reads))]

    def _load_old_one(self, layer: int, i: int) -> torch.Tensor:
        gi, j = self.cache.where[layer]
        pool = self.cache.pools[gi]
        hkv, d = self.cache.model.num_kv_heads, self.cache.model.head_dim
        read, rows = self.plan.reads[i][gi], self.plan.rows[i]
        n = rows.stop - rows.start
        buf = torch.empty(2, hkv, read.positions.shape[0], d, device=self.cache.placement.compute)
        if isinstance(pool, QuantPool):
            if read.n_pages:
                pool.read_into(j, read.pages, read.page_run or 0, read.n_pages, buf[:, :, : read.n_pages * pool.page_size])
            return buf
        m = read.positions.shape[0] - n
        if m:
            if read.first_slot is not None:
                src = pool.flat[j][:, :, read.first_slot :][:, :, :m]
            else:
                assert read.slots is not None
                src = pool.flat[j].index_select(2, read.slots[:m].to(pool.flat[j].device))
            buf[:, :, :m].copy_(src, non_blocking=True)
        return buf

    def _dense(self, layer: int, q: torch.Tensor, kv: torch.Tensor, read: ReadPlan, scale: float,
               i: int = 0, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; kv: [2, Hkv, L, D] -> [T, Hq, D]. ``i``: the sequence's index in the batch."""
        st = self.plan.seqs[i].press
        if st is not None and st.replay is not None:
            self._replay_scores(layer, q, kv, scale, i)
        if read.press:
            return self._pressed(layer, q, kv, scale, i)
        if read.delta is not None:
            rot = self.rotaries[layer] if self.rotaries is not None else None
            if rot is not None:
                q_sink = rot.rotate(q, -read.delta)  # [T, Hq, D]
                o = attend_with_sinks(q.transpose(0, 1), q_sink.transpose(0, 1), kv[0], kv[1], read.mask,
                                      read.n_sink, scale, softcap=self.softcap, sink_logits=sink_logits)
                return o.transpose(0, 1)
        return attend(q.transpose(0, 1), kv[0], kv[1], read.mask, scale, self.softcap, sink_logits).transpose(0, 1)

    def _replay_scores(self, layer: int, q: torch.Tensor, kv: torch.Tensor, scale: float, i: int) -> None:
        """KVzip: the largest attention the replayed tokens q [T, Hq, D] give each slot of kv
        [2, Hkv, L, D], gathered into the press's scores (press/kvzip.py)."""
        seq = self.plan.seqs[i]
        st = seq.press
        assert st is not None and st.replay is not None
        gi, j = self.cache.where[layer]
        acc = st.acc[gi]
        assert acc is not None
        lo, hi, end = st.replay
        q_pos = torch.arange(seq.length - q.shape[0], seq.length)
        peak = replay_peaks(q, q_pos, kv[0], st.positions(gi, j), scale, lo, hi, end, st.press.protect_first)
        acc[j, :, : peak.shape[1]] = torch.maximum(acc[j, :, : peak.shape[1]], peak)

    def _pressed(self, layer: int, q: torch.Tensor, kv: torch.Tensor, scale: float, i: int) -> torch.Tensor:
        """A press sequence whose layers and KV heads hold different tokens in their slots: masks
        per head from the positions the slots hold (windows and sinks by position), and the
        attention weights handed to the press when it scores with them. q: [T, Hq, D]; kv:
        [2, Hkv, L, D] -> [T, Hq, D]."""
        seq = self.plan.seqs[i]
        st = seq.press
        assert st is not None
        gi, j = self.cache.where[layer]
        g = self.cache.groups[gi]
        t = q.shape[0]
        q_pos = torch.arange(seq.length - t, seq.length)
        k_pos = st.positions(gi, j)  # [Hkv, L]
        mask = press_mask(q_pos, k_pos, g.window, g.sinks)
        q_sink, n_sink = None, 0
        rot = self.rotaries[layer] if self.rotaries is not None else None
        if g.sinks and g.window is not None and rot is not None:
            delta = (q_pos - (g.window - 1)).clamp(min=0)  # [T]
            if bool((delta > 0).any()):
                q_sink = rot.rotate(q, -delta).transpose(0, 1)
                n_sink = int(((k_pos[0] >= 0) & (k_pos[0] < g.sinks)).sum())
        weights = st.press.attention and (st.observing or st.press.decode)
        verifying = weights and not st.observing and t > 1  # proposals: only kept queries may count
        out, summed, last = attend_heads(q.transpose(0, 1), kv[0], kv[1], mask, scale, q_sink, n_sink, weights,
                                         rows_per_block=max(t, 256) if verifying else 256, per_query=verifying)
        if verifying:
            st.pending[layer] = (gi, j, q_pos, summed, last)  # press/state.py ``commit``
            st.scale = scale
            return out.transpose(0, 1)
        acc = st.acc[gi]
        if summed is not None and acc is not None:
            acc[j, :, : summed.shape[1]] += summed
        if last is not None and st.press.decode and not st.observing:
            st.last[layer] = last
        st.scale = scale
        return out.transpose(0, 1)

    def _plain(self, gi: int, i: int) -> bool:
        """Whether sequence ``i``'s read of group ``gi`` is plain causal: every position 0 .. L-1
        stored and seen by each new token up to itself (no window, sinks or press), as qattn.c's
        kernels take it. Asked once a forward, whatever the number of layers."""
        key = (i, gi)
        if key not in self._plains:
            g, seq, read = self.cache.groups[gi], self.plan.seqs[i], self.plan.reads[i][gi]
            n = read.positions.shape[0]
            self._plains[key] = (g.window is None and not g.sinks and seq.press is None and read.delta is None
                                 and not read.press and n > 0 and int(read.positions[-1]) == n - 1)
        return self._plains[key]

    def _quant(self, layer: int, gi: int, j: int, i: int, pool: QuantPool, q: torch.Tensor,
               buf: torch.Tensor | None, kv_new: torch.Tensor, read: ReadPlan, seq: SeqKV,
               scale: float, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Attend over the sealed pages, the fp32 tail and the new tokens, then seal the pages
        that left the residual window. Plain causal reads (no window, sinks or press) go to qattn,
        which reads the codes in place, in one order for every row however many come at once;
        otherwise the pages are dequantized into ``buf`` ([2, Hkv, L, D], filled here unless the
        prefetcher did)."""
        tails = seq.tails[gi]
        assert tails is not None
        tail = tails[j]
        n_q = read.n_pages * pool.page_size
        rest = torch.cat((tail, kv_new), 2)  # [2, Hkv, t + n, D]
        out = None
        if (buf is None and self.softcap is None and sink_logits is None and self._plain(gi, i)
                and n_q + rest.shape[2] == read.positions.shape[0]):
            pages = read.pages if read.pages is not None else torch.arange(read.page_run or 0,
                                                                            (read.page_run or 0) + read.n_pages)
            out = kernels.quant_attend((q * scale).contiguous(), pages, pool.parts[j], pool.page_size, pool.group,
                                       pool.bits, rest, pool.rotate)
        if out is None:
            if buf is None:
                buf = self._load_old_one(layer, i)
            buf[:, :, n_q:] = rest
            out = self._dense(layer, q, buf, read, scale, i, sink_logits)
        tails[j] = pool.seal(j, read.new_pages, rest)
        return out
