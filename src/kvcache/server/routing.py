"""Prefix-aware routing over engine replicas, without Ray: which pages a request will look up,
what a replica publishes about the pages it holds, and which replica a request goes to.

A request's *route keys* are the chained page keys (prefix/keys.py) of the full pages of its
prompt, less its last token (the part a prefix lookup may reuse), under its tenant's salt, each
cut to its first ``SHORT_BYTES`` bytes. A replica's *summary* is the same short keys of every
full page its radix index holds, for every tenant, packed into bytes. Because each key names its
whole prefix, a request's first ``i`` keys all being in a summary means that replica holds the
request's first ``i`` pages, and two tenants' keys never meet: the router learns no more than
"this replica holds this tenant's prefix", and only for a request of that tenant.

``choose`` ranks replicas: the one holding the longest prefix of the route keys, less a price per
request already queued there (``queue_cost`` tokens each); when no replica holds a single page,
the less loaded of two picked at random.

Locking: none. ``index_summary`` reads the radix index and runs on the engine thread (through
``EngineLoop.call``); everything else is pure.
"""

from __future__ import annotations

import random
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcache.prefix.keys import page_key, root_key

if TYPE_CHECKING:
    from kvcache.prefix.cache import PrefixCache

SHORT_BYTES = 8  # bytes of a chained key kept in summaries and route keys (collisions: ~n^2 / 2^65)
MAX_SUMMARY_KEYS = 1 << 16  # a summary keeps at most this many pages, the most recently used (512 KiB)


@dataclass(frozen=True)
class KeySpace:
    """What the keys of one deployment's replicas are made of: the model's fingerprint, the cache
    layout, the page size and the salt of requests without an API key."""

    fingerprint: str
    layout: str
    page_size: int
    default_salt: str = ""


@dataclass(frozen=True)
class RouteHint:
    """What the router knows of a request: its route keys (empty: route by load alone)."""

    keys: tuple[int, ...] = ()
    tokens: int = 0  # prompt tokens


def short(key: bytes) -> int:
    return int.from_bytes(key[:SHORT_BYTES], "little")


def route_keys(space: KeySpace, tokens: Sequence[int], salt: str | None) -> tuple[int, ...]:
    """Short keys of the full pages of ``tokens[:-1]`` under ``salt`` (the default salt when None)."""
    ps = space.page_size
    key = root_key(space.fingerprint, space.layout, space.default_salt if salt is None else salt)
    out = []
    for at in range(0, (len(tokens) - 1) // ps * ps, ps):
        key = page_key(key, tokens[at : at + ps])
        out.append(short(key))
    return tuple(out)


def key_space(prefix: "PrefixCache") -> KeySpace:
    return KeySpace(prefix.fingerprint, prefix.layout, prefix.cache.page_size, prefix.config.salt)


def index_summary(prefix: "PrefixCache", limit: int = MAX_SUMMARY_KEYS) -> bytes:
    """The short keys of every full page in ``prefix``'s radix index, packed (``SHORT_BYTES``
    each, little-endian). Past ``limit`` pages, the most recently used are kept. Engine thread."""
    ps, index = prefix.cache.page_size, prefix.index
    found: list[tuple[int, int]] = []  # (last used, short key)
    for salt, root in list(index.roots.items()):
        keys = {id(root): root_key(prefix.fingerprint, prefix.layout, salt)}
        for node in index.nodes(salt):  # parents before children
            parent = keys.get(id(node.parent))
            if parent is None or len(node.tokens) < ps:
                continue
            key = node.key if node.key is not None else page_key(parent, node.tokens)
            keys[id(node)] = key
            found.append((node.last_used, short(key)))
    if len(found) > limit:
        found.sort(reverse=True)
        del found[limit:]
    return b"".join(k.to_bytes(SHORT_BYTES, "little") for _, k in found)


def unpack(blob: bytes) -> frozenset[int]:
    n = SHORT_BYTES
    return frozenset(int.from_bytes(blob[i : i + n], "little") for i in range(0, len(blob) - n + 1, n))


def held_pages(keys: Sequence[int], *held: Container[int]) -> int:
    """How many of ``keys``, from the first, are in any of ``held`` (sets, dicts)."""
    n = 0
    for k in keys:
        if not any(k in s for s in held):
            break
        n += 1
    return n


@dataclass
class Candidate:
    """A replica as the router sees it: pages of the request it holds and requests queued there."""

    name: str
    held: int = 0  # pages of the request's prefix
    load: int = 0  # requests in flight


@dataclass
class Policy:
    """``prefix``: longest held prefix weighed against load, else two random choices;
    ``round-robin``: each replica in turn (the baseline routing is measured against)."""

    name: str = "prefix"
    queue_cost: int = 128  # tokens of prefix a request already queued on a replica is worth
    rng: random.Random = field(default_factory=random.Random)
    turn: int = 0

    def __post_init__(self) -> None:
        if self.name not in ("prefix", "round-robin"):
            raise ValueError(f"unknown routing policy {self.name!r}: prefix or round-robin")

    def choose(self, cands: Sequence[Candidate], page_size: int) -> list[Candidate]:
        """``cands`` ranked, the one to try first at the front."""
        if not cands:
            return []
        if self.name == "round-robin":
            self.turn += 1
            at = self.turn % len(cands)
            return list(cands[at:]) + list(cands[:at])
        best = max(c.held for c in cands)
        if best == 0:
            pair = self.rng.sample(list(cands), min(2, len(cands)))
            first = min(pair, key=lambda c: c.load)
            return [first] + sorted((c for c in cands if c is not first), key=lambda c: c.load)

        def score(c: Candidate) -> tuple[int, int]:
            return (c.held * page_size - self.queue_cost * c.load, -c.load)

        return sorted(cands, key=score, reverse=True)
