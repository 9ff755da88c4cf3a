"""Prometheus text exposition of the server's counters, gauges and histograms (no dependency).

Locking: one lock; request handlers (event loop) and the engine thread both record.
"""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, x)] += 1
        self.total += x
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out += [f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {
            "requests_total": 0, "requests_failed_total": 0, "requests_aborted_total": 0,
            "prompt_tokens_total": 0, "generation_tokens_total": 0, "prefix_cached_tokens_total": 0,
        }
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + value

    def finished(self, prompt_tokens: int, generated: int, cached: int, ttft: float | None,
                 tpot: float | None) -> None:
        with self._lock:
            self.counters["requests_total"] += 1
            self.counters["prompt_tokens_total"] += prompt_tokens
            self.counters["generation_tokens_total"] += generated
            self.counters["prefix_cached_tokens_total"] += cached
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)

    def render(self, gauges: dict[str, float]) -> str:
        """The exposition text; ``gauges`` are read by the caller from the engine."""
        p = "kvcache_"
        lines: list[str] = []
        with self._lock:
            for name, v in self.counters.items():
                lines += [f"# TYPE {p}{name} counter", f"{p}{name} {v:g}"]
            for name, h, doc in (("time_to_first_token_seconds", self.ttft, "arrival to first token"),
                                 ("time_per_output_token_seconds", self.tpot, "after the first token")):
                lines += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} histogram", *h.lines(p + name)]
        for name, v in gauges.items():
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# TYPE {p}{name} {kind}", f"{p}{name} {v:g}"]
        return "\n".join(lines) + "\n"
