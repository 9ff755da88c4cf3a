"""Retention: a press's evictions carried out on the paged cache (kvcache/press/ does the scoring).

A sequence with a press keeps its tokens in *slots*: ``held(seq, g)`` of them per layer group,
``seq.length - seq.dropped[g]``, in page order through its page table (never a HOLE). Each layer
and KV head may hold other tokens in the same slot; ``seq.press.pos`` says which (press/state.py),
and attention masks by those positions, never renumbering them (keys keep the RoPE of their own
position). Every layer and head of a group holds the same number of slots.

- ``end_prompt``: a prompt is in: its press scores the tokens added since the last compression
  (the span) and evicts its share; what stays is packed to the front and the pages past it go
  back to the pool. Quantized caches keep the whole prompt in their fp32 tail until then (evict,
  then quantize what stays).
- ``settle``: before a forward, a decode-time press evicts what the last step's attention
  condemned. Float pools mark the slots (-1) and pack them away once a page's worth is marked;
  quantized pools evict from the fp32 tail only (sealed pages are final).
- ``pack``: the packing itself; pages another sequence shares are copied before they are written.
- ``cut_point`` / ``truncate``: going back to an earlier length when the tokens after it sit in
  the last slots; ``release_dead``: a window's dead pages leave the table.

Each of these changes the press's tensors in place, which forwards made under inference mode, so
each runs under it too, whoever calls (the scheduler asks for pages outside any forward).

The cache comes in as CacheParts (cache/parts.py) and pages move only through its page manager
(``cache.pages``), which calls ``settle``, ``release_dead`` and ``truncate`` itself: this module
sits below pages.py and paged.py and imports neither.
"""

from __future__ import annotations

import torch

from kvcache.cache.parts import CacheParts
from kvcache.cache.pool import PagePool
from kvcache.cache.qpool import QuantPool
from kvcache.cache.sequence import SeqKV
from kvcache.press.base import LayerView
from kvcache.press.select import candidates, decode_evictions, evict_mask, span_evictions


def held(seq: SeqKV, g: int) -> int:
    """Slots the sequence uses in group g (its length where nothing was evicted)."""
    return seq.length - seq.dropped[g]


def slot_ids(cache: CacheParts, seq: SeqKV, g: int, n: int) -> torch.Tensor:
    """Pool slots of the sequence's first n slots of group g: [n] int64."""
    ps = cache.page_size
    i = torch.arange(n)
    return torch.tensor(seq.tables[g], dtype=torch.long)[i // ps] * ps + i % ps


def read_layer(cache: CacheParts, seq: SeqKV, g: int, j: int) -> torch.Tensor:
    """Every slot of layer j (index in group g): [2, Hkv, S, D] fp32 (quantized pages dequantized,
    then the fp32 tail)."""
    pool, s = cache.pools[g], held(seq, g)
    if isinstance(pool, PagePool):
        return pool.read(j, None, slot_ids(cache, seq, g, s), s)
    table, tail = seq.tables[g], seq.tails[g][j]  # type: ignore[index]
    buf = torch.empty(2, pool.num_kv_heads, s, pool.head_dim)
    if table:
        pool.read_into(j, torch.tensor(table, dtype=torch.long), 0, len(table), buf[:, :, : len(table) * pool.page_size])
    buf[:, :, len(table) * pool.page_size :] = tail
    return buf


def _frozen(cache: CacheParts, seq: SeqKV, g: int) -> int:
    """Slots that may not move: a quantized group's sealed pages."""
    return len(seq.tables[g]) * cache.page_size if cache.config.quantized else 0


def _view(cache: CacheParts, seq: SeqKV, g: int, j: int, last: bool) -> LayerView:
    st = seq.press
    assert st is not None
    layer = cache.groups[g].layers[j]
    kv = read_layer(cache, seq, g, j)
    acc = st.acc[g]
    return LayerView(kv[0], kv[1], st.positions(g, j), seq.length, st.scale, st.obs[layer],
                     acc=None if acc is None else acc[j, :, : st.n[g]],
                     last=st.last[layer] if last else None, rotary=st.rotary[layer])


@torch.inference_mode()
def end_prompt(cache: CacheParts, seq: SeqKV) -> None:
    """Score the span since the last compression and evict its share (see the module doc)."""
    st, cfg = seq.press, cache.config
    if st is None or not st.observing:
        return
    for g in cache.groups:
        keep = []
        for j in range(len(g.layers)):
            view = _view(cache, seq, g.index, j, last=False)
            n = span_evictions(view.pos, st.since, cfg.ratio, cfg.keep)
            ev = torch.zeros_like(view.live)
            if n:
                allowed = candidates(view.pos, seq.length, st.press, cfg.protect, g.sinks, st.since,
                                     _frozen(cache, seq, g.index))
                if bool(allowed.any()):  # nothing may go (a short prompt): nothing to score
                    ev = evict_mask(st.press.score(view), allowed, n)
            keep.append(view.live & ~ev)
        pack(cache, seq, g.index, torch.stack(keep))
    st.since, st.observing = seq.length, False
    st.points.append(seq.length)
    st.reset_observations()
    if st.press.replay:
        st.end_replay()


@torch.inference_mode()
def settle(cache: CacheParts, seq: SeqKV) -> None:
    """Before a forward: a decode-time press's evictions from the last step's attention, and
    packing once a page's worth of float slots is marked."""
    st, cfg = seq.press, cache.config
    if st is None:
        return
    st.commit(seq.length)  # a verifying forward's kept queries
    for g in cache.groups:
        gi = g.index
        if st.press.decode and not st.observing and st.n[gi]:
            keep, marked = [], False
            for j, layer in enumerate(g.layers):
                pos = st.positions(gi, j)
                n = decode_evictions(pos, seq.length, cfg.ratio, cfg.keep)
                # TOVA waits for a query's weights (none after scored text), H2O has its sums
                ready = st.last[layer] is not None if st.press.latest else st.acc[gi] is not None
                if not n or not ready or (st.last[layer] is not None and st.last[layer].shape[1] != pos.shape[1]):
                    keep.append(pos >= 0)
                    continue
                allowed = candidates(pos, seq.length, st.press, cfg.protect, g.sinks, 0, _frozen(cache, seq, gi))
                if not bool(allowed.any()):
                    keep.append(pos >= 0)
                    continue
                ev = evict_mask(st.press.score(_view(cache, seq, gi, j, last=True)), allowed, n)
                keep.append((pos >= 0) & ~ev)
                marked = marked or bool(ev.any())
            if marked:
                if cache.config.quantized:
                    pack(cache, seq, gi, torch.stack(keep))
                else:
                    for j, k in enumerate(keep):
                        st.pos[gi][j, :, : st.n[gi]][~k] = -1
            st.last = [None] * len(st.last)
        if not cache.config.quantized and st.masked(gi) >= cache.page_size:
            pack(cache, seq, gi, st.pos[gi][:, :, : st.n[gi]] >= 0)


@torch.inference_mode()
def pack(cache: CacheParts, seq: SeqKV, g: int, keep: torch.Tensor) -> None:
    """Keep the slots ``keep`` marks ([n_layers, Hkv, S] bool, the same count everywhere), packed
    to the front in their order; pages past them go back to the pool."""
    st = seq.press
    assert st is not None
    s = keep.shape[2]
    counts = keep.sum(-1)
    m = int(counts.max())
    if int(counts.min()) != m:
        raise AssertionError("a press kept different numbers of tokens in one group")
    if m == s:
        return
    idx = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[:, :, :m]  # [n_layers, Hkv, m]
    pool, ps, table = cache.pools[g], cache.page_size, seq.tables[g]
    if isinstance(pool, QuantPool):
        sealed = len(table) * ps
        if sealed and not bool((idx[:, :, :sealed] == torch.arange(sealed)).all()):
            raise AssertionError("a press may not move sealed quantized slots")
        tails = seq.tails[g]
        assert tails is not None
        for j, tail in enumerate(tails):
            ti = (idx[j, :, sealed:] - sealed)[None, :, :, None].expand(2, -1, -1, tail.shape[3])
            tails[j] = torch.gather(tail, 2, ti).clone()
    else:
        moved = (idx != torch.arange(m)).flatten(0, 1).any(0)  # [m]
        first = int(torch.nonzero(moved)[0]) if bool(moved.any()) else m
        cache.pages.own_pages(seq, g, first // ps, -(-m // ps))
        slots = slot_ids(cache, seq, g, s)
        dst = slots[first:m]
        for j in range(len(cache.groups[g].layers)):
            flat = pool.flat[j]  # [2, Hkv, P * ps, D]
            src = slots[idx[j, :, first:m]]  # [Hkv, m - first]
            data = torch.gather(flat, 2, src.to(flat.device)[None, :, :, None].expand(2, -1, -1, flat.shape[3]))
            flat.index_copy_(2, dst.to(flat.device), data)
        keep_pages = -(-m // ps)
        cache.pages.drop(g, table[keep_pages:])
        del table[keep_pages:]
    seq.dropped[g] += s - m
    st.keep(g, idx)


def cut_point(cache: CacheParts, seq: SeqKV, length: int) -> list[int] | None:
    """Per group, the slot count that holds exactly the tokens before ``length`` (every later one in
    the slots after it), or None when the tokens are mixed (or a quantized cut would fall inside
    sealed pages)."""
    st = seq.press
    assert st is not None
    out = []
    for g in cache.groups:
        pos = st.pos[g.index][:, :, : st.n[g.index]]
        before = (pos >= 0) & (pos < length)
        after = pos >= length
        idx = torch.arange(pos.shape[2])
        c = int(torch.where(before, idx, -1).max()) + 1 if pos.shape[2] else 0
        if bool(after[:, :, :c].any()):
            return None
        if c < _frozen(cache, seq, g.index):
            return None
        out.append(c)
    return out


@torch.inference_mode()
def truncate(cache: CacheParts, seq: SeqKV, length: int) -> None:
    """Forget the tokens from ``length`` on (``cut_point`` must allow it)."""
    cuts = cut_point(cache, seq, length)
    if cuts is None:
        raise ValueError(f"cannot go back to {length} tokens: the press mixed later tokens into earlier slots")
    st, ps = seq.press, cache.page_size
    assert st is not None
    for g, c in zip(cache.groups, cuts):
        gi = g.index
        if cache.config.quantized:
            sealed = len(seq.tables[gi]) * ps
            seq.tails[gi] = [t[:, :, : c - sealed] for t in seq.tails[gi]]  # type: ignore[union-attr]
        else:
            keep = -(-c // ps)
            cache.pages.drop(gi, seq.tables[gi][keep:])
            del seq.tables[gi][keep:]
        st.truncate(gi, c)
        seq.dropped[gi] = length - c
    seq.length = length
    st.since = min(st.since, length)
    st.commit(length)  # a verifying forward's kept queries; the refused ones never count


@torch.inference_mode()
def release_dead(cache: CacheParts, seq: SeqKV) -> None:
    """Windowed groups: pages whose every slot holds a token no later query sees leave the table
    (pages holding sinks stay; a quantized group's fp32 tail is not a page)."""
    st, ps = seq.press, cache.page_size
    assert st is not None
    for g in cache.groups:
        dead = g.dead_before(seq.length)
        if not dead:
            continue
        gi, table = g.index, seq.tables[g.index]
        first = -(-g.sinks // ps)
        i = first
        while i < len(table) and (i + 1) * ps <= st.n[gi]:
            page = st.pos[gi][:, :, i * ps : (i + 1) * ps]
            if not bool((page < dead).all()):
                break
            i += 1
        if i > first:
            cache.pages.drop(gi, table[first:i])
            del table[first:i]
            st.cut(gi, first * ps, i * ps)
            seq.dropped[gi] += (i - first) * ps
            st.released = True


def observe(seq: SeqKV, layer: int, q: torch.Tensor, rotary: object | None, scale: float) -> None:
    """Record what the press needs of a prompt's queries q [n, Hq, D] (RoPE applied) in one layer:
    the latest ones, and the moments of the ones before RoPE (past the press's own sinks)."""
    st = seq.press
    assert st is not None
    press, n = st.press, q.shape[0]
    st.scale, st.rotary[layer] = scale, rotary
    q_pos = torch.arange(seq.length - n, seq.length)
    if press.queries:
        st.obs[layer].record_queries(q, q_pos, press.queries)
    if press.moments:
        first = int((q_pos < press.protect_first).sum())
        if first < n:
            qq, pp = q[first:].float(), q_pos[first:]
            if rotary is not None:
                qq = rotary.rotate(qq, -pp) / rotary.attention_factor  # type: ignore[attr-defined]
            st.obs[layer].record_moments(qq)
