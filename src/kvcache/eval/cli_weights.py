"""``kvcache eval --compare-weights file,q8,q4``: what quantized weights cost in fidelity.

Each mode's model reads the same chunks of the text by llama.cpp's perplexity rule (eval/weights.py)
beside the same model with fp32 weights; the table gives perplexity, KL and top-1 agreement against
fp32, and the bytes the weights hold. With ``--llama-cpp-bin DIR`` llama.cpp's own
``llama-perplexity`` reads the same text with the same context and chunks (a child process; a
crash is a note, not a failure).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcache.cliargs import WEIGHTS
from kvcache.errors import InvalidParams
from kvcache.peers.llama_cpp import llama_perplexity


def cmd_eval_weights(args: argparse.Namespace, text: str, source: str) -> int:
    from tqdm import tqdm

    from kvcache.engine.llm import LLM
    from kvcache.eval.weights import chunks, compare_weights

    modes = [m.strip() for m in args.compare_weights.split(",") if m.strip()]
    bad = [m for m in modes if m not in WEIGHTS]
    if not modes or bad:
        raise InvalidParams(f"--compare-weights takes modes from {', '.join(WEIGHTS)}, got {args.compare_weights!r}")
    reference = LLM(args.model, threads=args.threads, weights="fp32", prefix=False)
    probe = reference.tokenizer.encode("a")
    bos = reference.tokenizer.bos_token_id if probe and probe[0] == reference.tokenizer.bos_token_id else None
    parts = chunks(reference.encode(text), args.ppl_ctx, args.ppl_chunks, bos)
    bar = tqdm(total=len(parts) * len(modes), desc="eval weights", unit="chunk", file=sys.stderr)
    rows = []
    for m in modes:
        llm = reference if m == "fp32" else LLM(args.model, threads=args.threads, weights=m, prefix=False)
        rows.append(compare_weights(llm, reference, parts, bar.update).as_dict())
    bar.close()
    peer, note = None, ""
    if args.llama_cpp_bin:
        import torch

        src = str(reference.model_path)
        if not src.endswith(".gguf"):
            note = "the model is not a GGUF file: llama.cpp skipped"
        else:
            peer, note = llama_perplexity(args.llama_cpp_bin, src, text, args.ppl_ctx, len(parts),
                                          torch.get_num_threads())
    n = rows[0]["tokens"]
    print(f"\neval weights: {reference.model_name}, {len(parts)} chunks of {args.ppl_ctx} tokens of {source} "
          f"(llama.cpp's perplexity rule: {n} positions scored); fp32 weights perplexity {rows[0]['ppl_ref']:.4f}")
    print(f"{'weights':<8} {'held as':<24} {'MiB':>7} {'ppl':>9} {'vs fp32':>8} {'KL nats':>9} {'top-1':>7}"
          + (f" {'vs llama.cpp':>12}" if peer else ""))
    for r in rows:
        kinds = "+".join(k for k in r["weight_kinds"] if r["weight_kinds"][k] > 1 << 20) or "fp32"
        line = (f"{r['weights']:<8} {kinds:<24} {r['weight_bytes'] / 2**20:>7.1f} {r['ppl']:>9.4f} "
                f"{r['ppl'] / r['ppl_ref'] - 1:>+7.2%} {r['kl']:>9.5f} {r['agreement']:>6.1%}")
        print(line + (f" {r['ppl'] / peer - 1:>+11.2%}" if peer else ""))
    if peer:
        print(f"llama.cpp llama-perplexity on {Path(str(reference.model_path)).name}: {peer:.4f}")
    elif note:
        print(f"llama.cpp: {note}")
    if args.json:
        meta = {"model": reference.model_name, "text": source, "ctx": args.ppl_ctx, "chunks": len(parts),
                "llama_cpp_ppl": peer, "llama_cpp_note": note}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    return 0
