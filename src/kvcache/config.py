"""Cache configuration: a frozen dataclass and the compact ``--kv`` spec parser.

A spec is a comma-separated list of a preset name and ``key=value`` options, e.g.
``static,max_tokens=4096`` or ``dynamic,page_size=32``. Combinations that cannot work are refused
here, when the config is built, with the list of what works.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvcache.errors import InvalidParams

STRATEGIES = ("none", "dynamic", "static")
_OPTIONS = {"page_size": int, "max_tokens": int, "max_seqs": int, "initial_tokens": int}


@dataclass(frozen=True)
class CacheConfig:
    """How K/V are kept.

    strategy: ``none`` (recompute the whole sequence every step: the baseline), ``dynamic`` (pages
    allocated as sequences grow; the pool doubles when full) or ``static`` (capacity for
    ``max_seqs`` sequences of ``max_tokens`` preallocated; never grows).
    """

    strategy: str = "dynamic"
    page_size: int = 16
    # static: capacity per sequence (None: the model's context length, capped at 4096)
    max_tokens: int | None = None
    # static: how many sequences the preallocated pool holds at once
    max_seqs: int = 1
    # dynamic: tokens of room the pool starts with
    initial_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise InvalidParams(
                f"unknown cache strategy {self.strategy!r}; choose one of: {', '.join(STRATEGIES)}"
            )
        if not 1 <= self.page_size <= 4096:
            raise InvalidParams(f"page_size must be between 1 and 4096, got {self.page_size}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParams(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.max_seqs < 1:
            raise InvalidParams(f"max_seqs must be at least 1, got {self.max_seqs}")
        if self.initial_tokens < 1:
            raise InvalidParams(f"initial_tokens must be at least 1, got {self.initial_tokens}")
        if self.strategy != "static" and self.max_tokens is not None:
            raise InvalidParams(
                f"max_tokens applies to the static strategy only (got {self.strategy!r}); "
                "use static,max_tokens=N"
            )

    @property
    def uses_cache(self) -> bool:
        return self.strategy != "none"

    def with_capacity(self, model_context: int) -> "CacheConfig":
        """Fill in a static cache's default capacity from the model's context length."""
        if self.strategy == "static" and self.max_tokens is None:
            return replace(self, max_tokens=min(model_context, 4096))
        return self

    def spec(self) -> str:
        """The compact spec that rebuilds this config."""
        parts = [self.strategy]
        default = CacheConfig(strategy=self.strategy)
        for name in _OPTIONS:
            value = getattr(self, name)
            if value != getattr(default, name):
                parts.append(f"{name}={value}")
        return ",".join(parts)


def parse_kv_spec(spec: str | CacheConfig | None) -> CacheConfig:
    """Parse ``--kv`` text into a CacheConfig; a CacheConfig passes through; None is dynamic."""
    if spec is None:
        return CacheConfig()
    if isinstance(spec, CacheConfig):
        return spec
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not parts:
        raise InvalidParams(f"empty --kv spec; choose one of: {', '.join(STRATEGIES)}")
    fields: dict[str, object] = {}
    for part in parts:
        if "=" in part:
            key, _, raw = part.partition("=")
            key = key.strip().replace("-", "_")
            if key not in _OPTIONS:
                raise InvalidParams(
                    f"unknown --kv option {key!r}; options: {', '.join(sorted(_OPTIONS))}"
                )
            try:
                fields[key] = _OPTIONS[key](raw)
            except ValueError:
                raise InvalidParams(f"--kv option {key} needs an integer, got {raw!r}") from None
        elif part in STRATEGIES:
            if "strategy" in fields:
                raise InvalidParams(f"--kv names two strategies: {fields['strategy']!r} and {part!r}")
            fields["strategy"] = part
        else:
            raise InvalidParams(
                f"unknown --kv item {part!r}; strategies: {', '.join(STRATEGIES)}; "
                f"options: {', '.join(sorted(_OPTIONS))}"
            )
    return CacheConfig(**fields)  # type: ignore[arg-type]
