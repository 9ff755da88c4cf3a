"""PrefixConfig: how much finished requests' K/V is kept for reuse, and where it spills."""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass, field

from kvcache.errors import InvalidParams
from kvcache.paths import cache_home


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
    prefix/entry.py); every process sharing a tier needs the same secret. Without one, the
    installation's own secret is used (``installation_secret``: made on first use, 0600 in the
    cache home), so by default no entry is served that this installation did not write.
    ``unsigned``: entries carry only a CRC-32 (bit rot is caught, a forger who can write to the
    tier is not). ``tier_timeout_s``: the longest a tier read is waited for (then a miss).
    """

    enabled: bool = True
    max_cached_tokens: int = 16384
    policy: str = "lru"
    disk: str | None = None
    disk_bytes: int | None = None
    redis: str | None = None
    salt: str = ""
    secret: str | None = field(default=None, repr=False)
    unsigned: bool = False
    tier_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.unsigned and self.secret is not None:
            raise InvalidParams("a tier secret and unsigned (CRC-only) entries exclude each other: give one")
        if not self.tier_timeout_s > 0:
            raise InvalidParams(f"the tier read timeout must be positive, got {self.tier_timeout_s}")
        if self.secret is not None and not self.secret.strip():
            raise InvalidParams("the tier secret is empty: give a secret, or none for the installation's own")
        if self.policy not in ("lru", "lfu"):
            raise InvalidParams(f"unknown prefix eviction policy {self.policy!r}: lru or lfu")
        if self.max_cached_tokens < 0:
            raise InvalidParams(f"max_cached_tokens must be 0 or more, got {self.max_cached_tokens}")
        if self.disk_bytes is not None and self.disk_bytes < 1:
            raise InvalidParams(f"disk_bytes must be positive, got {self.disk_bytes}")

    @property
    def tiers(self) -> bool:
        return self.disk is not None or self.redis is not None

    def mac_secret(self) -> str | None:
        """The secret tier entries are MAC'd with: the given one, else the installation's; None
        when ``unsigned``."""
        if self.unsigned:
            return None
        return self.secret if self.secret is not None else installation_secret()


def parse_prefix(value: "PrefixConfig | bool | None") -> PrefixConfig:
    if value is None or value is True:
        return PrefixConfig()
    if value is False:
        return PrefixConfig(enabled=False)
    if isinstance(value, PrefixConfig):
        return value
    raise InvalidParams(f"prefix must be a PrefixConfig, True or False, got {type(value).__name__}")


SECRET_ENV = "KVCACHE_TIER_SECRET"
SECRET_FILE = "tier-secret"  # in the cache home: this installation's secret


def installation_secret() -> str:
    """This installation's tier secret, ``$KVCACHE_HOME/tier-secret``: 64 random hex digits made
    on first use (0600, created exclusively, so two processes starting together agree). A file
    that is not a regular file of this user's, or that others may read or write, is refused:
    whoever can read it can forge entries."""
    path = cache_home() / SECRET_FILE
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            except FileExistsError:  # another process made it meanwhile: read theirs
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(32) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            continue
        except OSError as e:
            raise InvalidParams(f"cannot read the installation's tier secret {path}: {e.strerror}") from None
        with os.fdopen(fd, "r", encoding="ascii", errors="replace") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
                raise InvalidParams(f"the installation's tier secret {path} is not a file of this user's; remove it")
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise InvalidParams(f"the installation's tier secret {path} is open to other users "
                                    f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it, or remove it to make a new one")
            value = fh.read(4096).strip()
        if len(value) >= 32:
            return value
        raise InvalidParams(f"the installation's tier secret {path} is empty or too short; remove it to make a new one")
    raise InvalidParams(f"cannot create the installation's tier secret {path}")


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
