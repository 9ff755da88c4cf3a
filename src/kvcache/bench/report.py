"""Benchmark reports: the machine (CPU, SIMD features, kernel variant) and versions, the command,
the terminal table, JSON and plots; the metadata every suite's JSON carries and the table cells
every suite prints.

``kvcache bench SUITE --out DIR`` writes DIR/SUITE.json, DIR/SUITE.md (this report) and, for suites
with a picture, DIR/SUITE.png. The terminal output is captured as it is printed (a tee) and kept
verbatim in the report, so the report and the screen never disagree.
"""

from __future__ import annotations

import io
import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TextIO


def cell(x: float | None, spec: str = ".1f") -> str:
    """A table cell: the number formatted by ``spec``, or ``-`` where there is none."""
    return "-" if x is None else format(x, spec)


def run_meta(**extra: object) -> dict[str, object]:
    """The ``meta`` of a suite's JSON: the machine, its CPU features, the kernel variant, threads,
    torch, the date and time of the run (UTC; ``kvcache bench report`` dates its rows by it), and
    the suite's own settings (``extra``)."""
    import torch

    from kvcache.envinfo import cpu, kernel_variant

    name, feats = cpu()
    return {"machine": name, "cpu_features": feats, "kernel_variant": kernel_variant(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), **extra}


def machine() -> dict[str, str]:
    """CPU model, its SIMD features, the kernel variant, cores, memory, OS, and the versions of
    every system compared."""
    from kvcache.envinfo import FEATURES, cpu, kernel_variant

    name, feats = cpu()
    mem = ""
    try:
        kb = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")).split()[1])
        mem = f"{kb / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    import torch

    info = {"cpu": name, "cpu features": " ".join(feats) + f" (of {', '.join(FEATURES)})",
            "kernel variant": kernel_variant(),
            "cores available": str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                   else os.cpu_count()),
            "torch threads": str(torch.get_num_threads()), "memory": mem, "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__}
    for dist, label in (("kvcache", "kvcache"), ("transformers", "transformers"),
                        ("llama_cpp_python", "llama-cpp-python")):
        try:
            info[label] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[label] = "not installed"
    return info


class Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.buf = out, io.StringIO()

    def write(self, s: str) -> int:
        self.out.write(s)
        return self.buf.write(s)

    def flush(self) -> None:
        self.out.flush()


def write_report(out: Path, suite: str, argv: list[str], text: str, png: Path | None) -> Path:
    info = machine()
    lines = [f"# kvcache bench {suite}", "",
             f"Run {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} with:", "",
             "```sh", "kvcache " + shlex.join(argv), "```", "", "| machine | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += ["", "```", text.strip("\n"), "```", ""]
    if png is not None:
        lines += [f"![{suite}]({png.name})", ""]
    lines += [f"Raw results: [{suite}.json]({suite}.json)", ""]
    path = out / f"{suite}.md"
    path.write_text("\n".join(lines))
    return path


def run_with_report(suite, args, run) -> int:  # suite: suites.Suite; args: argparse.Namespace; run: () -> int
    """Run a suite with its output teed; then write its JSON (marked with the suite), plot and
    report under ``args.out``."""
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".kvcache-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        from kvcache.errors import KVCacheError

        raise KVCacheError(f"cannot write the report to {out}: {e.strerror or e}") from None
    if args.json is None:
        args.json = str(out / f"{suite.name}.json")
    tee = Tee(sys.stdout)
    old, sys.stdout = sys.stdout, tee  # type: ignore[assignment]
    try:
        rc = run()
    finally:
        sys.stdout = old
    from kvcache.bench.plots import plot_suite
    from kvcache.bench.suites import mark

    mark(args.json, suite)
    png = plot_suite(suite.load(), Path(args.json), out / f"{suite.name}.png")
    report = write_report(out, suite.name, sys.argv[1:], tee.buf.getvalue(), png)
    print(f"report: {report}" + (f", plot: {png}" if png else ""), file=sys.stderr)
    return rc
