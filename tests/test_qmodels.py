"""Models with quantized weights: the bundled Q4_1 file read as it ships, q8/q4 quantized at load,
against the same model with fp32 weights and against llama.cpp on the same file when it is here
(KVCACHE_LLAMA_CPP_BIN: a folder with llama-perplexity and llama-simple)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from kvcache import LLM, SamplingParams
from kvcache.eval.fidelity import builtin_text
from kvcache.eval.weights import chunks, compare_weights
from kvcache.kernels.qweight import QStack, QWeight

from conftest import gemma_installed

LLAMA_CPP = os.environ.get("KVCACHE_LLAMA_CPP_BIN")
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def parts(smollm):
    return chunks(smollm.encode(builtin_text()), 512, 2, None)  # SmolLM2 adds no BOS


def test_bundled_file_is_held_quantized(smollm_q):
    kinds = smollm_q.model.weight_kinds()
    assert smollm_q.weights == "file" and set(kinds) == {"fp32", "q4_f16", "s8_f16"}  # Q4_1 layers, Q8_0 table
    size = os.path.getsize(smollm_q.model_path)
    assert smollm_q.model.weight_bytes() <= size  # never more than the file: nothing expanded
    assert isinstance(smollm_q.model.lm_head, QWeight) and smollm_q.model.embed is None  # tied: one table


def test_file_weights_read_text_within_one_percent_of_fp32(smollm, smollm_q, parts):
    r = compare_weights(smollm_q, smollm, parts)
    assert r.tokens == 2 * 255
    assert abs(r.ppl / r.ppl_ref - 1) < 0.01, r
    assert r.kl < 0.02 and r.agreement > 0.9, r


def test_exact_strategies_on_quantized_weights_agree_with_recompute(smollm_q):
    """Cached decoding, a prefix hit, a fork and a saved cache give recompute's distribution: only
    a different attention path can round an int8 activation the other way (KL ~1e-3 at most)."""
    ids = smollm_q.encode("The lighthouse keeper climbed the stairs at dusk and found a note that said")
    none = LLM(kv="none", prefix=False)
    ref = none.runner.step([none.runner.new_sequence()], [ids])[0]
    seq = smollm_q.runner.new_sequence()
    got = [smollm_q.runner.step([seq], [ids[:-5]])[0]]
    for t in ids[-5:]:
        got.append(smollm_q.runner.step([seq], [[t]])[0])
    smollm_q.runner.free(seq)
    lp, lr = torch.log_softmax(got[-1], -1), torch.log_softmax(ref, -1)
    assert float((lr.exp() * (lr - lp)).sum()) < 5e-3 and int(got[-1].argmax()) == int(ref.argmax())
    smollm_q.generate([ids[:-1]], SamplingParams(max_tokens=4, ignore_eos=True))  # leaves its pages cached
    hit = smollm_q.runner.lookup(ids)
    assert 0 < len(hit.tokens) < len(ids)  # a prefix hit (never the whole prompt)
    got_hit = smollm_q.runner.step([hit], [ids[len(hit.tokens):]])[0]
    smollm_q.runner.free(hit)
    lh = torch.log_softmax(got_hit, -1)
    assert float((lr.exp() * (lr - lh)).sum()) < 5e-3 and int(got_hit.argmax()) == int(ref.argmax())
    smollm_q.check_integrity()


@pytest.mark.parametrize("mode,top1,kl", [("q8", 0.97, 5e-3), ("q4", 0.8, 0.1)])
def test_weights_quantized_at_load_from_an_hf_folder(tiny_dir, mode, top1, kl):
    path = str(tiny_dir("llama")[0])
    fp32, q = LLM(path, weights="fp32", prefix=False), LLM(path, weights=mode, prefix=False)
    assert q.weights == mode and isinstance(q.model.layers[0].qkv, QWeight)
    assert LLM(path, prefix=False).weights == "fp32"  # `file` on a folder without quantized tensors
    assert q.fingerprint != fp32.fingerprint  # K/V of other weights never mix in tiers or files
    ids = [5, 17, 42, 8, 99, 23, 4, 61, 77, 12, 30, 3, 9, 14] * 4
    a = fp32.runner.score(fp32.runner.new_sequence(), ids)
    b = q.runner.score(q.runner.new_sequence(), ids)
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    assert float((la.exp() * (la - lb)).sum(-1).mean()) < kl
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= top1


@pytest.mark.gemma
@pytest.mark.skipif(not gemma_installed(), reason="Gemma 3 270M packages not installed (make gemma)")
def test_gemma_file_mixes_types_in_one_projection():
    """Gemma 3's Q4_K_M file holds Q5_0 q/k beside a Q8_0 v (one fused projection of two formats),
    Q4_K, Q6_K and a Q8_0 table; read as it ships it stays within 1% of fp32 perplexity."""
    q = LLM("gemma3-270m", prefix=False)
    qkv = q.model.layers[0].qkv
    assert isinstance(qkv, QStack) and qkv.format_name == "q5o_f16+s8_f16"  # Q5_0 without stored minimums
    assert {"q4_ks", "q6_ks", "s8_f16", "q5o_f16"} <= set(q.model.weight_kinds())  # K-quants at their density
    assert q.model.weight_bytes() <= os.path.getsize(q.model_path) * 1.1  # about the file's size
    ref = LLM("gemma3-270m", prefix=False, weights="fp32")
    r = compare_weights(q, ref, chunks(ref.encode(builtin_text()), 512, 1, ref.tokenizer.bos_token_id))
    assert abs(r.ppl / r.ppl_ref - 1) < 0.01 and r.agreement > 0.9, r


@pytest.mark.skipif(LLAMA_CPP is None, reason="KVCACHE_LLAMA_CPP_BIN is not set (a llama.cpp build folder)")
def test_against_llama_cpp_on_the_same_file(smollm_q, parts):
    from kvcache.peers.llama_cpp import llama_perplexity

    text = builtin_text()
    peer, note = llama_perplexity(LLAMA_CPP, smollm_q.model_path, text, 512, 2, 2)
    assert peer is not None, note
    from kvcache.eval.weights import perplexity

    ours = perplexity(smollm_q, parts)
    assert abs(ours / peer - 1) < 0.01, (ours, peer)
    agree = []
    for p in PROMPTS:
        out = subprocess.run([str(Path(LLAMA_CPP) / "llama-simple"), "-m", smollm_q.model_path, "-n", "24", p],
                             capture_output=True, text=True, timeout=120).stdout
        theirs = smollm_q.encode(out)[len(smollm_q.encode(p)):][:16]
        mine = smollm_q.generate([p], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids[:16]
        agree.append(next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), len(theirs)))
    print("greedy tokens agreeing with llama.cpp, per prompt:", agree)
    assert min(agree) >= 4 and sum(agree) >= len(PROMPTS) * 8
