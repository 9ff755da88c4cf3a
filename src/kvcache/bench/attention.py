"""``kvcache bench attention``: one layer's decode attention alone, at depth, per KV encoding.

The cache's own cost, without the weights: the attention of one decode step of Llama-3.2-1B's
shape (8 KV heads, 4 query heads each, head_dim 64) over C tokens held in each encoding (default
4096, 16384, 32768 tokens; fp16, bf16, int8, int4, int2, and any quantized encoding with
``,rotate``), by the native kernel (kernels/qattn.c: codes and 16-bit values read in place) and
by the torch path it replaces (``--peers torch``, the default: the pages widened to fp32, then
attention; ``--peers ''`` skips it). The decode's own token follows the C tokens in every encoding
(C + 1 keys), as the engine holds it. Each figure is the best of ``--repeats`` timed calls (after
one untimed), in milliseconds per layer and per token of the model's 16 layers, with the bytes
the call reads (the encoding's pages of the C tokens) and the read bandwidth they make, against
the read bandwidth measured in the same run (kernels/membw.c). Calls go round enough copies of
the pages (256 MB at least) that none is still in the caches when it is read again. The pages
hold random codes and scales: the work does not depend on what they say.

``--rows N`` times a prefill chunk's attention instead: N new tokens of the sequence, causal among
themselves (kept in fp32 after quantized pages, as the engine keeps a chunk's own K/V; written
after the 16-bit pages), against the C tokens before them; the line then gives the milliseconds
for the N rows and their multiply-adds' GFLOP/s. The torch peer is a decode's, so it is left out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvcache.bench.context_lengths import parse_contexts
from kvcache.bench.rows import Headline, positive
from kvcache.errors import InvalidParams

if TYPE_CHECKING:
    import torch

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "attention"
ORDER = 30
OPTIONS = ("repeats", "kv", "contexts", "peers", "rows")
QUICK = {"contexts": "1024", "repeats": 1, "kv": "fp16,int4"}

HKV, G, D, LAYERS, PAGE = 8, 4, 64, 16, 32  # Llama-3.2-1B's attention; quantized pages of 32 tokens
ROUND = 256 << 20  # bytes of copies a run goes round, so no call finds its pages in the caches
WALL_FLOATS = 1 << 27  # the read-bandwidth probe's buffer (512 MiB)
DEFAULT_KV = "fp16,bf16,int8,int4,int2"
_BITS = {"int8": 8, "int4": 4, "int2": 2}
_HALF = {"fp16": "float16", "bf16": "bfloat16"}  # torch dtypes by name


def parse_kv(text: str) -> list[tuple[str, bool]]:
    """``--kv`` text -> (encoding, rotated) pairs; ``rotate`` joins the encoding before it."""
    out: list[tuple[str, bool]] = []
    for item in (p.strip() for p in text.replace(";", ",").split(",")):
        if not item:
            continue
        if item == "rotate":
            if not out or out[-1][0] not in _BITS:
                raise InvalidParams("--kv: rotate follows a quantized encoding (int8, int4 or int2), e.g. int4,rotate")
            out[-1] = (out[-1][0], True)
        elif item in _BITS or item in _HALF:
            out.append((item, False))
        else:
            raise InvalidParams(f"--kv: {item!r} is not an encoding this suite measures; give fp16, bf16, int8, "
                                f"int4 or int2 (a quantized one may be followed by rotate)")
    if not out:
        raise InvalidParams("--kv names no encoding; e.g. --kv int8,int4,rotate")
    return out


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _copies(nbytes: int) -> int:
    return max(1, -(-ROUND // nbytes))


def _quant_case(bits: int, rotate: bool, ctx: int, q: torch.Tensor) -> tuple[int, object, object]:
    import torch

    from kvcache import kernels
    from kvcache.cache.qpool import QuantPool

    pools = []
    for _ in range(_copies(int(ctx * HKV * D * 2 * (bits / 8 + 0.125)))):
        pool = QuantPool(1, HKV, D, PAGE, ctx // PAGE, bits, PAGE)
        for t in pool.parts[0].values():
            if t.dtype == torch.uint8:
                t.random_(0, 256)
            else:
                t.copy_((torch.rand(t.shape) * 0.05).to(t.dtype))
        pools.append(pool)
    pages, rest, turn = torch.arange(ctx // PAGE), torch.randn(2, HKV, q.shape[0], D), [0]
    nbytes = sum(t.numel() * t.element_size() for t in pools[0].parts[0].values())

    def next_pool() -> QuantPool:
        turn[0] = (turn[0] + 1) % len(pools)
        return pools[turn[0]]

    def native():
        return kernels.quant_attend(q, pages, next_pool().parts[0], PAGE, PAGE, bits, rest, rotate)

    def torch_path():
        buf = torch.empty(2, HKV, ctx + 1, D)
        next_pool().read_into(0, None, 0, ctx // PAGE, buf[:, :, :ctx])
        buf[:, :, ctx:] = rest
        return _attend(q, buf)

    return nbytes, native, torch_path


def _half_case(dtype: torch.dtype, ctx: int, q: torch.Tensor) -> tuple[int, object, object]:
    import torch

    from kvcache import kernels

    n = ctx + q.shape[0]  # the new tokens (a decode's one, a prefill's rows) follow the context, as after quantized pages
    flats = [torch.randn(2, HKV, n, D).to(dtype) for _ in range(_copies(n * HKV * D * 4))]
    turn = [0]

    def next_flat() -> torch.Tensor:
        turn[0] = (turn[0] + 1) % len(flats)
        return flats[turn[0]]

    def native():
        return kernels.half_attend(q, next_flat(), None, 0, n)

    context_bytes = 2 * HKV * ctx * D * flats[0].element_size()  # the context's pages, as the quantized cases count
    return context_bytes, native, lambda: _attend(q, next_flat().float())


def _attend(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The dense decode attention (attention/dense.py's decode form): q [1, Hq, D], kv [2, Hkv, L, D]."""
    import torch

    s = torch.matmul(q.view(HKV, G, D), kv[0].transpose(1, 2))  # [Hkv, g, L]
    return torch.matmul(torch.softmax(s, -1), kv[1])


def read_wall(repeats: int = 3) -> float | None:
    """The read bandwidth (GB/s) of a 512 MiB buffer streamed by the torch threads, best of ``repeats``."""
    import torch

    from kvcache import kernels

    buf = torch.ones(WALL_FLOATS)
    if kernels.stream_sum(buf) is None:
        return None
    return buf.numel() * 4 / _time(lambda: kernels.stream_sum(buf), repeats) / 1e9


def run(args: argparse.Namespace) -> int:
    import torch

    from kvcache import kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    if kernels.qattn() is None:
        raise InvalidParams("bench attention measures the native kernel, which could not be built here")
    contexts = parse_contexts(args.contexts or "4096,16384,32768")
    if any(c % PAGE for c in contexts):
        raise InvalidParams(f"--contexts: each must be a multiple of {PAGE} tokens (whole pages)")
    encodings = parse_kv(args.kv or DEFAULT_KV)
    n_rows = getattr(args, "rows", None) or 1
    if n_rows < 1 or n_rows > 8192:
        raise InvalidParams(f"--rows: {n_rows}; give the new tokens of a call, 1 (a decode) to 8192")
    peers = ("torch" if n_rows == 1 else "") if args.peers is None else args.peers
    if peers not in ("torch", ""):
        raise InvalidParams(f"--peers: {peers!r}; this suite's peer is torch (or '' for none)")
    if peers and n_rows > 1:
        raise InvalidParams("--peers torch times a decode's attention; with --rows above 1 give --peers ''")
    repeats = args.repeats or 5
    wall = read_wall()
    print(f"read wall: {wall:.1f} GB/s" if wall else "read wall: unmeasured", flush=True)
    rows = []
    q = torch.randn(n_rows, HKV * G, D) * 0.1
    for ctx in contexts:
        for enc, rotate in encodings:
            nbytes, native, torch_path = (_half_case(getattr(torch, _HALF[enc]), ctx, q) if enc in _HALF
                                          else _quant_case(_BITS[enc], rotate, ctx, q))
            t = _time(native, repeats)
            peer = _time(torch_path, max(1, repeats // 2)) if peers else None
            macs = 2 * n_rows * HKV * G * D * (ctx + (n_rows + 1) / 2)  # K.q and weights.V; row t sees ctx + t + 1 keys
            row = {"context": ctx, "kv": enc + (",rotate" if rotate else ""), "rows": n_rows, "ms_layer": t * 1e3,
                   "gflop_s": 2 * macs / t / 1e9,
                   "ms_token": t * 1e3 * LAYERS, "bytes_layer": nbytes, "gb_s": nbytes / t / 1e9,
                   "share_of_wall": nbytes / t / 1e9 / wall if wall else None,
                   "torch_ms_layer": peer * 1e3 if peer else None, "vs_torch": peer / t if peer else None}
            rows.append(row)
            print(_line(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"read_wall_gb_s": wall, "threads": torch.get_num_threads(),
                                               "rows": rows}, indent=1))
    return 0


def _line(r: dict) -> str:
    if r.get("rows", 1) > 1:
        return (f"{r['context']:>6} {r['kv']:<12} {r['ms_layer']:7.2f} ms/layer for {r['rows']} new rows "
                f"({r['rows'] / r['ms_layer'] * 1e3:.0f} rows/s, {r['gflop_s']:.1f} GFLOP/s)")
    share = f" ({r['share_of_wall']:.0%} of the wall)" if r["share_of_wall"] else ""
    peer = f"; torch path {r['torch_ms_layer']:.2f} ms ({r['vs_torch']:.1f}x)" if r["torch_ms_layer"] else ""
    return (f"{r['context']:>6} {r['kv']:<12} {r['ms_layer']:7.2f} ms/layer ({r['ms_token']:.1f} ms a token of "
            f"{LAYERS} layers), {r['bytes_layer'] / 1e6:.1f} MB at {r['gb_s']:.1f} GB/s{share}{peer}")


def headline(d: dict) -> list[Headline]:
    """``bench attention``: one layer's decode attention at the deepest context, the native kernel
    beside the torch path over the same cache."""
    rows = [r for r in d["rows"] if r.get("rows", 1) == 1]  # --rows N times a prefill's, without a peer
    if not rows:
        return []
    ctx = max(r["context"] for r in rows)
    return [Headline(f"decode attention ms per layer at {ctx} tokens, {r['kv']} KV", positive(r["ms_layer"]),
                "torch path, same cache", positive(r["torch_ms_layer"]), "ms", higher_better=False)
            for r in rows if r["context"] == ctx and r["kv"] in ("fp16", "int8", "int4")]
