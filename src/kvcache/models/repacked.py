"""The repacked weights of a GGUF file, written once beside its converted folder and mapped after.

Repacking a 1B model's blocks for the int8 kernels takes seconds, and quantizing its fp32 weights
anew (``weights="q8"`` or ``"q4"``) longer; the result depends only on the file and the mode. The
first load of a mode writes every QWeight's arrays into ``<converted folder>/repacked-v<VERSION>.kvq``
(``weights="file"``) or ``repacked-q8-v<VERSION>.kvq`` (``q4``: ``repacked-q4-...``); later loads of
that mode map the file (a private mapping: the page cache's pages, shared by every process that
maps it, never copied unless written) and build the QWeights as views of it.

File layout: 8 bytes of magic, 8 bytes of index length n and 4 bytes of CRC-32 (little endian),
the JSON index (n bytes), then the arrays, each 4096-aligned. The CRC covers the whole file but
its own 4 bytes: the header, the index and the data. The index names the format version, the GGUF
the weights came from (its path, size and mtime, and the sha256 its converted folder's
kvcache.json recorded), and every entry's part keys, format, shape and arrays (offset, byte
length, dtype, shape). A file whose magic, length, CRC, version, source or index does not check
out, or whose arrays do not fit their weight's format, is not used (those weights are repacked
from the GGUF again and the file rewritten); nothing read from it is allocated or raised before
it checks out. Files of older versions are removed when a new one is written.

Owns the file and the mapping; may not change the repacked layout (qweight.py, kernels/qformat.h).
Locking: models are built on one thread; a load that must repack holds ``.<the file's name>.lock``
(paths.one_at_a_time) from its check of the file to its write, so processes loading the same
file at once repack it once: the later one finds the first one's file and maps it.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
import zlib
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from kvcache import hugepages
from kvcache.errors import ModelLoadError
from kvcache.kernels.qweight import QWeight
from kvcache.paths import one_at_a_time

MAGIC = b"KVQPACK\0"
VERSION = 5  # bump when this layout or kernels/qformat.h's layouts change
HEAD = struct.Struct("<8sQI")  # magic, index length, CRC-32 of the rest of the file
ALIGN = 4096
PROGRESS_BYTES = 256 << 20  # files at least this large show a progress bar while repacked
_DTYPES = {"uint8": np.uint8, "float16": np.float16, "float32": np.float32}
_OLDER = re.compile(r"repacked-(?:(q8|q4)-)?v(\d+)\.kvq")
MODES = ("file", "q8", "q4")  # the weights modes whose QWeights are kept


def file_name(mode: str = "file") -> str:
    """The store's file name in a converted folder for weights ``mode`` (one of MODES)."""
    if mode not in MODES:
        raise ValueError(f"no repacked store for weights={mode!r}")
    return f"repacked-v{VERSION}.kvq" if mode == "file" else f"repacked-{mode}-v{VERSION}.kvq"


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _crc(mapped: np.ndarray) -> int:
    """The CRC-32 of a file's bytes but those of the CRC itself (HEAD's last 4)."""
    return zlib.crc32(mapped[HEAD.size :], zlib.crc32(mapped[: HEAD.size - 4]))


def source_identity(folder: Path) -> dict[str, Any] | None:
    """The GGUF that ``folder`` was converted from, as its kvcache.json names it: path, size,
    mtime (ns) and the sha256 taken at conversion; None where that cannot be read."""
    try:
        info = json.loads((Path(folder) / "kvcache.json").read_text())
        st = Path(info["source"]).stat()
        return {"path": str(info["source"]), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "sha256": str(info["fingerprint"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _count(x: Any) -> bool:
    return type(x) is int and x >= 0


def _fits(a: Any, data: int, size: int) -> bool:
    """An array's entry names a known dtype and a shape of exactly its bytes inside the data section."""
    if not isinstance(a, dict) or not isinstance(a.get("dtype"), str) or a["dtype"] not in _DTYPES:
        return False
    at, n, shape = a.get("offset"), a.get("bytes"), a.get("shape")
    if not (_count(at) and _count(n) and isinstance(shape, list) and all(_count(s) for s in shape)):
        return False
    itemsize = np.dtype(_DTYPES[a["dtype"]]).itemsize
    return at % ALIGN == 0 and data <= at and at + n <= size and math.prod(shape) * itemsize == n


def _entries(index: Any, source: dict[str, Any], data: int, size: int) -> dict[str, dict[str, Any]]:
    """The index's entries when it is of this version and source and every field checks out, else {}."""
    if not isinstance(index, dict) or index.get("version") != VERSION or index.get("source") != source:
        return {}
    entries = index.get("entries")
    if not isinstance(entries, dict):
        return {}
    for e in entries.values():
        if (not isinstance(e, dict) or not all(_count(e.get(f)) for f in ("fmt", "out", "k"))
                or not isinstance(e.get("arrays"), list) or len(e["arrays"]) != 3
                or not all(a is None or _fits(a, data, size) for a in e["arrays"])):
            return {}
    return entries


class RepackStore:
    """Entries found in the mapped file (``get``) and entries made by this load (``put``, written
    by ``save``). A folder whose source GGUF is unknown keeps no file."""

    def __init__(self, folder: Path, source_bytes: int = 0, mode: str = "file") -> None:
        self.mode = mode
        self.names: dict[int, str] = {}  # id -> state-dict name of the fp32 tensors a build quantizes (see key)
        self.path = Path(folder) / file_name(mode)
        self.source = source_identity(Path(folder))
        self.found: dict[str, dict[str, Any]] = {}
        self.made: dict[str, tuple[int, int, int, list[torch.Tensor | None]]] = {}
        self._map: np.ndarray | None = None
        if self.source is not None:
            self._open()
        self.source_bytes = source_bytes
        self.bar = None  # a progress bar over the GGUF's bytes while a large file is repacked

    def start(self) -> None:
        """Before a build: look for the file again where it was not found (another process may have
        written it since), and show a progress bar when a large file is to be repacked."""
        if self.found or self.source is None:
            return
        self._open()
        if not self.found and self.source_bytes >= PROGRESS_BYTES:
            from tqdm import tqdm

            self.bar = tqdm(total=self.source_bytes, unit="B", unit_scale=True, leave=False,
                            desc="repacking the weights (once)" if self.mode == "file" else
                            f"quantizing the weights to {self.mode} (once)")

    def repacked(self, nbytes: int) -> None:
        """``nbytes`` of the GGUF's quantized data were repacked (the progress bar moves)."""
        if self.bar is not None:
            self.bar.update(nbytes)

    def _open(self) -> None:
        """Map the file and take its entries when it checks out whole; any failure leaves none."""
        try:
            checked = self._checked_map()
            if checked is None:
                return
            mapped, n = checked
            index = json.loads(bytes(mapped[HEAD.size : HEAD.size + n]))
            found = _entries(index, self.source or {}, _aligned(HEAD.size + n), mapped.nbytes)
            if found:
                self._map, self.found = mapped, found
        except Exception:  # noqa: BLE001 - a file that does not check out is repacked, never fatal
            self._map, self.found = None, {}

    def _map_file(self) -> np.ndarray:
        """The file as a private mapping (copy on write, never written) with huge pages asked for."""
        with open(self.path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        hugepages.advise(m)
        return np.frombuffer(m, dtype=np.uint8)

    @staticmethod
    def _check(mapped: np.ndarray) -> int | None:
        """The index length of a mapped file whose header and CRC check out, else None."""
        if mapped.nbytes < HEAD.size:
            return None
        magic, n, crc = HEAD.unpack(bytes(mapped[: HEAD.size]))
        if magic != MAGIC or n > mapped.nbytes - HEAD.size or _crc(mapped) != crc:
            return None
        return int(n)

    def _checked_map(self) -> tuple[np.ndarray, int] | None:
        """The mapped file and its index length once its CRC checks out (reading it all populates
        the mapping), else None. Where the page cache held the file in small pages (it was just
        written, or read without huge pages), the clean cached pages are dropped and the file is
        read again through the advised mapping, once, so that decode streams it over 2 MiB pages
        (hugepages.py)."""
        mapped = self._map_file()
        size, n = mapped.nbytes, self._check(mapped)
        if n is None:
            return None
        if (not hugepages.advise_wanted(size) or not hasattr(os, "posix_fadvise")
                or hugepages.huge_bytes(mapped.ctypes.data, size) >= (size // hugepages.HUGE) * hugepages.HUGE * 9 // 10):
            return mapped, n
        del mapped  # unmapped: the drop below cannot touch another process's mapped pages either
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        mapped = self._map_file()
        n = self._check(mapped)
        return None if n is None else (mapped, n)

    def name(self, state_dict: dict[str, Any]) -> None:
        """Know the fp32 tensors of the build's state dict by their names (their keys in this store)."""
        self.names = {id(t): n for n, t in state_dict.items() if isinstance(t, torch.Tensor)}

    def key(self, parts: list[Any]) -> str | None:
        """The key of a projection quantized anew: the state-dict names of its fp32 parts; None where
        a part has none (a tensor made during the build), which is then not kept."""
        names = [self.names.get(id(p)) for p in parts]
        return None if None in names else "|".join("name:" + n for n in names)  # type: ignore[arg-type]

    def get(self, key: str, fmt: int, out: int, k: int) -> list[torch.Tensor | None] | None:
        """The arrays (qs, d, m) of ``key`` as views of the mapping, when it holds that weight in
        the shapes and dtypes of its format (QWeight's own check)."""
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
        try:
            QWeight(fmt, out, k, arrays=tuple(arrays))  # type: ignore[arg-type]
        except ModelLoadError:
            return None
        return arrays

    def put(self, key: str, fmt: int, out: int, k: int, arrays: list[torch.Tensor | None]) -> None:
        self.made[key] = (fmt, out, k, arrays)

    def save(self) -> None:
        """When this load made entries, write them and those it found to a new file, atomically, and
        remove older versions' files; a failure leaves no file and costs only the next load's
        repacking."""
        if not self.made or self.source is None:
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
                at = _aligned(at + arr.nbytes)
            layout[key] = (fmt, out, k, desc)

        def index_text(data: int) -> bytes:
            entries = {key: {"fmt": fmt, "out": out, "k": k, "arrays": [
                None if a is None else {"offset": data + a[0], "bytes": a[1], "dtype": a[2], "shape": a[3]}
                for a in desc]} for key, (fmt, out, k, desc) in layout.items()}
            return json.dumps({"version": VERSION, "source": self.source, "entries": entries}).encode()

        data = ALIGN
        while (need := _aligned(HEAD.size + len(index_text(data)))) > data:  # offsets move the data's start
            data = need
        text = index_text(data)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "wb") as f:
                f.truncate(data + at)
                f.seek(HEAD.size)
                f.write(text)
                crc = zlib.crc32(bytes(data - HEAD.size - len(text)), zlib.crc32(text, zlib.crc32(
                    MAGIC + struct.pack("<Q", len(text)))))
                pos = 0
                for rel, arr in blobs:
                    crc = zlib.crc32(arr, zlib.crc32(bytes(rel - pos), crc))
                    f.seek(data + rel)
                    f.write(arr.tobytes())
                    pos = rel + arr.nbytes
                crc = zlib.crc32(bytes(at - pos), crc)
                f.seek(0)
                f.write(HEAD.pack(MAGIC, len(text), crc))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return
        for old in self.path.parent.glob("repacked-*.kvq"):
            m = _OLDER.fullmatch(old.name)
            if m is not None and (m.group(1) or "file") == self.mode and int(m.group(2)) < VERSION:
                try:
                    old.unlink()
                except OSError:
                    pass


def gguf_key(parts: list[Any]) -> str:
    """A projection's key in the store: where its GGUF parts (GGUFTensor) lie in the file, and how."""
    return "|".join(f"{p.offset}:{p.ggml_type}:{p.out}:{p.k}:{p.permute_heads}" for p in parts)


_STORE: ContextVar[RepackStore | None] = ContextVar("kvcache_repack_store", default=None)


def current() -> RepackStore | None:
    """The store of the model being built (None: repack from the file, keep nothing)."""
    return _STORE.get()


@contextmanager
def repack_store(folder: Path | None, source_bytes: int = 0, mode: str = "file") -> Iterator[RepackStore | None]:
    """Models built inside read their repacked weights from ``folder``'s store of weights ``mode``
    and add to it; ``source_bytes``: what a first, long repack reads (the GGUF's size; for q8 and q4
    the fp32 weights' bytes), for its progress bar. A build that
    must repack takes its turn on the store's lock first (processes loading the file at once
    repack it once)."""
    store = RepackStore(folder, source_bytes, mode) if folder is not None else None
    with ExitStack() as turn:
        if store is not None and store.source is not None and not store.found:
            turn.enter_context(one_at_a_time(store.path.with_name(f".{store.path.name}.lock")))
        if store is not None:
            store.start()
        token = _STORE.set(store)
        try:
            yield store
        finally:
            _STORE.reset(token)
            if store is not None and store.bar is not None:
                store.bar.close()
        if store is not None:
            store.save()
