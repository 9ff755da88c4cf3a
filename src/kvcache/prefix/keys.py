"""Chained keys of prefix pages: a page's key names its whole prefix, in one model and layout.

``root_key(fingerprint, layout, salt)`` starts a chain; ``page_key(parent, tokens)`` hashes the
parent key with the page's token ids. Two pages have the same key only when every token before and
in them is the same, under the same model weights, cache layout and tenant salt.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST = 20  # bytes


def root_key(fingerprint: str, layout: str, salt: str = "") -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST, person=b"kvcache-root")
    for part in (fingerprint, layout, salt):
        data = part.encode()
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.digest()


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=DIGEST, person=b"kvcache-page")
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return h.digest()
