"""The repacked weights of a GGUF file, written once beside its converted folder and mapped after.

Repacking a 1B model's blocks for the int8 kernels takes seconds; the result depends only on the
file. The first load (``weights="file"``) writes every QWeight's arrays into
``<converted folder>/repacked-v<VERSION>.kvq``; later loads map that file (a private mapping: the
page cache's pages, shared by every process that maps it, never copied unless written) and build
the QWeights as views of it.

File layout: 8 bytes of magic, 8 bytes of index length (little endian), the JSON index, then the
arrays, each 4096-aligned. The index names the format version, every entry's part keys, format,
shape and arrays (offset, byte length, dtype, shape) and a CRC-32 of the data section. A file whose
magic, version, index, sizes or CRC does not check out is not used (the weights are repacked from
the GGUF again and the file rewritten).

Owns the file and the mapping; may not change the repacked layout (qweight.py, kernels/qformat.h).
Locking: none; models are built on one thread.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from kvcache import hugepages

MAGIC = b"KVQPACK\0"
VERSION = 3  # bump when kernels/qformat.h's layouts change
ALIGN = 4096
PROGRESS_BYTES = 256 << 20  # files at least this large show a progress bar while repacked
_DTYPES = {"uint8": np.uint8, "float16": np.float16, "float32": np.float32}


class RepackStore:
    """Entries found in the mapped file (``get``) and entries made by this load (``put``, written
    by ``save``)."""

    def __init__(self, folder: Path, source_bytes: int = 0) -> None:
        self.path = Path(folder) / f"repacked-v{VERSION}.kvq"
        self.found: dict[str, dict[str, Any]] = {}
        self.made: dict[str, tuple[int, int, int, list[torch.Tensor | None]]] = {}
        self._map: np.ndarray | None = None
        self._open()
        self.bar = None  # a progress bar over the GGUF's bytes while a large file is repacked
        if not self.found and source_bytes >= PROGRESS_BYTES:
            from tqdm import tqdm

            self.bar = tqdm(total=source_bytes, unit="B", unit_scale=True, desc="repacking the weights (once)",
                            leave=False)

    def repacked(self, nbytes: int) -> None:
        """``nbytes`` of the GGUF's quantized data were repacked (the progress bar moves)."""
        if self.bar is not None:
            self.bar.update(nbytes)

    def _open(self) -> None:
        try:
            size = self.path.stat().st_size
            if size < 16:
                return
            with open(self.path, "rb") as f:
                head = f.read(16)
                if head[:8] != MAGIC:
                    return
                (n,) = struct.unpack("<Q", head[8:])
                if n > size - 16:
                    return
                index = json.loads(f.read(n))
            if index.get("version") != VERSION:
                return
            data = -(-(16 + n) // ALIGN) * ALIGN
            mapped = self._checked_map(size, data, index["crc"])
            if mapped is None:
                return
            for e in index["entries"].values():
                for a in e["arrays"]:
                    if a is not None and (a["offset"] < data or a["offset"] + a["bytes"] > size):
                        return
            self._map, self.found = mapped, index["entries"]
        except (OSError, ValueError, KeyError, TypeError):
            self._map, self.found = None, {}

    def _map_file(self, size: int) -> np.ndarray:
        """The file as a private mapping (copy on write, never written) with huge pages asked for."""
        with open(self.path, "rb") as f:
            m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        hugepages.advise(m)
        return np.frombuffer(m, dtype=np.uint8)

    def _checked_map(self, size: int, data: int, crc: str) -> np.ndarray | None:
        """The mapped file once its data's CRC checks out (reading it all populates the mapping),
        else None. Where the page cache held the file in small pages (it was just written, or read
        without huge pages), the clean cached pages are dropped and the file is read again through
        the advised mapping, once, so that decode streams it over 2 MiB pages (hugepages.py)."""
        mapped = self._map_file(size)
        if f"{zlib.crc32(mapped[data:]):010d}" != crc:
            return None
        if (not hugepages.advise_wanted(size) or not hasattr(os, "posix_fadvise")
                or hugepages.huge_bytes(mapped.ctypes.data, size) >= (size // hugepages.HUGE) * hugepages.HUGE * 9 // 10):
            return mapped
        del mapped  # unmapped: the drop below cannot touch another process's mapped pages either
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        mapped = self._map_file(size)
        return mapped if f"{zlib.crc32(mapped[data:]):010d}" == crc else None

    def get(self, key: str, fmt: int, out: int, k: int) -> list[torch.Tensor | None] | None:
        """The arrays (qs, d, m) of ``key`` as views of the mapping, when it holds that weight."""
        e = self.found.get(key)
        if e is None or self._map is None or (e["fmt"], e["out"], e["k"]) != (fmt, out, k):
            return None
        arrays: list[torch.Tensor | None] = []
        for a in e["arrays"]:
            if a is None:
                arrays.append(None)
                continue
            raw = self._map[a["offset"] : a["offset"] + a["bytes"]]
            arrays.append(torch.from_numpy(raw.view(_DTYPES[a["dtype"]]).reshape(a["shape"])))
        return arrays

    def put(self, key: str, fmt: int, out: int, k: int, arrays: list[torch.Tensor | None]) -> None:
        self.made[key] = (fmt, out, k, arrays)

    def save(self) -> None:
        """When this load made entries, write them and those it found to a new file, atomically; a
        failure leaves no file and costs only the next load's repacking."""
        if not self.made:
            return
        for key, e in self.found.items():  # a file that held only part of the model keeps that part
            if key not in self.made:
                arrays = self.get(key, e["fmt"], e["out"], e["k"])
                if arrays is not None:
                    self.made[key] = (e["fmt"], e["out"], e["k"], arrays)
        layout, blobs, at = {}, [], 0  # data offsets relative to the data section
        for key, (fmt, out, k, arrays) in self.made.items():
            desc = []
            for t in arrays:
                if t is None:
                    desc.append(None)
                    continue
                arr = t.numpy()
                desc.append((at, arr.nbytes, str(arr.dtype), list(arr.shape)))
                blobs.append((at, arr))
                at = -(-(at + arr.nbytes) // ALIGN) * ALIGN
            layout[key] = (fmt, out, k, desc)

        def index_text(data: int, crc: int) -> bytes:
            entries = {key: {"fmt": fmt, "out": out, "k": k, "arrays": [
                None if a is None else {"offset": data + a[0], "bytes": a[1], "dtype": a[2], "shape": a[3]}
                for a in desc]} for key, (fmt, out, k, desc) in layout.items()}
            return json.dumps({"version": VERSION, "crc": f"{crc:010d}", "entries": entries}).encode()

        data = ALIGN
        while True:  # the data starts after the index, whose offsets depend on where the data starts
            need = -(-(16 + len(index_text(data, 0))) // ALIGN) * ALIGN
            if need <= data:
                break
            data = need
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "wb") as f:
                f.truncate(data + at)
                crc, pos = 0, 0
                for rel, arr in blobs:
                    gap = bytes(rel - pos)
                    crc = zlib.crc32(arr, zlib.crc32(gap, crc))
                    f.seek(data + rel)
                    f.write(arr.tobytes())
                    pos = rel + arr.nbytes
                crc = zlib.crc32(bytes(at - pos), crc)
                text = index_text(data, crc)
                f.seek(0)
                f.write(MAGIC + struct.pack("<Q", len(text)) + text)
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)


_STORE: ContextVar[RepackStore | None] = ContextVar("kvcache_repack_store", default=None)


def current() -> RepackStore | None:
    """The store of the model being built (None: repack from the file, keep nothing)."""
    return _STORE.get()


@contextmanager
def repack_store(folder: Path | None, source_bytes: int = 0) -> Iterator[RepackStore | None]:
    """Models built inside read their repacked weights from ``folder``'s store and add to it;
    ``source_bytes``: the GGUF's size, for the progress bar of a first, long repack."""
    store = RepackStore(folder, source_bytes) if folder is not None else None
    token = _STORE.set(store)
    try:
        yield store
    finally:
        _STORE.reset(token)
        if store is not None and store.bar is not None:
            store.bar.close()
    if store is not None:
        store.save()
