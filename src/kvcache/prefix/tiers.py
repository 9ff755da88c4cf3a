"""Persistent tiers of the prefix cache: plain byte stores keyed by chained page keys.

- ``DiskTier``: one file per entry under a folder (``ab/abcdef....kv``), written to a temporary
  name in the same folder and renamed, so a crash never leaves half an entry under a real name.
  Bounded in bytes: the least recently used files go first. A file that cannot be read is a miss
  and is removed; content that is readable but wrong is caught by the entry's digest, and the
  caller then ``discard``s it.
- ``RedisTier``: entries in a Redis that several processes or machines share. A server that is
  down, refuses or is slow is a miss and a dropped write, never an error: one warning, then the
  tier counts as down for a few seconds before it tries again.
- ``TierChain``: asks the tiers in order (a hit in a later tier is copied into the earlier ones,
  once the caller's ``decode`` has accepted it: a corrupt or forged entry is removed from the
  tier that held it and never promoted), and writes to all of them, on a background writer
  thread when asked to (``put_async``). Every read runs on a reader thread of its tier and is
  waited for at most ``read_timeout_s``: a tier that does not answer in time (a hung disk, a
  stalled server, a file that blocks) is a miss, and is skipped until its read returns and
  ``retry_after_s`` has passed, so the caller (the engine) never waits longer than that.

Tiers store bytes as given and know nothing of tensors (the ``Tier`` protocol, ``TierUnavailable``
and ``TierStats`` live in tier_base.py); ``entry.py`` turns pages into bytes that carry their key
and a digest.

Locking: the chain's writer thread and the reader threads (a daemon thread per read, at most one
running per tier) run concurrently with the caller. Each tier guards its own bookkeeping with a
lock, so a read and ``put`` on the writer thread may overlap; the chain guards its counters with a
lock.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from functools import partial
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kvcache.prefix.tier_base import Blob, Tier, TierStats, TierUnavailable
from kvcache.prefix.tier_disk import DiskTier
from kvcache.prefix.tier_redis import RedisTier

__all__ = ["DiskTier", "RedisTier", "Tier", "TierChain", "TierStats", "TierUnavailable"]

CLOSE_TIMEOUT_S = 30.0  # close() waits this long for queued writes; what is left then is dropped


def _close_at_exit(ref: weakref.ref) -> None:
    """The interpreter is exiting with a chain nobody closed: drain it now, while threads still
    run (a writer thread left in the middle of encoding a page when the interpreter finalizes
    would abort the process)."""
    chain = ref()
    if chain is not None:
        chain.close()


def _in_thread(fn: Callable[[], Any]) -> Future:
    """``fn()`` on a daemon thread of its own (one that hangs never holds up the process's exit)."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to the waiter, who counts it as a failed read
            fut.set_exception(e)

    threading.Thread(target=run, name="kvcache-tier-read", daemon=True).start()
    return fut


class TierChain:
    """Tiers asked in order (fastest first, e.g. disk then Redis); writes go to all of them.

    ``put_async`` queues a write (at most ``queue_size``; beyond that writes are dropped and
    counted, never waited for) for the writer thread, the only other thread here. ``flush`` waits
    for the queue to drain; ``close`` flushes (at most ``CLOSE_TIMEOUT_S``, then drops what is
    left, each write whole or not at all) and stops the thread. A chain still open when the
    interpreter exits is closed then (an ``atexit`` hook), so every stop drains its writes.
    """

    def __init__(self, tiers: list[Tier], queue_size: int = 1024, read_timeout_s: float = 2.0,
                 retry_after_s: float = 10.0) -> None:
        self.tiers = list(tiers)
        self.read_timeout_s, self.retry_after_s = read_timeout_s, retry_after_s
        self._pending: list[Future | None] = [None] * len(self.tiers)  # a read that outlived its wait
        self._skip_until = [0.0] * len(self.tiers)
        self.names: list[str] = []
        for i, t in enumerate(self.tiers):
            name = getattr(t, "name", type(t).__name__)
            self.names.append(name if name not in self.names else f"{name}{i}")
        self._stats = TierStats(hits={n: 0 for n in self.names})
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._closed = False
        self._cancel = False  # set by a close that ran out of time: the writer drops what is left
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._writer = threading.Thread(target=self._write_loop, name="kvcache-tiers", daemon=True)
        self._writer.start()
        self._at_exit = partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    # -- reading ----------------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        """The first tier's bytes for ``key``; a hit in a later tier is queued into the earlier ones."""
        return self.get_many([key])[0]

    def get_many(self, keys: list[bytes], decode: Callable[[bytes, bytes], Any] | None = None) -> list[Any]:
        """The first tier's bytes for each key (None: no tier has it), asking each tier once (Redis:
        one MGET) for the keys still missing. With ``decode(key, blob)``, its result instead; a
        blob it refuses (None) is removed from that tier and the next tier is asked. Accepted hits
        in a later tier are queued into the earlier ones (never before they were accepted)."""
        out: list[Any] = [None] * len(keys)
        todo = list(range(len(keys)))
        for i, tier in enumerate(self.tiers):
            if not todo:
                break
            try:
                blobs = self._read(i, [keys[j] for j in todo])
            except Exception as e:
                self._failed(i, "read", e)
                continue
            left = []
            for j, blob in zip(todo, blobs):
                if blob is None:
                    left.append(j)
                    continue
                value = blob if decode is None else decode(keys[j], blob)
                if value is None:  # corrupt, forged or not this layout's: gone from this tier
                    self._reject(i, keys[j])
                    left.append(j)
                    continue
                out[j] = value
                with self._lock:
                    self._stats.hits[self.names[i]] += 1
                if i:
                    self._enqueue(keys[j], blob, self.tiers[:i])
            todo = left
        with self._lock:
            self._stats.misses += len(todo)
        return out

    def _read(self, i: int, keys: list[bytes]) -> list[bytes | None]:
        """Tier ``i``'s bytes for ``keys``, read on its reader thread; TimeoutError when it does not
        answer within ``read_timeout_s``, or while an earlier read that did not is still running
        (or ended less than ``retry_after_s`` ago)."""
        pending = self._pending[i]
        if pending is not None:
            if not pending.done():
                raise TimeoutError(f"an earlier read has not returned after {self.read_timeout_s:g} s")
            self._pending[i] = None
            self._skip_until[i] = time.monotonic() + self.retry_after_s
        if time.monotonic() < self._skip_until[i]:
            raise TimeoutError(f"skipped for {self.retry_after_s:g} s after a read that took too long")
        tier = self.tiers[i]
        many = getattr(tier, "get_many", None)
        fut = _in_thread(lambda: many(keys) if many else [tier.get(k) for k in keys])
        try:
            return fut.result(self.read_timeout_s)
        except FutureTimeout:
            self._pending[i] = fut
            raise TimeoutError(f"no answer within {self.read_timeout_s:g} s") from None

    def __contains__(self, key: bytes) -> bool:
        return any(key in t for t in self.tiers)

    def _reject(self, i: int, key: bytes) -> None:
        with self._lock:
            self._stats.rejected += 1
        try:
            self.tiers[i].discard(key)
        except Exception as e:
            self._failed(i, "write", e)

    # -- writing ----------------------------------------------------------------------------------
    def put(self, key: bytes, blob: Blob, tiers: list[Tier] | None = None) -> None:
        """Write ``blob`` (bytes, or a callable giving them) to every tier (or ``tiers``), now."""
        try:
            data = blob() if callable(blob) else blob
        except Exception as e:
            with self._lock:
                self._stats.errors += 1
            self._warn_once("encode", f"kvcache: a prefix page could not be encoded for the tiers: {e!r}")
            return
        for tier in self.tiers if tiers is None else tiers:
            try:
                tier.put(key, data)
            except Exception as e:  # a full or vanished disk: the page stays in RAM only
                self._failed(self.tiers.index(tier), "write", e)
        if tiers is None:
            with self._lock:
                self._stats.writes += 1

    def put_async(self, key: bytes, blob: Blob, tiers: list[Tier] | None = None) -> None:
        """Queue a write for the writer thread; ``blob`` may be a callable, run there. Never waits:
        with the queue full the write is dropped (and counted). After ``close`` it writes now."""
        if self._closed:
            self.put(key, blob, tiers)
            return
        self._enqueue(key, blob, tiers)

    def _enqueue(self, key: bytes, blob: Blob, tiers: list[Tier] | None) -> None:
        try:
            self._q.put_nowait((key, blob, tiers))
        except queue.Full:
            with self._lock:
                self._stats.dropped += 1

    def _write_loop(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if self._cancel:
                    with self._lock:
                        self._stats.dropped += 1
                    continue
                self.put(*item)
            except Exception:  # put counts its own failures; the thread must outlive anything
                pass
            finally:
                self._q.task_done()

    def discard(self, key: bytes) -> None:
        """Remove ``key`` from every tier (an entry found wrong)."""
        for i, tier in enumerate(self.tiers):
            try:
                tier.discard(key)
            except Exception as e:
                self._failed(i, "write", e)

    def flush(self) -> None:
        """Wait until every queued write is done."""
        if not self._closed:
            self._q.join()

    def _drained(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for every queued write to be done; whether they are."""
        deadline = time.monotonic() + timeout_s
        done = self._q.all_tasks_done
        with done:
            while self._q.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                done.wait(left)
        return True

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Finish the queued writes (for at most ``timeout_s``; the writes still queued then are
        dropped and counted, and the one being written finishes), stop the writer thread and
        close the tiers. Idempotent."""
        if self._closed:
            return
        atexit.unregister(self._at_exit)
        self._cancel = not self._drained(timeout_s)
        self._closed = True  # put_async writes at once from now on
        try:
            self._q.put(None, timeout=5)
        except queue.Full:  # a writer stuck in a tier: it is a daemon, left behind
            pass
        self._writer.join(timeout=5 if self._cancel else timeout_s)
        for tier in self.tiers:
            close = getattr(tier, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> TierChain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- counters ---------------------------------------------------------------------------------
    def _failed(self, i: int, what: str, e: Exception) -> None:
        with self._lock:
            self._stats.errors += 1
        self._warn_once(f"{self.names[i]}:{what}", f"kvcache: could not {what} a prefix page in the "
                        f"{self.names[i]} tier ({type(e).__name__}: {e}); going on without it")

    def _warn_once(self, what: str, message: str) -> None:
        with self._lock:
            if what in self._warned:
                return
            self._warned.add(what)
        warnings.warn(message, TierUnavailable, stacklevel=4)

    @property
    def stats(self) -> TierStats:
        """A snapshot of the counters; ``errors`` includes the failures the tiers absorbed themselves."""
        with self._lock:
            s = TierStats(dict(self._stats.hits), self._stats.misses, self._stats.writes,
                          self._stats.errors, self._stats.dropped, self._stats.rejected)
        s.errors += sum(getattr(t, "errors", 0) for t in self.tiers)
        return s

    def stats_dict(self) -> dict[str, object]:
        return self.stats.as_dict()

