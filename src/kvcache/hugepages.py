"""The process's memory and the kernel: transparent huge pages for the large buffers every step
streams (weights, KV pools), and ``trim`` to give freed heap back after a load.

A decode step reads every weight once. With 4 KiB pages each 4 KiB of it costs a TLB miss (a
two-dimensional page walk in a virtual machine); with 2 MiB pages one miss covers 512 times as
much. On the reference machine a streaming read ran at 38-42 GB/s over 4 KiB pages and 49-52 GB/s
over 2 MiB pages, alternating in one process (docs/architecture.md, "Weights in memory").

Linux gives huge pages to memory a process asks for them with ``madvise(MADV_HUGEPAGE)`` when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``:
- anonymous memory (``anon``: the KV pools on the CPU): at first touch, so advise before writing
  (numpy already asks for its own large arrays, which hold the weights a load repacks);
- a file's mapping (``advise`` on the weights file's mapping): a page-cache read through an advised
  mapping reads 2 MiB folios, and the mapping maps them whole. Pages already cached in small
  pieces stay small: ``huge_bytes`` tells, and the weights' loader drops and rereads such a file
  once (models/repacked.py).
Where the kernel has no THP, or ``KVCACHE_HUGEPAGES=0``, every call here does nothing and the
buffers are plain ones: the same numbers, only slower reads.

A load parses the tokenizer's JSON, the GGUF's metadata and the model's tables, and frees most of
it; glibc keeps freed heap mapped until asked (``trim``: 10-15 MiB of a 1B model's load measured).

The base layer: imports nothing of kvcache and no torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from functools import lru_cache

HUGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page (PMD)
MIN_BYTES = 4 << 20  # smaller buffers are left alone (two huge pages at least)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)


@lru_cache(maxsize=1)
def enabled() -> bool:
    """THP can be had here by asking (Linux, mode ``always`` or ``madvise``) and it is not turned
    off with ``KVCACHE_HUGEPAGES=0``."""
    if os.environ.get("KVCACHE_HUGEPAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def advise_wanted(nbytes: int) -> bool:
    """A buffer of this size gets huge pages asked for (THP on, and not a small buffer)."""
    return nbytes >= MIN_BYTES and enabled()


def advise(m: mmap.mmap) -> bool:
    """Ask for huge pages over a whole mapping; False where nothing was asked (THP off, a small
    mapping, or the kernel refused)."""
    if not advise_wanted(len(m)):
        return False
    try:
        m.madvise(_MADV_HUGEPAGE)
    except (OSError, ValueError):
        return False
    return True


def anon(nbytes: int, huge: bool = True) -> mmap.mmap:
    """``nbytes`` of zeroed anonymous memory (wrap it with numpy.frombuffer / torch.frombuffer; the
    buffer lives while a view does), resident only where it is touched: with huge pages asked for
    before anything touches it, or with ``huge`` False kept in 4 KiB pages (even where THP is
    ``always``), for a buffer touched sparsely."""
    m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        advise(m)
    else:
        try:
            m.madvise(_MADV_NOHUGEPAGE)
        except (OSError, ValueError):
            pass
    return m


def huge_bytes(addr: int, nbytes: int) -> int:
    """Bytes of the mappings that overlap [addr, addr + nbytes) held in huge pages now (file pages
    mapped whole plus anonymous huge pages), from /proc/self/smaps; 0 where it cannot be read."""
    return _smaps_bytes(addr, nbytes, ("FilePmdMapped:", "AnonHugePages:"))


def resident_bytes(addr: int, nbytes: int) -> int:
    """Bytes of the mappings that overlap [addr, addr + nbytes) resident now (/proc/self/smaps'
    Rss); 0 where it cannot be read."""
    return _smaps_bytes(addr, nbytes, ("Rss:",))


def _smaps_bytes(addr: int, nbytes: int, fields: tuple[str, ...]) -> int:
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, _, hi = head.partition("-")
                    try:
                        inside = int(lo, 16) < addr + nbytes and int(hi, 16) > addr
                    except ValueError:
                        inside = False
                elif inside and head in fields:
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


@lru_cache(maxsize=1)
def libc() -> ctypes.CDLL | None:
    """The C library (loaded once: finding it runs ldconfig), with madvise's argument types set;
    None where there is none to load."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return lib
    except (OSError, AttributeError):
        return None


def trim() -> bool:
    """Give the heap's free memory back to the kernel (glibc's malloc_trim); False where there is
    no glibc."""
    lib = libc()
    return lib is not None and hasattr(lib, "malloc_trim") and bool(lib.malloc_trim(0))
