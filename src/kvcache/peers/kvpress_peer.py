"""kvpress beside kvcache: the same presses, ratios and text, measured the same way.

kvpress needs a transformers older than kvcache's, so it runs in a venv of its own (``make
kvpress`` builds ``.venv-kvpress``) as a child process (peers/kvpress_child.py, a standalone
script). This side sends token ids (tokenized once, by kvcache), the converted model folder with
fp32 weights and the cases; the child answers per-position figures as JSON. A missing venv, a
crash, a time-out or an unreadable answer gives rows marked skipped with the reason, never an
exception.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

CHILD = Path(__file__).with_name("kvpress_child.py")
PRESSES = ("knorm", "snapkv", "expected", "kvzip", "tova", "h2o")  # those kvpress has a counterpart of
ENV_PYTHON = "KVCACHE_KVPRESS_PYTHON"


def find_python(explicit: str | None = None) -> Path | None:
    """The kvpress venv's python: ``explicit``, $KVCACHE_KVPRESS_PYTHON, ./.venv-kvpress, or the
    one beside a source checkout of kvcache; None when there is none."""
    for cand in (explicit, os.environ.get(ENV_PYTHON)):
        if cand:
            return Path(cand)
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        p = root / ".venv-kvpress" / "bin" / "python"
        if p.is_file():
            return p
    return None


@dataclass(frozen=True)
class PeerRow:
    """kvpress's figures for one press at one ratio (or why there are none)."""

    press: str
    ratio: float | None
    budget: int | None = None
    skipped: str = ""  # the reason, when kvpress gave no figures
    nll: tuple[float, ...] = ()  # per continuation position
    kl: tuple[float, ...] = ()  # KL(uncompressed || press) per position, nats
    agree: tuple[int, ...] = ()  # 1 where the most likely token equals the uncompressed model's
    kept: float = 0.0  # tokens per layer left after the press (context only)
    answers: tuple[tuple[int, ...], ...] = ()  # greedy passkey answers, token ids
    seconds: float = 0.0

    @property
    def ppl(self) -> float:
        return math.exp(sum(self.nll) / len(self.nll)) if self.nll else float("nan")

    @property
    def mean_kl(self) -> float:
        return sum(self.kl) / len(self.kl) if self.kl else float("nan")

    @property
    def agreement(self) -> float:
        return sum(self.agree) / len(self.agree) if self.agree else float("nan")


@dataclass(frozen=True)
class PeerRun:
    rows: list[PeerRow]
    versions: dict[str, str] = field(default_factory=dict)
    reference_nll: tuple[float, ...] = ()
    reference_answers: tuple[tuple[int, ...], ...] = ()
    note: str = ""  # why the whole run gave nothing, if it did


def _skipped(cases: list[dict], reason: str) -> PeerRun:
    rows = [PeerRow(c["press"], c.get("ratio"), c.get("budget"), skipped=reason) for c in cases]
    return PeerRun(rows, note=reason)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def run_kvpress(
    model_folder: str | Path,
    cases: list[dict],
    context: list[int] | None = None,
    continuation: list[int] | None = None,
    passkeys: list[tuple[list[int], list[int]]] = (),  # type: ignore[assignment]
    answer_tokens: int = 8,
    eos: tuple[int, ...] = (),
    threads: int | None = None,
    python: str | Path | None = None,
    timeout: float = 3600.0,
    script: Path = CHILD,
) -> PeerRun:
    """kvpress on ``cases`` ({"press": name, "ratio": R} or {"press": name, "budget": N}): prefill
    ``context`` with the press, score ``continuation``, answer each passkey (context, question)."""
    cases = [dict(c) for c in cases]
    bad = [c["press"] for c in cases if c.get("press") not in PRESSES]
    if bad:
        return _skipped(cases, f"kvpress has no counterpart of press {bad[0]!r} (it has {', '.join(PRESSES)})")
    exe = find_python(str(python) if python else None)
    if exe is None or not exe.is_file():
        where = exe or ".venv-kvpress/bin/python"
        return _skipped(cases, f"kvpress is not installed ({where} not found; run `make kvpress`)")
    req = {"model": str(model_folder), "threads": threads, "cases": cases, "answer_tokens": answer_tokens, "eos": list(eos),
           "fidelity": {"context": list(context), "continuation": list(continuation)} if context and continuation else None,
           "passkey": [{"context": list(c), "question": list(q)} for c, q in passkeys]}
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # the child must not see kvcache's transformers
    try:
        p = subprocess.run([str(exe), str(script)], input=json.dumps(req), capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return _skipped(cases, f"kvpress did not answer within {timeout:.0f} s")
    except OSError as e:
        return _skipped(cases, f"kvpress did not start: {e.strerror or e}")
    if p.returncode < 0:
        return _skipped(cases, f"kvpress died of signal {-p.returncode}")
    if p.returncode != 0:
        return _skipped(cases, f"kvpress failed (exit {p.returncode}): {_last_line(p.stderr) or 'no message'}")
    try:
        ans = json.loads(p.stdout)
        rows = []
        for case, r in zip(cases, ans["results"]):
            if r.get("error"):
                rows.append(PeerRow(case["press"], case.get("ratio"), case.get("budget"), skipped=f"kvpress: {r['error']}"))
                continue
            rows.append(PeerRow(case["press"], case.get("ratio"), case.get("budget"),
                                nll=tuple(r.get("nll") or ()), kl=tuple(r.get("kl") or ()),
                                agree=tuple(r.get("agree") or ()), kept=float(r.get("kept", 0.0)),
                                answers=tuple(tuple(a) for a in r.get("passkey", ())),
                                seconds=float(r.get("seconds", 0.0))))
        if len(rows) != len(cases):
            raise ValueError(f"{len(rows)} results for {len(cases)} cases")
        ref = ans.get("reference") or {}
        return PeerRun(rows, {k: str(v) for k, v in (ans.get("versions") or {}).items()},
                       tuple(ref.get("nll") or ()), tuple(tuple(a) for a in ref.get("passkey", ())))
    except (ValueError, KeyError, TypeError) as e:
        return _skipped(cases, f"kvpress's answer could not be read ({e})")
