"""AMX tiles against the VNNI kernels on the quantized products of a prefill (kernels/qamx.c).

    python -m kvcache.bench.amx_check [--rows 512] [--repeats 5] [--threads N]

Prints the host line and this process's AMX status (``kernels.amx_status()``), then for GGUF Q4_0,
Q8_0, Q4_K, Q6_K and MXFP4 weights at a 1B model's shapes (K 2048 into 2048 and into 8192 outputs, K 8192
into 2048) times ``kv_q_linear`` over ``--rows`` rows with the kernels' own choice and with
KVCACHE_AMX=0, each side in a process of its own (whether AMX is used is settled once per process),
the best of ``--repeats`` calls on every CPU thread, and compares the outputs' bytes (a SHA-256 of
each). A table: format, shape, ms with VNNI, ms with AMX, the speedup, whether the bits are equal.

Needs only torch (and numpy) and the kvcache sources: the weights are pseudo-random GGUF blocks
with sane scales, repacked as a model's would be; no model file is read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

# GGUF type ids and block layouts: (inputs a block, bytes a block, byte offsets of fp16 d and dmin;
# MXFP4's scale is its first byte, an exponent)
TYPES = {"Q4_0": (2, 32, 18, 0, None), "Q8_0": (8, 32, 34, 0, None), "Q4_K": (12, 256, 144, 0, 2),
         "Q6_K": (14, 256, 210, 208, None), "MXFP4": (39, 32, 17, None, None)}
SHAPES = ((2048, 2048), (2048, 8192), (8192, 2048))  # (K inputs, out outputs): a 1B model's projections


def gguf_blocks(name: str, out: int, k: int, seed: int):
    """[out, bytes a row] random blocks of GGUF type ``name`` with fp16 scales in 0.001 .. 0.01."""
    import numpy as np

    _, per, size, d_at, dmin_at = TYPES[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(out, k // per, size), dtype=np.uint8)
    if d_at is None:  # MXFP4: scales 2^(e - 127) of 2^-9 .. 2^-3
        raw[:, :, 0] = rng.integers(118, 125, size=(out, k // per), dtype=np.uint8)
        return raw.reshape(out, -1)
    d = rng.uniform(0.001, 0.01, size=(out, k // per)).astype(np.float16)
    raw[:, :, d_at:d_at + 2] = d.view(np.uint8).reshape(out, k // per, 2)
    if dmin_at is not None:
        raw[:, :, dmin_at:dmin_at + 2] = (d * 0.5).astype(np.float16).view(np.uint8).reshape(out, k // per, 2)
    return raw.reshape(out, -1)


def child(rows: int, repeats: int, threads: int) -> None:
    """One side: every format and shape timed in this process; a JSON line on stdout."""
    import numpy as np

    from kvcache import kernels
    from kvcache.kernels.qweight import FORMAT_OF, QWeight

    lib = kernels.qgemm()
    if lib is None:
        raise SystemExit("the native kernels cannot be had here")
    status = kernels.amx_status()
    results = []
    for name in TYPES:
        gtype = TYPES[name][0]
        for i, (k, out) in enumerate(SHAPES):
            w = QWeight(FORMAT_OF[gtype], out, k)
            w.put_gguf(gtype, gguf_blocks(name, out, k, seed=11 * i + gtype), np.arange(out))
            qs, d, m = w.seal().parts()
            x = np.random.default_rng(7 + i).standard_normal((rows, k)).astype(np.float32)
            y = np.empty((rows, out), np.float32)

            def call() -> float:
                t = time.perf_counter()
                rc = lib.kv_q_linear(w.fmt, rows, k, out, x.ctypes.data, k, None, -1.0, qs.data_ptr(),
                                     d.data_ptr(), None if m is None else m.data_ptr(), None, y.ctypes.data, out,
                                     0, threads)
                if rc:
                    raise SystemExit(f"kv_q_linear refused {name} [{out}, {k}] ({rc})")
                return time.perf_counter() - t

            call()  # warm: pages, caches, the AMX check on first use
            best = min(call() for _ in range(repeats))
            results.append({"format": name, "K": k, "out": out, "ms": best * 1e3,
                            "sha": hashlib.sha256(y.tobytes()).hexdigest()})
    print(json.dumps({"status": status, "variant": kernels.variant(), "results": results}))


def side(amx_off: bool, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env.pop("KVCACHE_AMX", None)
    if amx_off:
        env["KVCACHE_AMX"] = "0"
    cmd = [sys.executable, "-m", "kvcache.bench.amx_check", "--child", "--rows", str(args.rows), "--repeats",
           str(args.repeats), "--threads", str(args.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"the {'VNNI' if amx_off else 'AMX'} side failed:\n{p.stderr or p.stdout}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ap = argparse.ArgumentParser(prog="python -m kvcache.bench.amx_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=512, help="rows of activations a product takes (default 512)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls a product, the best kept (default 5)")
    ap.add_argument("--threads", type=int, default=cores, help=f"threads a call uses (default: all, {cores})")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.rows, args.repeats, args.threads)
        return 0
    from kvcache.envinfo import host_line

    print(host_line())
    vnni, amx = side(True, args), side(False, args)
    print(f"amx: {amx['status']}")
    print(f"KVCACHE_AMX=0: {vnni['status']}")
    print(f"{args.rows} rows, {args.threads} threads, best of {args.repeats}, kernels {amx['variant']}\n")
    print(f"| {'format':<6} | {'K x out':<11} | {'ms vnni':>8} | {'ms amx':>8} | {'speedup':>7} | bits equal |")
    print(f"|{'-' * 8}|{'-' * 13}|{'-' * 10}|{'-' * 10}|{'-' * 9}|{'-' * 12}|")
    equal = True
    for a, b in zip(vnni["results"], amx["results"]):
        same = a["sha"] == b["sha"]
        equal &= same
        print(f"| {a['format']:<6} | {a['K']:>5}x{a['out']:<5} | {a['ms']:8.2f} | {b['ms']:8.2f} | "
              f"{a['ms'] / b['ms']:6.2f}x | {'yes' if same else 'NO':<10} |")
    if not amx["status"].startswith("used"):
        print("\n(AMX is not used in this process: both columns ran the VNNI kernels)")
    print("\nbits equal everywhere" if equal else "\nBITS DIFFER: the AMX path is not the VNNI kernels' result")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
