"""Save one sequence's cache to a file and load it back (llama.cpp's slot save/restore, MLX-LM's
prompt-cache files).

The file is safetensors: per layer the sequence's stored pages (in their stored form: fp32/fp16/
bf16 K/V, or quantized codes with their scales) and, for quantized encodings, the fp32 tail;
its metadata holds the format version, the model fingerprint, the cache settings that shape the
data, the token ids and each group's page table shape (which pages a window already dropped),
and a BLAKE2b digest over all of that and every tensor's name, dtype, shape and bytes: a file
whose bits rotted, or that was edited, is refused on load. It is created 0600 under a temporary
name beside the target and renamed, so a crash never leaves half a file under the target name.
Loading into another model, encoding or layout is a clear error.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from kvcache.cache import quant
from kvcache.cache.paged import PagedKVCache
from kvcache.cache.pool import PagePool
from kvcache.cache.sequence import HOLE, SeqKV
from kvcache.errors import KVCacheError

FORMAT = "kvcache-sequence/2"  # /1 files carry no digest and are refused
_SHAPING = ("encoding", "page_size", "group_size", "residual", "window", "sinks")


def _layout(cache: PagedKVCache) -> dict[str, object]:
    c, m = cache.config, cache.model
    out: dict[str, object] = {k: getattr(c, k) for k in _SHAPING}
    out["page_size"] = cache.page_size
    if c.quantized:  # how the scales and minimums are stored
        out["scales"] = str(quant.SCALE_DTYPE).removeprefix("torch.")
    out.update(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
               groups=[list(g.layers) for g in cache.groups])
    # a press's files hold the slots it kept and which tokens they hold (None: every token)
    out["press"] = [c.press, c.ratio, c.keep, c.protect] if c.press is not None else None
    if c.rotate:  # codes of Hadamard-rotated K/V (cache/rotation.py); files of unrotated caches unchanged
        out["rotate"] = "hadamard"
    return out


def pages_by_name(cache: PagedKVCache, group: int, pages: list[int],
                  tails: list[torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Copies of some pages of a group, per layer in their stored form (``layer{i}.kv``
    [2, Hkv, n, page_size, D], or each quantized part), and its fp32 tails (``layer{i}.tail``)."""
    out: dict[str, torch.Tensor] = {}
    pool = cache.pools[group]
    for j, layer in enumerate(cache.groups[group].layers):
        if pages:
            state = pool.page_state(j, pages)
            if isinstance(state, torch.Tensor):
                out[f"layer{layer}.kv"] = state.contiguous()
            else:
                out.update({f"layer{layer}.{n}": t.contiguous() for n, t in state.items()})
        if tails is not None:
            out[f"layer{layer}.tail"] = tails[j].contiguous()
    return out


def digest(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """BLAKE2b over the metadata (the digest field left out) and every tensor's name, dtype,
    shape and bytes, in name order."""
    h = hashlib.blake2b(digest_size=32, person=b"kvcache-seq")

    def put(data: bytes | memoryview) -> None:
        h.update(struct.pack("<Q", memoryview(data).nbytes))
        h.update(data)

    put(json.dumps({k: v for k, v in meta.items() if k != "digest"}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        put(f"{name}:{str(t.dtype)}:{list(t.shape)}".encode())
        put(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
    return h.hexdigest()


def save_sequence(cache: PagedKVCache, seq: SeqKV, tokens: list[int], path: str | Path, fingerprint: str,
                  extra: dict[str, str] | None = None) -> int:
    """Write ``seq``'s K/V and ``tokens`` (its token ids, len == seq.length) to ``path``, with
    ``extra`` metadata (a chat session's messages); returns the bytes written."""
    from safetensors.torch import save_file

    if len(tokens) != seq.length:
        raise ValueError(f"{len(tokens)} token ids for a sequence of {seq.length} tokens")
    tensors: dict[str, torch.Tensor] = {}
    for g in cache.groups:
        live = [p for p in seq.tables[g.index] if p != HOLE]
        tensors.update(pages_by_name(cache, g.index, live, seq.tails[g.index]))
        if seq.press is not None:
            tensors[f"group{g.index}.positions"] = seq.press.pos[g.index][:, :, : seq.press.n[g.index]].contiguous()
    press = {} if seq.press is None else {"dropped": json.dumps(seq.dropped), "since": str(seq.press.since),
                                          "points": json.dumps(seq.press.points)}
    meta = {**press, "format": FORMAT, "fingerprint": fingerprint, "layout": json.dumps(_layout(cache)),
            "tokens": json.dumps(tokens), "length": str(seq.length),
            "holes": json.dumps([[i for i, p in enumerate(t) if p == HOLE] for t in seq.tables]),
            "table_lens": json.dumps([len(t) for t in seq.tables]), **(extra or {})}
    meta["digest"] = digest(tensors, meta)
    path = Path(path)
    if not path.parent.is_dir():
        raise KVCacheError(f"cannot write cache file {path}: folder {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except Exception as e:  # OSError, or safetensors' own error wrapping one
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise KVCacheError(f"cannot write cache file {path}: {reason}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def read_meta(path: str | Path) -> dict[str, str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except FileNotFoundError:
        raise KVCacheError(f"cache file {path} does not exist") from None
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise KVCacheError(f"cache file {path} is corrupt or truncated ({type(e).__name__})") from None
    if meta.get("format") == "kvcache-sequence/1":
        raise KVCacheError(f"cache file {path} was written by an older kvcache and carries no digest; "
                           "make it again")
    if meta.get("format") != FORMAT:
        raise KVCacheError(f"{path} is not a kvcache sequence file (format {meta.get('format')!r})")
    return meta


def load_sequence(cache: PagedKVCache, path: str | Path, fingerprint: str) -> tuple[SeqKV, list[int]]:
    """A new sequence in ``cache`` holding the saved K/V; returns it and its token ids."""
    from safetensors.torch import load_file

    meta = read_meta(path)
    if meta["fingerprint"] != fingerprint:
        raise KVCacheError(f"cache file {path} was made with another model (fingerprint "
                           f"{meta['fingerprint'][:12]}, this model {fingerprint[:12]})")
    saved, mine = json.loads(meta["layout"]), _layout(cache)
    diff = [f"{k}={saved.get(k)!r} (here {mine.get(k)!r})" for k in sorted(mine.keys() | saved.keys())
            if saved.get(k) != mine.get(k)]  # a key on one side only (rotate) differs too
    if diff:
        raise KVCacheError(f"cache file {path} does not fit this cache: {', '.join(diff)}")
    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise KVCacheError(f"cache file {path} is corrupt or truncated ({type(e).__name__})") from None
    if digest(tensors, meta) != meta.get("digest"):
        raise KVCacheError(f"cache file {path} is corrupt: its content does not match its digest")
    tokens = json.loads(meta["tokens"])
    holes, lens = json.loads(meta["holes"]), json.loads(meta["table_lens"])
    seq = cache.new_sequence()
    try:
        for g in cache.groups:
            hole = set(holes[g.index])
            n_live = lens[g.index] - len(hole)
            pages = cache.pages.take(g.index, n_live) if n_live else []
            it = iter(pages)
            seq.tables[g.index] = [HOLE if i in hole else next(it) for i in range(lens[g.index])]
            pool = cache.pools[g.index]
            for j, layer in enumerate(g.layers):
                if pages:
                    if isinstance(pool, PagePool):
                        pool.load_pages(j, pages, tensors[f"layer{layer}.kv"])
                    else:
                        pool.load_pages(j, pages, {n: tensors[f"layer{layer}.{n}"] for n in pool.parts[j]})
                if seq.tails[g.index] is not None:
                    seq.tails[g.index][j] = tensors[f"layer{layer}.tail"].clone()  # type: ignore[index]
        seq.length = int(meta["length"])
        if seq.press is not None:
            seq.dropped = [int(x) for x in json.loads(meta["dropped"])]
            for g in cache.groups:
                pos = tensors[f"group{g.index}.positions"]
                seq.press.append(g.index, 0, pos.shape[2])
                seq.press.pos[g.index][:, :, : pos.shape[2]] = pos
            seq.press.since, seq.press.points = int(meta["since"]), json.loads(meta["points"])
            seq.press.observing = False
        if len(tokens) != seq.length:
            raise KVCacheError(f"cache file {path} holds {len(tokens)} token ids for {seq.length} tokens")
        cache.check_integrity()
    except (KeyError, RuntimeError, ValueError, AssertionError) as e:
        cache.free(seq)
        raise KVCacheError(f"cache file {path} is inconsistent: {e}") from None
    except KVCacheError:
        cache.free(seq)
        raise
    return seq, tokens
