"""The quality gate behind ``--kv auto``: measure candidate strategies on a calibration text, keep
the cheapest that stays within a quality budget, remember it beside the model's fingerprint.

- Candidates: the encodings (fp16, bf16, int8, int4, int2, and int4 and int2 with their K/V
  Hadamard-rotated: the same bytes, so where rotation lowers the KL the tie goes to it), sink+window
  caches alone and with int8 or int4, and, where the cache has presses, each press at several
  ratios with int8 and int4
  (evict, then quantize what stays; int8 costs about nothing in KL, so an fp32 press would only
  ever lose to it). The full fp32 cache is always there (KL 0), so a choice
  always exists. Per-layer precision is not a candidate: CacheConfig holds one encoding for all
  layers.
- Measurement: eval/continuation.py's protocol (prefill the calibration context through the
  candidate, then score a continuation against the full cache): mean KL(full || candidate), its
  standard error, top-1 agreement, and the bytes per token the cache holds after the text.
- Choice: the fewest bytes per token among candidates whose mean KL plus ``margin`` standard
  errors is at most ``max_kl`` and whose top-1 agreement is at least ``min_agree`` (ties: lower KL).
- Storage: $KVCACHE_HOME/auto/<fingerprint>.json (0600, written atomically) holds the measured
  table, the calibration it came from and one choice per budget; a new budget is picked from the
  saved table without measuring again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcache.cache.config import parse_kv_spec
from kvcache.errors import InvalidParams, KVCacheError

ENCODINGS = ("fp16", "bf16", "int8", "int4", "int4,rotate", "int2", "int2,rotate")
WINDOWS = (256, 512)
PRESSES = ("knorm", "snapkv", "expected", "tova", "h2o")
RATIOS = (0.25, 0.5, 0.75)
DEFAULT_MAX_KL = 0.05
DEFAULT_MIN_AGREE = 0.9
DEFAULT_MARGIN = 2.0  # standard errors of the mean KL added before comparing with the budget
FORMAT = 1


@dataclass(frozen=True)
class Budget:
    max_kl: float = DEFAULT_MAX_KL
    min_agree: float = DEFAULT_MIN_AGREE
    margin: float = DEFAULT_MARGIN

    def __post_init__(self) -> None:
        check_budget(self.max_kl, self.min_agree, self.margin)

    @property
    def key(self) -> str:
        return f"kl={self.max_kl:g},agree={self.min_agree:g},margin={self.margin:g}"

    def admits(self, row: dict) -> bool:
        return row["kl"] + self.margin * row["kl_se"] <= self.max_kl and row["agreement"] >= self.min_agree


def check_budget(max_kl: float, min_agree: float, margin: float = DEFAULT_MARGIN) -> None:
    """Refuse a budget that cannot mean anything, with one line naming it."""
    if not isinstance(max_kl, (int, float)) or not math.isfinite(max_kl) or max_kl <= 0:
        raise InvalidParams(f"the KL budget must be a number of nats above 0 (e.g. 0.05), got {max_kl!r}")
    if not isinstance(min_agree, (int, float)) or not 0 <= min_agree <= 1:
        raise InvalidParams(f"the top-1 agreement budget must be between 0 and 1 (e.g. 0.9), got {min_agree!r}")
    if not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 0:
        raise InvalidParams(f"the margin must be 0 or more standard errors, got {margin!r}")


def parse_auto(spec: str) -> Budget | None:
    """``auto``, ``auto,kl=0.05``, ``auto,kl=0.05,agree=0.95,margin=2``: the budget given (None
    for plain ``auto``: the choice saved last). Anything else after ``auto`` is refused."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts or parts[0] != "auto":
        raise InvalidParams(f"not an auto spec: {spec!r}")
    if len(parts) == 1:
        return None
    given: dict[str, float] = {}
    for p in parts[1:]:
        key, eq, raw = p.partition("=")
        key = {"max_kl": "kl", "min_agree": "agree"}.get(key.strip().replace("-", "_"), key.strip())
        if not eq or key not in ("kl", "agree", "margin"):
            raise InvalidParams(f"--kv auto takes kl=X, agree=Y and margin=Z only, got {p!r}")
        try:
            given[key] = float(raw)
        except ValueError:
            raise InvalidParams(f"--kv auto: {key}= takes a number, got {raw!r}") from None
    return Budget(given.get("kl", DEFAULT_MAX_KL), given.get("agree", DEFAULT_MIN_AGREE),
                  given.get("margin", DEFAULT_MARGIN))


def presses_available() -> bool:
    """Whether this kvcache's CacheConfig knows presses (``press=knorm,ratio=0.5`` parses)."""
    try:
        parse_kv_spec("press=knorm,ratio=0.5")
    except InvalidParams:
        return False
    return True


def candidates(presses: bool | None = None) -> list[str]:
    """The specs the gate measures, the full fp32 cache first."""
    out = ["dynamic", *ENCODINGS]
    for w in WINDOWS:
        out += [f"sinks=4,window={w}"] + [f"{e},sinks=4,window={w}" for e in ("int8", "int4")]
    if presses_available() if presses is None else presses:
        for p in PRESSES:
            for r in RATIOS:
                out += [f"{e},press={p},ratio={r:g}" for e in ("int8", "int4")]
    return out


def measure_table(model, context: Sequence[int], continuation: Sequence[int], specs: Sequence[str],
                  progress: Callable[[int], None] | None = None) -> list[dict]:
    """One row (Measured.as_dict) per spec; a spec the cache refuses is a row with its reason."""
    from kvcache.eval.continuation import measure, reference

    ref = reference(model, context, continuation)
    rows = []
    for s in specs:
        try:
            rows.append(measure(model, ref, s).as_dict() | {"asked": s})
        except KVCacheError as e:
            rows.append({"asked": s, "spec": s, "error": str(e)})
        if progress:
            progress(1)
    return rows


def choose(rows: Sequence[dict], budget: Budget) -> dict:
    """The cheapest admitted row (bytes per token, then KL); the full cache when none is."""
    ok = [r for r in rows if "error" not in r and budget.admits(r)]
    if not ok:
        raise KVCacheError(f"no candidate meets {budget.key}, not even the full cache (was it measured?)")
    return min(ok, key=lambda r: (r["bytes_per_token"], r["kl"]))


# -- storage beside the model's fingerprint ---------------------------------------------------

def store_path(fingerprint: str) -> Path:
    from kvcache.paths import cache_home

    if not fingerprint or any(c not in "0123456789abcdef" for c in fingerprint.lower()):
        raise InvalidParams(f"not a model fingerprint: {fingerprint!r}")
    d = cache_home() / "auto"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d / f"{fingerprint}.json"


def load(fingerprint: str) -> dict | None:
    """The saved calibration of a model, or None (also for an unreadable or foreign file)."""
    try:
        data = json.loads(store_path(fingerprint).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("fingerprint") != fingerprint:
        return None
    return data


def save(fingerprint: str, data: dict) -> Path:
    target = store_path(fingerprint)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise KVCacheError(f"cannot save the --kv auto choice to {target}: {e.strerror or e}") from None
    return target


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def record(data: dict | None, fingerprint: str, calibration: dict, rows: list[dict] | None,
           budget: Budget) -> tuple[dict, dict]:
    """``data`` with a new table (when ``rows`` is given: older choices are dropped) and the choice
    for ``budget`` made from its table; (data, chosen row)."""
    if rows is not None or data is None:
        data = {"format": FORMAT, "fingerprint": fingerprint, "calibration": calibration,
                "table": rows or [], "choices": {}}
    row = choose(data["table"], budget)
    data["choices"][budget.key] = {"spec": row["spec"], "max_kl": budget.max_kl, "min_agree": budget.min_agree,
                                   "margin": budget.margin}
    data["last"] = budget.key
    return data, row
