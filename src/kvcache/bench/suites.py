"""The suites of ``kvcache bench``, found in their own modules: a module of kvcache.bench that
assigns ``SUITE`` at its top level is one, and everything the command line, ``bench all`` and
``bench report`` need to know of it is declared beside its code, so that a new suite is one new
file:

    SUITE = "decode"              # its name on the command line
    MODE = "long"                 # (optional) run instead of SUITE's module when --long is given
    ORDER = 10                    # its place in `bench all` and in the report's tables
    OPTIONS = ("new_tokens", ...) # the options it reads (argparse dests); any other is refused
    QUICK = {...}                 # its settings under `bench all --quick`
    QUICK_LLAMA_CPP = {...}       # (optional) those that change when --llama-cpp-bin is given

and, as functions, ``run(args) -> int`` (measure, print the table, write args.json),
``headline(data) -> list[Row]`` (optional: the JSON's rows of kvcache beside a peer for ``bench
report``) and ``plot(plt, data)`` (optional: the figure of ``--out``). The declarations are read
from the source (literals only), not by importing it; a suite module imports torch and the engine
inside its functions, so that ``bench report`` and the command line's help load neither.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).resolve().parent
_DECLARED = ("SUITE", "MODE", "ORDER", "OPTIONS", "QUICK", "QUICK_LLAMA_CPP")


@dataclass(frozen=True)
class Suite:
    name: str  # on the command line: decode, context, ...
    module: str  # under kvcache.bench
    order: int
    mode: str | None = None  # the option that selects this module instead of the suite's own

    @property
    def key(self) -> str:
        """The name its JSON files are known by: ``decode``, or ``context --long`` for a mode."""
        return f"{self.name} --{self.mode}" if self.mode else self.name

    @property
    def options(self) -> tuple[str, ...]:
        return tuple(_literals(self.module).get("OPTIONS", ()))

    @property
    def quick(self) -> dict:
        return dict(_literals(self.module).get("QUICK", {}))

    @property
    def quick_llama_cpp(self) -> dict:
        return dict(_literals(self.module).get("QUICK_LLAMA_CPP", {}))

    def load(self) -> ModuleType:
        return importlib.import_module(f"kvcache.bench.{self.module}")


_SCALAR = re.compile(r'^(SUITE|MODE|ORDER) = (?:"([^"]+)"|(\d+))', flags=re.M)


@cache
def catalogue() -> tuple[Suite, ...]:
    """Every suite and mode, in ORDER (three one-line declarations read by a pattern: the command
    line's help lists the suites at every start)."""
    out = []
    for path in sorted(_HERE.glob("*.py")):
        found = {m.group(1): m.group(2) or m.group(3) for m in _SCALAR.finditer(path.read_text(encoding="utf-8"))}
        if "SUITE" in found:
            out.append(Suite(found["SUITE"], path.stem, int(found.get("ORDER", 1000)), found.get("MODE")))
    return tuple(sorted(out, key=lambda s: s.order))


@cache
def _literals(module: str) -> dict:
    """A suite module's declarations (literals), read from its source without importing it."""
    path = _HERE / f"{module}.py"
    found = {}
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in _DECLARED:
                found[node.targets[0].id] = ast.literal_eval(node.value)
    return found


def names() -> list[str]:
    """The suites' names, in order (their modes not repeated)."""
    return [s.name for s in catalogue() if s.mode is None]


def flags() -> tuple[str, ...]:
    """Every suite-specific option (argparse dest) any suite or mode reads, and the modes' own."""
    seen: dict[str, None] = {}
    for s in catalogue():
        for name in s.options + ((s.mode,) if s.mode else ()):
            seen[name] = None
    return tuple(seen)


def given(args: object, name: str) -> bool:
    """Whether option ``name`` was given: a value (0 and '' count), or a flag set."""
    value = getattr(args, name, None)
    return value is not None and value is not False


def find(name: str) -> Suite | None:
    return next((s for s in catalogue() if s.name == name and s.mode is None), None)


def chosen(name: str, args: object) -> Suite:
    """The module to run for suite ``name``: one of its modes when that mode's option is given."""
    for s in catalogue():
        if s.name == name and s.mode and given(args, s.mode):
            return s
    suite = find(name)
    assert suite is not None, name
    return suite


def by_key() -> dict[str, Suite]:
    """``decode`` / ``context --long`` -> its suite, in order."""
    return {s.key: s for s in catalogue()}


def mark(path: str | None, suite: Suite) -> None:
    """Record in the JSON a suite wrote which suite (or mode) wrote it."""
    if not path or not Path(path).is_file():
        return
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
        meta = {"suite": suite.key, **{k: v for k, v in meta.items() if k != "suite"}}
        data = {"meta": meta, **{k: v for k, v in data.items() if k != "meta"}}
        Path(path).write_text(json.dumps(data, indent=2))
