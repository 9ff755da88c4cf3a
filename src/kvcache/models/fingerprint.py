"""Model identity: a fingerprint that changes whenever the weights do.

Anything reused outside one process (prefix-tier entries, prompt-cache and chat-session files) is
keyed by this fingerprint, so two models that share an architecture but not their weights (two
fine-tunes of one base) never read each other's K/V.

- A folder converted from GGUF (it holds ``kvcache.json``): the GGUF file's sha256, computed once
  at conversion.
- Any other HF folder: sha256 over config.json and, per ``*.safetensors`` file, its name and the
  sha256 of its whole content (header and tensor data). Hashing a large file takes a while
  (about 1-2 GB/s), so each file's digest is remembered under ``$KVCACHE_HOME/fingerprints``,
  keyed by the file's resolved path, size and modification time (ns): a file rewritten in place
  gets a new mtime and is hashed again.

Pure functions apart from that memo (written atomically, 0600 in a 0700 folder); safe from any thread.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kvcache.paths import cache_home

VERSION = 2  # of the fingerprint's recipe; a new recipe never matches an old fingerprint
_BLOCK = 1 << 22


def fingerprint(path: Path) -> str:
    """The fingerprint of the HF-format model folder ``path`` (see the module docstring)."""
    info = path / "kvcache.json"
    if info.is_file():
        return str(json.loads(info.read_text())["fingerprint"])
    h = hashlib.sha256(f"kvcache-weights/{VERSION}".encode())
    config = (path / "config.json").read_bytes()
    h.update(len(config).to_bytes(8, "little") + config)
    for f in sorted(path.glob("*.safetensors")):
        name = f.name.encode()
        h.update(len(name).to_bytes(8, "little") + name + bytes.fromhex(file_digest(f)))
    return h.hexdigest()


def file_digest(f: Path) -> str:
    """sha256 of a file's bytes, remembered by (resolved path, size, mtime_ns)."""
    st = f.stat()
    real = str(f.resolve())
    memo = _memo_dir() / f"{hashlib.sha256(real.encode()).hexdigest()[:32]}.json"
    stamp = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        saved = json.loads(memo.read_text())
        if {k: saved.get(k) for k in stamp} == stamp and isinstance(saved.get("sha256"), str):
            return str(saved["sha256"])
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(_BLOCK), b""):
            h.update(block)
    digest = h.hexdigest()
    _write_private(memo, json.dumps({**stamp, "sha256": digest}))
    return digest


def _memo_dir() -> Path:
    d = cache_home() / "fingerprints"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _write_private(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` through a 0600 temporary file renamed into place (best effort:
    a memo that cannot be written is recomputed next time)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except OSError:
        pass
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass
