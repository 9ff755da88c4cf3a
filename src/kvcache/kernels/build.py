"""Compile the native kernels once per CPU variant and load the one this CPU can run.

Every kernel is C with its SIMD paths chosen by compile flags, so one source builds into several
libraries: ``avx512vnni``, ``avxvnni``, ``avx2`` and ``generic`` (plain C, any CPU). The variant is
picked at run time from the CPU's features (``/proc/cpuinfo`` flags); ``KVCACHE_KERNEL_VARIANT``
forces one (refused when the CPU cannot run it). A library's file name carries a hash of its source,
compiler, flags and variant, never ``-march=native``: a cache folder moved to another machine holds
libraries that are either right for it or never loaded, so nothing dies of an illegal instruction.

Libraries live in ``$KVCACHE_HOME/kernels`` (created 0700; a folder another user can write to is
not used). The math flags forbid reassociation, reciprocals and contraction, so every variant
rounds each float step alike and gives the same bits as every other (the kernels spell out their
fused multiply-adds and the order of their sums); never ``-ffast-math``, whose startup code would
also set flush-to-zero for the whole process. ``CC`` may carry
arguments (``ccache gcc``); a failed build warns with the compiler's own message.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvcache.paths import cache_home, one_at_a_time

SOURCES = Path(__file__).parent
LIBRARIES = ("qgemm", "qattn", "pgemm")  # every kernel library (kernels/__init__.py loads them by name)
# No reassociation, no reciprocals, no contraction: every float step rounds where the source says,
# so each variant gives the same bits (the kernels write their multiply-adds and sums out).
MATH = ["-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-ffp-contract=off"]
COMMON = ["-fopenmp", "-shared", "-fPIC"]


@dataclass(frozen=True)
class Variant:
    name: str
    needs: frozenset[str]  # /proc/cpuinfo flags the CPU must have
    flags: tuple[str, ...]


_X86 = [
    Variant("avx512vnni", frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                                     "avx512_vnni"}),
            ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni")),
    Variant("avxvnni", frozenset({"avx2", "fma", "f16c", "avx_vnni"}), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni")),
    Variant("avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
]
GENERIC = Variant("generic", frozenset(), ())


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def optimization(v: Variant) -> str:
    """-O3, except for the generic variant on x86: there it serves only CPUs without AVX2 and the
    tests' cross-check of the variants, and -O2 compiles it three times faster (the same bits: the
    flags of MATH forbid every rewrite that would change a rounding, at any level)."""
    return "-O2" if v.name == GENERIC.name and is_x86() else "-O3"


def variants() -> list[Variant]:
    """Every variant this architecture can build, best first."""
    return [*_X86, GENERIC] if is_x86() else [GENERIC]


@lru_cache(maxsize=1)
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, feature flags) of this CPU; flags are empty where /proc/cpuinfo is unavailable."""
    name, flags = platform.processor() or platform.machine(), frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return name, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name in ("", platform.machine(), platform.processor()):
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return name, flags


def runnable(v: Variant) -> bool:
    return v.needs <= cpu_info()[1]


def select() -> Variant:
    """The variant to load: KVCACHE_KERNEL_VARIANT when set (and runnable), else the best runnable."""
    want = os.environ.get("KVCACHE_KERNEL_VARIANT")
    if want:
        for v in variants():
            if v.name == want:
                if not runnable(v):
                    raise RuntimeError(f"KVCACHE_KERNEL_VARIANT={want}: this CPU lacks {', '.join(sorted(v.needs - cpu_info()[1]))}")
                return v
        raise RuntimeError(f"KVCACHE_KERNEL_VARIANT={want}: unknown; variants here: {', '.join(v.name for v in variants())}")
    return next(v for v in variants() if runnable(v))


def compiler() -> list[str] | None:
    """The C compiler command (``CC`` may hold arguments), or None when there is none."""
    env = os.environ.get("CC")
    if env:
        cmd = shlex.split(env)
        return cmd if cmd and shutil.which(cmd[0]) else None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def kernel_dir() -> Path:
    """$KVCACHE_HOME/kernels, private to this user (0700); a folder others can write to is refused."""
    d = cache_home() / "kernels"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid():
        raise RuntimeError(f"{d} belongs to another user: kernels are not loaded from it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(d, 0o700)
    return d


def sources(name: str) -> list[Path]:
    """The C files of kernel ``name`` (qgemm also holds the repacking code and the fused decode
    attention, which shares its quantized steps)."""
    return [SOURCES / f"{name}.c", *([SOURCES / "qpack.c", SOURCES / "qamx.c", SOURCES / "dattn.c", SOURCES / "dmoe.c", SOURCES / "cattn.c", SOURCES / "membw.c", SOURCES / "vmask.c"] if name == "qgemm" else [])]


def library_path(name: str, v: Variant, cc: list[str]) -> Path:
    h = hashlib.sha256()
    for f in [*sources(name), *sorted(SOURCES.glob("*.h"))]:
        h.update(f.read_bytes())
    h.update(" ".join([*cc, optimization(v), *MATH, *COMMON, *v.flags, v.name, platform.machine()]).encode())
    return kernel_dir() / f"{name}-{v.name}-{h.hexdigest()[:16]}.so"


def build(name: str, v: Variant) -> Path:
    """Compile kernel ``name`` for variant ``v`` (once; later calls find the file). Raises
    RuntimeError with the compiler's message when it fails, or when there is no compiler."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    out = library_path(name, v, cc)
    if out.is_file():
        return out
    with one_at_a_time(out.with_name(f".{out.name}.lock")):  # two processes starting at once compile it once
        if out.is_file():
            return out
        return _compile(name, v, cc, out)


def _compile(name: str, v: Variant, cc: list[str], out: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        cmd = [*cc, optimization(v), *MATH, *v.flags, *COMMON, f"-I{SOURCES}", *map(str, sources(name)), "-o", str(so), "-lm"]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(f"{cmd[0]} failed to run: {e}") from None
        if p.returncode != 0:
            msg = (p.stderr or p.stdout).strip().splitlines()
            raise RuntimeError(f"{name} ({v.name}) did not compile: " + " | ".join(msg[-6:]))
        os.chmod(so, 0o700)
        os.replace(so, out)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m kvcache.kernels [--every-variant | --selected] [--jobs N]``: see the parser's description."""
    import argparse
    import time
    from concurrent.futures import ThreadPoolExecutor

    ap = argparse.ArgumentParser(
        prog="python -m kvcache.kernels",
        description="Compile every kernel library ahead of use, for the variants this CPU runs, so that "
                    "no first run waits for the compiler (make setup-test runs it beside pip); one line "
                    "a library.")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--every-variant", action="store_true",
                       help="also the variants this CPU cannot run (compiled, never loaded)")
    which.add_argument("--selected", action="store_true",
                       help="only the variant kvcache loads here (KVCACHE_KERNEL_VARIANT, else the best this CPU "
                            "runs; make setup runs it beside pip)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compilers at once (default: every CPU)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: at least 1")
    try:
        chosen = select() if args.selected else None
    except RuntimeError as e:
        ap.error(str(e))
    todo = [(name, v) for v in variants() if (v == chosen if chosen else args.every_variant or runnable(v))
            for name in LIBRARIES]

    def one(job: tuple[str, Variant]) -> tuple[bool, str]:
        name, v = job
        t = time.perf_counter()
        try:
            path = build(name, v)
        except RuntimeError as e:
            return False, f"kernels: {e}"
        return True, f"kernels: {name} ({v.name}) {path} [{time.perf_counter() - t:.1f} s]"

    failed = 0
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each job waits on its own compiler process
        for ok, line in pool.map(one, todo):
            print(line, flush=True)
            failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":  # python src/kvcache/kernels/build.py (PYTHONPATH=src): the same, without torch
    raise SystemExit(main())
