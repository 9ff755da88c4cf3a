"""``kvcache bench report DIR ...``: one table per host kind from the suites' JSON files.

Every ``kvcache bench SUITE --out DIR`` (or ``--json FILE``) run leaves a JSON file with a ``meta``
(the suite that wrote it, the machine, its CPU features, the kernel variant: report.run_meta) and
its results. This module reads such files, takes each one's headline rows (kvcache beside a peer
measured in the same run) with its suite's own ``headline(data)`` (bench/suites.py finds the
module), groups the files by host kind (CPU model, features, kernel variant) and prints one markdown
table per host kind: what, kvcache, the peer, the ratio, the date and the file of each row. Where
several files hold the same row, the newest run's counts.

It imports no torch and measures nothing (the suites import theirs inside their functions): it
reads files (and asks git when a file was committed, where nothing else dates it). A file it cannot
read or does not know is skipped with one line on stderr.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from kvcache.bench import suites
from kvcache.bench.rows import Headline
from kvcache.errors import KVCacheError


@dataclass
class Run:
    """One suite JSON file: the suite that wrote it, its data, its host kind and date."""

    path: Path
    suite: str
    data: dict
    host: str
    date: str | None  # YYYY-MM-DD, or None where nothing records it
    when: str  # the sort key among runs of one date (a time of day where one is known)


class ReportError(KVCacheError):
    """Nothing to report from the directories given (the CLI turns it into one line, exit 2)."""


# ---------------------------------------------------------------------------------------------
# the host and the date of a run


def _md_fields(path: Path) -> dict[str, str]:
    """The report ``kvcache bench SUITE --out`` wrote beside the JSON (SUITE.md): its run time and
    its machine table."""
    md = path.with_suffix(".md")
    try:
        text = md.read_text(errors="replace")
    except OSError:
        return {}
    out = {}
    m = re.search(r"^Run (\d{4}-\d{2}-\d{2})(?: (\d{2}:\d{2}))?", text, flags=re.M)
    if m:
        out["date"], out["time"] = m.group(1), m.group(2) or ""
    for key, value in re.findall(r"^\| (cpu|cpu features|kernel variant) \| (.*?) \|$", text, flags=re.M):
        out[key] = value
    return out


def host_kind(meta: dict, md: dict[str, str] | None = None) -> str:
    """The host kind of a run: CPU model, its SIMD features and kernel variant, as the suites write
    it (meta's ``host``); older files that recorded none of these group as one kind."""
    md = md or {}
    if isinstance(meta.get("host"), str) and meta["host"]:
        return meta["host"]
    name = meta.get("machine") or md.get("cpu")
    feats = meta.get("cpu_features")
    feats = " ".join(feats) if isinstance(feats, list) else md.get("cpu features", "").split(" (of ")[0]
    variant = meta.get("kernel_variant") or md.get("kernel variant")
    if not feats and not variant:
        return f"{name or 'a host'} (CPU features and kernel variant not recorded)"
    return f"{name or 'CPU not recorded'} · {feats or 'features not recorded'} · kernels {variant or 'not recorded'}"


def _git_time(path: Path) -> str:
    """When the file was last committed (ISO), or '' outside a git work tree."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cI", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def run_date(path: Path, meta: dict, md: dict[str, str]) -> tuple[str | None, str]:
    """(date, sort key) of a run: meta's ``date`` (the suites record it), else the time in the
    report written beside it, else a date in the file's name (ordered by commit time within that
    date), else the date git last committed it."""
    if isinstance(meta.get("date"), str) and meta["date"]:
        return meta["date"][:10], meta["date"]
    if md.get("date"):
        return md["date"], f"{md['date']}T{md.get('time', '')}"
    committed = _git_time(path)
    m = re.search(r"(\d{4}-\d{2}-\d{2})", path.name)
    if m:
        return m.group(1), committed if committed.startswith(m.group(1)) else m.group(1)
    if committed:
        return committed[:10], committed
    return None, ""


# ---------------------------------------------------------------------------------------------


def find_files(dirs: list[str]) -> list[Path]:
    """Every *.json under the directories (or the files named); ReportError for one that does not
    exist."""
    files: list[Path] = []
    for d in dirs:
        p = Path(d)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += sorted(p.rglob("*.json"))
        else:
            raise ReportError(f"{d}: no such directory")
    return files


def load(path: Path, notes: TextIO = sys.stderr) -> Run | None:
    """One file as a Run, or None (with a one-line note) when it is not a suite JSON it can read."""
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        print(f"skipped {path}: cannot read it as JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
              file=notes)
        return None
    meta = d.get("meta") if isinstance(d, dict) and isinstance(d.get("meta"), dict) else {}
    suite = meta.get("suite")
    if not isinstance(suite, str) or suite not in suites.by_key():
        print(f"skipped {path}: not a kvcache bench suite's JSON (no known suite in meta.suite)", file=notes)
        return None
    md = _md_fields(path)
    date, when = run_date(path, meta, md)
    return Run(path, suite, d, host_kind(meta, md), date, when)


def headline(run: Run, notes: TextIO = sys.stderr) -> list[Headline]:
    """The run's headline rows; [] with a note when its layout is not the one its suite's function
    reads."""
    fn = getattr(suites.by_key()[run.suite].load(), "headline", None)
    if fn is None:
        return []
    try:
        return fn(run.data)
    except (KeyError, TypeError, ValueError, StopIteration, AttributeError, IndexError) as e:
        print(f"skipped {run.path}: a {run.suite} JSON of a layout this report does not read "
              f"({type(e).__name__}: {str(e)[:80]})", file=notes)
        return []


@dataclass
class Entry:
    row: Headline
    run: Run
    at: int  # the row's place in its run's headline


def collect(dirs: list[str], since: str | None = None,
            notes: TextIO = sys.stderr) -> dict[str, list[Entry]]:
    """host kind -> its rows, each from the newest run that measured it, in suite order."""
    runs = [r for r in (load(p, notes) for p in find_files(dirs)) if r is not None]
    if not runs:
        raise ReportError(f"no kvcache bench suite JSON under {', '.join(dirs)}")
    if since:
        runs = [r for r in runs if r.date is not None and r.date >= since]
    runs.sort(key=lambda r: (r.date or "", r.when, str(r.path)))
    by_host: dict[str, dict[tuple[str, str, str], Entry]] = {}
    for run in runs:  # oldest first: a newer run's row replaces an older one's
        for at, row in enumerate(headline(run, notes)):
            by_host.setdefault(run.host, {})[(run.suite, row.what, row.peer_name)] = Entry(row, run, at)
    order = list(suites.by_key())
    out = {}
    for host, rows in by_host.items():
        # suite by suite; within one, model by model (the name before the colon), then in the order
        # the suite's function gives them
        out[host] = sorted(rows.values(), key=lambda e: (order.index(e.run.suite),
                                                         _natural(e.row.what.partition(":")[0]
                                                                  if ":" in e.row.what else ""), e.at))
    return out


def _natural(s: str) -> list[object]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _fmt(x: float, unit: str) -> str:
    if unit in ("tok/s", "ms", "us", "MB"):
        text = f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.3f}"
    else:
        text = f"{x:.2f}"
    return text


def _source(path: Path) -> str:
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def markdown(tables: dict[str, list[Entry]]) -> str:
    """One markdown table per host kind."""
    parts = []
    newest = {h: max(e.run.date or "" for e in entries) for h, entries in tables.items()}
    for host in sorted(tables, key=lambda h: (newest[h], h), reverse=True):
        lines = [f"### {host}", "",
                 "| what | kvcache | peer (same run) | ratio | date | source |", "|---|---|---|---|---|---|"]
        for e in tables[host]:
            r = e.row
            lines.append(f"| {r.what} | {_fmt(r.kvcache, r.unit)} | {r.peer_name} {_fmt(r.peer, r.unit)} | "
                         f"{r.ratio:.2f}x | {e.run.date or 'not recorded'} | {_source(e.run.path)} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def report(dirs: list[str], since: str | None = None, out: str | None = None,
           notes: TextIO = sys.stderr) -> str:
    """The markdown of ``kvcache bench report``; written to ``out`` too when given."""
    if since is not None and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", since):
        raise ReportError(f"--since {since!r}: give a date as YYYY-MM-DD")
    tables = collect(dirs, since, notes)
    if not tables:
        raise ReportError(f"no headline rows under {', '.join(dirs)}" + (f" since {since}" if since else ""))
    text = markdown(tables)
    if out:
        try:
            Path(out).write_text(text)
        except OSError as e:
            raise ReportError(f"cannot write {out}: {e.strerror or e}") from None
    return text
