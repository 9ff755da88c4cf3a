"""How many tokens a compression evicts and which slots may go; pure functions over positions.

``pos`` [Hkv, S] gives the token position each slot of one layer holds (-1: already evicted).
Never evicted: the latest ``protect`` tokens (and whatever the press itself protects), attention
sinks (the first ``sinks`` positions), and, when ``since`` is given, anything before it (a
prefill-time press compresses only the tokens added since its last compression). ``frozen`` marks
slots that may not move any more (a quantized cache's sealed pages).
"""

from __future__ import annotations

import torch

from kvcache.press.base import Press


def candidates(pos: torch.Tensor, length: int, press: Press, protect: int, sinks: int = 0, since: int = 0,
               frozen: int = 0) -> torch.Tensor:
    """bool [Hkv, S]: slots this compression may evict (the first ``frozen`` slots never)."""
    recent = length - max(protect, press.protect_last)
    first = max(sinks, press.protect_first, since)
    out = (pos >= first) & (pos < recent)
    if frozen:
        out[:, :frozen] = False
    return out


def span_evictions(pos: torch.Tensor, since: int, ratio: float | None, keep: int | None) -> int:
    """Tokens a prefill-time compression of the span from position ``since`` evicts (per head):
    ``int(n * (1 - ratio))`` of its n tokens stay (kvpress's rounding), or as many as bring the
    layer to ``keep`` tokens."""
    live = pos >= 0
    span = int((live & (pos >= since)).sum(-1).min())
    if keep is not None:
        before = int((live & (pos < since)).sum(-1).max())
        stay = max(0, keep - before)
    else:
        assert ratio is not None
        stay = int(span * (1 - ratio))
    return max(0, span - stay)


def decode_evictions(pos: torch.Tensor, length: int, ratio: float | None, keep: int | None) -> int:
    """Tokens a decode-time press evicts now (per head): what the layer holds beyond ``keep``, or
    beyond ``int(length * (1 - ratio))``."""
    held = int((pos >= 0).sum(-1).max())
    target = keep if keep is not None else int(length * (1 - ratio))  # type: ignore[operator]
    return max(0, held - target)


def evict_mask(scores: torch.Tensor, allowed: torch.Tensor, n: int) -> torch.Tensor:
    """bool [Hkv, S]: the ``n`` lowest-scored allowed slots per head (fewer where fewer are allowed)."""
    from kvcache.press.base import choose

    n = min(n, int(allowed.sum(-1).min()))
    return choose(scores, allowed, n)
