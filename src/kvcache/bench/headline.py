"""``kvcache bench report DIR ...``: one table per host kind from the suites' JSON files.

Every ``kvcache bench SUITE --out DIR`` (or ``--json FILE``) run leaves a JSON file with a ``meta``
(the machine, its CPU features, the kernel variant: report.run_meta) and its results. This module
reads such files, tells which suite wrote each one from its layout, takes each suite's headline
rows (kvcache beside a peer measured in the same run) with one small function per suite
(``HEADLINES``), groups the files by host kind (CPU model, features, kernel variant) and prints one
markdown table per host kind: what, kvcache, the peer, the ratio, the date and the file of each row.
Where several files hold the same row, the newest run's counts.

It imports no torch and measures nothing: it reads files (and asks git when a file was committed,
where nothing else dates it). A file it cannot read or does not know is skipped with one line on
stderr.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, TextIO

from kvcache.bench.rows import shipped_type
from kvcache.errors import KVCacheError


@dataclass(frozen=True)
class Row:
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
# helpers shared by the suites' headline functions


def _model(meta: dict, weights: str = "") -> str:
    """A short name for the model a run measured: ``1b-0-Q4_0`` -> ``1B Q4_0``, the bundled
    ``smollm2`` with ``file (Q4_1)`` weights -> ``SmolLM2-135M Q4_1``, a path -> its file name."""
    name = str(meta.get("model") or "")
    name = re.sub(r"\.gguf$", "", name.replace("\\", "/").rsplit("/", 1)[-1])
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


def _one(rows: Iterable[dict], **match: object) -> dict:
    """The one row whose keys hold these values (KeyError when there is none)."""
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    raise KeyError(f"no row with {match}")


def _num(x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or x <= 0:
        raise ValueError(f"not a positive number: {x!r}")
    return float(x)


# ---------------------------------------------------------------------------------------------
# one headline function per suite: (the file's JSON) -> rows; a layout it does not expect raises
# KeyError, TypeError or ValueError and the file is skipped with a note


def decode_rows(d: dict) -> list[Row]:
    """``bench decode``: kvcache on the file's own weights beside llama.cpp on the same file
    (decode at batch 1, prefill, decode at depth); the layout before llama.cpp rows: kvcache
    against transformers' DynamicCache."""
    meta, results = d.get("meta", {}), d["results"]
    if not d.get("ratios"):  # the first layout: one decode test, kvcache beside transformers
        k = _one(results, system="kvcache", cache="dynamic")
        p = _one(results, system="transformers", cache="DynamicCache")
        return [Row("decode tok/s, batch 1, fp32 weights", _num(k["tok_s"]), "transformers DynamicCache",
                    _num(p["tok_s"]), "tok/s")]
    rows = []
    for r in d["ratios"]:
        test, tokens = r["test"], r["tokens"]
        k = next(x for x in results if x["system"] == "kvcache" and x["test"] == test and x["tokens"] == tokens
                 and f"{x['weights']} {x['cache']}" == r["kvcache"])
        if not str(k["weights"]).startswith("file"):
            continue  # the file's own weights only: llama.cpp runs that file
        p = next(x for x in results if x["system"] != "kvcache" and x["test"] == test and x["tokens"] == tokens
                 and f"{x['system']} {x['weights']} {x['cache']}" == r["peer"])
        model = _model(meta, str(k["weights"]))
        if test == "decode":
            what = f"{model}: decode tok/s, batch 1"
        elif test == "prefill":
            what = f"{model}: prefill {tokens} tokens, tok/s"
        elif test == "depth":
            what = f"{model}: decode tok/s after {tokens} tokens, {k['cache']} KV (peer {p['cache']})"
        else:
            what = f"{model}: {test} {tokens}, tok/s"
        rows.append(Row(what, _num(k["tok_s"]), f"{p['system']}, same file", _num(p["tok_s"]), "tok/s"))
    return rows


def _suite(d: dict) -> tuple[dict, list[dict], str]:
    """A suite file's meta, its result rows and the model they name."""
    return d["meta"], d["results"], _model(d["meta"])


def serve_rows(d: dict) -> list[Row]:
    """``bench serve``: output tok/s of ``kvcache serve`` beside llama-server on the same GGUF, at
    each level of concurrent streams."""
    meta, results, model = _suite(d)
    rows = []
    for k in (r for r in results if r["system"] == "kvcache"):
        p = next(x for x in results if x["system"] != "kvcache" and x["streams"] == k["streams"])
        what = (f"{model}: serving, {k['streams']} concurrent streams, {meta['prompt_tokens']}-token prompts, "
                f"{meta['new_tokens']} out, output tok/s")
        rows.append(Row(what, _num(k["tok_s"]), f"{p['system']}, same file", _num(p["tok_s"]), "tok/s"))
    return rows


def spec_rows(d: dict) -> list[Row]:
    """``bench spec``: prompt lookup beside the peers' own (transformers on fp32 weights,
    llama-server on the file); a prediction on the file's weights beside the same run without."""
    meta, results = d.get("meta", {}), d["results"]
    rows = []
    for p in results:
        if p["system"] == "kvcache" or p["method"] != "lookup":
            continue
        k = _one(results, system="kvcache", pair=p["pair"], workload=p["workload"], method="lookup")
        weights = "fp32 weights" if p["pair"] == "fp32" else _model(meta, str(k["weights"]))
        rows.append(Row(f"{p['workload']}: prompt-lookup decode tok/s, {weights}", _num(k["spec_tok_s"]),
                        p["system"], _num(p["spec_tok_s"]), "tok/s"))
    for k in results:
        if k["system"] == "kvcache" and k["pair"] == "file" and k["method"] == "prediction":
            rows.append(Row(f"{k['workload']}: decode tok/s with the file as `prediction`, "
                            f"{_model(meta, str(k['weights']))}", _num(k["spec_tok_s"]),
                            "kvcache without speculation", _num(k["plain_tok_s"]), "tok/s"))
    return rows


def structured_rows(d: dict) -> list[Row]:
    """``bench structured``: JSON-schema constrained decode beside the same requests unconstrained;
    the grammar engine kvcache uses (llguidance) beside xgrammar."""
    rows = []
    for r in d["results"]:
        rows.append(Row(f"JSON-schema constrained decode tok/s, {r['requests']} requests, batch {r['batch']}",
                        _num(r["constrained_tok_s"]), "same requests unconstrained", _num(r["free_tok_s"]),
                        "tok/s"))
    engines = {e["engine"]: e for e in d.get("engines", [])}
    if "llguidance" in engines and "xgrammar" in engines:
        ll, xg = engines["llguidance"], engines["xgrammar"]
        rows.append(Row("grammar engine: mean token mask, us", _num(ll["mask_mean_us"]), "xgrammar",
                        _num(xg["mask_mean_us"]), "us", higher_better=False))
        rows.append(Row("grammar engine: schema compile, ms", _num(ll["compile_s"]) * 1e3, "xgrammar",
                        _num(xg["compile_s"]) * 1e3, "ms", higher_better=False))
    return rows


def throughput_rows(d: dict) -> list[Row]:
    """``bench throughput``: continuous batching's output tok/s beside each of transformers' ways."""
    meta, results = d["meta"], d["results"]
    k = next(r for r in results if r["system"].startswith("kvcache"))
    what = (f"output tok/s, {meta['requests']} requests at once, {meta['new_tokens']} new tokens each")
    return [Row(what, _num(k["tok_s"]), p["system"], _num(p["tok_s"]), "tok/s")
            for p in results if not p["system"].startswith("kvcache")]


def prefix_rows(d: dict) -> list[Row]:
    """``bench prefix``: TTFT with a shared system prompt already cached (RAM, disk, Redis) beside
    prefilling it, and beside transformers' prefill + deepcopy."""
    meta, results = d["meta"], d["results"]
    cold = _one(results, case="kvcache cold (prefill all)")
    n = meta.get("system_tokens", "?")
    rows = []
    for r in results:
        case = r["case"]
        if case.startswith("kvcache") and "cold" not in case:
            where = case.removeprefix("kvcache ").strip()
            rows.append(Row(f"TTFT ms, {n}-token shared system prompt, {where}", _num(r["ttft_ms"]),
                            "kvcache prefilling it", _num(cold["ttft_ms"]), "ms", higher_better=False))
    warm = next(r for r in results if r["case"].startswith("kvcache warm"))
    for r in results:
        if r["case"].startswith("transformers"):
            rows.append(Row(f"TTFT ms, {n}-token shared system prompt, warm", _num(warm["ttft_ms"]), r["case"],
                            _num(r["ttft_ms"]), "ms", higher_better=False))
    return rows


def cache_vs_none_rows(d: dict) -> list[Row]:
    """``bench cache-vs-none``: ms per token with kvcache's cache beside transformers' DynamicCache."""
    results = d["results"]
    k = _one(results, system="kvcache", cache="dynamic")
    p = _one(results, system="transformers", cache="DynamicCache")
    return [Row(f"ms per token over {k['tokens']} new tokens, with a cache",
                _num(k["total_s"]) * 1e3 / _num(k["tokens"]), "transformers DynamicCache",
                _num(p["total_s"]) * 1e3 / _num(p["tokens"]), "ms", higher_better=False)]


def hf_rows(d: dict) -> list[Row]:
    """``bench hf``: KV bytes held by kvcache's strategies through ``kvcache.hf`` beside
    transformers' DynamicCache at the longest context measured."""
    results = d["results"]
    ctx = max(r["context"] for r in results)
    ref = _one(results, system="transformers", cache="DynamicCache", context=ctx)
    return [Row(f"KV MB at {ctx} tokens, `{r['cache']}` through kvcache.hf", _num(r["kv_bytes"]) / 1e6,
                "transformers DynamicCache", _num(ref["kv_bytes"]) / 1e6, "MB", higher_better=False)
            for r in results if r["system"] == "kvcache.hf" and r["context"] == ctx
            and r["cache"] not in ("dynamic", "static")]


def growth_rows(d: dict) -> list[Row]:
    """``bench growth``: the mean time to append a token's K/V in the last bucket beside
    transformers' DynamicCache."""
    last = d["buckets"][-1]
    return [Row(f"ms per K/V append, {last['bucket']} tokens", _num(last["kvcache_us"]) / 1e3,
                "transformers DynamicCache", _num(last["transformers_us"]) / 1e3, "ms", higher_better=False)]


def memory_rows(d: dict) -> list[Row]:
    """``bench memory``: a request's peak memory beside transformers' with the same cache kind."""
    results = d["results"]
    k = _one(results, system="kvcache", cache="dynamic")
    p = _one(results, system="transformers", cache="DynamicCache")
    return [Row(f"a request's peak memory MB, {k['context']}-token prompt", _num(k["request_peak"]) / 2**20,
                "transformers DynamicCache", _num(p["request_peak"]) / 2**20, "MB", higher_better=False)]


def attention_rows(d: dict) -> list[Row]:
    """``bench attention``: one layer's decode attention at the deepest context, the native kernel
    beside the torch path over the same cache."""
    rows = d["rows"]
    ctx = max(r["context"] for r in rows)
    return [Row(f"decode attention ms per layer at {ctx} tokens, {r['kv']} KV", _num(r["ms_layer"]),
                "torch path, same cache", _num(r["torch_ms_layer"]), "ms", higher_better=False)
            for r in rows if r["context"] == ctx and r["kv"] in ("fp16", "int8", "int4")]


_LLAMA_KV = {"fp16": "f16", "int8": "q8_0", "int4": "q4_0"}


def long_context_rows(d: dict) -> list[Row]:
    """``bench context --long``: decode at depth with each KV encoding beside llama.cpp's KV type of
    the same width, and prefill of the longest prompt (fp16 beside f16), on the same GGUF."""
    meta, results, model = _suite(d)
    rows = []
    for k in (r for r in results if r["system"] == "kvcache"):
        peer_kv = _LLAMA_KV.get(k["kv"])
        p = next((x for x in results if x["system"] != "kvcache" and x["kv"] == peer_kv
                  and x["test"] == k["test"] and x["context"] == k["context"]), None)
        if p is None or (k["test"] == "prefill" and k["context"] == meta.get("reference_prompt")):
            continue
        what = (f"{model}: decode tok/s after {k['context']} tokens, {k['kv']} KV (peer {peer_kv})"
                if k["test"] == "decode" else f"{model}: prefill {k['context']} tokens, {k['kv']} KV, tok/s")
        rows.append(Row(what, _num(k["tok_s"]), f"{p['system']}, same file", _num(p["tok_s"]), "tok/s"))
    return rows


# suite -> its headline function, in the order the tables list them
HEADLINES: dict[str, Callable[[dict], list[Row]]] = {
    "decode": decode_rows, "context --long": long_context_rows, "attention": attention_rows,
    "serve": serve_rows, "spec": spec_rows, "structured": structured_rows, "throughput": throughput_rows,
    "prefix": prefix_rows, "cache-vs-none": cache_vs_none_rows, "growth": growth_rows, "hf": hf_rows,
    "memory": memory_rows,
}
# suites whose JSON is recognised but holds no kvcache-beside-a-peer row
NO_HEADLINE = ("context",)


def suite_of(d: object) -> str | None:
    """Which suite wrote this JSON, told from its layout (None: not a suite's JSON)."""
    if not isinstance(d, dict):
        return None
    meta = d.get("meta") if isinstance(d.get("meta"), dict) else {}
    results = d.get("results")
    first = results[0] if isinstance(results, list) and results and isinstance(results[0], dict) else {}
    if meta.get("mode") == "long":
        return "context --long"
    if isinstance(d.get("rows"), list) and d["rows"] and "torch_ms_layer" in d["rows"][0]:
        return "attention"
    if "buckets" in d:
        return "growth"
    if "engines" in d or ("constrained_tok_s" in first):
        return "structured"
    if "workload" in first and "method" in first:
        return "spec"
    if "streams" in first:
        return "serve"
    if "case" in first:
        return "prefix"
    if isinstance(d.get("ratios"), dict) and "vs_sequential" in d["ratios"]:
        return "throughput"
    if "total_s" in first and "ms_per_token" in first:
        return "cache-vs-none"
    if "request_peak" in first:
        return "memory"
    if "kv_bytes" in first and str(first.get("system", "")).startswith(("transformers", "kvcache.hf")):
        return "hf"
    if "spec" in first and "config" in first:
        return "context"
    if first.get("system") in ("kvcache", "transformers", "llama.cpp") and "tok_s" in first:
        return "decode"
    return None


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
    suite = suite_of(d)
    if suite is None:
        print(f"skipped {path}: not a kvcache bench suite's JSON", file=notes)
        return None
    meta = d.get("meta") if isinstance(d.get("meta"), dict) else {}
    md = _md_fields(path)
    date, when = run_date(path, meta, md)
    return Run(path, suite, d, host_kind(meta, md), date, when)


def headline(run: Run, notes: TextIO = sys.stderr) -> list[Row]:
    """The run's headline rows; [] with a note when its layout is not the one its suite's function
    reads."""
    fn = HEADLINES.get(run.suite)
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
    row: Row
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
    order = list(HEADLINES)
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
