"""SpanLink: compressed prompts (prefix/spans.py) in the disk and Redis tiers, for other processes.

One tier entry per compressed prompt, under the key ``page_key(root, all its token ids)`` where the
root hashes the model fingerprint, the cache layout (the press, its ratio or budget and protection
included, so another press's or a whole prompt's entry is another key) and the tenant salt. It
holds, per layer, the pages of the kept slots (their stored form), a quantized cache's fp32 tail,
per group the position each slot holds and the slot count. Per tenant a directory entry (key
``page_key(root, ())``) lists the prompt lengths written, newest last, so a lookup asks the tiers
for those prefixes of its prompt only: one request for the directory, one for the candidates.

An entry is checked like any tier entry (a CRC-32, or a keyed MAC with a tier secret) and against
this layout's shapes before a page is taken; anything else is a miss, removed from its tier.

Locking: none; the engine calls it from one thread (the tier writer thread only sees bytes).
"""

from __future__ import annotations

import torch

from kvcache.cache.paged import PagedKVCache
from kvcache.cache.persist import pages_by_name
from kvcache.cache.pool import PagePool
from kvcache.errors import CacheFull
from kvcache.prefix.entry import decode_entry, encode_entry, mac_key
from kvcache.prefix.keys import page_key, root_key
from kvcache.prefix.spans import SpanEntry, SpanIndex
from kvcache.prefix.tiers import TierChain

MAX_LENGTHS = 64  # prompt lengths a tenant's directory remembers


class SpanLink:
    def __init__(self, cache: PagedKVCache, index: SpanIndex, tiers: TierChain, fingerprint: str, layout: str,
                 secret: str | None) -> None:
        self.cache, self.index, self.tiers = cache, index, tiers
        self.fingerprint, self.layout = fingerprint, layout
        self.mac = mac_key(secret) if secret is not None else None
        self.lengths: dict[str, list[int]] = {}  # per salt, as last read or written
        self.restored_tokens = 0

    def _root(self, salt: str) -> bytes:
        return root_key(self.fingerprint, self.layout, salt)

    # -- write-through ----------------------------------------------------------------------------
    def write(self, entry: SpanEntry) -> None:
        """Queue the entry and the tenant's directory for the tiers."""
        root = self._root(entry.salt)
        key = entry.key = page_key(root, entry.tokens)
        tensors = self._tensors(entry)  # copies: the pages may be evicted and reused later
        self.tiers.put_async(key, lambda: encode_entry(key, tensors, secret=self.mac))
        lengths = [n for n in self._directory(entry.salt) if n != len(entry.tokens)] + [len(entry.tokens)]
        self.lengths[entry.salt] = lengths = lengths[-MAX_LENGTHS:]
        dkey = page_key(root, ())
        data = {"lengths": torch.tensor(lengths, dtype=torch.int64)}
        self.tiers.put_async(dkey, lambda: encode_entry(dkey, data, secret=self.mac))

    def _tensors(self, entry: SpanEntry) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {"slots": torch.tensor(entry.slots, dtype=torch.int64)}
        for g in self.cache.groups:
            out[f"group{g.index}.pos"] = entry.pos[g.index].contiguous()
            out.update(pages_by_name(self.cache, g.index, entry.pages[g.index], entry.tails[g.index]))
        return out

    # -- lookup -----------------------------------------------------------------------------------
    def _directory(self, salt: str) -> list[int]:
        dkey = page_key(self._root(salt), ())
        found = self.tiers.get_many([dkey], lambda k, b: decode_entry(b, k, self.mac))[0]
        if found is not None and "lengths" in found:
            self.lengths[salt] = [int(x) for x in found["lengths"].tolist()]
        return self.lengths.get(salt, [])

    def find(self, tokens: list[int], salt: str, limit: int) -> SpanEntry | None:
        """The longest compressed prompt in the tiers that begins ``tokens`` (at most ``limit``
        long), loaded into fresh pool pages and indexed; None when there is none (or no room)."""
        root = self._root(salt)
        lengths = sorted({n for n in self._directory(salt) if 0 < n <= min(limit, len(tokens))}, reverse=True)
        if not lengths:
            return None
        keys = [page_key(root, tuple(tokens[:n])) for n in lengths]
        for n, key, tensors in zip(lengths, keys, self.tiers.get_many(keys, self._decode)):
            if tensors is None:
                continue
            entry = self._load(tensors, tuple(tokens[:n]), salt, key)
            if entry is not None:
                self.restored_tokens += n
                return entry
        return None

    def _decode(self, key: bytes, blob: bytes) -> dict[str, torch.Tensor] | None:
        tensors = decode_entry(blob, key, self.mac)
        return tensors if tensors is not None and self._fits(tensors) else None

    def _fits(self, t: dict[str, torch.Tensor]) -> bool:
        """Whether an entry holds this layout's tensors with consistent shapes."""
        c, ps, hkv = self.cache, self.cache.page_size, self.cache.model.num_kv_heads
        slots = t.get("slots")
        if slots is None or tuple(slots.shape) != (len(c.groups),):
            return False
        for g in c.groups:
            s, pos = int(slots[g.index]), t.get(f"group{g.index}.pos")
            if pos is None or tuple(pos.shape) != (len(g.layers), hkv, s) or pos.dtype != torch.int32:
                return False
            pool = c.pools[g.index]
            for j, layer in enumerate(g.layers):
                if isinstance(pool, PagePool):
                    kv, n = t.get(f"layer{layer}.kv"), -(-s // ps)
                    want = (2, hkv, n, ps, pool.head_dim)
                    if (n and (kv is None or tuple(kv.shape) != want or kv.dtype != pool.dtype)) or (not n and kv is not None):
                        return False
                else:
                    tail = t.get(f"layer{layer}.tail")
                    if tail is None or tail.dim() != 4 or tail.shape[2] > s or (s - tail.shape[2]) % ps:
                        return False
                    n = (s - tail.shape[2]) // ps
                    for name, ref in pool.parts[j].items():
                        part = t.get(f"layer{layer}.{name}")
                        want = (ref.shape[0], n, *ref.shape[2:])
                        if n and (part is None or tuple(part.shape) != want or part.dtype != ref.dtype):
                            return False
        return True

    def _load(self, t: dict[str, torch.Tensor], tokens: tuple[int, ...], salt: str, key: bytes) -> SpanEntry | None:
        c, ps = self.cache, self.cache.page_size
        slots = [int(x) for x in t["slots"].tolist()]
        if any(bool((t[f"group{g.index}.pos"] >= len(tokens)).any()) for g in c.groups):
            return None  # a slot holding a token past the prompt: not this prompt's entry
        pages: list[list[int]] = []
        try:
            for g in c.groups:
                tail0 = t.get(f"layer{g.layers[0]}.tail")
                n = -(-slots[g.index] // ps) if tail0 is None else (slots[g.index] - tail0.shape[2]) // ps
                pages.append(c.pages.take(g.index, n) if n else [])
        except CacheFull:
            for g, got in enumerate(pages):
                c.pages.drop(g, got)
            return None
        tails: list[list[torch.Tensor] | None] = []
        for g in c.groups:
            pool, got = c.pools[g.index], pages[g.index]
            for j, layer in enumerate(g.layers):
                if got and isinstance(pool, PagePool):
                    pool.load_pages(j, got, t[f"layer{layer}.kv"])
                elif got:
                    pool.load_pages(j, got, {n: t[f"layer{layer}.{n}"] for n in pool.parts[j]})
            tails.append([t[f"layer{layer}.tail"].clone() for layer in g.layers] if c.quantized else None)
        pos = [t[f"group{g.index}.pos"].clone() for g in c.groups]
        entry = self.index.adopt(SpanEntry(salt, tokens, pages, slots, pos, tails, key=key))
        for g, got in enumerate(pages):  # the index now holds the references pages.take gave
            c.pages.drop(g, got)
        return entry
