"""``kvcache env`` and ``kvcache --version``: the software and the host a run happens on.

The host line names the CPU, which of the SIMD features kvcache's kernels care about it has, and
the kernel variant this process loads (``kvcache.kernels.variant()``); benchmark reports print the
same line, so a figure always says where it was taken.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcache.engine.llm import LLM

FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def version() -> str:
    try:
        return metadata.version("kvcache")
    except metadata.PackageNotFoundError:
        return "unknown"


def cpu() -> tuple[str, list[str]]:
    """(CPU model name, the FEATURES it has, in FEATURES' order)."""
    from kvcache.kernels.build import cpu_info

    name, flags = cpu_info()
    return name, [f for f in FEATURES if f in flags]


def kernel_variant() -> str:
    """The kernel variant this process loads, ``off`` when KVCACHE_NO_KERNELS=1, or why none can be."""
    if os.environ.get("KVCACHE_NO_KERNELS") == "1":
        return "off (KVCACHE_NO_KERNELS=1)"
    from kvcache import kernels

    try:
        return kernels.variant()
    except RuntimeError as e:  # KVCACHE_KERNEL_VARIANT names one this CPU cannot run
        return f"none ({e})"


def host_line() -> str:
    """``AMD EPYC · avx2 avx512f avx512_vnni · kernels avx512vnni``."""
    name, feats = cpu()
    return f"{name} · {' '.join(feats) or 'none of ' + '/'.join(FEATURES)} · kernels {kernel_variant()}"


def version_line() -> str:
    import torch

    return f"kvcache {version()} · Python {platform.python_version()} · torch {torch.__version__} · {host_line()}"


def _dist(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def report(check_build: bool = True) -> list[tuple[str, str]]:
    """(name, value) pairs for ``kvcache env``; ``check_build`` loads (building once) a kernel."""
    import torch

    name, feats = cpu()
    variant = kernel_variant()
    # whether the products of many rows use AMX tiles, and why (kernels/qamx.c's checks)
    amx = "not used (no kernels)" if variant.startswith(("off", "none")) else "not checked"
    if check_build and not variant.startswith(("off", "none")):
        import warnings

        from kvcache import kernels

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = kernels.qgemm() is not None
        if not built:
            variant += " (could not be built here: the torch path runs)"
        amx = (kernels.amx_status() if built else None) or "not used (no kernels)"
    from kvcache.paths import cache_home

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [("kvcache", version()), ("python", f"{platform.python_version()} ({sys.executable})"),
            ("torch", f"{torch.__version__} ({torch.get_num_threads()} threads)"), ("cpu", name),
            ("cores available", str(cores)),
            ("cpu features", " ".join(f"{f}{'' if f in feats else ' (no)'}" for f in FEATURES)),
            ("kernel variant", variant), ("amx", amx), ("transformers", _dist("transformers")),
            ("llama-cpp-python", _dist("llama_cpp_python")), ("cache home", str(cache_home())),
            ("os", platform.platform())]


DIGEST_PROMPT = "The quick brown fox jumps over the lazy dog. In one sentence, the reason is"
DIGEST_STEPS = 4


def logits_digest(llm: LLM, prompt: str, steps: int) -> tuple[str, list[int]]:
    """sha256 of the logits after ``prompt`` and after each of ``steps`` greedy tokens (the bytes
    of every forward's float32 logits, in order), and those tokens."""
    import hashlib

    r = llm.runner
    seq, h, tokens = r.new_sequence(), hashlib.sha256(), []
    try:
        logits = r.step([seq], [llm.encode(prompt)])[0]
        for i in range(steps + 1):
            h.update(logits.float().contiguous().numpy().tobytes())
            if i < steps:
                tokens.append(int(logits.argmax()))
                logits = r.step([seq], [[tokens[-1]]])[0]
    finally:
        r.free(seq)
    return h.hexdigest(), tokens


def forward_digest(model: str | None = None) -> str:
    """A short hash of a fixed forward: the logits of DIGEST_PROMPT and of DIGEST_STEPS greedy
    tokens after it, the bundled model with the file's weights unless ``model`` names another.
    Two machines whose kernels compute the same bits print the same digest."""
    from kvcache.engine.llm import LLM

    llm = LLM(model, kv="dynamic", prefix=False)
    try:
        digest, _ = logits_digest(llm, DIGEST_PROMPT, DIGEST_STEPS)
        return f"{digest[:16]} ({llm.model_name}, {llm.weights} weights, {DIGEST_STEPS + 1} forwards)"
    finally:
        llm.close()


def cmd_env(args: argparse.Namespace) -> int:
    rows = report()
    if args.digest:
        try:
            digest = forward_digest()
        except Exception as e:  # a missing model or a failed load: say so, the rest of the report stands
            digest = f"unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        rows.append(("forward digest", digest))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


class VersionAction(argparse.Action):
    """``--version``: the version and the host line, computed only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(version_line())
        parser.exit()


def add_env_parser(parser: argparse.ArgumentParser, sub: argparse._SubParsersAction) -> None:
    parser.add_argument("--version", action=VersionAction, help="print the version, Python, torch, the CPU and "
                                                                "the kernel variant, and exit")
    e = sub.add_parser("env", help="Python, torch, the CPU, its SIMD features, the kernel variant in use and a "
                                   "digest of a fixed forward (compare it across machines)")
    e.add_argument("--no-digest", dest="digest", action="store_false",
                   help="skip the forward digest (it loads the bundled model: a few seconds)")
    e.set_defaults(func=cmd_env)
