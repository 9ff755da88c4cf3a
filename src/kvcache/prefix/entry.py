"""One prefix page as bytes: safetensors with its format, key and a digest in the header metadata.

``encode_entry(key, tensors, meta)`` -> bytes; ``decode_entry(blob, key)`` -> tensors or None.
The digest (blake2b) covers every tensor's name, dtype, shape and bytes and the caller's metadata,
so ``decode_entry`` never raises: bytes that are truncated, corrupt, of another format, stored under
another key or whose content does not match the digest give None (a miss: the page is recomputed).
Dtypes are kept as they are (float32, float16, bfloat16, int8, uint8, ...).

Pure functions: safe to call from any thread (the tier writer thread encodes entries).
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

FORMAT = "kvcache-page/1"
RESERVED = ("format", "key", "digest")


def _digest(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"kvcache-entry")
    for name in sorted(meta):
        h.update(f"{len(name)}:{name}={len(meta[name])}:{meta[name]};".encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{len(name)}:{name}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def encode_entry(key: bytes, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> bytes:
    """Bytes holding ``tensors`` (moved to the CPU) under ``key``; ``meta``: extra string fields."""
    from safetensors.torch import save

    meta = {str(k): str(v) for k, v in (meta or {}).items() if k not in RESERVED}
    tensors = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
    header = {**meta, "format": FORMAT, "key": key.hex(), "digest": _digest(tensors, meta)}
    return save(tensors, metadata=header)


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
        tensors = load(bytes(blob))
        ok = _digest(tensors, {k: v for k, v in meta.items() if k not in RESERVED}) == meta.get("digest")
    except Exception:  # safetensors raises its own error types for bad bytes
        return None
    return tensors if ok else None
