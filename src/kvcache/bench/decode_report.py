"""``bench decode``'s tables: decode, prefill and long-context rows, and each kvcache row's ratio
against the peers measured in the same run on the weights it is paired with."""

from __future__ import annotations

PEERS = ("llama.cpp", "transformers")


def _f(x: object, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def ratios(results: list[dict[str, object]]) -> list[dict[str, object]]:
    """kvcache tok/s over each peer's on the same test, length and paired weights (transformers:
    its fastest cache). ``file`` pairs with llama.cpp's GGUF as shipped, ``q8`` with its Q8_0,
    ``fp32`` with its F32 and with transformers."""
    out = []
    for r in results:
        if r["system"] != "kvcache" or not r["tok_s"]:
            continue
        for peer in PEERS:
            same = [p for p in results if p["system"] == peer and p["tok_s"] and p["test"] == r["test"]
                    and p["tokens"] == r["tokens"] and p["pair"] == r["pair"]]
            if not same:
                continue
            best = max(same, key=lambda p: p["tok_s"])  # type: ignore[arg-type,return-value]
            out.append({"test": r["test"], "tokens": r["tokens"], "kvcache": f"{r['weights']} {r['cache']}",
                        "peer": f"{peer} {best['weights']} {best['cache']}",
                        "ratio": r["tok_s"] / best["tok_s"]})  # type: ignore[operator]
    return out


def _head(title: str, cols: str) -> None:
    print(f"\n{title}")
    print(f"{'system':<13} {'weights':<18} {'cache':<13} " + cols)


def _line(r: dict[str, object], cols: str) -> None:
    print(f"{r['system']:<13} {str(r['weights']):<18} {str(r['cache']):<13} " + cols)


def print_tables(results: list[dict[str, object]], meta: dict[str, object]) -> list[dict[str, object]]:
    """Print every table and the ratios; returns the ratios."""
    rep = meta["repeats"]
    print(f"\ndecode: {meta['model']}, chat prompt of {meta['prompt_tokens']} tokens, {meta['new_tokens']} new "
          f"tokens, batch 1, {meta['threads']} threads, median of {rep} (min-max)")
    print(f"host: {meta['host']}")
    _head("decode after the prompt", f"{'tok/s':>7} {'min-max':>13} {'TTFT ms':>8} {'GB/s':>6}")
    for r in (x for x in results if x["test"] == "decode"):
        if r["tok_s"] is None:
            _line(r, str(r["note"]))
            continue
        mm = f"{_f(r['tok_s_min'])}-{_f(r['tok_s_max'])}"
        _line(r, f"{r['tok_s']:>7.1f} {mm:>13} {_f(r['ttft_ms'], '.0f'):>8} {_f(r['gb_s'], '.2f'):>6}")
    pre = [x for x in results if x["test"] == "prefill"]
    if pre:
        _head("prefill: prompt tokens/s into an empty cache", f"{'tokens':>6} {'tok/s':>8} {'min-max':>15} "
              f"{'seconds':>8}")
        for n in sorted({int(x["tokens"]) for x in pre}):  # type: ignore[call-overload]
            for r in (x for x in pre if x["tokens"] == n):
                if r["tok_s"] is None:
                    _line(r, f"{n:>6} {r['note']}")
                    continue
                mm = f"{_f(r['tok_s_min'], '.0f')}-{_f(r['tok_s_max'], '.0f')}"
                _line(r, f"{n:>6} {r['tok_s']:>8.0f} {mm:>15} {_f(r['seconds'], '.2f'):>8}")
    deep = [x for x in results if x["test"] == "depth"]
    if deep:
        _head(f"decode after {deep[0]['tokens']} tokens of context ({meta['depth_new_tokens']} new tokens; "
              "8-bit KV: kvcache int8, llama.cpp q8_0)", f"{'tok/s':>7} {'min-max':>13} {'prefill s':>9} {'GB/s':>6}")
        for r in deep:
            if r["tok_s"] is None:
                _line(r, str(r["note"]))
                continue
            mm = f"{_f(r['tok_s_min'])}-{_f(r['tok_s_max'])}"
            pf = None if r["ttft_ms"] is None else r["ttft_ms"] / 1000  # type: ignore[operator]
            _line(r, f"{r['tok_s']:>7.1f} {mm:>13} {_f(pf, '.2f'):>9} {_f(r['gb_s'], '.2f'):>6}")
    rat = ratios(results)
    if rat:
        print("\nkvcache / peer, tok/s in this run (each kvcache weights mode against the peer on the same weights)")
        for x in rat:
            what = {"decode": "decode", "prefill": f"prefill {x['tokens']}", "depth": f"decode @{x['tokens']}"}
            print(f"  {what[str(x['test'])]:<14} kvcache {str(x['kvcache']):<26} vs {str(x['peer']):<38} "
                  f"{x['ratio']:.2f}x")
    print("\nGB/s: (weights + KV read per step) x tok/s. Pairs: kvcache file (the GGUF's own types) with llama.cpp\n"
          "on the file as shipped; q8 with llama.cpp's Q8_0 conversion; fp32 with its F32 and with transformers.")
    return rat
