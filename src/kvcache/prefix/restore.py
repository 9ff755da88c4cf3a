"""TierLink: the prefix index's traffic with its persistent tiers, restore and write-through.

- ``restore(tokens, m, salt, seq)``: extends a RAM match with full pages found in the tiers,
  RESTORE_BATCH chained keys at a time (one request per tier: a Redis MGET), each entry checked
  (digest or MAC, this layout's shapes) before it is loaded into fresh pool pages and indexed;
- ``write_through(path, salt)``: every full page of an inserted path that has no tier key yet is
  encoded and queued for the tiers (the chain's writer thread encodes and writes it);
- ``key(node, salt)``: a node's chained key (model fingerprint, cache layout, tenant salt, the
  token ids up to its page), computed along its path and kept on the nodes.

Owns the tier keys and the restore/write-through steps. May not touch the index's eviction or
policy (prefix/cache.py), nor the cache beyond taking pool pages for restored entries
(prefix/pages.py) and holding them in the looking-up sequence. Locking: none; the engine calls it
from one thread (the tier writer thread only sees bytes and the callables that make them).
"""

from __future__ import annotations

import json

from kvcache.cache.paged import PagedKVCache
from kvcache.cache.sequence import SeqKV
from kvcache.prefix.config import PrefixConfig
from kvcache.prefix.entry import decode_entry, encode_entry, mac_key
from kvcache.prefix.keys import page_key, root_key
from kvcache.prefix.pages import PageEntries, hold, unhold
from kvcache.prefix.radix import Match, Node, RadixIndex
from kvcache.prefix.tiers import DiskTier, RedisTier, Tier, TierChain

RESTORE_BATCH = 16  # pages asked of the tiers at once


def layout_text(cache: PagedKVCache) -> str:
    """The cache layout a tier entry is made for, as the text its root key hashes."""
    c, m = cache.config, cache.model
    return json.dumps({"encoding": c.encoding, "page_size": cache.page_size, "group_size": c.group_size,
                       "layers": m.num_layers, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
                       "groups": [[list(g.layers), g.window, g.sinks] for g in cache.groups],
                       # a press's entries never mix with another press's, or with whole prompts
                       **({"press": [c.press, c.ratio, c.keep, c.protect]} if c.press is not None else {}),
                       # rotated codes never mix with unrotated ones; unrotated keys stay as they were
                       **({"rotate": "hadamard"} if c.rotate else {})},
                      sort_keys=True)


def open_tiers(config: PrefixConfig) -> TierChain:
    """The chain of the tiers ``config`` names, fastest first (disk, then Redis)."""
    tiers: list[Tier] = []
    if config.disk is not None:
        tiers.append(DiskTier(config.disk, config.disk_bytes))
    if config.redis is not None:
        tiers.append(RedisTier(config.redis))
    return TierChain(tiers, read_timeout_s=config.tier_timeout_s)


class TierLink:
    def __init__(self, cache: PagedKVCache, index: RadixIndex, pages: PageEntries, tiers: TierChain,
                 fingerprint: str, layout: str, secret: bytes | None) -> None:
        self.cache, self.index, self.pages, self.tiers = cache, index, pages, tiers
        self.fingerprint, self.layout = fingerprint, layout
        self.mac = mac_key(secret) if secret is not None else None
        self.restored_tokens = 0  # tokens whose pages came from a tier
        self.rejected = 0  # entries found corrupt, forged or for another layout (recomputed)

    # -- restore ----------------------------------------------------------------------------------
    def restore(self, tokens: list[int], m: Match, salt: str, seq: SeqKV) -> None:
        """Extend the RAM match ``m`` (its nodes already held by ``seq``) with full pages found in
        the tiers, asking for up to RESTORE_BATCH chained keys at once and loading each layer's
        pages with one copy. A match that ends inside a page is first cut back to that page's
        start; the partial page is given up only when the tiers hold the whole page there."""
        ps = self.cache.page_size
        cut = m.length % ps
        base = m.nodes[:-1] if cut else m.nodes
        parent = base[-1] if base else self.index.root(salt)
        key = self.key(parent, salt)
        at = m.length - cut
        while at + ps <= len(tokens):
            keys, chunks = [], []
            while at + ps <= len(tokens) and len(keys) < RESTORE_BATCH:
                chunks.append(tuple(tokens[at : at + ps]))
                key = page_key(key, chunks[-1])
                keys.append(key)
                at += ps
            found = []
            for tensors in self.tiers.get_many(keys, self._decode):
                if tensors is None:
                    break
                found.append(tensors)
            if found and cut:  # the tiers go further than RAM's partial page: drop it
                unhold(self.cache, seq, m.nodes.pop())
                m.length -= cut
                cut = 0
            loaded = self.pages.load(found)  # fewer when the pool has no room for all
            for chunk, k, pages in zip(chunks, keys, loaded):
                node = self.index.add_child(parent, chunk, pages)
                node.key = k
                hold(self.cache, seq, [node])
                m.nodes.append(node)
                m.length += ps
                self.restored_tokens += ps
                parent = node
            if len(loaded) < len(keys):
                break

    def _decode(self, key: bytes, blob: bytes) -> dict | None:
        """An entry's tensors if it is intact, made with this secret and shaped for this layout."""
        tensors = decode_entry(blob, key, self.mac)
        if tensors is None or not self.pages.fits(tensors):
            self.rejected += 1
            return None
        return tensors

    # -- write-through ----------------------------------------------------------------------------
    def write_through(self, path: list[Node], salt: str) -> None:
        """Queue every full page of ``path`` (root to leaf) that has no tier key yet."""
        key = self.key(None, salt)
        for node in path:
            if len(node.tokens) < self.cache.page_size:
                break
            if node.key is not None:
                key = node.key
                continue
            key = node.key = page_key(key, node.tokens)
            tensors = self.pages.tensors(node.pages)  # copies: the page may be evicted and reused later
            self.tiers.put_async(key, lambda k=key, t=tensors: encode_entry(k, t, secret=self.mac))

    def key(self, node: Node | None, salt: str) -> bytes:
        """The chained tier key of ``node`` (the root's when None), computed along its path."""
        path = []
        while node is not None and node.parent is not None:
            if node.key is not None:
                break
            path.append(node)
            node = node.parent
        key = node.key if node is not None and node.key is not None else root_key(self.fingerprint, self.layout, salt)
        for n in reversed(path):
            key = n.key = page_key(key, n.tokens)
        return key
