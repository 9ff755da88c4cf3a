"""The rows of ``kvcache bench context --long`` and what is derived from them: bytes read per
decode step, achieved GB/s and its share of the measured read bandwidth, prefill seconds per 1k
tokens and throughput relative to the 512-token prompt; the markdown tables.

Free of torch and of the engine: the numbers are plain arithmetic on what the children measured.

- bytes per token (a decode step): the weights one step reads plus the KV it attends to,
  ``weights + kv_per_context_token * (context + new / 2)`` (rows.step_bytes: the context grows by
  one each step, so the average step sees ``new / 2`` more than the depth);
- GB/s: bytes per token x tok/s; share of the wall: GB/s / the read bandwidth measured in the run;
- prefill: the median seconds of the whole prompt; s per 1k: seconds x 1000 / tokens; vs 512:
  tok/s over the same system's (and KV's) 512-token prompt tok/s.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from kvcache.bench.rows import step_bytes

REFERENCE = 512  # prompt tokens every prefill is compared with


@dataclass
class DepthRow:
    system: str  # kvcache | llama.cpp
    kv: str  # kvcache's --kv spec, or llama.cpp's KV type (f16, q8_0, q4_0)
    test: str  # decode (after ``context`` tokens) | prefill (a prompt of ``context`` tokens)
    context: int
    samples: list[float] = field(default_factory=list)  # decode: new tokens/s; prefill: seconds
    kv_bytes_per_token: float = 0.0  # decode: KV bytes per context token (kvcache: its accounting)
    weight_bytes: int = 0  # decode: bytes of weights one step reads
    new: int = 0  # decode: new tokens per run
    stages: int = 0  # prefill: forwards the prompt went in (kvcache grows in stages)
    note: str = ""  # why there are no samples

    def summary(self, read_gb_s: float | None) -> dict[str, object]:
        out: dict[str, object] = {"system": self.system, "kv": self.kv, "test": self.test, "context": self.context,
                                  "samples": list(self.samples), "note": self.note}
        med = statistics.median(self.samples) if self.samples else None
        if self.test == "decode":
            nbytes = step_bytes(self.weight_bytes, self.kv_bytes_per_token, self.context, self.new)
            gb_s = nbytes * med / 1e9 if med is not None else None
            out.update(tok_s=med, tok_s_min=min(self.samples, default=None), tok_s_max=max(self.samples, default=None),
                       new_tokens=self.new, weight_bytes=self.weight_bytes, kv_bytes_per_token=self.kv_bytes_per_token,
                       kv_bytes_read=nbytes - self.weight_bytes, bytes_per_token=nbytes, gb_s=gb_s,
                       wall_share=gb_s / read_gb_s if gb_s is not None and read_gb_s else None)
        else:
            out.update(seconds=med, tok_s=self.context / med if med else None,
                       s_per_1k=1000 * med / self.context if med else None, stages=self.stages)
        return out


def summarize(rows: list[DepthRow], read_gb_s: float | None) -> list[dict[str, object]]:
    """Every row's summary, prefill rows with ``vs_512`` (tok/s over the same system and KV's
    512-token prompt; None without one)."""
    out = [r.summary(read_gb_s) for r in rows]
    ref = {(r["system"], r["kv"]): r["tok_s"] for r in out if r["test"] == "prefill" and r["context"] == REFERENCE}
    for r in out:
        if r["test"] == "prefill":
            base, tok = ref.get((r["system"], r["kv"])), r["tok_s"]
            r["vs_512"] = tok / base if tok and base else None  # type: ignore[operator]
    return out


def _n(x: object, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _mb(x: object) -> str:
    return "-" if not x else f"{float(x) / 1e6:,.1f} MB"  # type: ignore[arg-type]


def _mib(x: object) -> str:
    return "-" if not x else f"{float(x) / 2**20:,.1f} MiB"  # type: ignore[arg-type]


def _of_test(results: list[dict[str, object]], test: str) -> list[dict[str, object]]:
    """The rows of one test, by context, kvcache's first."""
    rows = [r for r in results if r["test"] == test]
    return sorted(rows, key=lambda r: (r["context"], r["system"] != "kvcache"))  # type: ignore[arg-type,return-value]


def _skipped(r: dict[str, object], blanks: int) -> str:
    """A table line for a row that was skipped, with its reason and ``blanks`` empty cells after it."""
    return f"| {r['context']} | {r['system']} | {r['kv']} | skipped: {r['note']} |" + " |" * blanks


def decode_table(results: list[dict[str, object]]) -> list[str]:
    lines = ["| context | system | kv | tok/s (min-max) | KV B/context token | bytes read/token | GB/s | share of wall |",
             "|---|---|---|---|---|---|---|---|"]
    for r in _of_test(results, "decode"):
        if r["tok_s"] is None:
            lines.append(_skipped(r, 4))
            continue
        share = r["wall_share"]
        lines.append(f"| {r['context']} | {r['system']} | {r['kv']} | {_n(r['tok_s'], '.2f')} "
                     f"({_n(r['tok_s_min'], '.2f')}-{_n(r['tok_s_max'], '.2f')}) | {_n(r['kv_bytes_per_token'], ',.0f')} "
                     f"| {_mb(r['bytes_per_token'])} | {_n(r['gb_s'], '.2f')} | "
                     f"{'-' if share is None else f'{100 * share:.0f}%'} |")  # type: ignore[operator]
    return lines


def prefill_table(results: list[dict[str, object]]) -> list[str]:
    lines = ["| prompt | system | kv | seconds | tok/s | s per 1k tokens | vs 512 |", "|---|---|---|---|---|---|---|"]
    for r in _of_test(results, "prefill"):
        if r["seconds"] is None:
            lines.append(_skipped(r, 3))
            continue
        vs = r["vs_512"]
        lines.append(f"| {r['context']} | {r['system']} | {r['kv']} | {_n(r['seconds'], '.2f')} | {_n(r['tok_s'], '.0f')} "
                     f"| {_n(r['s_per_1k'], '.2f')} | {'-' if vs is None else f'{vs:.2f}x'} |")
    return lines


def memory_table(memory: list[dict[str, object]]) -> list[str]:
    lines = ["| kv | context | KV held | KV allocated | `kvcache size` | RSS loaded | RSS at depth | RSS peak |",
             "|---|---|---|---|---|---|---|---|"]
    for m in memory:
        if m.get("note"):
            lines.append(f"| {m['kv']} | {m['context']} | skipped: {m['note']} | | | | | |")
            continue
        lines.append(f"| {m['kv']} | {m['context']} | {_mib(m['kv_used'])} | {_mib(m['kv_allocated'])} | "
                     f"{_mib(m['size_bytes'])} | {_mib(m['rss_loaded'])} | {_mib(m['rss_after'])} | "
                     f"{_mib(m['rss_peak'])} |")
    return lines


def print_report(meta: dict[str, object], results: list[dict[str, object]], memory: list[dict[str, object]]) -> None:
    bw = meta.get("read_gb_s")
    print(f"\nlong context: {meta['model']} ({meta['weights']} weights), batch 1, {meta['threads']} threads, "
          f"{meta['new_tokens']} new tokens per decode, median of {meta['repeats']}")
    print(f"host: {meta.get('host')}")
    load = meta.get("load_avg_1min")
    if isinstance(load, dict):
        print(f"load average (1 min) before the run {load['before']:.2f}, after {load['after']:.2f} (this run's own "
              f"{meta['threads']} threads included after; more than that means other processes shared the cores)")
    print(f"memory read bandwidth measured in this run: {_n(bw)} GB/s (a streaming read of 1 GiB, the best of "
          "the probes before and after); share of wall: a decode's GB/s as a share of it")
    print("kvcache reaches each depth by growing one sequence per spec in stages (one prefill of the largest "
          "context); llama-bench prefills every depth itself (-d N -fa 1 -ctk X -ctv X)")
    print("\ndecode after N tokens of context\n")
    print("\n".join(decode_table(results)))
    print("\nprefill of an N-token prompt (kvcache: the sum of its stages; llama.cpp: llama-bench -p N -fa 1, "
          "f16 KV)\n")
    print("\n".join(prefill_table(results)))
    if memory:
        print("\nmemory at the largest context (kvcache, each spec in its own process)\n")
        print("\n".join(memory_table(memory)))
    print("\nbytes read/token: the weights a step reads + KV B/context token x (N + new/2); KV B/context token: "
          "kvcache's own accounting (quantized: scales and the fp32 tail included), llama.cpp's from its KV "
          "type's block size; RSS at depth: resident after the last decode with the sequence held, freed heap "
          "given back; `kvcache size`: its KV bytes for the same tokens")
