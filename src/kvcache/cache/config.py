"""Cache configuration (CacheConfig): one frozen dataclass over four independent axes, and the ``--kv`` parser.

Axes (every combination works unless it is impossible in principle; those are refused here, when
the config is built, with the list of what works):

- capacity: ``dynamic`` (pages allocated as sequences grow) | ``static`` (``max_tokens`` per
  sequence preallocated) | ``none`` (no cache: recompute everything, the baseline);
- visibility: full | ``window=N`` (the last N tokens) | ``sinks=K,window=N`` (the first K tokens
  plus the last N - K: StreamingLLM). The model's own sliding layers keep their window;
- encoding: ``fp32`` | ``fp16`` | ``bf16`` | ``int8`` | ``int4`` | ``int2`` (KIVI: keys per channel
  over ``group_size`` tokens, values per token over ``group_size`` channels, the last ``residual``
  tokens in fp32); ``rotate`` with a quantized encoding rotates K and V per head by the normalized
  Hadamard transform before quantizing (outlier channels spread; cache/rotation.py);
- placement: ``device`` | ``host`` | ``disk`` (pages in memory-mapped files under ``dir``);
- retention: every token | ``press=NAME`` with ``ratio=R`` (the share of tokens evicted) or
  ``keep=N`` (tokens kept), the latest ``protect`` tokens never evicted (kvcache/press/):
  ``knorm``, ``snapkv``, ``expected``, ``kvzip`` score a prompt once it is in; ``tova``, ``h2o``
  rescore while generating.

A dynamic pool may be given a memory ``budget`` (``budget=2GiB``, ``budget=25%`` of RAM): it never
grows past it (see cache/capacity.py; the text is read by cache/budget.py).

A spec is a comma-separated list of a preset or axis value and ``key=value`` options, e.g.
``static,int4,sinks=4,window=1024`` or ``int4,rotate,residual=0``. Later items override earlier ones.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from kvcache.cache.budget import parse_budget
from kvcache.errors import InvalidParams

CAPACITIES = ("dynamic", "static", "none")
ENCODINGS = ("fp32", "fp16", "bf16", "int8", "int4", "int2")
PLACEMENTS = ("device", "host", "disk")
# preset name -> the fields it sets (the names transformers users know)
PRESETS: dict[str, dict[str, object]] = {
    "none": {"capacity": "none"},
    "dynamic": {"capacity": "dynamic"},
    "static": {"capacity": "static"},
    "offloaded": {"capacity": "dynamic", "placement": "host"},
    "offloaded_static": {"capacity": "static", "placement": "host"},
    "quantized": {"encoding": "int4"},
    "sliding_window": {"window": 1024, "sinks": 0},
    "sink": {"window": 1024, "sinks": 4},
}
PRESS_NAMES = ("knorm", "snapkv", "expected", "kvzip", "tova", "h2o")  # kvcache/press/
DECODE_PRESSES = ("tova", "h2o")  # rescore while generating
_INT_OPTIONS = ("page_size", "max_tokens", "max_seqs", "initial_tokens", "window", "sinks",
                "group_size", "residual", "keep", "protect")
_OPTIONS = _INT_OPTIONS + ("dir", "budget", "press", "ratio")
FLAGS = ("rotate",)  # items that switch a field on by their bare name
MAX_INT_OPTION = 2**31 - 1  # no count of tokens, pages or sequences is larger


def _works() -> str:
    return (f"presets: {', '.join(PRESETS)}; encodings: {', '.join(ENCODINGS)}; "
            f"placements: {', '.join(PLACEMENTS)}; presses: {', '.join(PRESS_NAMES)}; "
            f"flags: {', '.join(FLAGS)}; options: {', '.join(o + '=' for o in _OPTIONS)}")


@dataclass(frozen=True)
class CacheConfig:
    """How K/V are kept. See the module docstring for the axes."""

    capacity: str = "dynamic"
    page_size: int | None = None  # None: 16, or group_size for a quantized encoding
    max_tokens: int | None = None  # static: per sequence (None: the model's context, at most 4096)
    max_seqs: int = 1  # static: sequences the preallocated pool holds at once
    initial_tokens: int = 1024  # dynamic: tokens of room the pool starts with
    window: int | None = None  # tokens visible to a query (sinks included); None: all
    sinks: int = 0  # first tokens kept visible beside the window
    encoding: str = "fp32"
    group_size: int = 32  # quantized: tokens per key group, channels per value group
    residual: int = 128  # quantized: the most recent tokens kept in fp32
    rotate: bool = False  # quantized: K/V Hadamard-rotated per head before quantizing
    placement: str = "device"
    dir: str | None = None  # disk: where the page files go (None: a temporary folder)
    budget: int | None = None  # dynamic: bytes the pools may hold at most (None: no bound)
    press: str | None = None  # retention: a press scoring tokens (None: every token is kept)
    ratio: float | None = None  # press: the share of tokens evicted
    keep: int | None = None  # press: tokens kept (instead of a ratio)
    protect: int = 64  # press: the latest tokens never evicted

    def __post_init__(self) -> None:
        if self.capacity not in CAPACITIES:
            raise InvalidParams(f"unknown capacity {self.capacity!r}; {_works()}")
        if self.encoding not in ENCODINGS:
            raise InvalidParams(f"unknown encoding {self.encoding!r} (bits must be 8, 4 or 2); "
                                f"encodings: {', '.join(ENCODINGS)}")
        if self.placement not in PLACEMENTS:
            raise InvalidParams(f"unknown placement {self.placement!r}; placements: {', '.join(PLACEMENTS)}")
        if self.page_size is not None and not 1 <= self.page_size <= 4096:
            raise InvalidParams(f"page_size must be between 1 and 4096, got {self.page_size}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParams(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.max_seqs < 1:
            raise InvalidParams(f"max_seqs must be at least 1, got {self.max_seqs}")
        if self.initial_tokens < 1:
            raise InvalidParams(f"initial_tokens must be at least 1, got {self.initial_tokens}")
        if self.capacity != "static" and self.max_tokens is not None:
            raise InvalidParams(f"max_tokens applies to the static capacity only (got {self.capacity!r}); "
                                "use static,max_tokens=N")
        if self.sinks < 0:
            raise InvalidParams(f"sinks must be 0 or more, got {self.sinks}")
        if self.window is not None and self.window < 1:
            raise InvalidParams(f"window must be at least 1, got {self.window}")
        if self.sinks and self.window is None:
            raise InvalidParams(f"sinks={self.sinks} needs a window: e.g. sinks={self.sinks},window=1024")
        if self.window is not None and self.window <= self.sinks:
            raise InvalidParams(f"window ({self.window}) must be larger than sinks ({self.sinks}): "
                                "the window counts the sink tokens too")
        if self.residual < 0:
            raise InvalidParams(f"residual (the fp32 window of recent tokens) must be 0 or more, got {self.residual}")
        if self.group_size < 1:
            raise InvalidParams(f"group_size must be at least 1, got {self.group_size}")
        if self.quantized and self.group_size % 8:
            raise InvalidParams(f"group_size must be a multiple of 8 for {self.encoding} (codes are packed "
                                f"by eight), got {self.group_size}")
        if self.rotate and not self.quantized:
            ints = ", ".join(e for e in ENCODINGS if e.startswith("int"))
            raise InvalidParams(f"rotate applies to the quantized encodings ({ints}), not {self.encoding}: "
                                "e.g. int4,rotate")
        if self.quantized and self.page_size is not None and self.page_size % self.group_size:
            raise InvalidParams(f"page_size ({self.page_size}) must be a multiple of group_size "
                                f"({self.group_size}) for {self.encoding}: keys are quantized per page")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 1):
            raise InvalidParams(f"budget must be a positive number of bytes, got {self.budget!r}")
        if self.budget is not None and self.capacity != "dynamic":
            raise InvalidParams(f"a KV budget applies to the dynamic capacity only (got {self.capacity!r}): a static "
                                "pool is sized by max_tokens and max_seqs")
        if self.dir is not None and self.placement != "disk":
            raise InvalidParams("dir= applies to the disk placement only; add 'disk' to the spec")
        self._check_press()
        if self.capacity == "none":
            other = [f.name for f in fields(self) if f.name != "capacity"
                     and getattr(self, f.name) != getattr(_DEFAULT, f.name)]
            if other:
                raise InvalidParams(f"the 'none' strategy keeps no cache, so {', '.join(other)} cannot apply; "
                                    "drop them or choose dynamic or static")

    def _check_press(self) -> None:
        """The retention axis: a known press with either a ratio or a token budget."""
        if self.press is None:
            extra = [f"{n}=" for n in ("ratio", "keep") if getattr(self, n) is not None]
            if self.protect != 64:
                extra.append("protect=")
            if extra:
                raise InvalidParams(f"{', '.join(extra)}: press options without a press; add press=NAME "
                                    f"({', '.join(PRESS_NAMES)})")
            return
        if self.press not in PRESS_NAMES:
            raise InvalidParams(f"unknown press {self.press!r}; presses: {', '.join(PRESS_NAMES)}")
        if (self.ratio is None) == (self.keep is None):
            raise InvalidParams(f"press={self.press} needs either ratio=R (the share evicted, e.g. 0.5) "
                                "or keep=N (tokens kept): exactly one of them")
        if self.ratio is not None and not 0 < self.ratio < 1:
            raise InvalidParams(f"ratio is the share of tokens evicted: between 0 and 1 (exclusive), got {self.ratio}")
        if self.protect < 0:
            raise InvalidParams(f"protect must be 0 or more, got {self.protect}")
        if self.keep is not None and self.keep <= self.protect + self.sinks:
            raise InvalidParams(f"keep={self.keep} must exceed the tokens always kept: protect={self.protect} "
                                f"plus sinks={self.sinks}")
        if self.window is not None and self.window <= self.protect + self.sinks:
            raise InvalidParams(f"window={self.window} shows no token the press could evict: it must exceed "
                                f"protect={self.protect} plus sinks={self.sinks}")
        if self.quantized and self.press in DECODE_PRESSES and self.residual <= self.protect:
            raise InvalidParams(f"press={self.press} with {self.encoding} evicts tokens before they are quantized: "
                                f"residual ({self.residual}) must exceed protect ({self.protect})")

    @property
    def strategy(self) -> str:
        """The capacity axis (``none``, ``dynamic`` or ``static``)."""
        return self.capacity

    @property
    def uses_cache(self) -> bool:
        return self.capacity != "none"

    @property
    def quantized(self) -> bool:
        return self.encoding.startswith("int")

    @property
    def bits(self) -> int:
        return int(self.encoding[3:]) if self.quantized else 0

    @property
    def pages_of(self) -> int:
        """The page size in effect."""
        if self.page_size is not None:
            return self.page_size
        return self.group_size if self.quantized else 16

    @property
    def exact(self) -> bool:
        """Whether attention sees exactly what recomputation would (fp32, full visibility, every token)."""
        return self.encoding == "fp32" and self.window is None and self.press is None

    def with_capacity(self, model_context: int) -> "CacheConfig":
        """Fill in a static cache's default capacity from the model's context length."""
        if self.capacity == "static" and self.max_tokens is None:
            return replace(self, max_tokens=min(model_context, 4096))
        return self

    def spec(self) -> str:
        """The compact spec that rebuilds this config."""
        parts = [self.capacity]
        for f in fields(self):
            if f.name in ("capacity",):
                continue
            value = getattr(self, f.name)
            if value == getattr(_DEFAULT, f.name):
                continue
            if f.name == "budget":
                value = f"{value}B"
            if f.name in FLAGS:
                parts.append(f.name)
                continue
            parts.append(value if f.name in ("encoding", "placement") else f"{f.name}={value}")  # type: ignore[arg-type]
        return ",".join(parts)


_DEFAULT = CacheConfig()


def parse_kv_spec(spec: str | CacheConfig | None) -> CacheConfig:
    """Parse ``--kv`` text into a CacheConfig; a CacheConfig passes through; None is dynamic."""
    if spec is None:
        return CacheConfig()
    if isinstance(spec, CacheConfig):
        return spec
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not parts:
        raise InvalidParams(f"empty --kv spec; {_works()}")
    values: dict[str, object] = {}
    said: dict[str, str] = {}  # key -> the item that set it (an explicit item, or a preset)

    def put(key: str, value: object, item: str, preset: bool = False) -> None:
        """Set ``key``; two items that set it differently are refused, except an explicit item
        refining what a preset set (``sliding_window,window=512``)."""
        if key in values and values[key] != value:
            first = said[key]
            if preset or first not in PRESETS:
                raise InvalidParams(f"--kv {first!r} and {item!r} both set {key} ({values[key]} vs {value}); "
                                    "give one")
        values[key] = value
        said[key] = item

    for part in parts:
        if "=" in part:
            key, _, raw = part.partition("=")
            key = key.strip().replace("-", "_")
            raw = raw.strip()
            if key in ("bits",):
                if raw not in ("8", "4", "2", "16", "32"):
                    raise InvalidParams(f"bits must be 8, 4 or 2 (or 16/32 for floats), got {raw!r}")
                put("encoding", {"16": "fp16", "32": "fp32"}.get(raw, f"int{raw}"), part)
                continue
            if key in FLAGS:
                raise InvalidParams(f"--kv {key} takes no value: write {key!r} alone (e.g. int4,{key})")
            if key not in _OPTIONS:
                raise InvalidParams(f"unknown --kv option {key!r}; {_works()}")
            if key in ("dir", "press"):
                put(key, raw, part)
                continue
            if key == "ratio":
                try:
                    put(key, float(raw), part)
                except ValueError:
                    raise InvalidParams(f"--kv option ratio needs a number between 0 and 1, got {raw!r}") from None
                continue
            if key == "budget":
                put(key, parse_budget(raw), part)
                continue
            try:
                number = int(raw)
            except ValueError:
                raise InvalidParams(f"--kv option {key} needs an integer, got {raw!r}") from None
            if abs(number) > MAX_INT_OPTION:
                raise InvalidParams(f"--kv option {key}={raw} is out of range (at most {MAX_INT_OPTION})")
            put(key, number, part)
        elif part in PRESETS:
            for key, value in PRESETS[part].items():
                put(key, value, part, preset=True)
        elif part in ENCODINGS:
            put("encoding", part, part)
        elif part in PLACEMENTS:
            put("placement", part, part)
        elif part in FLAGS:
            put(part, True, part)
        else:
            raise InvalidParams(f"unknown --kv item {part!r}; {_works()}")
    return CacheConfig(**values)  # type: ignore[arg-type]
