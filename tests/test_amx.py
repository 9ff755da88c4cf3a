"""AMX tiles for the quantized products (kernels/qamx.c): used only where the CPU, the OS and a
self-check allow, and then the very bits of the VNNI kernels; ``kvcache env`` and
``kernels.amx_status()`` say whether and why.

Whether AMX is used is settled once per process, so each side of a comparison runs in a process of
its own (KVCACHE_AMX=0 turns the tiles off). On CPUs without AMX the tile code still runs: a
build with the tile instructions emulated in C (KV_AMX_EMULATE) goes through the same self-check
and products, and must give the VNNI bits too.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import run_kvcache
from kvcache import kernels
from kvcache.kernels import build

TESTS = Path(__file__).parent
HAS_AMX = "amx_int8" in build.cpu_info()[1] and "amx_tile" in build.cpu_info()[1]
AVX512 = next((v for v in build.variants() if v.name == "avx512vnni"), None)

# Products of 16 to 310 rows (whole tiles, rows over, two row chunks, two windows of the folded K-quants) for GGUF Q4_0, Q8_0, Q4_K, Q5_K,
# Q6_K and Q2_K weights, with a bias, the RMS row scale and accumulation in some; prints the status of each
# library given (the default one: "") and a digest of every product's bytes.
CHECK = """
import ctypes, hashlib, json, sys
import numpy as np
sys.path.insert(0, {tests!r})
from gguf import GGMLQuantizationType as T
from kvcache import kernels
from kvcache.kernels import signatures
from test_qweights import repacked

out = {{}}
for path in {paths!r}:
    if path:
        lib = ctypes.CDLL(path)
        for name in ("kv_amx_status", "kv_q_linear"):
            s = signatures.SIGNATURES[name]
            fn = getattr(lib, name)
            fn.argtypes = [signatures.ctype(t) for _, t in s.params]
            fn.restype = signatures.ctype(s.ret, result=True)
    else:
        lib = kernels.qgemm()
    digests = {{}}
    for t, o, k in ((T.Q4_0, 40, 512), (T.Q8_0, 70, 256), (T.Q4_K, 45, 512), (T.Q5_K, 40, 512), (T.Q6_K, 33, 768),
                    (T.Q2_K, 24, 256)):
        w, _ = repacked(t, o, k, seed=3)
        qs, d, m = w.parts()
        rng = np.random.default_rng(4)
        for n in (16, 17, 37, 64, 100, 310):
            x = rng.standard_normal((n, k)).astype(np.float32)
            bias = rng.standard_normal(o).astype(np.float32)
            y = rng.standard_normal((n, o)).astype(np.float32)
            odd = n % 2
            assert lib.kv_q_linear(w.fmt, n, k, o, x.ctypes.data, k, None, 1e-5 if odd else -1.0, qs.data_ptr(),
                                   d.data_ptr(), None if m is None else m.data_ptr(), bias.ctypes.data if odd else None,
                                   y.ctypes.data, o, odd, 2) == 0
            digests[f"{{t.name}} {{n}}"] = hashlib.sha256(y.tobytes()).hexdigest()
    out[path] = {{"status": lib.kv_amx_status().decode(), "digests": digests}}
print(json.dumps(out))
"""


def run_checks(paths: list[str]) -> tuple[dict[str, dict], dict[str, dict]]:
    """CHECK over ``paths`` with the libraries' own choice and with KVCACHE_AMX=0, side by side."""
    procs = []
    for off in (False, True):
        env = dict(os.environ)
        env.pop("KVCACHE_AMX", None)
        if off:
            env["KVCACHE_AMX"] = "0"
        procs.append(subprocess.Popen([sys.executable, "-c", CHECK.format(tests=str(TESTS), paths=paths)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results[0], results[1]


def physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs this process may use (sysfs topology)."""
    pairs = set()
    for c in os.sched_getaffinity(0):
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            pairs.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return len(os.sched_getaffinity(0))
    return len(pairs)


def expected_reason(status: str) -> None:
    """The status of the default library on this host: used where the CPU has AMX, else why not."""
    variant = kernels.variant()
    if variant != "avx512vnni":
        assert status == f"not used: the {variant} kernels have no AMX path", status
    elif HAS_AMX:
        assert status.startswith("used (self-check passed: "), status
        assert f"bit-identical to avx512vnni) by calls of at most {physical_cores()} threads, one a core" in status
    else:
        assert status.startswith("not used: CPU lacks amx_"), status


def test_the_status_says_whether_and_why():
    if kernels.qgemm() is None:
        pytest.skip("no native kernels here")
    status = kernels.amx_status()
    expected_reason(status)
    assert status == kernels.amx_status()  # settled once


def test_env_reports_the_amx_line():
    p = run_kvcache("env", "--no-digest", timeout=300)
    assert p.returncode == 0, p.stderr
    lines = {ln.split("  ", 1)[0].strip(): ln.split("  ", 1)[1].strip() for ln in p.stdout.splitlines()}
    if kernels.qgemm() is None:
        assert lines["amx"].startswith("not used")
    else:
        assert lines["amx"] == kernels.amx_status()
    env = dict(os.environ, KVCACHE_AMX="0")
    p = run_kvcache("env", "--no-digest", env=env, timeout=300)
    assert p.returncode == 0 and "off (KVCACHE_AMX=0)" in p.stdout


def emulated_library() -> Path | None:
    """qgemm.c and qamx.c built as the avx512vnni variant with the tile instructions emulated, or
    None where that variant cannot run or there is no compiler. Built once and kept in the kernels
    folder under a hash of its sources, compiler and flags, as the libraries are (a build takes
    seconds)."""
    cc = build.compiler()
    if AVX512 is None or not build.runnable(AVX512) or cc is None:
        return None
    flags = [build.optimization(AVX512), *build.MATH, *AVX512.flags, "-fopenmp", "-fPIC", "-DKV_AMX_EMULATE"]
    h = hashlib.sha256()
    for f in [build.SOURCES / "qgemm.c", build.SOURCES / "qamx.c", *sorted(build.SOURCES.glob("*.h"))]:
        h.update(f.read_bytes())
    h.update(" ".join([*cc, *flags, *build.COMMON]).encode())
    out = build.kernel_dir() / f"qgemm-amx-emulated-{h.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs, procs = [], []
        for name in ("qgemm", "qamx"):  # compiled side by side, then linked
            objs.append(Path(tmp) / f"{name}.o")
            procs.append(subprocess.Popen([*cc, *flags, f"-I{build.SOURCES}", "-c", str(build.SOURCES / f"{name}.c"),
                                           "-o", str(objs[-1])], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
        so = Path(tmp) / out.name
        p = subprocess.run([*cc, *build.COMMON, *map(str, objs), "-o", str(so), "-lm"], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr
        os.replace(so, out)
    return out


def test_products_have_the_same_bits_with_amx_and_without():
    """The default library with its own choice and with KVCACHE_AMX=0 (on an AMX host: tiles
    against VNNI), and the emulated-tile build both ways: one set of bits for all four."""
    if kernels.qgemm() is None:
        pytest.skip("no native kernels here")
    emu = emulated_library()
    paths = ["", *([str(emu)] if emu else [])]
    on, off = run_checks(paths)
    expected_reason(on[""]["status"])
    for path in paths:
        assert off[path]["status"] == "off (KVCACHE_AMX=0)"
        assert on[path]["digests"] == off[""]["digests"], f"{path or 'default'}: the products' bits moved"
    if emu:
        assert on[str(emu)]["status"].startswith("used (emulated tiles; self-check passed: "), on[str(emu)]["status"]
        # a parallel region of more threads than cores leaves the tiles to the VNNI kernels
        assert on[str(emu)]["status"].endswith(f"by calls of at most {physical_cores()} threads, one a core")
