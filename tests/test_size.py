"""The KV size calculator against hand-computed values, and its bad input."""

from __future__ import annotations

import json

import pytest
from conftest import run_kvcache

from kvcache.cache import quant
from kvcache.cache.config import parse_kv_spec
from kvcache.errors import InvalidParams
from kvcache.inspect.size import UNCAPPED, kv_size, largest_batch, load_model_config, longest_context

GIB = 2**30


def test_known_models_by_hand():
    _, llama2 = load_model_config("llama-2-7b")
    # 2 (K, V) x 32 layers x 32 KV heads x 128 x 2 bytes = 0.5 MiB per token
    assert kv_size(llama2, parse_kv_spec("fp16"), 4096).bytes_total == 2 * 32 * 32 * 128 * 2 * 4096 == 2 * GIB
    _, llama3 = load_model_config("Llama-3-8B")
    assert kv_size(llama3, parse_kv_spec("fp16"), 8192, batch=4).bytes_total == 4 * GIB
    _, mistral = load_model_config("Mistral-7B")  # sliding window 4096 on every layer
    assert kv_size(mistral, parse_kv_spec("fp16"), 32768).bytes_total == 32 * 4096 * 2 * 8 * 128 * 2
    _, gemma = load_model_config("Gemma-3-27B")  # 52 sliding layers (1024), 10 full
    full, sliding = 10 * 131072 * 8192, 52 * 1024 * 8192  # 2 x 16 KV heads x 128 x 2 bytes = 8 KiB
    assert kv_size(gemma, parse_kv_spec("fp16"), 131072).bytes_total == full + sliding


def test_quantized_and_sink_bytes():
    _, smol = load_model_config(None)  # SmolLM2-135M: 30 layers, 3 KV heads x 64
    fp32_token = 2 * 3 * 64 * 4
    int4_token = 3 * (32 + 8) * 2  # codes 32 B + float16 scale/min per head for K and V (group 32)
    size = kv_size(smol, parse_kv_spec("int4"), 8192)
    assert size.bytes_total == 30 * ((8192 - 128) * int4_token + 128 * fp32_token)
    sink = kv_size(smol, parse_kv_spec("sinks=4,window=1024"), 8192)
    assert sink.kept == (1024,) * 30 and sink.bytes_total == 30 * 1024 * fp32_token


def test_budget_questions():
    _, llama3 = load_model_config("Llama-3-8B")
    fp16 = parse_kv_spec("fp16")
    assert longest_context(llama3, fp16, 1, GIB // 2) == 4096
    assert longest_context(llama3, fp16, 1, 10 * GIB) == 8192  # the model's context caps it
    assert largest_batch(llama3, fp16, 8192, 16 * GIB) == 16
    with pytest.raises(InvalidParams, match="smaller than one token's KV"):
        longest_context(llama3, fp16, 1, 1000)


def test_config_json_and_unknown_model(tmp_path):
    cfg = {"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 64, "max_position_embeddings": 128, "vocab_size": 10, "intermediate_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, model = load_model_config(str(tmp_path))
    assert kv_size(model, parse_kv_spec("dynamic"), 100).bytes_total == 2 * 2 * 2 * 16 * 4 * 100
    with pytest.raises(InvalidParams, match="unknown model 'nope'.*bundled model .*gemma3-270m.*Llama-3-8B"):
        load_model_config("nope")


def test_a_bundled_models_name_reads_its_gguf():
    """`kvcache size gemma3-270m` (and `bench memory --model gemma3-270m`) read the bundled file's
    own hyper-parameters, as LLM("gemma3-270m") loads it."""
    from conftest import gemma_installed

    if not gemma_installed():
        pytest.skip("Gemma 3 270M packages not installed (make gemma)")
    name, model = load_model_config("gemma3-270m")
    assert name.startswith("gemma-3-270m") and model.num_layers == 18 and model.num_kv_heads == 1


def test_size_command():
    r = run_kvcache("size", "Llama-3-8B", "--budget", "16", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "8 KV heads x 128" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("fp16 "))
    assert "1.0 GiB" in row and row.split()[-1] == "16"
    bad = run_kvcache("size", "Llama-3-70B", "--budget", "0.0001", timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == ("kvcache: a budget of 107,374 bytes is smaller than one token's KV for "
                                  "batch 1 (655,360 bytes)")
    assert run_kvcache("size", "--kv", "none", timeout=120).returncode == 2


def test_gguf_metadata_gives_the_same_answer():
    from kvcache.models.bundled import default_gguf

    _, from_gguf = load_model_config(str(default_gguf()))
    _, known = load_model_config("SmolLM2-135M")
    spec = parse_kv_spec("int8")
    assert kv_size(from_gguf, spec, 2000).bytes_total == kv_size(known, spec, 2000).bytes_total


def test_weight_bytes_by_hand_and_per_mode():
    from kvcache.inspect.weight_size import parameter_groups, weight_size

    _, llama3 = load_model_config("Llama-3-8B")
    proj, rest, embed = parameter_groups(llama3)
    assert proj + rest == 8_030_261_248  # the published parameter count
    assert embed == 128256 * 4096  # untied: the input table stays fp32 when projections are quantized
    sizes = weight_size(llama3).by_mode
    assert sizes["fp32"] == 4 * (proj + rest)
    assert sizes["q8"] == round(proj * 34 / 32) + 4 * rest and sizes["q4"] == round(proj * 20 / 32) + 4 * rest
    _, gemma = load_model_config("Gemma-3-27B")  # tied: no separate input table
    assert parameter_groups(gemma)[2] == 0


@pytest.mark.slow
def test_weights_counted_as_the_loaded_model_holds_them(smollm, smollm_q):
    from kvcache import LLM
    from kvcache.inspect.weight_size import weight_size
    from kvcache.models.bundled import default_gguf

    gguf = default_gguf()
    _, cfg = load_model_config(str(gguf))
    sizes = weight_size(cfg, gguf)
    assert sizes.file_kinds == {"Q4_1": 66355200, "Q8_0": 30081024, "F32": 140544}  # the file's own tensors
    q8 = LLM(weights="q8", prefix=False)
    for mode, llm in (("fp32", smollm), ("file", smollm_q), ("q8", q8)):
        assert abs(sizes.by_mode[mode] - llm.model.weight_bytes()) < 0.002 * llm.model.weight_bytes(), mode


def test_size_counts_the_weights_out_of_a_budget(capsys):
    from kvcache.cli import main
    r = run_kvcache("size", "Llama-3-8B", "--budget", "16", "--weights", "q8", "--kv", "fp16", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "8.03 B parameters: fp32 29.9 GiB · q8 9.4 GiB · q4 6.3 GiB" in r.stdout
    assert "KV budget: 16 GiB less q8 weights = 6.6 GiB" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("fp16 "))
    assert row.split()[-1] == "6"  # 1 GiB of fp16 KV per 8192-token sequence: 6 fit in 6.6 GiB
    for args, message in ((("--budget", "16", "--weights", "q4", "Llama-3-70B"), "q4 weights take 44.4 GiB"),
                          (("--weights", "file", "--budget", "16", "Llama-3-8B"), "--weights file needs a GGUF"),
                          (("--weights", "q8", "Llama-3-8B"), "give --budget GiB too")):
        assert main(["size", *args]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("kvcache: ") and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("spec", ["dynamic", "fp16", "bf16", "int8", "int4", "int2", "int4,residual=0"])
def test_size_per_token_is_the_cache_own_accounting(smollm_q, spec):
    """`kvcache size`'s bytes against what the cache itself counts holding the same tokens (a
    prefill, then decodes): equal whenever the quantized fp32 tail is exactly ``residual`` tokens;
    between those points the cache holds the tokens of its unsealed page in fp32 too, up to a page."""
    from kvcache.engine.runner import ModelRunner

    cfg, model = parse_kv_spec(spec), smollm_q.config
    runner = ModelRunner(smollm_q.model, cfg)  # a runner of its own: the shared LLM keeps its cache
    page = runner.cache.page_size
    stored, fp32 = (quant.bytes_per_token(model.num_kv_heads, model.head_dim, cfg.bits, cfg.group_size)
                    if cfg.quantized else 0.0), 2 * model.num_kv_heads * model.head_dim * 4
    aligned = (cfg.residual if cfg.quantized else 0) + 3 * page
    ids = smollm_q.encode("The keeper of the lighthouse counted the ships. " * 40)
    seq = runner.new_sequence()
    runner.step([seq], [ids[:aligned - 3]])
    for n in range(aligned - 3, aligned + page // 2 + 1):  # decodes across the aligned point
        st = runner.stats()
        size = kv_size(model, cfg, n)
        assert st.tokens_stored == n
        if n == aligned or not cfg.quantized:
            assert st.bytes_used == size.bytes_total
            assert st.bytes_used / st.tokens_stored == size.bytes_total / n  # the B/token `kvcache size` prints
        else:
            extra = (n - cfg.residual) % page if n > cfg.residual else 0
            assert st.bytes_used == size.bytes_total + round(model.num_layers * extra * (fp32 - stored))
        runner.step([seq], [[ids[n]]])
    runner.free(seq)


def test_longest_context_past_the_model_limit():
    _, one_b = load_model_config("Llama-3.2-1B")
    fp16 = parse_kv_spec("fp16")
    assert kv_size(one_b, fp16, 1).bytes_total == 2 * 16 * 8 * 64 * 2  # 32 KiB a token
    assert longest_context(one_b, fp16, 1, 16 * GIB) == 131072  # the model's context caps it
    assert longest_context(one_b, fp16, 1, 16 * GIB, capped=False) == 16 * GIB // 32768
    assert longest_context(one_b, parse_kv_spec("sink"), 1, GIB, capped=False) == UNCAPPED
    r = run_kvcache("size", "Llama-3.2-3B", "--budget", "16", "--weights", "q4", "--no-context-cap", "--kv", "fp16;int4",
                    timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.startswith(("fp16 ", "int4 "))}
    assert rows["fp16"][1] == "114,688" and int(rows["fp16"][-2]) > 131072 and int(rows["int4"][-2]) > int(rows["fp16"][-2])
    bad = run_kvcache("size", "Llama-3.2-1B", "--no-context-cap", timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().endswith("give --budget GiB too")
