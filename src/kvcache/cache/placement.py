"""Where pages live: ``device`` (beside the compute), ``host`` (CPU memory, pinned when the compute
device is a GPU) or ``disk`` (memory-mapped files, so the operating system keeps in RAM only the
pages in use and a context larger than the RAM budget still runs).

A disk page file is created with its full size reserved up front (``posix_fallocate``), so a full
disk is a clear error when the pool is made or grown, never a crash while writing; it is created
0600 with O_EXCL (a file or link planted under its name is never followed), mapped from the
descriptor that created it, and unlinked at once, so nothing is left behind, even after a crash,
and no other process can swap the file between creation and mapping. Without ``dir=`` the pages
go to a fresh private folder (``mkdtemp``: 0700, a name nobody could create first) under the
system's temporary directory, removed at exit.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import math
import mmap
import os
import tempfile
from pathlib import Path

import torch

from kvcache import hugepages
from kvcache.errors import KVCacheError

_names = itertools.count()
_PAGE = mmap.PAGESIZE
_MADV_WILLNEED = 3
_LIBC = hugepages.libc()  # for madvise; None where there is no C library to load


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_PRIVATE: list[Path] = []


def _private_dir() -> Path:
    """This process's own folder for page files (0700, made by mkdtemp), removed at exit."""
    if not _PRIVATE:
        d = Path(tempfile.mkdtemp(prefix="kvcache-pages-"))
        _PRIVATE.append(d)
        atexit.register(_remove_private, d)
    return _PRIVATE[0]


def _remove_private(d: Path) -> None:
    try:
        d.rmdir()  # page files were unlinked once mapped: it is empty
    except OSError:
        pass


class Placement:
    def __init__(self, kind: str, compute: torch.device, directory: str | None = None) -> None:
        self.kind = kind
        self.compute = compute
        self.dir: Path | None = None
        if kind == "disk":
            self.dir = Path(directory) if directory else _private_dir()
            self._check_dir(self.dir)

    @property
    def offloaded(self) -> bool:
        """Pages are away from the compute and come back layer by layer (a GPU computes; on a
        CPU, host and disk pages are read where they lie: disk pages through the mapping)."""
        return self.kind in ("host", "disk") and self.compute.type != "cpu"

    def advise(self, t: torch.Tensor) -> None:
        """Disk: ask the kernel to start reading a tensor's pages in (madvise WILLNEED), so the
        next layer's K/V arrive while this one computes."""
        if self.kind != "disk" or _LIBC is None or not t.numel():
            return
        start = t.data_ptr() & ~(_PAGE - 1)
        end = t.data_ptr() + t.numel() * t.element_size()
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_WILLNEED)

    @staticmethod
    def _check_dir(path: Path) -> None:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe = path / f".kvcache-probe-{os.getpid()}-{next(_names)}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600))
            probe.unlink()
        except OSError as e:
            raise KVCacheError(f"disk placement: cannot write to {path}: {e.strerror or e}") from None

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, sparse: bool = False) -> torch.Tensor:
        """A zero-filled tensor where this placement keeps pages. Never an inference tensor, even
        when a pool grows inside a forward (``torch.inference_mode``): pages are also written
        outside one (restored from a prefix tier, loaded from a saved session). ``sparse``: most of
        it may stay unwritten (a dynamic pool's first size): in memory, it is kept in 4 KiB pages,
        resident only where written; otherwise a CPU pool takes huge pages, which a decode streams
        faster, and which make a whole pool resident as soon as each head's run of pages is
        written at its start."""
        with torch.inference_mode(False):
            return self._zeros(shape, dtype, sparse)

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, sparse: bool) -> torch.Tensor:
        if self.kind == "device":
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if self.compute.type == "cpu" and hugepages.advise_wanted(n):  # decode streams the pages
                return torch.frombuffer(hugepages.anon(n, huge=not sparse), dtype=dtype).view(shape)
            return torch.zeros(shape, dtype=dtype, device=self.compute)
        if self.kind == "host":
            pin = self.compute.type == "cuda"
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)
        return self._mapped(shape, dtype)

    def _mapped(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert self.dir is not None
        numel = 1
        for s in shape:
            numel *= s
        nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
        path = self.dir / f"kv-{os.getpid()}-{next(_names)}.pages"
        fd = -1
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
            os.posix_fallocate(fd, 0, nbytes)
            mapped = mmap.mmap(fd, nbytes)  # from the descriptor: the file we created, whatever the name holds now
        except OSError as e:
            raise KVCacheError(
                f"disk placement: cannot reserve {nbytes / 2**20:.1f} MiB in {self.dir}: {e.strerror or e}"
            ) from None
        finally:
            if fd >= 0:
                os.close(fd)
                path.unlink(missing_ok=True)
        t = torch.frombuffer(mapped, dtype=dtype, count=max(1, numel))  # keeps the mapping alive
        return t[:numel].view(shape)

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor's data on the compute device (a copy when it lives elsewhere)."""
        if t.device != self.compute:
            return t.to(self.compute, non_blocking=True)
        return t
