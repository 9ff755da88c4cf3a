"""Persistent tiers of the prefix cache: plain byte stores keyed by chained page keys.

- ``DiskTier``: one file per entry under a folder (two-character fan-out), written to a temporary
  name and renamed, bounded in bytes (least recently used files go first);
- ``RedisTier``: entries in a Redis several processes or machines share; a server that is down,
  refuses or is slow is a miss (one warning, then a few seconds before trying again), never an
  error;
- ``TierChain``: asks the tiers in order (a hit in a later tier is copied into the earlier ones)
  and writes to all of them on a background thread.

Locking: the chain's writer thread is the only concurrent user; each tier guards its own state
with a lock.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from kvcache.errors import KVCacheError


class DiskTier:
    name = "disk"

    def __init__(self, path: str | os.PathLike, max_bytes: int | None = None) -> None:
        self.path = Path(path).expanduser()
        self.max_bytes = max_bytes
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise KVCacheError(f"prefix cache folder {self.path} is not writable: {e.strerror or e}") from None
        self._lock = threading.Lock()
        self._sizes: dict[Path, int] = {}  # entry -> bytes, in least recently used order
        for f in sorted(self.path.glob("*/*.kv"), key=lambda f: f.stat().st_atime):
            self._sizes[f] = f.stat().st_size
        self.nbytes = sum(self._sizes.values())

    def _file(self, key: bytes) -> Path:
        h = key.hex()
        return self.path / h[:2] / f"{h}.kv"

    def __contains__(self, key: bytes) -> bool:
        return self._file(key).is_file()

    def get(self, key: bytes) -> bytes | None:
        f = self._file(key)
        try:
            blob = f.read_bytes()
        except OSError:
            return None
        with self._lock:
            if f in self._sizes:
                self._sizes[f] = self._sizes.pop(f)  # most recently used now
        return blob

    def discard(self, key: bytes) -> None:
        """Remove an entry found corrupt."""
        f = self._file(key)
        f.unlink(missing_ok=True)
        with self._lock:
            self.nbytes -= self._sizes.pop(f, 0)

    def put(self, key: bytes, blob: bytes) -> None:
        f = self._file(key)
        f.parent.mkdir(exist_ok=True)
        tmp = f.with_name(f".{f.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(blob)
            os.replace(tmp, f)
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self.nbytes += len(blob) - self._sizes.pop(f, 0)
            self._sizes[f] = len(blob)
            if self.max_bytes is not None:
                while self.nbytes > self.max_bytes and len(self._sizes) > 1:
                    old = next(iter(self._sizes))
                    self.nbytes -= self._sizes.pop(old)
                    old.unlink(missing_ok=True)

    def clear(self) -> None:
        with self._lock:
            for f in list(self._sizes):
                f.unlink(missing_ok=True)
            self._sizes.clear()
            self.nbytes = 0


class RedisTier:
    name = "redis"
    RETRY_S = 5.0  # after a failure, how long the tier counts as down

    def __init__(self, url: str, timeout: float = 0.5, ttl: int | None = None, prefix: str = "kvcache:") -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise KVCacheError(f"Redis URL {url!r} must start with redis://, rediss:// or unix://")
        import redis

        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        except ValueError as e:
            raise KVCacheError(f"bad Redis URL {url!r}: {e}") from None
        self.url, self.ttl, self.prefix = url, ttl, prefix
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.errors = 0

    def _failed(self, e: Exception) -> None:
        with self._lock:
            self.errors += 1
            if time.monotonic() >= self._down_until:
                warnings.warn(f"kvcache: Redis at {self.url} did not answer ({type(e).__name__}); prefix pages "
                              f"there count as misses for {self.RETRY_S:.0f} s", stacklevel=3)
            self._down_until = time.monotonic() + self.RETRY_S

    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def __contains__(self, key: bytes) -> bool:
        if not self._up():
            return False
        try:
            return bool(self.client.exists(self.prefix.encode() + key))
        except Exception as e:
            self._failed(e)
            return False

    def get(self, key: bytes) -> bytes | None:
        if not self._up():
            return None
        try:
            return self.client.get(self.prefix.encode() + key)
        except Exception as e:  # redis.RedisError, OSError: a miss, never an error
            self._failed(e)
            return None

    def put(self, key: bytes, blob: bytes) -> None:
        if not self._up():
            return
        try:
            self.client.set(self.prefix.encode() + key, blob, ex=self.ttl)
        except Exception as e:
            self._failed(e)

    def discard(self, key: bytes) -> None:
        try:
            self.client.delete(self.prefix.encode() + key)
        except Exception as e:
            self._failed(e)

    def clear(self) -> None:
        try:
            for k in self.client.scan_iter(match=self.prefix + "*", count=500):
                self.client.delete(k)
        except Exception as e:
            self._failed(e)


@dataclass
class TierStats:
    hits: dict[str, int] = field(default_factory=dict)
    misses: int = 0
    writes: int = 0
    dropped: int = 0  # writes skipped because the queue was full

    def as_dict(self) -> dict[str, object]:
        return {"hits": dict(self.hits), "misses": self.misses, "writes": self.writes, "dropped": self.dropped}


class TierChain:
    def __init__(self, tiers: list, queue_size: int = 4096) -> None:
        self.tiers = tiers
        self.stats = TierStats(hits={t.name: 0 for t in tiers})
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._writer = threading.Thread(target=self._write_loop, name="kvcache-tiers", daemon=True)
        self._writer.start()

    def get(self, key: bytes) -> bytes | None:
        for i, tier in enumerate(self.tiers):
            blob = tier.get(key)
            if blob is not None:
                self.stats.hits[tier.name] += 1
                for earlier in self.tiers[:i]:  # promote: the next lookup finds it closer
                    self.put_async(key, blob, [earlier])
                return blob
        self.stats.misses += 1
        return None

    def discard(self, key: bytes) -> None:
        for tier in self.tiers:
            tier.discard(key)

    def put(self, key: bytes, blob: bytes) -> None:
        for tier in self.tiers:
            tier.put(key, blob)
        self.stats.writes += 1

    def put_async(self, key: bytes, blob: object, tiers: list | None = None) -> None:
        """Queue a write (``blob``: bytes, or a callable returning them, run on the writer)."""
        try:
            self._q.put_nowait((key, blob, tiers))
        except queue.Full:
            self.stats.dropped += 1

    def _write_loop(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                key, blob, tiers = item
                data = blob() if callable(blob) else blob
                for tier in tiers or self.tiers:
                    try:
                        tier.put(key, data)
                    except OSError as e:  # a full or vanished disk: the page stays in RAM only
                        warnings.warn(f"kvcache: could not write a prefix page to {tier.name}: {e}", stacklevel=2)
                self.stats.writes += 1
            finally:
                self._q.task_done()

    def flush(self) -> None:
        """Wait until every queued write is done."""
        self._q.join()

    def close(self) -> None:
        self.flush()
        self._q.put(None)
        self._writer.join(timeout=10)

    def stats_dict(self) -> dict[str, object]:
        return self.stats.as_dict()
