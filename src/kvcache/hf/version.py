"""The transformers versions the bridge supports, checked when ``kvcache.hf`` is imported."""

from __future__ import annotations

import re

from kvcache.errors import KVCacheError

# keep in step with the transformers line of pyproject.toml
MIN_VERSION = (5, 0)  # inclusive
MAX_VERSION = (6, 0)  # exclusive
SUPPORTED = f">={MIN_VERSION[0]}.{MIN_VERSION[1]},<{MAX_VERSION[0]}"


class UnsupportedTransformers(KVCacheError):
    """The installed transformers is outside the range the bridge is built and tested for."""


def parse_version(text: str) -> tuple[int, int, int]:
    """'5.23.0', '5.3.0.dev0', '4.57.1+cpu' -> (major, minor, patch)."""
    m = re.match(r"\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    if m is None:
        raise UnsupportedTransformers(f"cannot read the transformers version {text!r}; kvcache.hf needs "
                                      f"transformers{SUPPORTED}")
    return int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0)


def check_transformers_version(version: str | None = None) -> str:
    """Raise UnsupportedTransformers unless ``version`` (default: the installed one) is in range;
    return the version checked."""
    if version is None:
        try:
            from importlib.metadata import PackageNotFoundError
            from importlib.metadata import version as dist_version

            version = dist_version("transformers")
        except PackageNotFoundError:
            raise UnsupportedTransformers(f"kvcache.hf needs transformers{SUPPORTED}, which is not installed: "
                                          f"pip install 'transformers{SUPPORTED}'") from None
    got = parse_version(version)[:2]
    if not MIN_VERSION <= got < MAX_VERSION:
        raise UnsupportedTransformers(f"kvcache.hf supports transformers{SUPPORTED}, found {version}: "
                                      f"pip install 'transformers{SUPPORTED}'")
    return version
