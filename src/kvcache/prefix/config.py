"""PrefixConfig: how much finished requests' K/V is kept for reuse, and where it spills."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.errors import InvalidParams


@dataclass(frozen=True)
class PrefixConfig:
    """Automatic prefix caching.

    ``enabled``: finished requests leave their pages in a radix index; a new prompt that starts
    with cached tokens reuses them. ``max_cached_tokens``: in a dynamic pool, tokens the index may
    keep beyond what running requests hold before it evicts (a static pool evicts only when it is
    full). ``policy``: ``lru`` or ``lfu``. ``disk``: a folder for the disk tier; ``disk_bytes``: its
    size bound. ``redis``: a Redis URL (``redis://host:port/db``) shared by several processes.
    ``salt``: the default tenant salt (requests may give their own).
    """

    enabled: bool = True
    max_cached_tokens: int = 16384
    policy: str = "lru"
    disk: str | None = None
    disk_bytes: int | None = None
    redis: str | None = None
    salt: str = ""

    def __post_init__(self) -> None:
        if self.policy not in ("lru", "lfu"):
            raise InvalidParams(f"unknown prefix eviction policy {self.policy!r}: lru or lfu")
        if self.max_cached_tokens < 0:
            raise InvalidParams(f"max_cached_tokens must be 0 or more, got {self.max_cached_tokens}")
        if self.disk_bytes is not None and self.disk_bytes < 1:
            raise InvalidParams(f"disk_bytes must be positive, got {self.disk_bytes}")

    @property
    def tiers(self) -> bool:
        return self.disk is not None or self.redis is not None


def parse_prefix(value: "PrefixConfig | bool | None") -> PrefixConfig:
    if value is None or value is True:
        return PrefixConfig()
    if value is False:
        return PrefixConfig(enabled=False)
    if isinstance(value, PrefixConfig):
        return value
    raise InvalidParams(f"prefix must be a PrefixConfig, True or False, got {type(value).__name__}")
