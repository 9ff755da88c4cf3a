"""One prefix page as bytes: safetensors with its key and a digest of the tensors in the header.

``decode_entry`` never raises: bytes that are truncated, corrupt, of another format, stored under
another key or whose tensors do not match their digest give None (a miss; the page is recomputed).
"""

from __future__ import annotations

import hashlib

import torch

FORMAT = "kvcache-page/1"


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def encode_entry(key: bytes, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> bytes:
    from safetensors.torch import save

    tensors = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
    header = {"format": FORMAT, "key": key.hex(), "digest": _digest(tensors), **(meta or {})}
    return save(tensors, metadata=header)


def entry_meta(blob: bytes) -> dict[str, str] | None:
    """The header metadata of an entry, or None if it is not readable."""
    import json
    import struct

    try:
        (n,) = struct.unpack("<Q", blob[:8])
        return dict(json.loads(blob[8 : 8 + n]).get("__metadata__", {}))
    except Exception:
        return None


def decode_entry(blob: bytes, key: bytes) -> dict[str, torch.Tensor] | None:
    from safetensors.torch import load

    meta = entry_meta(blob)
    if meta is None or meta.get("format") != FORMAT or meta.get("key") != key.hex():
        return None
    try:
        tensors = load(blob)
    except Exception:  # safetensors raises its own error types for bad bytes
        return None
    if _digest(tensors) != meta.get("digest"):
        return None
    return tensors
