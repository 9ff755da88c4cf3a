"""matplotlib for the PNG figures of ``inspect``, ``eval`` and ``bench --out``: loaded on first use
(the console commands start without it) with the headless Agg backend."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
