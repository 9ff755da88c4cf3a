"""What every persistent tier of the prefix cache is: a byte store keyed by chained page keys.

Owns the ``Tier`` protocol, the ``TierUnavailable`` warning and the chain's counters
(``TierStats``). The stores (tier_disk.py, tier_redis.py) and the chain (tiers.py) build on it;
it imports none of them, and knows nothing of tensors, pages or the index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, Union

Blob = Union[bytes, Callable[[], bytes]]  # an entry's bytes, or a callable that makes them (on the writer thread)


class TierUnavailable(UserWarning):
    """A tier could not be read or written; the prefix cache goes on without it for a while."""


class Tier(Protocol):
    """A byte store. Reads of a missing or unreadable entry give None; failures may raise (the
    chain counts them and warns once) or be absorbed (then counted in the tier's ``errors``).
    A tier may also offer ``get_many(keys) -> list[bytes | None]`` (one round trip) and
    ``close()``."""

    name: str

    def get(self, key: bytes) -> bytes | None: ...

    def put(self, key: bytes, blob: bytes) -> None: ...

    def discard(self, key: bytes) -> None: ...

    def __contains__(self, key: bytes) -> bool: ...


@dataclass
class TierStats:
    """Counters of a TierChain. ``hits``: per tier name; ``misses``: gets no tier answered;
    ``writes``: entries written (to all tiers); ``errors``: failed reads or writes in any tier;
    ``dropped``: queued writes given up because the queue was full; ``rejected``: entries found
    that the caller's ``decode`` refused (corrupt, forged, another layout), removed."""

    hits: dict[str, int] = field(default_factory=dict)
    misses: int = 0
    writes: int = 0
    errors: int = 0
    dropped: int = 0
    rejected: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"hits": dict(self.hits), "misses": self.misses, "writes": self.writes,
                "errors": self.errors, "dropped": self.dropped, "rejected": self.rejected}
