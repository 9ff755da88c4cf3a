"""Layers point one way: a module imports (at run time) only from its own layer or the layers below.

The order, top to bottom, is docs/architecture.md's:

    entry points   kvcache (the lazy public API), cli, cliargs, envinfo, server, bench, eval, inspect, hf, peers
    engine         scheduling, sampling, the runner
    prefix         the prefix index and its tiers
    models         model families, weights, loading, tokenizers
    attention      attention backends over the cache's pages
    cache          pages, page tables, their manager, visibility, plans
    press          token scoring for eviction
    kernels        native kernels, repacked weight formats, RoPE
    base           errors, fmt, paths, plotting, hugepages, gcpolicy

Imports under ``if TYPE_CHECKING:`` never run and are not counted (the same walk as
test_import_cycles.py).
"""

from __future__ import annotations

from pathlib import Path

import kvcache
from test_import_cycles import import_graph

LAYERS = [
    ["kvcache", "kvcache.__main__", "kvcache.cli", "kvcache.cliargs", "kvcache.envinfo", "kvcache.server",
     "kvcache.bench", "kvcache.eval", "kvcache.inspect", "kvcache.hf", "kvcache.peers"],
    ["kvcache.engine"],
    ["kvcache.prefix"],
    ["kvcache.models"],
    ["kvcache.attention"],
    ["kvcache.cache"],
    ["kvcache.press"],
    ["kvcache.kernels"],
    ["kvcache.errors", "kvcache.fmt", "kvcache.paths", "kvcache.plotting", "kvcache.hugepages", "kvcache.gcpolicy",
     "kvcache.recent"],
]


def layer_of(module: str) -> int:
    """The layer (0 at the top) of a module: its longest listed prefix."""
    best, depth = None, -1
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > depth and (n != "kvcache" or module == n):
                best, depth = i, len(n)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and to docs/architecture.md"
    return best


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if layer_of(t) < layer_of(m))


def test_no_module_imports_a_layer_above_its_own():
    graph = import_graph(Path(kvcache.__file__).parent)
    assert "kvcache.kernels.rotary" in graph["kvcache.attention.backends"]  # the walk sees lazy and module imports
    found = upward(graph)
    assert not found, "upward imports:\n" + "\n".join(found)


def test_an_upward_import_is_found():
    graph = {"kvcache.cache.plan": {"kvcache.attention.dense"}, "kvcache.attention.dense": {"kvcache.cache.visibility"},
             "kvcache.cache.visibility": set()}
    assert upward(graph) == ["kvcache.cache.plan -> kvcache.attention.dense"]


def test_the_order_is_the_one_the_architecture_page_states():
    doc = (Path(kvcache.__file__).parents[2] / "docs" / "architecture.md").read_text()
    names = ["entry points", "engine", "prefix", "models", "attention", "cache", "press", "kernels", "base"]
    at = [doc.find(f"\n    {n} ") for n in names]
    assert all(i > 0 for i in at) and at == sorted(at), "docs/architecture.md must list the layers in this order"
