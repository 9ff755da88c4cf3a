"""API keys: who may call the server, which tenant a key is, and who is an admin.

Keys come from ``--api-key`` (visible in ``ps``), ``--api-key-file`` (one key per line, ``#``
comments) or ``KVCACHE_API_KEY``; admin keys from ``--admin-key-file`` or ``KVCACHE_ADMIN_KEY``.
An empty key is refused when the server starts: it would match a request that sends none. Every
presented key is compared with every configured key in constant time (``hmac.compare_digest``).

A server without keys is open: every caller is the same tenant and is trusted as an admin (bind it
to 127.0.0.1). With keys, each key is a tenant whose prefix-cache entries are salted apart from
every other's; only admin keys may send ``priority``, see every tenant's cache statistics and run
the integrity check.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcache.errors import InvalidParams


@dataclass(frozen=True)
class Caller:
    salt: str | None  # the tenant's prefix-cache salt (None on an open server)
    admin: bool


OPEN = Caller(None, True)


def read_key_file(path: str) -> list[str]:
    """Keys of a key file: one per line; blank lines and ``#`` comments are skipped."""
    p = Path(path)
    try:
        text = p.read_text()
        mode = p.stat().st_mode
    except OSError as e:
        raise InvalidParams(f"cannot read key file {path}: {e.strerror or e}") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        print(f"kvcache serve: warning: key file {path} is readable by other users (chmod 600 it)",
              file=sys.stderr)
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise InvalidParams(f"key file {path} holds no key")
    return keys


def gather_keys(cli: Sequence[str], files: Sequence[str], env: str) -> list[str]:
    """Keys from the command line, key files and the environment variable ``env``; an empty one
    (or one with spaces around it) is refused."""
    keys = list(cli)
    for f in files:
        keys += read_key_file(f)
    if env in os.environ:
        keys.append(os.environ[env])
    for k in keys:
        if not k or not k.strip():
            raise InvalidParams("an API key is empty: it would let in requests that send none; "
                                "give a non-empty key or no --api-key at all")
        if k != k.strip() or any(c.isspace() for c in k):
            raise InvalidParams("an API key contains whitespace; keys are sent as 'Bearer KEY' and cannot")
    return keys


class Auth:
    def __init__(self, keys: Iterable[str] = (), admin_keys: Iterable[str] = (), metrics_public: bool = False) -> None:
        admins = [k.encode() for k in admin_keys]
        users = [k.encode() for k in keys]
        if any(not k for k in users + admins):
            raise InvalidParams("an API key is empty: it would let in requests that send none")
        self._keys = [(k, False) for k in users if k not in admins] + [(k, True) for k in admins]
        self.metrics_public = metrics_public

    @property
    def open(self) -> bool:
        return not self._keys

    def caller(self, authorization: str | None, api_key: str | None = None) -> Caller | None:
        """The caller a request's Authorization header names; None when it names no valid key.
        ``api_key``: the key as Anthropic's clients send it (the ``x-api-key`` header), for the
        endpoints that accept it. Either header names the same tenant for the same key; when both
        are sent they must hold the same key."""
        if self.open:
            return OPEN
        auth = authorization or ""
        bearer = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
        plain = (api_key or "").strip().encode()
        if bearer and plain and not hmac.compare_digest(bearer, plain):
            return None
        presented = bearer or plain
        found: tuple[bytes, bool] | None = None
        for key, admin in self._keys:  # no early exit: the time taken does not tell which key matched
            if hmac.compare_digest(presented, key) and presented:
                found = (key, admin)
        if found is None:
            return None
        return Caller(hashlib.blake2b(found[0], digest_size=16).hexdigest(), found[1])
