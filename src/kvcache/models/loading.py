"""Resolve a model spec to an HF-format folder (converting GGUF once) and load its weights.

A spec is None (the bundled default), a bundled name, a .gguf file, an HF model folder, or a hub
id (org/name). A GGUF file's config and tokenizer are converted into
$KVCACHE_HOME/models/<stem>-<key>/ the first time. Its weights are read from the file itself
under ``weights="file"``; fp32 weights (``fp32``, ``q8``, ``q4``) are converted once into the same
folder's model.safetensors, the first time they are asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcache.errors import ModelLoadError
from kvcache.models.bundled import BUNDLED, DEFAULT, bundled_path, is_hub_id, is_installed, not_found
from kvcache.paths import OWNER, cache_home, one_at_a_time, scratch

FORMAT_VERSION = 4


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # HF-format folder to load
    source: Path | str  # what the user named: the GGUF file, the folder, or the hub id
    name: str
    gguf: Path | None = None  # the GGUF file the folder was converted from


def _converted_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}:{FORMAT_VERSION}".encode()).hexdigest()[:12]
    return cache_home() / "models" / f"{gguf.stem}-{key}"


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _converting(parent: Path) -> Path:
    """A new temporary folder for a conversion in ``parent`` (paths.scratch: marked with this
    process's id, after removing the ones a killed process left behind)."""
    return scratch(parent, ".converting-")


def ensure_converted(gguf: Path, show_progress: bool = True) -> Path:
    """The converted folder of ``gguf`` (config and tokenizer), converting it now if needed
    (atomically: a temporary folder renamed into place, so an interrupted conversion leaves
    nothing half-written)."""
    target = _converted_dir(gguf)
    if (target / "kvcache.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with one_at_a_time(target.parent / f".{target.name}.lock"):  # processes starting at once convert it once
        if not (target / "kvcache.json").is_file():
            _convert(gguf, target, show_progress)
    return target


def _convert(gguf: Path, target: Path, show_progress: bool) -> None:
    from kvcache.models.gguf_convert import convert_gguf

    tmp = _converting(target.parent)
    try:
        convert_gguf(gguf, tmp, show_progress=show_progress, weights=False)
        info = {"source": str(gguf.resolve()), "fingerprint": _file_sha256(gguf), "format": FORMAT_VERSION}
        (tmp / "kvcache.json").write_text(json.dumps(info, indent=2))
        (tmp / OWNER).unlink(missing_ok=True)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "kvcache.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_fp32(resolved: ResolvedModel, show_progress: bool = True) -> None:
    """Give a converted GGUF folder its fp32 model.safetensors (once; written to a temporary file
    renamed into place; processes asking at once take turns, as for the conversion)."""
    if resolved.gguf is None or (resolved.path / "model.safetensors").is_file():
        return
    with one_at_a_time(resolved.path.parent / f".{resolved.path.name}.fp32.lock"):
        if not (resolved.path / "model.safetensors").is_file():
            _convert_fp32(resolved, show_progress)


def _convert_fp32(resolved: ResolvedModel, show_progress: bool) -> None:
    from kvcache.models.gguf_convert import convert_gguf

    tmp = _converting(resolved.path.parent)
    try:
        # the folder has its tokenizer already: only the weights (a vocabulary's conversion takes seconds)
        convert_gguf(resolved.gguf, tmp, show_progress=show_progress, weights=True, tokenizer=False)
        os.replace(tmp / "model.safetensors", resolved.path / "model.safetensors")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_weights(resolved: ResolvedModel, mode: str) -> dict[str, Any]:
    """HF-named weights for ``mode`` (models/weights.py): a GGUF under ``file`` gives its quantized
    tensors unread (GGUFTensor); everything else is fp32."""
    if resolved.gguf is not None and mode == "file":
        from kvcache.models.gguf_convert import gguf_weights

        return gguf_weights(resolved.gguf, resolved.path)
    ensure_fp32(resolved)
    return load_weights(resolved.path)[1]


def fp32_folder(spec: str | os.PathLike | None) -> Path:
    """An HF-format folder with fp32 weights for ``spec`` (what transformers loads)."""
    resolved = resolve_model(spec)
    ensure_fp32(resolved)
    return resolved.path


def resolve_model(spec: str | os.PathLike | None) -> ResolvedModel:
    if spec is None or str(spec) in BUNDLED:
        name = DEFAULT if spec is None else str(spec)
        gguf = bundled_path(name)
        return ResolvedModel(ensure_converted(gguf), gguf, name, gguf)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf" and path.read_bytes()[:4] != b"GGUF":
            raise ModelLoadError(f"{path} is not a model: give a .gguf file or a model folder")
        return ResolvedModel(ensure_converted(path), path, path.stem, path)
    if path.is_dir():
        _check_hf_dir(path)
        return ResolvedModel(path, path, path.name)
    if is_hub_id(str(spec)):
        return _from_hub(str(spec))
    raise not_found(spec)


def _check_hf_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a model folder: it has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no *.safetensors weights")


def _from_hub(repo_id: str) -> ResolvedModel:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover
        raise ModelLoadError("loading a hub id needs huggingface_hub: pip install huggingface_hub") from None
    try:
        folder = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"])
    except Exception as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or "offline" in str(e).lower() or "connect" in str(e).lower()
        reason = "no network (or HF_HUB_OFFLINE=1) and it is not in the local hub cache" if offline else str(e).splitlines()[0]
        raise ModelLoadError(f"hub model {repo_id!r} is not available: {reason}; pass a local GGUF file or model folder") from None
    path = Path(folder)
    _check_hf_dir(path)
    return ResolvedModel(path, repo_id, repo_id.split("/")[-1])


def read_config(path: Path) -> dict[str, Any]:
    """The HF config dict of an HF-format folder."""
    try:
        return dict(json.loads((path / "config.json").read_text()))
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path / 'config.json'} cannot be read ({e})") from None


def load_weights(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF config dict, fp32 state dict) of an HF-format folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_config(path)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f} is not a valid safetensors file ({e})") from None
        state.update(part)
    for k, v in state.items():
        if v.dtype != torch.float32:
            state[k] = v.float()
    return config, state


def model_fingerprint(path: Path) -> str:
    """A stable id of a model's weights (see kvcache.models.fingerprint)."""
    from kvcache.models.fingerprint import fingerprint

    return fingerprint(path)


def list_models() -> list[str]:
    """Rows for `kvcache models`: bundled models, then converted ones in the cache."""
    rows = ["bundled:"]
    width = max(len(name) for name in BUNDLED)
    for name, desc in BUNDLED.items():
        mark = "installed" if is_installed(name) else "not installed"
        rows.append(f"  {name:<{width}} {desc} [{mark}]{'  (default)' if name == DEFAULT else ''}")
    rows.append(f"converted ({cache_home() / 'models'}):")
    found = False
    for d in sorted((cache_home() / "models").glob("*/kvcache.json")):
        info = json.loads(d.read_text())
        size = sum(f.stat().st_size for f in d.parent.iterdir() if f.is_file())
        rows.append(f"  {d.parent.name:<40} {size / 2**20:7.0f} MiB  from {info.get('source')}")
        found = True
    if not found:
        rows.append("  (none yet)")
    return rows
