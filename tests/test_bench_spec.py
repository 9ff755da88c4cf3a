"""``kvcache bench spec``: a short run in this process writes its rows (speculation gives the text
without it, the ceiling keeps every proposal, a prediction that misses rests); transformers' child
process; llama-server on the same file; the suite's refusals."""

from __future__ import annotations

import json
import sys

from kvcache.bench import spec as sb
from kvcache.peers import speculation
from kvcache.cli import main


def test_a_short_run_writes_positive_rows_and_the_same_texts(tmp_path, capsys):
    path = tmp_path / "spec.json"
    assert main(["bench", "spec", "--new-tokens", "24", "--repeats", "1", "--weights", "file", "--peers", "",
                 "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(path.read_text())
    meta = data["meta"]
    assert meta["torch"] and meta["new_tokens"] == 24 and meta["lookup"] == sb.LOOKUP
    assert set(meta["prompt_tokens"]) == set(sb.WORKLOADS) and meta["prompt_tokens"]["document"] > 1000
    rows = {(r["workload"], r["method"]): r for r in data["results"]}
    assert set(rows) == {(w, m) for w, (_, ms) in sb.WORKLOADS.items() for m in ms}
    for r in rows.values():
        assert r["system"] == "kvcache" and r["pair"] == "file" and r["weights"].startswith("file")
        assert 1 < r["tokens"] <= 24 and r["text"]
        for key in ("plain_tok_s", "spec_tok_s", "speedup", "tokens_per_forward", "plain_ms_per_forward",
                    "spec_ms_per_forward", "forward_cost"):
            assert r[key] > 0, key
        assert r["plain_forwards"] == r["tokens"] - 1  # one token a forward without speculation
        assert r["forwards"] >= r["verifying_forwards"] >= 0 and r["proposed"] >= r["accepted"] >= 0
        if r["workload"] != "free text":  # where little matches, the lookup may propose nothing in 24 tokens
            assert r["verifying_forwards"] > 0
        assert r["tokens_per_forward"] == (r["tokens"] - 1) / r["forwards"]
        assert r["runs"] == 2 and r["mismatches"] == 0 and r["identical"] is True  # untimed run and timed run
    ceiling = rows[("code edit", "ceiling")]
    assert ceiling["acceptance"] == 1.0 and ceiling["tokens_per_forward"] > 1.5
    assert ceiling["prediction_tokens"] == ceiling["tokens"]
    assert rows[("code edit", "prediction")]["accepted"] > 0 and data["ratios"] == []
    miss = rows[("code edit", "miss")]  # another file: a few probes, then it rests
    assert 0 < miss["verifying_forwards"] <= miss["tokens"] // 3 and miss["speedup_median"] > 0
    assert miss["prediction_tokens"] > 100 and miss["speculation"] == "prediction: another file"
    assert "prediction: its output" in printed and "prompt lookup" in printed and "same 2/2" in printed
    assert "DIFFERS" not in printed and "free text, file" in printed
    assert "code edit, file" in printed and "a prediction that misses" in printed


def test_the_draft_row_of_fp32_weights_proposes_from_the_gguf_and_keeps_the_text():
    """fp32 weights add a draft row: the model's own GGUF weights propose for their fp32 self (here
    on the shortest workload, the one `bench all --quick` no longer runs in fp32)."""
    from kvcache.engine.llm import LLM

    llm = LLM(None, weights="fp32")
    draft = sb._draft(None, llm, None)
    assert draft is not None and draft.weights != "fp32"
    ids = llm.encode(sb.WORKLOADS["free text"][0], chat=True)
    rows, text = sb.bench_workload(llm, "free text", ids, ("draft",), 12, 1, sb.LOOKUP, {}, None, draft.runner)
    (row,) = rows
    assert row["method"] == "draft" and row["pair"] == "fp32" and len(text) == row["tokens"] == 12
    assert row["identical"] is True and row["runs"] == 2 and row["proposed"] > 0 and row["spec_tok_s"] > 0
    assert row["forwards"] < row["tokens"] - 1  # accepted proposals: fewer forwards than tokens
    assert llm.runner.draft is None  # attached for the draft's runs only


def test_transformers_rows_in_a_child_process():
    from kvcache.models.loading import fp32_folder, resolve_model
    from kvcache.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model(None).path)
    ids = tok.encode_chat([{"role": "user", "content": "Say 'the cat sat on the mat' three times."}])
    row, draft = speculation.peer_rows(str(fp32_folder(None)), {"free text": ids}, 8, 1, 3, 1, sorted(tok.eos_token_ids),
                              timeout=300)
    if row["spec_tok_s"] is None:  # transformers missing or broken: a skipped row with the reason
        assert row["note"]
        return
    assert draft["method"] == "draft" and draft["speculation"] == speculation.ASSISTANT
    if draft["spec_tok_s"] is not None:  # the int8 assistant (torch's dynamic quantization) ran
        assert draft["identical"] is True and draft["proposed"] > 0 and draft["forwards"] >= 1
    assert row["system"] == "transformers" and 1 < row["tokens"] <= 8 and row["identical"] is True
    assert row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0 and row["forwards"] >= 1
    assert len(row["token_ids"]) == row["tokens"]
    sb.compare_peer([row], {"free text": list(row["token_ids"])})
    assert row["matches_kvcache"] is True and row["first_difference"] is None and "token_ids" not in row


def test_llama_server_rows_on_the_same_file():
    """llama-server (when `make llamacpp` built it) with and without its n-gram lookup, on the
    bundled GGUF and kvcache's prompt ids; without the binary, skipped rows that say why."""
    from kvcache.peers.llama_cpp import llama_server
    from kvcache.models.loading import resolve_model
    from kvcache.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model(None).path)
    ids = tok.encode_chat([{"role": "user", "content": "Say 'the cat sat on the mat' three times."}])
    gguf = resolve_model(None).gguf
    binary, _ = llama_server(None, gguf)
    (row,) = speculation.llama_rows(binary, gguf, {"free text": ids}, 12, 1, 3, 1, "file (Q4_1)", "n-gram lookup 3")
    if binary is None:
        assert row["spec_tok_s"] is None and "llama-server not built" in row["note"]
        return
    assert row["system"] == "llama-server" and row["pair"] == "file" and 1 < row["tokens"] <= 12
    assert row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0 and row["identical"] is True
    assert row["proposed"] >= row["accepted"] >= 0 and row["forwards"] >= 1 and row["token_ids"]
    (none,) = speculation.llama_rows(None, gguf, {"free text": ids}, 12, 1, 3, 1, "file (Q4_1)", "n-gram lookup 3")
    assert none["spec_tok_s"] is None and "not built" in none["note"]


def test_ratios_pair_each_peer_with_its_weights():
    rows = [{"system": "kvcache", "pair": "file", "workload": "document", "method": "lookup", "plain_tok_s": 200.0,
             "spec_tok_s": 400.0},
            {"system": "kvcache", "pair": "fp32", "workload": "document", "method": "lookup", "plain_tok_s": 100.0,
             "spec_tok_s": 150.0},
            {"system": "kvcache", "pair": "fp32", "workload": "document", "method": "draft", "plain_tok_s": 100.0,
             "spec_tok_s": 180.0},
            {"system": "llama-server", "pair": "file", "workload": "document", "method": "lookup", "plain_tok_s": 100.0,
             "spec_tok_s": 100.0},
            {"system": "transformers", "pair": "fp32", "workload": "document", "method": "lookup", "plain_tok_s": 50.0,
             "spec_tok_s": 100.0},
            {"system": "transformers", "pair": "fp32", "workload": "document", "method": "draft", "plain_tok_s": 50.0,
             "spec_tok_s": 60.0}]
    got = {(x["peer"], x["pair"], x["method"]): (x["plain"], x["spec"]) for x in sb.ratios(rows)}
    assert got == {("llama-server", "file", "lookup"): (2.0, 4.0), ("transformers", "fp32", "lookup"): (2.0, 1.5),
                   ("transformers", "fp32", "draft"): (2.0, 3.0)}


def test_a_missing_transformers_is_a_skipped_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    (row,) = speculation._peer_child({"threads": 1, "prompts": {"document": [1, 2, 3]}, "lookup": 6, "new": 8,
                             "repeats": 1, "model_dir": "/nonexistent"})
    assert row["spec_tok_s"] is None and "not installed" in row["note"] and row["prompt_tokens"] == 3


def test_first_difference():
    assert sb.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert sb.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert sb.first_difference([1, 2], [1, 2, 3]) == 2


def test_spec_refusals(capsys):
    assert main(["bench", "spec", "--peers", "vllm"]) == 2
    assert "unknown peer 'vllm'" in capsys.readouterr().err
    assert main(["bench", "spec", "--kv", "int8"]) == 2
    assert "--kv does not apply to the spec suite" in capsys.readouterr().err
    assert main(["bench", "spec", "--new-tokens", "4"]) == 2
    assert "at least 8" in capsys.readouterr().err
    assert main(["bench", "spec", "--weights", "q3"]) == 2
    assert "unknown mode 'q3'" in capsys.readouterr().err
