"""Fault injection for the engine's failure paths (the fault-injection tests use it).

``KVCACHE_FAULTS`` names stages and a trigger token id, comma-separated: ``sample:157,forward:158``
makes every request whose prompt holds token 157 fail while it is sampled, and every forward that
feeds token 158 fail. Stages: ``admit`` (prefix lookup), ``forward`` (after the cache reserved the
step's pages, before the model runs), ``fork`` (the ``n`` samples share the prompt), ``sample``,
and ``stall`` (a forward that feeds the token sleeps ``KVCACHE_FAULT_STALL_S`` seconds, default 3,
then goes on: a step that hangs, as a stuck read or kernel would).
Unset, ``ACTIVE`` is False and the hooks cost one attribute test.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

STAGES = ("admit", "forward", "fork", "sample")  # stages that fail
DELAYS = ("stall",)  # stages that only take time


class InjectedFault(RuntimeError):
    """Raised where KVCACHE_FAULTS asks for a failure."""


def _parse(spec: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        stage, _, token = part.strip().partition(":")
        if stage not in STAGES + DELAYS or not token.strip().isdigit():
            raise ValueError(f"KVCACHE_FAULTS: bad entry {part!r}; use stage:token_id with a stage of "
                             f"{STAGES + DELAYS}")
        out[stage] = int(token)
    return out


TRIGGERS = _parse(os.environ.get("KVCACHE_FAULTS"))
ACTIVE = bool(TRIGGERS)


def check(stage: str, token_ids: Iterable[int]) -> None:
    """Raise InjectedFault when ``stage`` is armed and ``token_ids`` hold its trigger token."""
    token = TRIGGERS.get(stage)
    if token is not None and token in token_ids:
        if stage == "stall":
            time.sleep(float(os.environ.get("KVCACHE_FAULT_STALL_S", "3")))
            return
        raise InjectedFault(f"injected fault at {stage} (token {token})")
