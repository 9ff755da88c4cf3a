"""Where pages live: ``device`` (beside the compute), ``host`` (CPU memory, pinned when the compute
device is a GPU) or ``disk`` (memory-mapped files, so the operating system keeps in RAM only the
pages in use and a context larger than the RAM budget still runs).

A disk page file is created with its full size reserved up front (``posix_fallocate``), so a full
disk is a clear error when the pool is made or grown, never a crash while writing; the file is
unlinked as soon as it is mapped, so nothing is left behind, even after a crash.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
import os
import tempfile
from pathlib import Path

import torch

from kvcache.errors import KVCacheError

_names = itertools.count()
_PAGE = mmap.PAGESIZE
_MADV_WILLNEED = 3
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _LIBC = None


class Placement:
    def __init__(self, kind: str, compute: torch.device, directory: str | None = None) -> None:
        self.kind = kind
        self.compute = compute
        self.dir: Path | None = None
        if kind == "disk":
            self.dir = Path(directory) if directory else Path(tempfile.gettempdir()) / "kvcache-pages"
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
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".kvcache-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise KVCacheError(f"disk placement: cannot write to {path}: {e.strerror or e}") from None

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor where this placement keeps pages. Never an inference tensor, even
        when a pool grows inside a forward (``torch.inference_mode``): pages are also written
        outside one (restored from a prefix tier, loaded from a saved session)."""
        with torch.inference_mode(False):
            return self._zeros(shape, dtype)

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.kind == "device":
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
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
            t = torch.from_file(str(path), shared=True, size=max(1, numel), dtype=dtype)
        except OSError as e:
            raise KVCacheError(
                f"disk placement: cannot reserve {nbytes / 2**20:.1f} MiB in {self.dir}: {e.strerror or e}"
            ) from None
        finally:
            path.unlink(missing_ok=True)
        return t[:numel].view(shape)

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor's data on the compute device (a copy when it lives elsewhere)."""
        if t.device != self.compute:
            return t.to(self.compute, non_blocking=True)
        return t
