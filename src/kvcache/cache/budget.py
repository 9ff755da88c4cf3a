"""A memory budget as people write it (``--kv-budget``, ``--kv ...,budget=``), in bytes.

- ``parse_budget``: "2" or "2GiB" (GiB when no unit), "512MiB", "1.5GB", "4096B", or "25%" of
  the machine's RAM, to bytes.
- ``ram_bytes``: the machine's physical memory (what a percentage is of).

Pure functions over text and the machine: the lowest floor of cache/ (config.py parses a spec's
``budget=`` with them). What a budget means for a pool (room to grow, what one sequence can
hold, giving pages back) is cache/capacity.py's.
"""

from __future__ import annotations

import os
import re

from kvcache.errors import InvalidParams

_UNITS = {"": 2**30, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def ram_bytes() -> int:
    """Physical memory of this machine."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def parse_budget(text: str | int | float) -> int:
    """Bytes of a budget written as GiB, with a unit, or as a percentage of RAM."""
    raw = str(text).strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?|\.\d+)(%|[a-z]*)", raw)
    if m is None or (m.group(2) not in _UNITS and m.group(2) != "%"):
        raise InvalidParams(f"KV budget {text!r} is not a size: give GiB (2), a unit (512MiB, 1.5GB) or a share "
                            "of RAM (25%)")
    value = float(m.group(1))
    if m.group(2) == "%":
        if not 0 < value <= 100:
            raise InvalidParams(f"KV budget {text!r}: a share of RAM must be above 0% and at most 100%")
        return int(ram_bytes() * value / 100)
    out = int(value * _UNITS[m.group(2)])
    if out < 1:
        raise InvalidParams(f"KV budget {text!r} is zero")
    return out
