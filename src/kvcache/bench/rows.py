"""The headline rows a suite gives `bench report` (its ``headline(data)``), and their helpers.
A measurement's row is ``peers.row.Row``, shared with the peers' child processes."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from kvcache.peers.row import shipped_type


@dataclass(frozen=True)
class Headline:
    """One headline: kvcache's figure beside the peer's from the same run. ``ratio`` says how many
    times better kvcache did: kvcache / peer for rates (tok/s), peer / kvcache for times and sizes
    (``higher_better`` False)."""

    what: str
    kvcache: float
    peer_name: str
    peer: float
    unit: str
    higher_better: bool = True

    @property
    def ratio(self) -> float:
        return self.kvcache / self.peer if self.higher_better else self.peer / self.kvcache


def model_name(meta: dict, weights: str = "") -> str:
    """A short name for the model a run measured: ``1b-0-Q4_0`` -> ``1B Q4_0``, the bundled
    ``smollm2`` with ``file (Q4_1)`` weights -> ``SmolLM2-135M Q4_1``, a path -> its file name."""
    name = str(meta.get("model") or "")
    name = re.sub(r"\.gguf$", "", name.replace("\\", "/").rsplit("/", 1)[-1])
    from kvcache.models import fetch_qwen

    if name == fetch_qwen.NAME:  # the alias `make qwen` installs: named as its file is
        name = fetch_qwen.FILE.removesuffix(".gguf")
    m = re.fullmatch(r"(\d+[bBmM])-\d+-(\w+)", name)
    if m:
        return f"{m.group(1).upper()} {m.group(2)}"
    m = re.fullmatch(r"h(\d+)-l(\d+)-.*-(\w+)", name)
    if m:
        return f"h{m.group(1)}-l{m.group(2)} {m.group(3)}"
    if name.lower().startswith("smollm2"):
        m = re.search(r"\((\w+)\)", weights) or re.search(r"\b(Q\d\w*)", str(meta.get("model") or ""))
        name = "SmolLM2-135M" + (f" {m.group(1)}" if m else "")
        return name
    kind = shipped_type(name)  # a file named as it ships
    if kind:
        return f"{name[: -len(kind) - 1]} {kind}"
    m = re.search(r"\((\w+)\)", weights)  # a model named by its alias: the type the weights label says
    return (name + (f" {m.group(1)}" if m else "")) if name else "model not recorded"


def one(rows: Iterable[dict], **match: object) -> dict:
    """The one row whose keys hold these values (KeyError when there is none)."""
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    raise KeyError(f"no row with {match}")


def positive(x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or x <= 0:
        raise ValueError(f"not a positive number: {x!r}")
    return float(x)


def suite_parts(d: dict) -> tuple[dict, list[dict], str]:
    """A suite file's meta, its result rows and the model they name."""
    return d["meta"], d["results"], model_name(d["meta"])


def beside_same_file(what: str, ours: dict, peer: dict) -> Headline:
    """A tok/s headline: kvcache's row beside a peer that ran the same GGUF file."""
    return Headline(what, positive(ours["tok_s"]), f"{peer['system']}, same file", positive(peer["tok_s"]), "tok/s")
