"""Speculative decoding (engine/speculate.py) on the bundled model: greedy text with prompt lookup
or a prediction is token for token the text without, for every exact cache strategy, alone and in
a batch of 8, with prefix hits; the cache after a run (pages, the prefix index's nodes and cached
pages, the integrity check) is what a run without speculation leaves, so refused tokens never
reach the index; sampled output keeps the target distribution (the verification step over many
seeds); and the proposers propose what they should."""

from __future__ import annotations

import json

import pytest
import torch

from kvcache import LLM
from kvcache.engine.params import SamplingParams
from kvcache.engine.speculate import Speculator, speculative, verify

DOC = ("The lighthouse keeper climbed the stairs at dusk. He lit the lamp, wound the clock and wrote the weather "
       "in the log. The lighthouse keeper climbed the stairs at dawn. He put out the lamp and wrote the weather "
       "in the log again.")
PROMPTS = [[{"role": "user", "content": f"Copy this text exactly:\n{DOC}"}],
           [{"role": "user", "content": "Count from one to twenty in words, separated by commas."}],
           [{"role": "user", "content": f"Summarize in one sentence:\n{DOC}"}],
           [{"role": "user", "content": "Write a short poem about the sea."}]]


def _plain(llm, prompts, n=48):
    return llm.generate_batch(prompts, SamplingParams(max_tokens=n), chat=True)


def _wrong(ids: list[int], every: int = 5) -> list[int]:
    """A prediction that departs from the text now and then (every ``every``-th token replaced)."""
    return [t if (i + 1) % every else (t + 7) % 40000 for i, t in enumerate(ids)]


@pytest.fixture(scope="module")
def exact_text():
    """The batch of 8 without speculation on a dynamic cache: the text of every exact strategy."""
    return _plain(LLM(kv="dynamic"), PROMPTS * 2)


@pytest.mark.parametrize("kv", ["dynamic", "static,max_tokens=512", "dynamic,page_size=4", "dynamic,host",
                                "dynamic,window=96,page_size=4"])
def test_greedy_text_is_the_text_without_speculation(kv, exact_text):
    """Against the text without speculation: the dynamic cache's for the exact strategies (each
    gives its bits, test_batch_invariance.py), the window's own for the window."""
    spec_llm = LLM(kv=kv)
    prompts = PROMPTS * 2  # a batch of 8, each prompt twice: the second batch's prompts hit the prefix cache
    want = _plain(LLM(kv=kv), prompts) if "window" in kv else exact_text
    preds = [_wrong(o.token_ids) for o in want]
    for params in ([SamplingParams(max_tokens=48, prompt_lookup=6)] * len(prompts),
                   [SamplingParams(max_tokens=48, prediction=p) for p in preds]):
        got = spec_llm.generate_batch(prompts, params, chat=True)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        for i in range(4):  # one at a time, over the prefix the batch cached
            (alone,) = spec_llm.generate_batch([prompts[i]], [params[i]], chat=True)
            assert alone.token_ids == want[i].token_ids, (kv, i)
            assert alone.cached_tokens > 0, (kv, i)
    spec_llm.check_integrity()
    stats = spec_llm.generate_batch(prompts[:1], [SamplingParams(max_tokens=48, prediction=preds[0])], chat=True)[0]
    assert stats.metrics["spec_accepted"] > 0 and stats.metrics["spec_pred_rejected"] > 0  # both paths ran


def test_the_cache_after_speculation_is_the_cache_without():
    """Rollback leaves what a sequence that never saw the refused tokens leaves: the same pages in
    use and cached, the same prefix-index nodes; the refused tokens reach no page of the index."""
    prompts = PROMPTS
    plain_llm, spec_llm = LLM(kv="dynamic,page_size=4"), LLM(kv="dynamic,page_size=4")
    want = _plain(plain_llm, prompts)
    got = spec_llm.generate_batch(prompts, [SamplingParams(max_tokens=48, prediction=_wrong(o.token_ids, 3))
                                            for o in want], chat=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics["spec_pred_rejected"] for o in got) > 20
    a, b = plain_llm.prefix_stats(), spec_llm.prefix_stats()
    assert (a.nodes, a.cached_pages) == (b.nodes, b.cached_pages)
    sa, sb = plain_llm.kv_stats(), spec_llm.kv_stats()
    assert (sa.pages_used, sa.tokens_stored, sa.pages_cached) == (sb.pages_used, sb.tokens_stored, sb.pages_cached)
    spec_llm.check_integrity()


@pytest.mark.parametrize("kv", ["int8", "int4,residual=8", "fp16", "window=96,sinks=4,page_size=4"])
def test_lossy_encodings_speculate_and_keep_their_accounting(kv, exact_text):
    """A lossy encoding takes proposals back too (the residual buffer and sealed pages as a
    sequence that never saw them); its text may differ from one-at-a-time decoding by the
    encoding's rounding, as a prefill chunk's does (the verified tokens attend to each other at
    full precision), so only the accounting is compared. Sinks likewise (a verified block sits
    at the cache positions of its step, where one-token steps shift them token by token). A
    window without sinks is exact and in the greedy test above. The predictions: the exact text
    with every third token wrong."""
    llm = LLM(kv=f"dynamic,{kv}")
    got = llm.generate_batch(PROMPTS, [SamplingParams(max_tokens=48, prediction=_wrong(o.token_ids, 3))
                                       for o in exact_text[:4]], chat=True)
    assert sum(o.metrics.get("spec_pred_rejected", 0) for o in got) > 0
    assert sum(o.metrics.get("spec_pred_accepted", 0) for o in got) > 0
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0


@pytest.mark.parametrize("kv", ["press=snapkv,ratio=0.5", "press=knorm,ratio=0.3", "press=expected,ratio=0.5"])
def test_prefill_presses_speculate_with_the_text_unchanged(kv):
    """A press that scores prompts reads a verifying forward as decodes (nothing is scored or
    evicted between prompts), so greedy text is the text without speculation."""
    llm = LLM(kv=f"dynamic,{kv}")
    want = _plain(llm, PROMPTS)
    for params in ([SamplingParams(max_tokens=48, prompt_lookup=5)] * len(PROMPTS),
                   [SamplingParams(max_tokens=48, prediction=_wrong(o.token_ids, 3)) for o in want]):
        got = llm.generate_batch(PROMPTS, params, chat=True)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert sum(o.metrics["spec_accepted"] for o in got) > 0
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0


@pytest.mark.parametrize("kv", ["dynamic,press=h2o,ratio=0.3", "dynamic,press=tova,ratio=0.3",
                                "int8,press=h2o,ratio=0.3", "int4,press=snapkv,ratio=0.5",
                                "dynamic,press=snapkv,ratio=0.5,window=128,page_size=4"])
def test_lossy_presses_speculate_and_keep_their_accounting(kv, exact_text):
    """Decode-time presses (only kept tokens' queries count, press/state.py ``commit``), quantized
    presses (a verifying forward seals only pages of tokens from before it, so a cut never falls
    in a sealed page) and a press with a window: proposals are refused and cut, and the cache
    holds nothing afterwards. The predictions: the exact text with every third token wrong."""
    llm = LLM(kv=kv)
    got = llm.generate_batch(PROMPTS, [SamplingParams(max_tokens=48, prediction=_wrong(o.token_ids, 3))
                                       for o in exact_text[:4]], chat=True)
    assert all(o.finish_reason in ("stop", "length") for o in got)
    assert sum(o.metrics["spec_pred_rejected"] for o in got) > 0
    assert sum(o.metrics["spec_pred_accepted"] for o in got) > 0
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0


def test_prediction_equal_to_the_output_needs_few_forwards(smollm_q):
    (want,) = _plain(smollm_q, PROMPTS[:1], 64)
    (got,) = smollm_q.generate_batch(PROMPTS[:1], [SamplingParams(max_tokens=64, prediction=want.token_ids)],
                                     chat=True)
    assert got.token_ids == want.token_ids
    m = got.metrics
    assert m["spec_pred_rejected"] == 0 and m["spec_accepted"] == m["spec_proposed"] > 0
    # each verifying forward gives its kept proposals and one token of its own
    assert m["spec_accepted"] + m["spec_forwards"] >= len(want.token_ids) - 1
    assert m["spec_forwards"] <= len(want.token_ids) // 4  # 4 or more tokens a forward


def test_which_requests_speculate():
    from kvcache.engine.grammar import Constraint

    assert speculative(SamplingParams(prompt_lookup=4))
    assert speculative(SamplingParams(prediction=(1, 2), temperature=0.7))
    for kw in (dict(repetition_penalty=1.2), dict(logit_bias={3: 1.0}), dict(min_tokens=2),
               dict(frequency_penalty=0.5), dict(logprobs=2)):
        assert speculative(SamplingParams(prompt_lookup=4, **kw)), kw
    assert not speculative(SamplingParams())
    assert speculative(SamplingParams(prompt_lookup=4, constraint=Constraint.regex("yes|no")))


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.3), dict(frequency_penalty=1.5, presence_penalty=0.2),
                                dict(logit_bias={13: 2.5, 30: -3.0}), dict(min_tokens=40)])
def test_penalties_bias_and_min_tokens_speculate_with_the_text_unchanged(smollm_q, kw):
    """Each verified position sees the penalty state a one-token decode there would see (the
    proposals before it counted), so greedy text is the text without speculation."""
    short = [{"role": "user", "content": "Is water wet? Answer with one word."}]  # min_tokens holds its EOS back
    prompts = [short, PROMPTS[0]] if "min_tokens" in kw else PROMPTS[:2]
    want = smollm_q.generate_batch(prompts, SamplingParams(max_tokens=40, **kw), chat=True)
    got = smollm_q.generate_batch(prompts, [SamplingParams(max_tokens=40, prediction=_wrong(o.token_ids, 4), **kw)
                                            for o in want], chat=True)
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids and b.metrics["spec_accepted"] > 0
    base = smollm_q.generate_batch(prompts[:1], SamplingParams(max_tokens=40), chat=True)[0]
    assert base.token_ids != want[0].token_ids  # the setting did change the text


def test_logprobs_with_speculation_are_those_without(smollm_q):
    """Each kept token's log-probability and top alternatives come from its verifying row: the
    same entries as one-token decoding gives, alone and streamed."""
    want = smollm_q.generate_batch(PROMPTS[:2], SamplingParams(max_tokens=32, logprobs=3), chat=True)
    preds = [_wrong(o.token_ids, 4) for o in want]
    got = smollm_q.generate_batch(PROMPTS[:2], [SamplingParams(max_tokens=32, logprobs=3, prediction=p)
                                                for p in preds], chat=True)
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids and b.metrics["spec_accepted"] > 0
        lp_a, lp_b = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert lp_b == lp_a and len(lp_b) == len(b.token_ids)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    sp = Speculator(SamplingParams(prompt_lookup=3), [5, 6, 7, 8, 9, 5, 6, 1, 2])
    sp.took([5, 6])  # "5 6" occurred twice: the latest was followed by 1 2
    assert sp.propose(10) == [1, 2, 5]
    sp.took([42])  # nothing ends with 42 before: no proposal
    assert sp.propose(10) == []
    assert sp.propose(0) == []


def test_prediction_follows_the_output_and_realigns():
    sp = Speculator(SamplingParams(prediction=(10, 11, 12, 13, 14, 15, 16)), [1, 2])
    assert sp.propose(3) == [10, 11, 12]
    sp.took([10, 11])
    assert sp.propose(3) == [12, 13, 14]
    sp.took([99, 14])  # departs, then "14" is found again in the prediction
    assert sp.propose(2) == [15, 16]
    sp.verified(2, 1)
    assert sp.prediction.pace.k == 2 and sp.pred_accepted == 1 and sp.pred_rejected == 1


def test_a_proposer_that_keeps_failing_rests():
    """Three refused proposals in a row rest a proposer 8 steps; after that one refusal rests it
    again, twice as long, until a proposal is kept (2 tokens for a prediction: one may be luck);
    a prediction's k starts at 4."""
    from kvcache.engine.proposers import Pace

    pace = Pace(8, first=4, enough=2)
    assert pace.k == 4
    for _ in range(3):
        assert pace.step()
        pace.verified(1, 0)
    assert [pace.step() for _ in range(9)] == [False] * 8 + [True]
    pace.verified(1, 1)  # one token kept: neither refused nor kept
    pace.verified(1, 0)
    assert [pace.step() for _ in range(17)] == [False] * 16 + [True]
    pace.verified(3, 2)  # kept: the rests start over
    assert pace.pause == 8 and pace.refused == 0 and pace.k == 3
    pace.verified(1, 0)
    pace.verified(1, 0)
    assert pace.step()
    pace.verified(1, 0)
    assert not pace.step() and pace.rest == 7


def test_the_proposer_with_more_evidence_proposes():
    """A prediction just realigned on 2 tokens gives way to a lookup's 3-gram; one the output has
    followed for longer does not."""
    sp = Speculator(SamplingParams(prompt_lookup=4, prediction=(50, 51, 6, 7, 60, 61, 62, 63, 64, 65)),
                    [5, 6, 7, 8, 9, 5, 6, 7, 1, 60, 61, 62, 2])
    sp.took([5, 6, 7])  # departs from the prediction; "6 7" realigns it; "5 6 7" was last followed by 1
    assert sp.propose(4) == [1, 60, 61, 62] and sp._source is sp.lookup
    sp.verified(4, 0)
    sp.took([60, 61, 62])  # the output follows the prediction for 5 tokens; "60 61 62" was followed by 2
    assert sp.lookup.propose(sp.history, 4) == ([2, 5, 6, 7], 3)
    assert sp.propose(4) == [63, 64, 65] and sp._source is sp.prediction


def _edit_runs(llm, **kw):
    """The bench's code edit (128 tokens) without speculation and with ``kw`` each (a list of dicts)."""
    from kvcache.bench.spec_texts import EDIT

    prompt = [{"role": "user", "content": EDIT}]
    (plain,) = llm.generate_batch([prompt], SamplingParams(max_tokens=128), chat=True)
    return plain, {name: llm.generate_batch([prompt], SamplingParams(max_tokens=128, **p), chat=True)[0]
                   for name, p in kw.items()}


def test_prompt_lookup_0_turns_the_default_off(smollm_q):
    """`serve --prompt-lookup 6` (the scheduler's default): a request that leaves prompt_lookup
    unset (None) speculates, one that sends 0 does not; the server's body keeps the difference."""
    from kvcache.engine.scheduler import SchedulerConfig
    from kvcache.server.protocol import ChatRequest

    msgs = [{"role": "user", "content": f"Copy this text exactly:\n{DOC}"}]
    runs = {lk: smollm_q.generate_batch([msgs], SamplingParams(max_tokens=48, **kw), chat=True,
                                        scheduler=SchedulerConfig(prompt_lookup=6))[0]
            for lk, kw in ((None, {}), (0, dict(prompt_lookup=0)))}
    assert runs[None].metrics["spec_proposed"] > 0 and runs[None].metrics["spec_accepted"] > 0
    assert "spec_proposed" not in runs[0].metrics, runs[0].metrics and "spec_forwards" not in runs[0].metrics
    assert runs[0].token_ids == runs[None].token_ids
    assert SamplingParams().prompt_lookup is None
    assert ChatRequest(model="m", messages=msgs).sampling(16).prompt_lookup is None
    assert ChatRequest(model="m", messages=msgs, prompt_lookup=0).sampling(16).prompt_lookup == 0


def test_a_wrong_prediction_rests_and_leaves_the_steps_to_the_lookup(smollm_q):
    """A prediction that is all wrong (the file's tokens backwards: every token realigns it, every
    proposal is refused) proposes a few times and rests; with prompt lookup too, the lookup
    proposes as it does alone. The text is the text without speculation throughout."""
    from kvcache.bench.spec_texts import EDIT_PREDICTION

    wrong = tuple(reversed(smollm_q.tokenizer.encode(EDIT_PREDICTION, add_special_tokens=False)))
    plain, got = _edit_runs(smollm_q, wrong=dict(prediction=wrong), lookup=dict(prompt_lookup=6),
                            both=dict(prediction=wrong, prompt_lookup=6))
    assert len(plain.token_ids) == 128
    for o in got.values():
        assert o.token_ids == plain.token_ids
    m = got["wrong"].metrics
    assert m["spec_proposed"] <= 24 and m["spec_forwards"] <= 16 and m["spec_pred_rejected"] > 0
    alone, both = got["lookup"].metrics, got["both"].metrics
    assert both["spec_accepted"] - both["spec_pred_accepted"] >= 0.9 * alone["spec_accepted"] > 60
    assert both["spec_forwards"] <= alone["spec_forwards"] + 6


def test_sampled_verification_keeps_the_target_distribution():
    """The first token verify returns, over 6000 seeds: the target distribution p at that position,
    whether the proposal there is likely or not (chi-square against p, and the draft kept at the
    rate p gives it)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 12) * 1.5
    p = torch.softmax(logits[0] / 0.8, -1)
    params = SamplingParams(temperature=0.8)
    for draft in ([int(p.argmax()), 3], [int(p.argmin()), 0]):
        counts = torch.zeros(12)
        kept_second = 0
        n = 6000
        for seed in range(n):
            g = torch.Generator().manual_seed(seed)
            out = verify(logits, draft, params, g)
            counts[out[0]] += 1
            kept_second += len(out) == 3
        expected = p * n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 40.0, (draft, counts.tolist(), expected.tolist())  # 11 degrees of freedom: p < 1e-4
    assert verify(logits, [int(logits[0].argmax()), 5], SamplingParams(), None)[0] == int(logits[0].argmax())


def test_predicted_outputs_through_the_openai_client():
    """`prediction` on both endpoints with the real openai client: the same text as without, and
    OpenAI's accounting in usage.completion_tokens_details; `prompt_lookup` as an extra."""
    from test_server import Server, _model

    from kvcache.models.bundled import default_gguf

    server = Server(str(default_gguf()))
    try:
        client, model = server.client(), _model(server)
        msgs = [{"role": "user", "content": f"Copy this text exactly:\n{DOC}"}]
        plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=60, temperature=0)
        text = plain.choices[0].message.content
        assert plain.usage.completion_tokens_details is None  # no prediction, no prediction accounting
        same = client.chat.completions.create(model=model, messages=msgs, max_tokens=60, temperature=0,
                                              prediction={"type": "content", "content": text})
        assert same.choices[0].message.content == text
        details = same.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0.5 * same.usage.completion_tokens
        assert details.rejected_prediction_tokens == 0
        half = len(text) // 2  # a prediction that departs from the text halfway and comes back
        off = client.chat.completions.create(model=model, messages=msgs, max_tokens=60, temperature=0,
                                             prediction={"type": "content",
                                                         "content": text[:half] + " Something else. " + text[half:]})
        assert off.choices[0].message.content == text
        assert off.usage.completion_tokens_details.rejected_prediction_tokens > 0
        comp = client.completions.create(model=model, prompt=DOC, max_tokens=30, temperature=0)
        looked = client.completions.create(model=model, prompt=DOC, max_tokens=30, temperature=0,
                                           extra_body={"prompt_lookup": 5})
        assert looked.choices[0].text == comp.choices[0].text
        code, err = server.post("/v1/completions", json.dumps({"model": model, "prompt": "x", "max_tokens": 2,
                                                              "prediction": {"type": "image"}}).encode())
        assert code == 400 and err["error"]["param"] == "prediction.type"
    finally:
        server.close()


def test_preempted_speculating_requests_give_the_same_text():
    """A pool too small for four speculating requests at once: requests are preempted with
    proposals pending and resumed (the feed rebuilt from their tokens); the text is unchanged and
    the pages all come back."""
    from kvcache.engine.scheduler import SchedulerConfig

    want = _plain(LLM(prefix=False), PROMPTS, 40)
    tight = LLM(kv="dynamic,page_size=4,budget=10MiB")
    got = tight.generate_batch(PROMPTS, [SamplingParams(max_tokens=40, prediction=_wrong(o.token_ids, 4))
                                         for o in want], chat=True,
                               scheduler=SchedulerConfig(max_batch_tokens=64, max_running=4))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics["preemptions"] for o in got) > 0
    tight.check_integrity()
    assert tight.kv_stats().pages_in_use == 0


def test_a_draft_model_proposes_and_the_text_is_unchanged():
    """The bundled model's quantized file as the draft of its q8 self (the fp32 weights quantized
    anew: other weights, so that some proposals miss): the same greedy tokens as the q8 model
    alone, several tokens a forward, and the draft's pages all back after."""
    from kvcache.models.bundled import default_gguf

    target = LLM(weights="q8", draft_model=str(default_gguf()))
    want = LLM(weights="q8").generate_batch(PROMPTS, SamplingParams(max_tokens=24), chat=True)
    got = target.generate_batch(PROMPTS, SamplingParams(max_tokens=24), chat=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    m = [o.metrics for o in got]
    assert sum(x["spec_accepted"] for x in m) > 0.5 * sum(x["spec_proposed"] for x in m)
    assert sum(x["spec_forwards"] for x in m) < 0.5 * sum(len(o.token_ids) for o in got)
    # with a prediction too: each step the one with more evidence proposes, the text unchanged
    got = target.generate_batch(PROMPTS, [SamplingParams(max_tokens=24, prediction=_wrong(o.token_ids, 4))
                                          for o in want], chat=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    m = [o.metrics for o in got]
    assert sum(x["spec_pred_accepted"] for x in m) > 0
    assert sum(x["spec_accepted"] - x["spec_pred_accepted"] for x in m) > 0  # the draft's
    assert target.draft.kv_stats().pages_in_use == 0
    target.check_integrity()


def test_a_draft_with_another_tokenizer_is_refused(tiny_dir):
    from kvcache.errors import InvalidParams

    with pytest.raises(InvalidParams, match="another tokenizer"):
        LLM(str(tiny_dir("llama")[0]), draft_model="smollm2")


@pytest.mark.gemma
def test_gemma3_speculates_over_its_sliding_layers():
    """Gemma 3's own sliding-window layers (512 tokens): a document longer than the window, copied
    with prompt lookup and with a prediction, gives the greedy text of one-token decoding, alone
    and beside a short request; the window's pages are given back as they leave it."""
    from conftest import gemma_installed

    if not gemma_installed():
        pytest.skip("the Gemma 3 270M package is not installed (make gemma)")
    llm = LLM("gemma3-270m", kv="dynamic,page_size=16")
    long_doc = " ".join([DOC] * 14)  # about 700 tokens: the window is full before decoding starts
    prompts = [[{"role": "user", "content": f"Copy this text exactly:\n{long_doc}"}], PROMPTS[1]]
    assert len(llm.encode(long_doc)) > 600
    want = _plain(llm, prompts, 40)
    for params in ([SamplingParams(max_tokens=40, prompt_lookup=6)] * 2,
                   [SamplingParams(max_tokens=40, prediction=_wrong(o.token_ids, 4)) for o in want]):
        got = llm.generate_batch(prompts, params, chat=True)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got[0].metrics["spec_accepted"] > 0
        (alone,) = llm.generate_batch(prompts[:1], params[:1], chat=True)
        assert alone.token_ids == want[0].token_ids
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0


@pytest.mark.parametrize("kw", [dict(frequency_penalty=1.0), dict(presence_penalty=1.0), dict(repetition_penalty=2.0),
                                dict(min_tokens=3)])
def test_each_verified_position_sees_the_proposals_before_it(kw):
    """Token 5 leads token 6 by 0.5 everywhere, token 0 (EOS) leads both at the last position: a
    proposal of 5 makes the next 5 pay its penalty, so the second proposal is refused; min_tokens
    holds EOS back at the first three tokens out only."""
    from kvcache.engine.speculate import verify_rows

    logits = torch.full((3, 10), -5.0)
    logits[:, 5], logits[:, 6] = 5.0, 4.5
    params = SamplingParams(**kw)
    counts = torch.zeros(10) if "frequency_penalty" in kw or "presence_penalty" in kw else None
    seen = torch.zeros(10, dtype=torch.bool) if "repetition_penalty" in kw else None
    if "min_tokens" in kw:
        logits[2, 0] = 9.0
        rows = verify_rows(params, None, 0, counts, seen, [5, 5])
        assert verify(logits, [5, 5], params, None, rows, (0,)) == [5, 5, 5]  # 2 tokens out, plus 1: EOS held
        rows = verify_rows(params, None, 1, counts, seen, [5, 5])
        assert verify(logits, [5, 5], params, None, rows, (0,)) == [5, 5, 0]  # the third token out may end
        return
    rows = verify_rows(params, None, 0, counts, seen, [5, 5])
    assert verify(logits, [5, 5], params, None, rows) == [5, 6]
    assert verify(logits, [5, 5], params, None) == [5, 5, 5]  # without the state: nothing is penalized
    assert counts is None or float(counts.sum()) == 0.0  # the sample's own state is untouched


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "colours": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                       "maxItems": 3}},
          "required": ["name", "colours"], "additionalProperties": False}


@pytest.mark.parametrize("how", ["schema", "regex"])
def test_constrained_requests_speculate_with_the_text_unchanged(smollm_q, how):
    """Under a grammar each verified position's choice is the constrained decode's there (the
    matcher takes the proposals in turn and gives them back): greedy text unchanged, and the
    matcher's state after the run is the plain run's (its text still parses)."""
    from kvcache.engine.grammar import Constraint

    c = Constraint.json_schema(SCHEMA) if how == "schema" else Constraint.regex(r"The (sea|sky) is [a-z]+( and [a-z]+){0,3}\.")
    prompts = [[{"role": "user", "content": "Describe the sea as JSON with a name and its colours."}],
               [{"role": "user", "content": "In one sentence: what colour is the sea?"}]]
    want = smollm_q.generate_batch(prompts, SamplingParams(max_tokens=60, constraint=c), chat=True)
    got = smollm_q.generate_batch(prompts, [SamplingParams(max_tokens=60, constraint=c, prediction=_wrong(o.token_ids, 4))
                                            for o in want], chat=True)
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
        assert b.metrics["spec_accepted"] > 0 and b.metrics["spec_pred_rejected"] > 0
    if how == "schema":
        for o in got:
            if o.finish_reason == "stop":
                assert set(json.loads(o.text)) == {"name", "colours"}


def test_sampled_constrained_speculation_stays_in_the_grammar(smollm_q):
    from kvcache.engine.grammar import Constraint

    c = Constraint.json_schema(SCHEMA)
    prompt = [{"role": "user", "content": "Describe the sea as JSON with a name and its colours."}]
    (plain,) = smollm_q.generate_batch([prompt], SamplingParams(max_tokens=60, constraint=c), chat=True)
    outs = smollm_q.generate_batch([prompt] * 12, [SamplingParams(max_tokens=80, constraint=c, temperature=0.9,
                                                                  seed=s, prediction=plain.token_ids)
                                                   for s in range(12)], chat=True)
    assert sum(o.metrics["spec_accepted"] for o in outs) > 0
    for o in outs:
        if o.finish_reason == "stop":
            doc = json.loads(o.text)
            assert set(doc) == {"name", "colours"} and len(doc["colours"]) <= 3
    smollm_q.check_integrity()
