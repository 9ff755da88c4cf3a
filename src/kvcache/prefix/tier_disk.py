"""DiskTier: prefix pages as files under a folder (see tiers.py for the whole picture).

Files are created 0600 (never following a link; written to a temporary name and renamed), the
folders kvcache creates are 0700, and a folder that belongs to another user is refused: entries
hold K/V from which prompts can be recovered. Reads never block on what is found under an entry's
name: only a regular file is read (a FIFO, a device or a link is a miss and removed), and it must
not grow past its size while it is read.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

from kvcache.errors import KVCacheError

_STALE_TMP_S = 3600.0  # temporary files older than this are leftovers of a crashed writer
MAX_ENTRY_BYTES = 256 << 20  # no page entry is larger (a 3B model's fp32 page of 16 tokens: about 4 MB)


class DiskTier:
    """Entries as files under ``path``; ``max_bytes`` bounds the folder (least recently used go).

    Several processes may share one folder: writes are atomic renames, and a file another process
    wrote is found by ``get``. Each process counts the bytes it knows of (the files present when it
    opened the folder, those it wrote and those it read), so with several writers the folder may
    pass ``max_bytes`` by what the others wrote since.
    """

    name = "disk"

    def __init__(self, path: str | os.PathLike, max_bytes: int | None = None) -> None:
        self.path = Path(path).expanduser()
        if max_bytes is not None and max_bytes < 1:
            raise KVCacheError(f"disk tier size bound must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            owner = self.path.stat().st_uid
            probe = self.path / f".probe-{os.getpid()}-{threading.get_ident()}"
            _write_new(probe, b"")
            probe.unlink()
        except OSError as e:
            reason = e.strerror or type(e).__name__
            if self.path.exists() and not self.path.is_dir():
                reason = "it is a file, not a folder"
            raise KVCacheError(f"prefix cache folder {self.path} is not writable: {reason}") from None
        if hasattr(os, "geteuid") and owner != os.geteuid():
            raise KVCacheError(f"prefix cache folder {self.path} belongs to another user (uid {owner}); "
                               "use a folder of your own")
        self.errors = 0  # files that could not be read (removed)
        self._lock = threading.Lock()
        self._files: OrderedDict[Path, int] = OrderedDict()  # entry -> bytes, least recently used first
        self._nbytes = 0
        self._scan()

    def _scan(self) -> None:
        now, found = time.time(), []
        for f in self.path.glob("??/*"):
            try:
                st = f.stat()
            except OSError:  # removed meanwhile by another process
                continue
            if f.name.endswith(".kv"):
                found.append((st.st_mtime, f, st.st_size))
            elif f.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                f.unlink(missing_ok=True)
        for _, f, size in sorted(found):
            self._files[f] = size
            self._nbytes += size

    def _file(self, key: bytes) -> Path:
        h = key.hex()
        return self.path / h[:2] / f"{h}.kv"

    @property
    def nbytes(self) -> int:
        """Bytes of the entries this tier knows of."""
        with self._lock:
            return self._nbytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def __contains__(self, key: bytes) -> bool:
        return self._file(key).is_file()

    def get(self, key: bytes) -> bytes | None:
        """The bytes stored under ``key``, or None (missing, or unreadable: then removed)."""
        f = self._file(key)
        try:
            data = _read_entry(f)
        except FileNotFoundError:  # never written, or removed by another process
            with self._lock:
                self._nbytes -= self._files.pop(f, 0)
            return None
        except OSError:  # a damaged file or disk; a folder, pipe, device or link where a file should be
            with self._lock:
                self.errors += 1
            self._remove(f)
            return None
        try:
            os.utime(f)  # recency for other processes and later runs; best effort
        except OSError:
            pass
        with self._lock:
            self._nbytes += len(data) - self._files.pop(f, 0)
            self._files[f] = len(data)
        return data

    def put(self, key: bytes, blob: bytes) -> None:
        """Store ``blob`` under ``key`` (replacing what was there); evict to stay in bounds. An
        entry larger than the bound is not stored. Raises OSError if the disk refuses the write."""
        if self.max_bytes is not None and len(blob) > self.max_bytes:
            return
        f = self._file(key)
        f.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = f.with_name(f".{f.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            _write_new(tmp, blob)
            os.replace(tmp, f)
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._nbytes += len(blob) - self._files.pop(f, 0)
            self._files[f] = len(blob)
            self._evict()

    def _evict(self) -> None:
        """Remove least recently used files until within ``max_bytes`` (lock held)."""
        while self.max_bytes is not None and self._nbytes > self.max_bytes and self._files:
            old, size = self._files.popitem(last=False)
            self._nbytes -= size
            _unlink(old)

    def _remove(self, f: Path) -> None:
        _unlink(f)
        with self._lock:
            self._nbytes -= self._files.pop(f, 0)

    def discard(self, key: bytes) -> None:
        """Remove the entry under ``key`` (for example one whose content was found wrong)."""
        self._remove(self._file(key))

    def clear(self) -> None:
        """Remove every entry in the folder, including those other processes wrote."""
        with self._lock:
            for f in self.path.glob("??/*.kv"):
                _unlink(f)
            self._files.clear()
            self._nbytes = 0

    def close(self) -> None:
        """Nothing to release; here so every tier closes alike."""

    def __repr__(self) -> str:
        return f"DiskTier({str(self.path)!r}, max_bytes={self.max_bytes})"


def _read_entry(f: Path) -> bytes:
    """An entry's bytes. Only a regular file of at most MAX_ENTRY_BYTES is read: it is opened
    without following a link and without blocking (a FIFO planted under an entry's name would
    otherwise hang the open until someone writes to it), then checked with fstat; anything else
    (a pipe, a device, a socket, a folder, a link) raises OSError, so the caller removes it."""
    fd = os.open(f, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(f))
        if st.st_size > MAX_ENTRY_BYTES:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, over the {MAX_ENTRY_BYTES} an entry may have", str(f))
        chunks, left = [], st.st_size + 1  # one byte more: a file that grew meanwhile is refused too
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise OSError(errno.EFBIG, "the file grew while it was read", str(f))
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_new(f: Path, data: bytes) -> None:
    """Create ``f`` (0600; it must not exist, and a link in its place is not followed) holding ``data``."""
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _unlink(f: Path) -> None:
    """Remove an entry file; a folder in its place is removed if empty, else left alone."""
    try:
        f.unlink(missing_ok=True)
    except OSError:
        try:
            f.rmdir()
        except OSError:
            pass
