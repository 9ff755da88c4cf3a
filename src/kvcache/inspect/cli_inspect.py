"""``kvcache inspect PROMPT``: the cache's anatomy per layer, Q/K/V and attention per head, and
the prefix-reuse check."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvcache.cliargs import add_weights_arg
from kvcache.errors import InvalidParams


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidParams(f"--{what} takes comma-separated integers, got {text!r}") from None


def add_inspect_parser(sub: argparse._SubParsersAction) -> None:
    i = sub.add_parser("inspect", help="look inside the KV cache: shapes, bytes, Q/K/V, attention, prefix reuse")
    i.add_argument("prompt", help="prompt text")
    i.add_argument("--model", "-m", default=None, help="model (default: bundled SmolLM2-135M-Instruct)")
    i.add_argument("--kv", default="dynamic", help="cache spec whose anatomy to show (default dynamic)")
    add_weights_arg(i)
    i.add_argument("--layers", default="0,-1", help="layers to capture, comma-separated; -1 is the last (default 0,-1)")
    i.add_argument("--heads", default="0", help="query heads to show attention for (default 0)")
    i.add_argument("--reuse", default=None, metavar="PROMPT2",
                   help="a second prompt sharing a prefix: check that attention over the reused K/V equals recomputation")
    i.add_argument("--save", default=None, metavar="FILE",
                   help="write the captured q, k, v, attention weights to a safetensors file")
    i.add_argument("--png", default=None, metavar="DIR",
                   help="write PNG heatmaps (attention per layer and head, K and V per layer) to this folder")
    i.add_argument("--json", default=None, help="write the report to this JSON file")
    i.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    from kvcache.cache.config import parse_kv_spec
    from kvcache.engine.llm import LLM
    from kvcache.engine.runner import ModelRunner
    from kvcache.inspect.capture import attention_weights, capture, check_indices, gqa_groups, prefix_reuse

    cfg = parse_kv_spec(args.kv)
    if not cfg.uses_cache:
        raise InvalidParams("--kv none keeps no cache to inspect; choose a caching strategy")
    layers, heads = _ints(args.layers, "layers"), _ints(args.heads, "heads")
    llm = LLM(args.model, kv="dynamic", weights=args.weights)
    model, mc = llm.model, llm.config
    layers = [x + mc.num_layers if x < 0 else x for x in layers]
    check_indices(model, layers, heads)
    ids = llm.encode(args.prompt)
    if not ids:
        raise InvalidParams("the prompt is empty")
    runner = ModelRunner(model, cfg)
    seq = runner.new_sequence()
    runner.step([seq], [ids])
    stats = runner.stats()
    runner.free(seq)
    report: dict[str, object] = {"model": llm.model_name, "tokens": len(ids), "kv": stats.strategy}
    print(f"{llm.model_name}: {mc.num_layers} layers, {mc.num_heads} query heads sharing {mc.num_kv_heads} KV heads "
          f"(head_dim {mc.head_dim}); prompt {len(ids)} tokens; kv={stats.strategy}")
    print("GQA: " + "  ".join(f"KV head {h} <- query heads {g}" for h, g in enumerate(gqa_groups(model))))
    print(f"{'layer':>5} {'K and V shape':>22} {'window':>7} {'encoding':>9} {'pages':>6} {'B/token':>8} {'bytes used':>11}")
    rows = []
    for s in stats.per_layer:
        kept = len(ids) if s.window is None else min(len(ids), s.window)
        shape = f"[1, {mc.num_kv_heads}, {kept}, {mc.head_dim}]"
        rows.append({"layer": s.layer, "shape": [1, mc.num_kv_heads, kept, mc.head_dim], "window": s.window,
                     "encoding": stats.encoding, "pages": s.pages_used, "bytes_per_token": s.bytes_per_token,
                     "bytes_used": s.bytes_used})
        print(f"{s.layer:>5} {shape:>22} {str(s.window or 'full'):>7} {stats.encoding:>9} {s.pages_used:>6} "
              f"{s.bytes_per_token:>8.0f} {s.bytes_used:>11,}")
    report["layers"] = rows
    seen = capture(model, ids, layers)
    labels = [llm.tokenizer.decode([t]) for t in ids]
    tensors = {}
    attn: dict[str, object] = {}
    for layer in layers:
        c = seen[layer]
        print(f"\nlayer {layer}: q {list(c.q.shape)}, k {list(c.k.shape)}, v {list(c.v.shape)} (tokens, heads, head_dim)")
        tensors.update({f"layer{layer}.q": c.q, f"layer{layer}.k": c.k, f"layer{layer}.v": c.v})
        for h in heads:
            w = attention_weights(model, c, layer, h)
            tensors[f"layer{layer}.head{h}.attention"] = w
            top = w[-1].topk(min(5, len(ids)))
            pairs = [(labels[int(j)], round(float(p), 3)) for p, j in zip(top.values, top.indices)]
            attn[f"{layer}.{h}"] = pairs
            kv_head = h // (mc.num_heads // mc.num_kv_heads)
            print(f"  head {h} (KV head {kv_head}): last token attends most to " +
                  ", ".join(f"{t!r} {p:.3f}" for t, p in pairs))
    report["attention_top"] = attn
    if args.png:
        from kvcache.inspect.plots import heatmap

        out = Path(args.png)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidParams(f"cannot write to {out}: {e.strerror or e}") from None
        files = []
        for layer in layers:
            c = seen[layer]
            for h in heads:
                w = tensors[f"layer{layer}.head{h}.attention"]
                files.append(heatmap(w, out / f"attention-layer{layer}-head{h}.png",
                                     f"layer {layer}, head {h}: attention", labels, labels, "key", "query"))
            for name, t in (("k", c.k), ("v", c.v)):
                flat = t.transpose(0, 1).reshape(-1, t.shape[-1])  # [Hkv * N, D]: KV heads stacked
                files.append(heatmap(flat, out / f"{name}-layer{layer}.png",
                                     f"layer {layer}: {name.upper()} (KV heads stacked)",
                                     labels * t.shape[1], None, "channel", "token"))
        report["png"] = [str(f) for f in files]
        print(f"\nwrote {len(files)} PNG files to {out}")
    if args.reuse is not None:
        second = llm.encode(args.reuse)
        check = prefix_reuse(ModelRunner(model, cfg), ids, second)
        report["reuse"] = check.__dict__
        print(f"\nprefix reuse: {check.prefix} of {check.total} tokens shared; attention outputs with the reused "
              f"K/V vs recomputed: max |diff| {check.max_diff:.2e}; K/V projections saved {check.kv_saved:.0%}, "
              f"attention scores saved {check.attention_saved:.0%}")
    if args.save:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, args.save, metadata={"tokens": json.dumps(ids)})
        print(f"\nsaved {len(tensors)} tensors to {args.save}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
