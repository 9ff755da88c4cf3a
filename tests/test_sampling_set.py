"""The whole sampling set, each parameter against its oracle on the same logits: transformers'
logits processors (logit_bias, repetition_penalty, min_tokens, temperature, top-k, top-p, min-p),
OpenAI's documented formula for frequency and presence penalties (transformers has no processor
for them); several requests with different settings in one batched choice give each the result
it has alone; and through the engine, stop_token_ids, min_tokens and the penalties act on real
generations of the bundled model."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from kvcache.engine.params import SamplingParams
from kvcache.kernels import build
from kvcache.engine.sampler import Row, adjust, choose, draw, warp
from kvcache.errors import InvalidParams

V = 300


def _logits(seed: int = 0, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


def _row(params: SamplingParams, prompt: list[int] = (), out: list[int] = ()) -> Row:
    """A Row in the state a sample with this prompt and output has."""
    from kvcache.engine.sampler import needs_counts, needs_seen

    counts = seen = None
    if needs_counts(params):
        counts = torch.zeros(V)
        for t in out:
            counts[t] += 1
    if needs_seen(params):
        seen = torch.zeros(V, dtype=torch.bool)
        seen[list(prompt) + list(out)] = True
    return Row(params, None, len(out), counts, seen)


PROMPT, OUT = [3, 7, 7, 11, 42], [7, 19, 19, 19, 250, 3]


def test_logit_bias_is_transformers_sequence_bias():
    bias = {5: 7.5, 17: -100.0, 250: 0.25}
    logits = _logits()
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([PROMPT]), logits.clone())
    got = adjust(logits, [_row(SamplingParams(logit_bias=bias))])
    assert torch.equal(got, want)
    assert int(got.argmax()) == 5 or float(logits[0].max()) > float(logits[0, 5]) + 7.5


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_is_transformers_processor(penalty):
    logits = _logits(1)
    ids = torch.tensor([PROMPT + OUT])
    want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    got = adjust(logits, [_row(SamplingParams(repetition_penalty=penalty), PROMPT, OUT)])
    assert torch.allclose(got, want, atol=0, rtol=1e-6)
    assert not torch.equal(got, logits)  # the penalty did act


@pytest.mark.parametrize("freq,pres", [(0.5, 0.0), (0.0, 1.5), (1.2, -0.4), (-2.0, 2.0)])
def test_frequency_and_presence_penalties_follow_openai_formula(freq, pres):
    logits = _logits(2)
    want = logits.clone()
    for t in set(OUT):  # platform.openai.com: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        want[0, t] -= OUT.count(t) * freq + pres
    got = adjust(logits, [_row(SamplingParams(frequency_penalty=freq, presence_penalty=pres), PROMPT, OUT)])
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got[0, 100], logits[0, 100])  # a token never generated is left alone (prompt tokens too)
    assert torch.equal(got[0, 42], logits[0, 42])


def test_min_tokens_is_transformers_min_new_tokens():
    eos = (0, 1)
    logits = _logits(3)
    p = SamplingParams(min_tokens=4, stop_token_ids=(9,), max_tokens=10)
    for n_out in range(6):
        proc = MinNewTokensLengthLogitsProcessor(len(PROMPT), 4, list(eos) + [9])
        want = proc(torch.tensor([PROMPT + OUT[:n_out]]), logits.clone())
        got = adjust(logits, [Row(p, None, n_out)], stop_ids=eos)
        assert torch.equal(got, want), n_out
        assert (torch.isinf(got[0, [0, 1, 9]]).all()) == (n_out < 4)


@pytest.mark.parametrize("kw", [dict(temperature=1.5, top_k=1), dict(temperature=0.7, top_k=20),
                                dict(temperature=1.3, min_p=0.05), dict(temperature=0.9, top_p=0.6),
                                dict(temperature=0.9, top_k=30, top_p=0.8, min_p=0.1)])
def test_warpers_are_transformers_warpers(kw):
    logits = _logits(4)
    scores = TemperatureLogitsWarper(kw["temperature"])(None, logits.clone())
    if kw.get("top_k"):
        scores = TopKLogitsWarper(kw["top_k"])(None, scores)
    if kw.get("top_p", 1.0) < 1.0:
        scores = TopPLogitsWarper(kw["top_p"])(None, scores)
    if kw.get("min_p"):
        scores = MinPLogitsWarper(kw["min_p"])(None, scores)
    want = torch.softmax(scores, -1)
    got = warp(logits, [SamplingParams(**kw)])
    assert torch.allclose(got, want, atol=1e-6)
    assert (got > 0).sum() < V


@pytest.mark.parametrize("spread, top_p", [(8.0, 0.9), (3.0, 0.95), (0.3, 0.99), (0.01, 0.5)])
def test_the_nucleus_is_the_whole_sorts_on_peaked_and_flat_rows(spread, top_p):
    """top-p ranks only its leading tokens (64, then four times as many while their mass is short):
    the tokens it keeps are those a sort of the whole 49,152-token row keeps (drop a token when the
    tokens ranked above it reach top_p), from a peaked row (a few tokens) to a nearly flat one
    (most of the vocabulary, so the ranking grows to the whole row)."""
    scores = torch.randn(3, 49_152, generator=torch.Generator().manual_seed(int(spread * 100))) * spread
    got = warp(scores, [SamplingParams(temperature=1.0, top_p=top_p)] * 3)
    probs = torch.softmax(scores, -1)
    ranked, order = torch.sort(probs, dim=-1, descending=True)
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, (torch.cumsum(ranked, -1) - ranked) >= top_p)
    assert torch.equal(got > 0, ~drop)
    kept = (~drop).sum(-1)
    assert bool((kept >= 1).all())
    if spread >= 8:
        assert int(kept.max()) < 64  # within the first ranking
    elif spread < 0.5:
        assert int(kept.max()) > 4 * 4 * 64  # the ranking grew three times


def test_a_batch_of_mixed_settings_gives_each_row_its_own_result():
    """Rows with different processors and warpers in one choice: each row bitwise what it gets alone."""
    settings = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, seed=1),
                SamplingParams(logit_bias={7: 5.0}, repetition_penalty=1.4),
                SamplingParams(temperature=1.2, top_p=0.7, min_p=0.02, frequency_penalty=0.8, seed=2),
                SamplingParams(presence_penalty=1.0, min_tokens=3, max_tokens=8),
                SamplingParams(temperature=0.5, seed=3, logit_bias={1: -100.0})]
    logits = _logits(5, len(settings))
    rows = [_row(p, PROMPT, OUT[:2]) for p in settings]
    together = adjust(logits, rows, stop_ids=(0,))
    for i, p in enumerate(settings):
        alone = adjust(logits[i : i + 1], [rows[i]], stop_ids=(0,))
        assert torch.equal(together[i], alone[0]), i
    drawn = [i for i, p in enumerate(settings) if p.temperature > 0]
    probs = warp(together[drawn], [settings[i] for i in drawn])
    for j, i in enumerate(drawn):
        assert torch.equal(probs[j], warp(together[i : i + 1], [settings[i]])[0]), i
    # the seeded draws too: the same tokens in the batch as one by one
    def gens():
        return [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in settings]

    batch_rows = [Row(p, g, r.n_out, r.counts, r.seen) for p, g, r in zip(settings, gens(), rows)]
    single = [choose(logits[i : i + 1], [Row(p, g, r.n_out, r.counts, r.seen)], stop_ids=(0,))[0]
              for i, (p, g, r) in enumerate(zip(settings, gens(), rows))]
    assert choose(logits, batch_rows, stop_ids=(0,)) == single


def test_draws_follow_the_distribution_and_never_take_a_token_of_weight_zero():
    """draw() against the probabilities it is given: 40,000 draws of a warped row land on each token
    as often as its probability says (every count within 4.5 standard deviations), never on a
    token top-k removed, the same token for the same generator state, and weights that sum to
    nothing are refused rather than drawn from."""
    probs = warp(_logits(3) / 2, [SamplingParams(temperature=1.0, top_k=20)])[0]
    g = torch.Generator().manual_seed(11)
    n = 40_000
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(n)]), minlength=V).double()
    p = probs.double()
    assert counts[p == 0].sum() == 0 and int((p > 0).sum()) == 20
    sd = (n * p * (1 - p)).sqrt()
    assert bool(((counts - n * p).abs() <= 4.5 * sd + 1).all()), (counts[p > 0], n * p[p > 0])
    weights = probs * 7.5  # unnormalized weights: the same draws
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert [draw(probs, a) for _ in range(50)] == [draw(weights, b) for _ in range(50)]
    for bad in (torch.zeros(V), torch.full((V,), float("nan")), torch.full((V,), float("inf"))):
        with pytest.raises(RuntimeError, match="invalid sampling distribution"):
            draw(bad, g)


def test_bad_values_are_refused_with_the_parameter_named():
    for kw, word in [(dict(logit_bias={5: 101}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
                     (dict(logit_bias={-1: 1}), "logit_bias"), (dict(presence_penalty=2.5), "presence_penalty"),
                     (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                     (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_tokens=-1), "min_tokens"),
                     (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(stop_token_ids=[-3]), "stop_token_ids")]:
        with pytest.raises(InvalidParams, match=word):
            SamplingParams(**kw)
    with pytest.raises(InvalidParams, match="outside the vocabulary"):
        SamplingParams(logit_bias={10**6: 1.0}).check_vocab(1000)


# -- through the engine, on the bundled model ----------------------------------------------------------
def test_stop_token_ids_end_the_text_before_the_token(smollm_q):
    free = smollm_q.generate(["The capital of France is"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    out = smollm_q.generate(["The capital of France is"], SamplingParams(max_tokens=12, stop_token_ids=[stop]))[0]
    assert out.token_ids == free.token_ids[:first] and out.finish_reason == "stop"


def test_min_tokens_outlasts_an_early_eos(smollm_q):
    prompt = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    short = smollm_q.generate([prompt], SamplingParams(max_tokens=40), chat=True)[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    longer = smollm_q.generate([prompt], SamplingParams(max_tokens=40, min_tokens=len(short.token_ids) + 5),
                               chat=True)[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 5
    assert longer.token_ids[: len(short.token_ids)] == short.token_ids  # same path until EOS was held back


def test_penalties_and_bias_change_greedy_text_in_the_batch(smollm_q):
    prompt = "List the numbers: one, two, one, two, one, two,"
    plain, rep, freq, bias = smollm_q.generate_batch(
        [prompt] * 4, [SamplingParams(max_tokens=16), SamplingParams(max_tokens=16, repetition_penalty=1.8),
                       SamplingParams(max_tokens=16, frequency_penalty=2.0),
                       SamplingParams(max_tokens=16, logit_bias={smollm_q.encode(" one")[0]: -100})])
    assert rep.token_ids != plain.token_ids and freq.token_ids != plain.token_ids
    assert smollm_q.encode(" one")[0] not in bias.token_ids
    # the batch gives each request what it gets alone
    alone = smollm_q.generate([prompt], SamplingParams(max_tokens=16, repetition_penalty=1.8))[0]
    assert alone.token_ids == rep.token_ids


@pytest.mark.parametrize("variant", [v for v in build.variants() if build.runnable(v)], ids=lambda v: v.name)
def test_the_mask_kernel_equals_the_torch_unpacking_on_every_variant(variant):
    """kernels/vmask.c sets exactly the tokens whose bit is clear to -inf (words of all ones, all
    zeros and mixed; a vocabulary that ends mid-word), on every kernel variant this CPU runs."""
    from test_qweights import variant_lib

    from kvcache.engine.grammar import allowed_tokens

    lib = variant_lib(variant)
    g = torch.Generator().manual_seed(9)
    for vocab in (300, 49152, 33):
        words = (vocab + 31) // 32
        mask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
        mask[0, : words // 2] = -1
        mask[1, : words // 2] = 0
        logits = torch.randn(3, vocab, generator=g)
        want = logits.masked_fill(~allowed_tokens(mask, vocab), float("-inf"))
        got = logits.clone()
        assert lib.kv_mask_logits(3, vocab, got.data_ptr(), vocab, mask.data_ptr(), words) == 0
        assert torch.equal(got, want), (variant.name, vocab)
        assert torch.isinf(got[1, : (words // 2) * 32]).all() and torch.equal(got[0, :32], logits[0, :32])
    assert lib.kv_mask_logits(1, 64, got.data_ptr(), 64, mask.data_ptr(), 1) == -1  # a mask too short is refused
