"""Chained keys of prefix pages: a page's key names its whole prefix, in one model and layout.

``root_key(fingerprint, layout, salt)`` starts a chain; ``page_key(parent, tokens)`` hashes the
parent key with the page's token ids (int32, little-endian). Two pages have the same key only when
every token before and in them is the same, under the same model weights (``fingerprint``), cache
layout (``layout``: encoding, page size, shapes, as the caller describes them) and tenant ``salt``.
Keys are 20 raw bytes; ``key.hex()`` names them in files and Redis.

Pure functions: safe to call from any thread.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST = 20  # bytes in a key


def root_key(fingerprint: str, layout: str, salt: str = "") -> bytes:
    """The key every chain of one model, layout and tenant starts from."""
    h = hashlib.blake2b(digest_size=DIGEST, person=b"kvcache-root")
    for part in (fingerprint, layout, salt):  # length-prefixed: ("ab", "c") differs from ("a", "bc")
        data = part.encode()
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.digest()


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of the page holding ``tokens`` after the prefix ``parent`` names."""
    h = hashlib.blake2b(digest_size=DIGEST, person=b"kvcache-page")
    h.update(struct.pack("<Q", len(parent)))
    h.update(parent)
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return h.digest()
