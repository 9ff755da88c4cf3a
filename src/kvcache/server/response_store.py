"""Stored responses of /v1/responses: what ``previous_response_id`` continues from.

A ``StoredResponse`` keeps the Response object as it was returned, the chat conversation that led
to it with its output appended (the next turn's prompt is that conversation plus the new input),
the token ids of its prompt and output as the model saw and wrote them (the next prompt starts
with them, so the prefix cache holds every one), and the turn's input items (for
``GET /v1/responses/{id}/input_items``).

``ResponseStore`` bounds them by count, total bytes and age (``--responses-max-count``,
``--responses-max-bytes``, ``--responses-max-age``); the oldest go first. Each entry belongs to the
tenant that stored it (a hash of the caller's prefix-cache salt): for any other tenant it does not
exist. With a folder (the prefix cache's ``--prefix-dir``, under ``responses/``), every entry is
also a file, and a later process finds it: files are written whole (a temporary name renamed),
0600 in a 0700 folder, and each carries a keyed BLAKE2b MAC made with the prefix tiers' secret (a
plain BLAKE2b digest under ``--tier-unsigned``) over its id and content. A file that is not a
regular file, is too large, or whose magic, digest, id or content is wrong is a miss: logged,
removed, never read further. Several processes may share the folder (servers on one machine):
each finds the entries the others wrote; each bounds what it knows of.

Locking: one lock around the index and the files; the server calls it through
``asyncio.to_thread``.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import hmac
import json
import logging
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcache.errors import InvalidParams

log = logging.getLogger("kvcache.server")
RESP_ID = re.compile(r"resp_[0-9a-f]{32}")
MAGIC = b"kvcache-response/1\n"
HEADER = len(MAGIC) + 65  # the magic line, then the digest's 64 hex digits and a newline
SUFFIX = ".resp"
_STALE_TMP_S = 3600.0
MAX_FILE_BYTES = 64 << 20  # no stored response is read back larger than this
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "s": 1, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class StoreLimits:
    max_count: int = 10000  # --responses-max-count
    max_bytes: int = 256 << 20  # --responses-max-bytes (the entries as their files hold them)
    max_age_s: float = 30 * 86400.0  # --responses-max-age (OpenAI keeps responses 30 days)

    def __post_init__(self) -> None:
        for flag, v in (("--responses-max-count", self.max_count), ("--responses-max-bytes", self.max_bytes),
                        ("--responses-max-age", self.max_age_s)):
            if not v > 0:
                raise InvalidParams(f"{flag} must be positive, got {v}")


@dataclass
class StoredResponse:
    id: str
    tenant: str  # tenant_of(the caller's salt)
    created: float  # seconds since the epoch
    response: dict[str, Any]  # the Response object as returned
    conversation: list[dict[str, Any]] = field(default_factory=list)  # chat messages, its output last
    input_items: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the prompt's token ids and the output's, as generated

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), ensure_ascii=False, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "StoredResponse | None":
        """The entry ``data`` holds, or None when it is not exactly one."""
        try:
            d = json.loads(data)
            entry = cls(**d) if isinstance(d, dict) else None
        except (ValueError, TypeError, RecursionError):
            return None
        if entry is None or not (isinstance(entry.id, str) and isinstance(entry.tenant, str)
                                 and isinstance(entry.created, (int, float)) and isinstance(entry.response, dict)
                                 and isinstance(entry.conversation, list) and isinstance(entry.input_items, list)
                                 and isinstance(entry.tokens, list) and all(type(t) is int for t in entry.tokens)):
            return None
        return entry


def tenant_of(salt: str | None) -> str:
    """The tenant an entry is stored under: a hash of the caller's salt ("" on an open server)."""
    if not salt:
        return ""
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"kvcache-tenant").hexdigest()


@dataclass
class _Slot:
    tenant: str | None  # None until the file is read
    created: float
    size: int
    entry: StoredResponse | None  # None: on disk only


class ResponseStore:
    def __init__(self, limits: StoreLimits | None = None, folder: str | os.PathLike | None = None,
                 secret: str | None = None) -> None:
        """``folder``: where entries persist (None: memory only); ``secret``: the MAC's secret (None:
        a plain digest, which catches damage but not forgery)."""
        self.limits = limits or StoreLimits()
        self.folder = Path(folder).expanduser() if folder is not None else None
        from kvcache.prefix.entry import mac_key  # (torch, which `kvcache serve --help` need not load)

        self._key = mac_key(secret) if secret is not None else None
        self._lock = threading.Lock()
        self._slots: OrderedDict[str, _Slot] = OrderedDict()  # oldest first
        self._nbytes = 0
        self.rejected = 0  # files found damaged or forged
        if self.folder is not None:
            self._open_folder()

    # -- the API ---------------------------------------------------------------------------------
    def put(self, entry: StoredResponse) -> None:
        """Keep ``entry`` (and write its file); the oldest go while the bounds are passed. An
        entry larger than the byte bound is not kept. A disk that refuses the write is logged."""
        data = entry.to_bytes()
        size = HEADER + len(data)  # what its file holds
        if size > self.limits.max_bytes or not RESP_ID.fullmatch(entry.id):
            return
        with self._lock:
            self._drop(entry.id)
            self._slots[entry.id] = _Slot(entry.tenant, entry.created, size, entry)
            self._nbytes += size
            if self.folder is not None:
                try:
                    self._write(entry.id, data)
                except OSError as e:
                    log.warning("kvcache: stored response %s not written to %s: %s", entry.id, self.folder,
                                e.strerror or e)
            self._evict(time.time())

    def get(self, rid: str, tenant: str) -> StoredResponse | None:
        """The entry ``rid`` of ``tenant``; None when there is none (or it is another tenant's,
        too old, or its file is damaged)."""
        if not RESP_ID.fullmatch(rid):
            return None
        with self._lock:
            slot = self._slots.get(rid)
            if slot is None and self.folder is not None:  # written since by another process sharing the folder
                slot = self._slots[rid] = _Slot(None, time.time(), 0, None)
            if slot is None:
                return None
            if slot.entry is None:
                slot.entry = self._load(rid)
                if slot.entry is None:
                    self._drop(rid)
                    return None
                slot.tenant, slot.created = slot.entry.tenant, slot.entry.created
                if not slot.size:
                    slot.size = HEADER + len(slot.entry.to_bytes())
                    self._nbytes += slot.size
            if time.time() - slot.created > self.limits.max_age_s:
                self._drop(rid)
                return None
            return slot.entry if hmac.compare_digest(slot.tenant or "", tenant) else None

    def delete(self, rid: str, tenant: str) -> bool:
        """Remove ``rid`` of ``tenant``; whether there was one."""
        if self.get(rid, tenant) is None:
            return False
        with self._lock:
            self._drop(rid)
        return True

    def set_limits(self, limits: StoreLimits) -> None:
        """New bounds, applied at once."""
        with self._lock:
            self.limits = limits
            self._evict(time.time())

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes

    # -- bounds ----------------------------------------------------------------------------------
    def _evict(self, now: float) -> None:
        lim = self.limits
        while self._slots:
            rid, oldest = next(iter(self._slots.items()))
            if (len(self._slots) <= lim.max_count and self._nbytes <= lim.max_bytes
                    and now - oldest.created <= lim.max_age_s):
                return
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        slot = self._slots.pop(rid, None)
        if slot is None:
            return
        self._nbytes -= slot.size
        if self.folder is not None:
            _unlink(self._file(rid))

    # -- files -----------------------------------------------------------------------------------
    def _open_folder(self) -> None:
        assert self.folder is not None
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            owner = self.folder.stat().st_uid
        except OSError as e:
            raise InvalidParams(f"stored responses folder {self.folder} is not usable: {e.strerror or e}") from None
        if hasattr(os, "geteuid") and owner != os.geteuid():
            raise InvalidParams(f"stored responses folder {self.folder} belongs to another user (uid {owner})")
        found, now = [], time.time()
        for f in self.folder.iterdir():
            try:
                st = f.lstat()
            except OSError:
                continue
            if f.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                _unlink(f)
            elif f.name.endswith(SUFFIX) and RESP_ID.fullmatch(f.name[:-len(SUFFIX)]):
                found.append((st.st_mtime, f.name[:-len(SUFFIX)], st.st_size))
        for mtime, rid, size in sorted(found):  # bounds apply at the next put (or set_limits)
            self._slots[rid] = _Slot(None, mtime, size, None)
            self._nbytes += size

    def _file(self, rid: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{rid}{SUFFIX}"

    def _digest(self, rid: str, data: bytes) -> bytes:
        h = hashlib.blake2b(key=self._key or b"", digest_size=32, person=b"kvcache-resp")
        h.update(len(rid).to_bytes(8, "little") + rid.encode())
        h.update(data)
        return h.hexdigest().encode()

    def _write(self, rid: str, data: bytes) -> None:
        f = self._file(rid)
        tmp = f.with_name(f".{f.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(MAGIC + self._digest(rid, data) + b"\n" + data)
            os.replace(tmp, f)
        finally:
            _unlink(tmp)

    def _load(self, rid: str) -> StoredResponse | None:
        """The entry in ``rid``'s file, checked whole; a file that fails any check is removed."""
        f = self._file(rid)
        try:
            blob = _read_file(f)
        except FileNotFoundError:
            return None
        except OSError as e:
            return self._reject(f, f"unreadable ({e.strerror or e})")
        head, digest, data = blob[:len(MAGIC)], blob[len(MAGIC):HEADER - 1], blob[HEADER:]
        if head != MAGIC or blob[HEADER - 1:HEADER] != b"\n":
            return self._reject(f, "not a stored response")
        if not hmac.compare_digest(digest, self._digest(rid, data)):
            return self._reject(f, "its MAC does not match (damaged, forged, or written with another secret)")
        entry = StoredResponse.from_bytes(data)
        if entry is None or entry.id != rid:
            return self._reject(f, "its content is not a stored response")
        return entry

    def _reject(self, f: Path, why: str) -> None:
        self.rejected += 1
        log.warning("kvcache: stored response file %s refused: %s; removed", f, why)
        _unlink(f)
        return None


def _read_file(f: Path) -> bytes:
    """A regular file's bytes (no link followed, no blocking on a FIFO, at most MAX_FILE_BYTES)."""
    fd = os.open(f, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes")
        chunks, left = [], st.st_size + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise OSError(errno.EFBIG, "the file grew while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _unlink(f: Path) -> None:
    try:
        f.unlink(missing_ok=True)
    except OSError:
        pass


def parse_amount(text: str, flag: str, units: str) -> float:
    """A number with an optional unit among ``units`` (k, m, g: bytes; s, h, d: seconds)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]?)", str(text).strip().lower())
    if m is None or m.group(2) not in ("",) + tuple(units):
        raise InvalidParams(f"{flag} {text!r} is not a number with an optional unit ({', '.join(units)})")
    return float(m.group(1)) * _UNITS[m.group(2)]


def add_store_args(p: argparse.ArgumentParser) -> None:
    """``kvcache serve``'s bounds on stored responses."""
    d = StoreLimits()
    p.add_argument("--responses-max-count", type=int, default=d.max_count, metavar="N",
                   help="stored /v1/responses kept for previous_response_id, GET and DELETE (default "
                        f"{d.max_count}); the oldest go first. With --prefix-dir they are also files under "
                        "DIR/responses/ (MAC'd with the tier secret) and survive a restart")
    p.add_argument("--responses-max-bytes", default="256m", metavar="SIZE",
                   help="total size of the stored responses (k, m, g units; default 256m)")
    p.add_argument("--responses-max-age", default="30d", metavar="AGE",
                   help="stored responses older than this are dropped (seconds, or with s, h, d; default 30d)")


def store_limits(args: argparse.Namespace) -> StoreLimits:
    """The bounds ``add_store_args`` reads (refused before the model loads)."""
    return StoreLimits(max_count=args.responses_max_count,
                       max_bytes=int(parse_amount(args.responses_max_bytes, "--responses-max-bytes", "kmg")),
                       max_age_s=parse_amount(args.responses_max_age, "--responses-max-age", "shd"))
