"""One prefix page as bytes: safetensors with its format, key and a digest in the header metadata.

``encode_entry(key, tensors, meta, secret)`` -> bytes; ``decode_entry(blob, key, secret)`` ->
tensors or None. The digest covers the whole serialized entry but itself: the header (every
tensor's name, dtype, shape and offsets, and all metadata, the digest field left out) and the
data section.

- Without a secret it is a CRC-32 of each: a storage checksum against bit rot and truncation
  (about 6 GB/s here, so restoring a page costs little more than copying it). Anyone who can
  write to the tier can recompute it, so it does not stop a forged entry.
- With a secret (``--tier-secret``, ``KVCACHE_TIER_SECRET``) it is a keyed BLAKE2b MAC (32
  bytes; about 1 GB/s here): an entry is only accepted if it was written by a process holding the
  same secret. Without the right MAC, or with a CRC where a MAC is expected (or the reverse), an
  entry is a miss.

The key is checked on its own. ``decode_entry`` never raises: bytes that are truncated, corrupt,
of another format, stored under another key or whose content does not match the digest give None
(a miss: the page is recomputed). Dtypes are kept as they are (float32, float16, bfloat16, int8,
uint8, ...).

Pure functions: safe to call from any thread (the tier writer thread encodes entries).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import zlib

import torch

FORMAT = "kvcache-page/2"  # /1 entries (another digest) are misses
RESERVED = ("format", "key", "digest")


def _split(blob: bytes) -> tuple[dict, memoryview] | None:
    """The parsed safetensors header and a view of the data section, or None if unreadable."""
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        return None
    header = json.loads(bytes(blob[8 : 8 + n]))
    return (header, memoryview(blob)[8 + n :]) if isinstance(header, dict) else None


def mac_key(secret: str | bytes) -> bytes:
    """The 32-byte BLAKE2b key derived from a tier secret."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    return hashlib.blake2b(raw, digest_size=32, person=b"kvcache-tiermac").digest()


def _digest(header: dict, data: memoryview, key: bytes | None = None) -> str:
    """The header without its digest field, and the data section: CRC-32 of each, or one keyed
    BLAKE2b MAC over both when ``key`` (from ``mac_key``) is given."""
    header = dict(header)
    meta = {k: v for k, v in dict(header.get("__metadata__") or {}).items() if k != "digest"}
    header["__metadata__"] = meta
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if key is None:
        return f"crc32:{zlib.crc32(text):08x}{zlib.crc32(data):08x}"
    h = hashlib.blake2b(key=key, digest_size=32, person=b"kvcache-page")
    h.update(struct.pack("<Q", len(text)))
    h.update(text)
    h.update(data)
    return f"b2mac:{h.hexdigest()}"


def encode_entry(key: bytes, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None,
                 secret: bytes | None = None) -> bytes:
    """Bytes holding ``tensors`` (moved to the CPU) under ``key``; ``meta``: extra string fields;
    ``secret``: a key from ``mac_key`` (the entry then carries a MAC instead of a CRC)."""
    from safetensors.torch import save

    meta = {str(k): str(v) for k, v in (meta or {}).items() if k not in RESERVED}
    tensors = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
    header = {**meta, "format": FORMAT, "key": key.hex()}
    parts = _split(save(tensors, metadata=header))  # the layout without the digest, to checksum
    assert parts is not None
    return save(tensors, metadata={**header, "digest": _digest(*parts, secret)})


def entry_meta(blob: bytes) -> dict[str, str] | None:
    """The header metadata of an entry (format, key, digest and the caller's fields), or None if
    it is not readable. The tensors are not checked: ``decode_entry`` does that."""
    try:
        (n,) = struct.unpack("<Q", blob[:8])
        if n > len(blob) - 8:
            return None
        meta = json.loads(bytes(blob[8 : 8 + n])).get("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            return None
        return dict(meta)
    except Exception:  # struct, JSON, unicode, type errors: not an entry
        return None


def decode_entry(blob: bytes, key: bytes, secret: bytes | None = None) -> dict[str, torch.Tensor] | None:
    """The tensors of an entry stored under ``key``, or None for anything that is not exactly that
    (with ``secret``: also None unless the entry's MAC was made with it)."""
    from safetensors.torch import load

    meta = entry_meta(blob)
    if meta is None or meta.get("format") != FORMAT or meta.get("key") != key.hex():
        return None
    try:
        parts = _split(blob)
        if parts is None or not hmac.compare_digest(_digest(*parts, secret), meta.get("digest", "")):
            return None
        return load(bytes(blob))
    except Exception:  # safetensors raises its own error types for bad bytes
        return None
