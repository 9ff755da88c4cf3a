"""PrefixConfig: how much finished requests' K/V is kept for reuse, and where it spills."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvcache.errors import InvalidParams


@dataclass(frozen=True)
class PrefixConfig:
    """Automatic prefix caching.

    ``enabled``: finished requests leave their pages in a radix index; a new prompt that starts
    with cached tokens reuses them. ``max_cached_tokens``: in a dynamic pool, tokens the index may
    keep beyond what running requests hold before it evicts (a static pool evicts only when it is
    full). ``policy``: ``lru`` or ``lfu``. ``disk``: a folder for the disk tier; ``disk_bytes``: its
    size bound. ``redis``: a Redis URL (``redis://host:port/db``) shared by several processes.
    ``salt``: the default tenant salt (requests may give their own). ``secret``: tier entries
    carry a keyed MAC made with it, and entries without the right MAC are misses (see
    prefix/entry.py); every process sharing a tier needs the same secret.
    """

    enabled: bool = True
    max_cached_tokens: int = 16384
    policy: str = "lru"
    disk: str | None = None
    disk_bytes: int | None = None
    redis: str | None = None
    salt: str = ""
    secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.secret is not None and not self.secret.strip():
            raise InvalidParams("the tier secret is empty: give a secret, or none to use CRC-32 digests")
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


SECRET_ENV = "KVCACHE_TIER_SECRET"


def tier_secret(inline: str | None = None, file: str | None = None, env: str = SECRET_ENV) -> str | None:
    """The tier secret from ``inline``, else the first line of ``file``, else the environment
    variable ``env``; None when none is given. An empty one is refused (it would protect nothing)."""
    source, value = "--tier-secret", inline
    if value is None and file is not None:
        source = f"--tier-secret-file {file}"
        try:
            with open(file, encoding="utf-8") as fh:
                value = fh.readline().strip("\r\n")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidParams(f"cannot read the tier secret file {file}: {getattr(e, 'strerror', None) or e}") from None
    if value is None and env in os.environ:
        source, value = env, os.environ[env]
    if value is not None and not value.strip():
        raise InvalidParams(f"the tier secret from {source} is empty")
    return value
