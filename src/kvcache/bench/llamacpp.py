"""llama.cpp as a decode peer, through llama-cpp-python when it is installed (an optional extra:
``pip install 'kvcache[llamacpp]'`` compiles it for several minutes).

It runs the bundled GGUF as it is (quantized weights) and two conversions made with llama.cpp's own
quantize API: F32 (the same fp32 weights kvcache computes with) and Q8_0. Same prompt token ids,
same number of new tokens (greedy, EOS never checked), same thread count. llama.cpp keeps its own
KV cache (fp16).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvcache.bench.decode import Row

FTYPES = {"F32": 0, "Q8_0": 7}  # llama_ftype values


def missing() -> str | None:
    """None when llama-cpp-python imports, else why not (for the report)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # ImportError, or a broken native library
        return f"llama-cpp-python not installed ({type(e).__name__}): skipped"
    return None


def convert(src: Path, ftype: str, out_dir: Path) -> Path:
    """``src`` re-quantized to ``ftype`` by llama.cpp (cached beside other conversions)."""
    import llama_cpp

    out = out_dir / f"{src.stem}.{ftype}.gguf"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.allow_requantize = True
    params.nthread = 0
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not convert {src.name} to {ftype} (code {rc})")
    tmp.rename(out)
    return out


def bench(models: dict[str, Path], ids: list[int], new: int, repeats: int, threads: int,
          progress: Callable[[], None] | None = None) -> list[Row]:
    from llama_cpp import Llama

    rows = []
    for label, path in models.items():
        row = Row("llama.cpp", label)
        try:
            llm = Llama(model_path=str(path), n_ctx=len(ids) + new + 16, n_threads=threads, n_threads_batch=threads,
                        n_batch=512, verbose=False)
        except Exception as e:
            row.note = f"failed to load: {type(e).__name__}: {str(e)[:100]}"
            rows.append(row)
            continue
        _run(llm, ids[:8], 4)  # warm-up
        for _ in range(repeats):
            ttft, rest, made = _run(llm, ids, new)
            row.ttft_s.append(ttft)
            row.tok_s.append((made - 1) / rest if rest > 0 else 0.0)
            if progress:
                progress()
        rows.append(row)
        del llm
    return rows


def _run(llm, ids: list[int], new: int) -> tuple[float, float, int]:
    """(time to first token, time for the rest, tokens made) of one greedy generation."""
    llm.reset()
    t0 = time.perf_counter()
    t_first, made = 0.0, 0
    for _ in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
        made += 1
        if made == 1:
            t_first = time.perf_counter()
        if made >= new:
            break
    return t_first - t0, time.perf_counter() - t_first, made
