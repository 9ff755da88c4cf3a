"""One prefix page as bytes: safetensors with its format, key and a digest in the header metadata.

``encode_entry(key, tensors, meta)`` -> bytes; ``decode_entry(blob, key)`` -> tensors or None.
The digest covers the whole serialized entry but itself: a CRC-32 of the header (every tensor's
name, dtype, shape and offsets, and all metadata, the digest field left out) and one of the data
section. CRC-32 is a storage checksum (about 6 GB/s here, so restoring a page costs little more
than copying it; a cryptographic hash ran at 1-2 GB/s and was most of a restore's time); the key
is checked on its own. So ``decode_entry`` never raises: bytes that are truncated, corrupt, of
another format, stored under another key or whose content does not match the digest give None (a
miss: the page is recomputed). Dtypes are kept as they are (float32, float16, bfloat16, int8,
uint8, ...).

Pure functions: safe to call from any thread (the tier writer thread encodes entries).
"""

from __future__ import annotations

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


def _digest(header: dict, data: memoryview) -> str:
    """CRC-32 of the header without its digest field, and of the data section."""
    header = dict(header)
    meta = {k: v for k, v in dict(header.get("__metadata__") or {}).items() if k != "digest"}
    header["__metadata__"] = meta
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return f"crc32:{zlib.crc32(text):08x}{zlib.crc32(data):08x}"


def encode_entry(key: bytes, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> bytes:
    """Bytes holding ``tensors`` (moved to the CPU) under ``key``; ``meta``: extra string fields."""
    from safetensors.torch import save

    meta = {str(k): str(v) for k, v in (meta or {}).items() if k not in RESERVED}
    tensors = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
    header = {**meta, "format": FORMAT, "key": key.hex()}
    parts = _split(save(tensors, metadata=header))  # the layout without the digest, to checksum
    assert parts is not None
    return save(tensors, metadata={**header, "digest": _digest(*parts)})


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


def decode_entry(blob: bytes, key: bytes) -> dict[str, torch.Tensor] | None:
    """The tensors of an entry stored under ``key``, or None for anything that is not exactly that."""
    from safetensors.torch import load

    meta = entry_meta(blob)
    if meta is None or meta.get("format") != FORMAT or meta.get("key") != key.hex():
        return None
    try:
        parts = _split(blob)
        if parts is None or _digest(*parts) != meta.get("digest"):
            return None
        return load(bytes(blob))
    except Exception:  # safetensors raises its own error types for bad bytes
        return None
