"""Optional native kernels, compiled on first use with the system's C compiler.

``qgemm.c`` (with ``qpack.c``) multiplies activations by quantized weights in kvcache's repacked
formats (int8 dot products; see qformat.h) and repacks GGUF blocks into them; ``qattn.c`` attends
over quantized and 16-bit pages read in place, in one canonical order (qlanes.h, qrows.h);
``cattn.c`` (in the qgemm library) attends any number of new tokens per sequence over float32
pages in place, in one canonical order, so that a row's result
is the same bits whether it is decoded, extended, prefilled or recomputed, alone or in a batch;
``dattn.c`` fuses it with the rotary embedding, the cache write and the projections; ``dmoe.c``
holds a mixture of experts' router and a decode row's whole sparse block (qmoe.py calls them);
``pgemm.c`` multiplies several rows by packed fp32 projection weights (register tiles that reuse
every weight across rows). build.py compiles each once per CPU variant (AVX512-VNNI, AVX-VNNI,
AVX2, generic) into ``$KVCACHE_HOME/kernels`` and loads the best variant this CPU runs; when there
is no compiler, the build fails, or ``KVCACHE_NO_KERNELS=1``, callers fall back to the pure torch
path, which gives the same result (quantized weights then dequantize their rows in torch).

Every exported function's signature is declared once, in signatures.py; loading a library sets
the ctypes argument and result types of all its functions from there. qweight.py holds weights in
the repacked formats (``QWeight``, ``QStack``) and the fused attention-half and MLP calls over them;
rotary.py the RoPE tables every layer above shares.

The lowest layer but the base (docs/architecture.md): it imports nothing of kvcache but errors and
paths, and knows nothing of models, caches or requests.

The wrappers check what they hand to C (dtype, contiguity, device, shapes) and return None when a
kernel cannot take the inputs, so a caller never passes memory the kernel would misread.
"""

from __future__ import annotations

import ctypes
import os
import warnings

import torch

from kvcache.kernels import build, signatures

_LIBS: dict[str, ctypes.CDLL | bool] = {}  # name -> library, or False: unavailable here
_PROFILE: list[float] | None = None  # [native calls, seconds in them] while profiling (profile())


def profile(on: bool = True) -> None:
    """Count the native calls and the time spent in them (``profiled()``), for every library loaded
    now or later in this process (``kvcache bench decode --profile``); ``on=False`` stops counting."""
    global _PROFILE
    _PROFILE = [0.0, 0.0] if on else None
    if on:
        for lib in _LIBS.values():
            if lib:
                _time_calls(lib)  # type: ignore[arg-type]


def profiled() -> tuple[int, float]:
    """(native calls, seconds spent in them) since ``profile()``; (0, 0.0) when not profiling."""
    return (0, 0.0) if _PROFILE is None else (int(_PROFILE[0]), _PROFILE[1])


def _time_calls(lib: ctypes.CDLL) -> None:
    """Wrap each bound function of ``lib`` so that its calls add to the profile's counters."""
    import time

    for attr, fn in list(vars(lib).items()):
        if not isinstance(fn, ctypes._CFuncPtr) or getattr(fn, "__wrapped__", None) is not None:  # type: ignore[attr-defined]
            continue

        def timed(*args, _fn=fn):
            t0 = time.perf_counter()
            try:
                return _fn(*args)
            finally:
                if _PROFILE is not None:
                    _PROFILE[0] += 1
                    _PROFILE[1] += time.perf_counter() - t0

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        setattr(lib, attr, timed)


def variant() -> str:
    """The kernel variant this process loads (``generic`` where nothing better runs)."""
    return build.select().name


def _load(name: str) -> ctypes.CDLL | None:
    """The compiled library ``name`` with its functions' signatures set (signatures.py), or None when
    it cannot be had."""
    if name not in _LIBS:
        if os.environ.get("KVCACHE_NO_KERNELS") == "1":
            _LIBS[name] = False
        else:
            try:
                _LIBS[name] = signatures.bind(ctypes.CDLL(str(build.build(name, build.select()))), name)
                if _PROFILE is not None:
                    _time_calls(_LIBS[name])  # type: ignore[arg-type]
            except (OSError, RuntimeError, AttributeError) as e:
                warnings.warn(f"kvcache: native kernel {name} unavailable ({e}); using the torch path", stacklevel=3)
                _LIBS[name] = False
    return _LIBS[name] or None


def _cpu_f32(*ts: torch.Tensor | None) -> bool:
    """Every given tensor is a contiguous float32 CPU tensor."""
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()) for t in ts)


def qattn() -> ctypes.CDLL | None:
    """The quantized decode-attention library, or None when it cannot be had here."""
    return _load("qattn")


def _canonical(switch: str) -> ctypes.CDLL | None:
    """The qgemm library, home of the canonical float32 paged attention (cattn.c); ``switch`` names
    a caller that can be turned off on its own (``_LIBS[switch] = False``: the torch path)."""
    return None if _LIBS.get(switch) is False else qgemm()


def pattn() -> ctypes.CDLL | None:
    """The library answering ``paged_decode`` (cattn.c), or None."""
    return _canonical("pattn")


def xattn() -> ctypes.CDLL | None:
    """The library answering ``paged_extend`` (cattn.c), or None."""
    return _canonical("xattn")


def paged_decode(
    q: torch.Tensor,  # [B, Hkv, g, D] fp32 contiguous, softmax scale applied
    flat: torch.Tensor,  # [2, Hkv, S, D] fp32 contiguous: a pool layer
    tables: torch.Tensor,  # [B, max_pages] int64 contiguous
    lens: torch.Tensor,  # [B] int64: tokens each query attends to (its own included)
    page_size: int,
) -> torch.Tensor | None:  # [B, Hkv, g, D], or None when the kernel is unavailable
    if pattn() is None or q.dim() != 4 or not _cpu_f32(q):
        return None
    b, hkv, g, d = q.shape
    ones = torch.ones(b, dtype=torch.long)
    out = _attend(q.view(b, hkv * g, d), flat, tables, torch.arange(b), ones, lens, page_size)
    return None if out is None else out.view(b, hkv, g, d)


def quant_attend(
    q: torch.Tensor,  # [T, Hq, D] fp32 contiguous, softmax scale applied: T new tokens of one sequence
    pages: torch.Tensor,  # [n] int64 contiguous: pool pages in position order
    parts: dict[str, torch.Tensor],  # the layer's QuantPool tensors (kc ks km vc vs vm; scales float16)
    page_size: int,
    group: int,
    bits: int,
    rest: torch.Tensor,  # [2, Hkv, m, D] fp32 contiguous: the tokens after the pages, the T new ones last
    rotate: bool = False,  # the pages hold K and V turned by the normalized Hadamard transform
    way: int = 0,  # how work is spread: 0 the kernel's choice, 1 chunks over threads, 2 blocks of rows
) -> torch.Tensor | None:  # [T, Hq, D], or None when the kernel cannot take these inputs
    """Causal attention of T new rows over quantized pages read in place, then the fp32 rest
    (kernels/qattn.c): each row's bits do not depend on T, on ``way`` or on the threads."""
    lib = qattn()
    if (lib is None or not _cpu_f32(q, rest) or not _i64(pages) or q.dim() != 3 or rest.dim() != 4
            or any(parts[n].dtype != torch.float16 or not parts[n].is_contiguous() for n in ("ks", "km", "vs", "vm"))
            or not parts["kc"].is_contiguous() or not parts["vc"].is_contiguous() or parts["kc"].device.type != "cpu"
            or rest.shape[1] < 1 or q.shape[1] % rest.shape[1] or rest.shape[3] != q.shape[2]
            or rest.shape[2] < q.shape[0] or not lib.kv_quant_fits(q.shape[2], group, bits, page_size)):
        return None
    t, hq, d = q.shape
    hkv = rest.shape[1]
    out = torch.empty(t, hq, d)
    kc = parts["kc"]
    rc = lib.kv_quant_attend(
        hkv, hq // hkv, d, page_size, group, bits, t, q.data_ptr(), pages.data_ptr(), pages.shape[0],
        kc.data_ptr(), parts["ks"].data_ptr(), parts["km"].data_ptr(), parts["vc"].data_ptr(),
        parts["vs"].data_ptr(), parts["vm"].data_ptr(), kc.shape[1], rest[0].data_ptr(), rest[1].data_ptr(),
        rest.shape[2], int(rotate), way, out.data_ptr(), torch.get_num_threads(),
    )
    return out if rc == 0 else None


def half_attend(
    q: torch.Tensor,  # [T, Hq, D] fp32 contiguous, softmax scale applied: the T new tokens of one sequence
    flat: torch.Tensor,  # [2, Hkv, S, D] float16 or bfloat16 contiguous: a pool layer, the new tokens written
    slots: torch.Tensor | None,  # [L] int64: the slot of each position; None: first_slot + position
    first_slot: int,
    length: int,  # L: the sequence's tokens, the new ones last
    way: int = 0,  # how work is spread: 0 the kernel's choice, 1 chunks over threads, 2 blocks of rows
) -> torch.Tensor | None:  # [T, Hq, D], or None when the kernel cannot take these inputs
    """Causal attention of T new rows over 16-bit float pages read in place (kernels/qattn.c),
    in one canonical order: a row's bits do not depend on T, ``way`` or the threads."""
    lib = qattn()
    if (lib is None or not _cpu_f32(q) or q.dim() != 3 or flat.dim() != 4 or flat.device.type != "cpu"
            or flat.dtype not in (torch.float16, torch.bfloat16) or not flat.is_contiguous()
            or flat.shape[3] != q.shape[2] or q.shape[1] % flat.shape[1] or length < q.shape[0]
            or (slots is not None and (not _i64(slots) or slots.shape[0] < length))):
        return None
    t, hq, d = q.shape
    hkv = flat.shape[1]
    out = torch.empty(t, hq, d)
    rc = lib.kv_half_attend(hkv, hq // hkv, d, int(flat.dtype == torch.bfloat16), t, q.data_ptr(), flat.data_ptr(),
                            flat.shape[2], None if slots is None else slots.data_ptr(), first_slot, length, way,
                            out.data_ptr(), torch.get_num_threads())
    return out if rc == 0 else None


def pgemm() -> ctypes.CDLL | None:
    """The packed-weight multi-row projection library, or None."""
    return _load("pgemm")


def packed_matmul(
    x: torch.Tensor,  # [N, in] fp32 on the CPU, unit stride along in
    w: torch.Tensor,  # [k, in, part] fp32 contiguous: packed weights (models.layers.pack)
    bias: torch.Tensor | None,  # [k, 1, part] fp32 contiguous, or None
) -> torch.Tensor | None:  # [N, k * part], or None when the kernel is unavailable for these inputs
    lib = pgemm()
    if (lib is None or not _cpu_f32(w, bias) or x.dtype != torch.float32 or x.device.type != "cpu"
            or x.dim() != 2 or x.stride(1) != 1 or w.dim() != 3 or x.shape[1] != w.shape[1]):
        return None
    k, inn, part = w.shape
    n = x.shape[0]
    y = torch.empty(n, k * part)
    rc = lib.kv_packed_matmul(n, inn, k, part, x.data_ptr(), x.stride(0), w.data_ptr(),
                              None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y if rc == 0 else None


def paged_extend(
    q: torch.Tensor,  # [N, Hq, D] fp32 contiguous, softmax scale applied; sequences' rows one after another
    flat: torch.Tensor,  # [2, Hkv, S, D] fp32 contiguous: a pool layer
    tables: torch.Tensor,  # [B, max_pages] int64 contiguous
    row0: torch.Tensor,  # [B] int64: each sequence's first row in q
    new: torch.Tensor,  # [B] int64: its new tokens (rows), at least 1
    lens: torch.Tensor,  # [B] int64: tokens it holds, the new ones included
    page_size: int,
    window: int = 0,  # a sliding window: a row at position p sees keys p - window + 1 .. p; 0: all
) -> torch.Tensor | None:  # [N, Hq, D], or None when the kernel is unavailable for these inputs
    if xattn() is None:
        return None
    return _attend(q, flat, tables, row0, new, lens, page_size, window)


def _attend(q: torch.Tensor, flat: torch.Tensor, tables: torch.Tensor, row0: torch.Tensor, new: torch.Tensor,
            lens: torch.Tensor, page_size: int, window: int = 0) -> torch.Tensor | None:
    """cattn.c over q [N, Hq, D] (scale applied) -> [N, Hq, D]; None when it cannot take the inputs."""
    lib = qgemm()
    if (lib is None or not _cpu_f32(q, flat) or not _i64(tables, row0, new, lens) or q.dim() != 3
            or flat.dim() != 4 or flat.shape[3] != q.shape[2] or q.shape[1] % flat.shape[1] or tables.dim() != 2
            or tables.shape[0] != row0.shape[0] or row0.shape != new.shape or new.shape != lens.shape):
        return None
    n, hq, d = q.shape
    hkv = flat.shape[1]
    out = torch.empty(n, hq, d)
    rc = lib.kv_paged_attend(tables.shape[0], hkv, hq // hkv, d, page_size, flat.shape[2], q.data_ptr(),
                             flat.data_ptr(), tables.data_ptr(), tables.shape[1], row0.data_ptr(), new.data_ptr(),
                             lens.data_ptr(), window, out.data_ptr(), n, torch.get_num_threads())
    return out if rc == 0 else None


def _i64(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous() for t in ts)


def qgemm() -> ctypes.CDLL | None:
    """The quantized-weight library (products, repacking, dequantizing), or None."""
    return _load("qgemm")


def amx_status() -> str | None:
    """Whether the quantized products of many rows use AMX tiles in this process, and why
    (kernels/qamx.c: a line starting with ``used`` when they do; the first call runs the CPU, OS
    and bit-identity checks), or None without the kernel library."""
    lib = qgemm()
    return None if lib is None else lib.kv_amx_status().decode()


def stream_sum(x: torch.Tensor) -> float | None:
    """The sum of a contiguous fp32 CPU vector of a multiple of 4096 values, read at the memory's
    speed (kernels/membw.c: the read-bandwidth probe of the benchmarks); None without the kernel."""
    lib = qgemm()
    if lib is None or not _cpu_f32(x) or x.dim() != 1 or x.numel() % 4096 or x.numel() == 0:
        return None
    return float(lib.kv_stream_sum(x.data_ptr(), x.numel(), torch.get_num_threads()))


def mask_logits(x: torch.Tensor, mask: torch.Tensor) -> bool:
    """Set to -inf, in place, the logits of x [R, V] (fp32, rows contiguous) whose bit in ``mask``
    [R, W] (int32, token t: bit t % 32 of word t // 32) is clear (kernels/vmask.c). False when the
    kernel is missing or the tensors do not fit it (the caller then masks in torch)."""
    lib = qgemm()
    if (lib is None or x.dim() != 2 or mask.dim() != 2 or x.dtype != torch.float32 or mask.dtype != torch.int32
            or x.stride(1) != 1 or not mask.is_contiguous() or x.shape[0] != mask.shape[0]
            or mask.shape[1] * 32 < x.shape[1] or x.device.type != "cpu"):
        return False
    return lib.kv_mask_logits(x.shape[0], x.shape[1], x.data_ptr(), x.stride(0), mask.data_ptr(), mask.shape[1]) == 0


def release_scratch() -> None:
    """Give back the calling thread's kernel scratch memory, which the quantized products keep from
    call to call (a 1B prefill chunk's takes tens of MiB); the next call allocates it again."""
    lib = _LIBS.get("qgemm")  # only a library already loaded: never builds or loads one for this
    if lib:
        lib.kv_scratch_release()


def int8_peak(seconds: float = 0.3) -> float | None:
    """Int8 multiply-adds per second this CPU's kernel variant can do on the torch threads
    (kernels/membw.c: independent chains of its dot-product instruction on registers; the best of
    three), or None without the kernel. The ceiling of a quantized prefill's products."""
    import time

    lib = qgemm()
    if lib is None:
        return None
    sink, threads, iters, best = ctypes.c_int64(0), torch.get_num_threads(), 1 << 16, 0.0
    while True:  # grow the work until one call takes a measurable time
        t = time.perf_counter()
        macs = lib.kv_int8_peak(iters, threads, ctypes.byref(sink))
        dt = time.perf_counter() - t
        if dt > seconds / 3 or iters > 1 << 34:
            break
        iters *= 4
    for _ in range(3):
        t = time.perf_counter()
        macs = lib.kv_int8_peak(iters, threads, ctypes.byref(sink))
        best = max(best, macs / (time.perf_counter() - t))
    return best


def dattn() -> ctypes.CDLL | None:
    """The fused attention (norm, rotary, cache write, canonical attention; kernels/dattn.c, built
    into the qgemm library), or None."""
    return qgemm()


def decode_attend(
    qkv: torch.Tensor,  # [N, (hq + 2 hkv) * D] fp32, unit column stride: q and k heads rotated in place
    heads: tuple[int, int, int],  # hq, hkv, D
    cos: torch.Tensor,  # [N, rot] fp32 contiguous (rot may be 0)
    sin: torch.Tensor,  # [N, rot] fp32 contiguous, rotate_half's sign folded in
    qk_norm: torch.Tensor | None,  # [hq + hkv, D] fp32 contiguous: per-head RMSNorm weights
    eps: float,
    flat: torch.Tensor,  # [2, hkv, S, D] fp32 contiguous: a pool layer
    page_size: int,
    slots: torch.Tensor,  # [N] int64: where each new token's K/V go
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],  # tables [B, P], row0, nnew, lens [B]
    scale: float,
    window: int = 0,  # a sliding window: a row at position p sees keys p - window + 1 .. p; 0: all
    sink_logits: torch.Tensor | None = None,  # [hq] fp32 contiguous: gpt-oss's learned sinks
) -> torch.Tensor | None:  # [N, hq * D], or None when the kernel cannot take these inputs
    """Every new token of every sequence in one call: norm, RoPE, the cache write and attention."""
    lib = dattn()
    hq, hkv, d = heads
    tables, row0, nnew, lens = rows
    if (lib is None or qkv.dtype != torch.float32 or qkv.device.type != "cpu" or qkv.dim() != 2
            or qkv.stride(1) != 1 or not _cpu_f32(cos, sin, qk_norm, flat, sink_logits) or not _i64(slots, *rows)
            or flat.dim() != 4 or flat.shape[1] != hkv or flat.shape[3] != d or cos.shape != sin.shape
            or cos.shape[0] != qkv.shape[0] or slots.shape[0] != qkv.shape[0]
            or (sink_logits is not None and sink_logits.shape != (hq,))):
        return None
    n = qkv.shape[0]
    out = torch.empty(n, hq * d)
    rc = lib.kv_decode_attend(n, hq, hkv, d, cos.shape[1], qkv.data_ptr(), qkv.stride(0), cos.data_ptr(),
                              sin.data_ptr(), None if qk_norm is None else qk_norm.data_ptr(), float(eps),
                              flat.data_ptr(), page_size, flat.shape[2], slots.data_ptr(), tables.data_ptr(),
                              tables.shape[1], tables.shape[0], row0.data_ptr(), nnew.data_ptr(), lens.data_ptr(),
                              window, float(scale), None if sink_logits is None else sink_logits.data_ptr(),
                              out.data_ptr(), torch.get_num_threads())
    return out if rc == 0 else None
