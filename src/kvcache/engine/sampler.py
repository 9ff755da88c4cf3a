"""Token selection for a step's rows at once: the grammar's mask, min_tokens, logit_bias, the
repetition, frequency and presence penalties, then greedy or temperature, top-k, top-p, min-p, with
per-sample seeded generators.

Every per-request setting is a tensor over the rows that use it (``choose``): no Python loop runs
over the vocabulary, and a row's result does not depend on the other rows (each row's reductions
are its own), so a request picks the same token alone or in any batch.

Order (vLLM's): the mask and min_tokens (disallowed tokens get -inf), logit_bias (added), the
repetition penalty (transformers' and vLLM's: over the prompt's and the output's tokens, a positive
logit divided by it, a negative one multiplied), the frequency and presence penalties (OpenAI's:
``logit - count * frequency - (count > 0) * presence`` over the output's tokens); then greedy
takes the argmax, or sampling divides by the temperature and applies top-k, top-p and min-p in
transformers' order. Log-probabilities stay those of the model (``log_probs``: before any of this).

Inputs are bounded here rather than trusted: a seed is reduced modulo 2^64 (sample i of a request
uses seed + i, which may pass the top), and a temperature below ``GREEDY_BELOW`` picks greedily
(dividing logits by 1e-40 overflows float32 and turns the probabilities into NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.engine.params import SamplingParams, TokenLogprob

SEED_SPACE = 2**64  # torch generators take seeds in [0, 2^64)
GREEDY_BELOW = 1e-6  # temperatures below this are greedy: sampling there differs from argmax only in ties
NEG = float("-inf")


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW


def make_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """A generator for sample ``index`` of a request: seeded when params.seed is set."""
    if is_greedy(params):
        return None
    g = torch.Generator()
    if params.seed is not None:
        g.manual_seed((params.seed + index) % SEED_SPACE)
    else:
        g.seed()
    return g


@dataclass
class Row:
    """One sample's part of a step's choice.

    ``n_out``: tokens it has generated; ``counts``: how often each token occurs in its output [V]
    (float32; kept when frequency or presence penalties are asked for); ``seen``: the tokens of its
    prompt and output [V] (bool; for the repetition penalty); ``mask``: its row in the step's
    grammar masks, or None when it is free."""

    params: SamplingParams
    gen: torch.Generator | None = None
    n_out: int = 0
    counts: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    mask: int | None = None


def needs_counts(p: SamplingParams) -> bool:
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def needs_seen(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0


def choose(logits: torch.Tensor, rows: list[Row], masks: torch.Tensor | None = None,
           stop_ids: tuple[int, ...] = ()) -> list[int]:
    """One token per row of ``logits`` [R, V]. ``masks``: the step's grammar masks [M, W] (int32
    bitmasks, see engine/grammar.py), indexed by ``Row.mask``; ``stop_ids``: the end-of-sequence
    tokens, held back (with each row's ``stop_token_ids``) until ``min_tokens`` are out."""
    scores = adjust(logits, rows, masks, stop_ids)
    out = [0] * len(rows)
    greedy = [i for i, r in enumerate(rows) if is_greedy(r.params)]
    if greedy:
        picks = torch.argmax(scores[greedy] if len(greedy) < len(rows) else scores, dim=-1).tolist()
        for i, t in zip(greedy, picks):
            out[i] = int(t)
    drawn = [i for i, r in enumerate(rows) if not is_greedy(r.params)]
    if drawn:
        probs = warp(scores[drawn], [rows[i].params for i in drawn])
        for j, i in enumerate(drawn):
            out[i] = draw(probs[j], rows[i].gen)
    return out


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token drawn from ``probs`` [V] (non-negative weights; their sum need not be 1): one
    uniform u from ``gen`` (float64), then the first token whose cumulative weight (summed in
    float64, in token order) exceeds u times the total, so a token of weight 0 is never drawn.
    The same distribution as torch.multinomial(probs, 1), which took 0.85 ms a draw on a 49k-token
    vocabulary and 4.5 ms on a 262k one (this: 0.04 and 1.1), most of a sampled batch's step on
    the bundled model. A row's draw reads only its own weights and generator: the same token alone
    or in any batch."""
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    total = float(cdf[-1])
    if not 0.0 < total < float("inf"):
        raise RuntimeError(f"invalid sampling distribution (its weights sum to {total})")
    u = torch.rand(1, generator=gen, dtype=torch.float64)
    return min(int(torch.searchsorted(cdf, u * total, right=True)), len(cdf) - 1)


def adjust(logits: torch.Tensor, rows: list[Row], masks: torch.Tensor | None = None,
           stop_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """The logits [R, V] after masks, min_tokens, logit_bias and penalties (a copy when any applies)."""
    scores = logits.float()
    touched = False

    def own() -> torch.Tensor:
        nonlocal scores, touched
        if not touched:
            scores, touched = scores.clone(), True
        return scores

    masked = [i for i, r in enumerate(rows) if r.mask is not None]
    if masked and masks is not None:
        s = own()
        bits = masks[[rows[i].mask for i in masked]]  # type: ignore[misc]
        if len(masked) == len(rows):
            _mask(s, bits)
        else:
            sub = s[masked]
            _mask(sub, bits)
            s[masked] = sub
    held = [(i, tuple(stop_ids) + r.params.stop_token_ids) for i, r in enumerate(rows)
            if r.n_out < r.params.min_tokens]
    if held:
        ri = [i for i, ids in held for _ in ids]
        ti = [t for _, ids in held for t in ids]
        if ri:
            s = own()
            before = s[[i for i, _ in held]].clone()
            s[ri, ti] = NEG
            # the grammar's end wins over min_tokens: a row left with no token keeps its stops
            dead = torch.isinf(s[[i for i, _ in held]]).all(-1)
            if bool(dead.any()):
                for k in dead.nonzero().flatten().tolist():
                    s[held[k][0]] = before[k]
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if biased:
        ri = [i for i, b in biased for _ in b]
        ti = [t for _, b in biased for t, _ in b]
        vals = torch.tensor([v for _, b in biased for _, v in b], dtype=torch.float32)
        s = own()
        s.index_put_((torch.tensor(ri), torch.tensor(ti)), vals, accumulate=True)
    rep = [i for i, r in enumerate(rows) if needs_seen(r.params) and r.seen is not None]
    if rep:
        s = own()
        pen = torch.tensor([rows[i].params.repetition_penalty for i in rep], dtype=torch.float32)[:, None]
        seen = torch.stack([rows[i].seen for i in rep])  # type: ignore[misc]
        x = s[rep]
        s[rep] = torch.where(seen, torch.where(x < 0, x * pen, x / pen), x)
    pf = [i for i, r in enumerate(rows) if needs_counts(r.params) and r.counts is not None]
    if pf:
        s = own()
        freq = torch.tensor([rows[i].params.frequency_penalty for i in pf], dtype=torch.float32)[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in pf], dtype=torch.float32)[:, None]
        counts = torch.stack([rows[i].counts for i in pf])  # type: ignore[misc]
        s[pf] = s[pf] - counts * freq - (counts > 0).float() * pres
    return scores


def _mask(scores: torch.Tensor, bits: torch.Tensor) -> None:
    """-inf, in place, for the tokens the grammar bitmasks [R, W] do not allow (the native kernel;
    torch where it is missing)."""
    from kvcache import kernels

    if not kernels.mask_logits(scores, bits.contiguous()):
        from kvcache.engine.grammar import allowed_tokens

        scores.masked_fill_(~allowed_tokens(bits, scores.shape[-1]), NEG)


def warp(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The probabilities [R, V] tokens are drawn from: scores [R, V] divided by each row's
    temperature, then top-k, top-p and min-p, in transformers' order (its logits warpers give the
    same). A row whose setting is off is left as it is."""
    vocab = scores.shape[-1]
    temp = torch.tensor([max(p.temperature, GREEDY_BELOW) for p in params], dtype=torch.float32)[:, None]
    scores = scores / temp
    topk = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if topk:  # keep the scores of at least the k-th largest (ties with it kept)
        ks = torch.tensor([params[i].top_k for i in topk])[:, None]
        rows = scores[topk]
        kth = torch.topk(rows, int(ks.max()), dim=-1).values.gather(1, ks - 1)
        scores[topk] = rows.masked_fill(rows < kth, NEG)
    for i, p in enumerate(params):
        if p.top_p < 1.0:
            scores[i] = _top_p(scores[i], p.top_p)
    probs = torch.softmax(scores, -1)
    mp = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if mp:  # keep p >= min_p * max p
        sub = probs[mp]
        floor = torch.tensor([params[i].min_p for i in mp], dtype=torch.float32)[:, None] * sub.max(-1, keepdim=True).values
        sub = sub.masked_fill(sub < floor, 0.0)
        probs[mp] = sub / sub.sum(-1, keepdim=True)
    return probs


def _top_p(scores: torch.Tensor, top: float) -> torch.Tensor:
    """A row's ``scores`` [V] with every token dropped (-inf) whose higher-ranked tokens'
    probabilities already reach ``top`` (the nucleus). Only the leading tokens are ranked: the
    largest 64 probabilities, four times as many while their mass is short of top, since a token
    ranked below a set that reaches top is dropped whatever its own probability (a whole sort of a
    49k-token row took about 8 ms a token). Each row is ranked on its own, so its nucleus never
    depends on the rows beside it."""
    probs = torch.softmax(scores, -1)
    vocab = scores.shape[-1]
    n = min(64, vocab)
    while True:
        ranked, order = torch.topk(probs, n)
        mass = torch.cumsum(ranked, -1)
        if n == vocab or float(mass[-1]) >= top:
            break
        n = min(4 * n, vocab)
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter(0, order, (mass - ranked) < top)
    return scores.masked_fill(~keep, NEG)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities under the model: log-softmax of the raw logits [..., V] (float32)."""
    return torch.log_softmax(logits.float(), -1)


def token_logprob(lp: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``token``'s entry in log-probabilities ``lp`` [V], with the ``k`` most likely tokens."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(int(token), float(lp[token]), top)
