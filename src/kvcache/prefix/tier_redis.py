"""RedisTier: prefix pages in a Redis several processes share (see tiers.py)."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable

from kvcache.errors import KVCacheError
from kvcache.prefix.tier_base import TierUnavailable


class RedisTier:
    """Entries in Redis under ``prefix + key.hex()``, with an optional ``ttl`` in seconds.

    ``timeout`` bounds every connect and command (no retries). On a failure the tier warns once
    (``TierUnavailable``) and counts as down for ``retry_after`` seconds: gets are misses and puts
    are dropped without touching the network. It then tries again; it warns again only after it
    has worked in between. Nothing is sent at construction.
    """

    name = "redis"

    def __init__(self, url: str, timeout: float = 0.5, ttl: int | None = None, prefix: str = "kvcache:",
                 retry_after: float = 5.0) -> None:
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            shown = _redact(url) if isinstance(url, str) else url
            raise KVCacheError(f"Redis URL {shown!r} must start with redis://, rediss:// or unix://")
        if url.startswith("unix://") and len(url) == len("unix://"):
            raise KVCacheError(f"Redis URL {url!r} names no socket path (unix:///path/to/redis.sock)")
        if ttl is not None and ttl < 1:
            raise KVCacheError(f"Redis entry ttl must be a positive number of seconds, got {ttl}")
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                               retry=Retry(NoBackoff(), 0), health_check_interval=0)
        except (ValueError, TypeError) as e:
            raise KVCacheError(f"bad Redis URL {_redact(url)!r}: {e}") from None
        self.url, self.ttl, self.prefix, self.retry_after = _redact(url), ttl, prefix, retry_after
        self.errors = 0  # failed commands (calls skipped while down are not counted)
        self._down_until = 0.0
        self._warned = False
        self._lock = threading.Lock()

    def _name(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def _call(self, fn: Callable[[], object], default: object) -> object:
        """Run one command; on any failure warn (once per outage), mark the tier down, give ``default``."""
        if time.monotonic() < self._down_until:
            return default
        try:
            out = fn()
        except Exception as e:  # redis.RedisError, OSError: a miss or a dropped write, never an error
            with self._lock:
                self.errors += 1
                self._down_until = time.monotonic() + self.retry_after
                warn, self._warned = not self._warned, True
            if warn:
                warnings.warn(f"kvcache: Redis at {self.url} did not answer ({type(e).__name__}: {e}); the "
                              f"prefix cache goes on without it, trying again every {self.retry_after:g} s",
                              TierUnavailable, stacklevel=3)
            return default
        self._warned = False
        return out

    @property
    def down(self) -> bool:
        """Whether the tier is waiting out a failure."""
        return time.monotonic() < self._down_until

    def __contains__(self, key: bytes) -> bool:
        return bool(self._call(lambda: self.client.exists(self._name(key)), False))

    def get(self, key: bytes) -> bytes | None:
        return self._call(lambda: self.client.get(self._name(key)), None)  # type: ignore[return-value]

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """One MGET for all ``keys``; all misses while the server is down."""
        return self._call(lambda: self.client.mget([self._name(k) for k in keys]),  # type: ignore[return-value]
                          [None] * len(keys))

    def put(self, key: bytes, blob: bytes) -> None:
        self._call(lambda: self.client.set(self._name(key), blob, ex=self.ttl), None)

    def discard(self, key: bytes) -> None:
        self._call(lambda: self.client.delete(self._name(key)), None)

    def clear(self) -> None:
        """Delete the keys under this tier's prefix (SCAN, so other data in the database stays)."""
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + "*"

        def run() -> None:
            batch = []
            for k in self.client.scan_iter(match=pattern, count=1000):
                batch.append(k)
                if len(batch) >= 1000:
                    self.client.delete(*batch)
                    batch.clear()
            if batch:
                self.client.delete(*batch)

        self._call(run, None)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"RedisTier({self.url!r}, prefix={self.prefix!r})"


def _redact(url: str) -> str:
    """``url`` with any password replaced, for messages."""
    import re
    from urllib.parse import urlsplit

    url = re.sub(r"(password=)[^&#]*", r"\1***", url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{parts.netloc.rsplit('@', 1)[1]}").geturl()
