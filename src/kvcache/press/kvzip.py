"""KVzip: keep the tokens the model needs to say the context again.

Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (arXiv
2505.23416). Once the prompt is in, the model reads a request to repeat it followed by the prompt
itself, chunk by chunk ("Repeat the previous context exactly." for the first chunk, "Repeat the
part of the previous context exactly, starting with" and the 8 tokens before it for the others,
then the chat template's opening of an answer); a slot's score is the largest attention any of
those replayed tokens gives it, over the query heads of its KV head. As kvpress computes it, the
softmax of a replayed token runs over the attention sinks (the first 4 tokens, never evicted), the
chunk being replayed and the replay tokens up to it. The replayed tokens are dropped afterwards.

What it costs: a second prefill of the prompt (plus its context: each replayed token attends to
the whole prompt). What it buys: nothing after the prompt is needed to choose, so a compressed
prompt can be shared (question-agnostic), and a token no query of the prompt looked at, a number
hidden in filler, is kept if saying the prompt again needs it.

kvpress evicts its global lowest scores (each layer and head a different count, masked); here each
layer and KV head keep the same count, as every press of this cache does. Chunks are kvpress's
2048 tokens, or fewer when the model's context has less room after the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.press.base import LayerView, Press

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk quoted in a later chunk's request


@dataclass(frozen=True)
class ReplayPrompt:
    """Token ids around each replayed chunk: ``first`` or ``later`` (then the previous chunk's last
    OVERLAP tokens), then ``suffix`` (what opens the model's answer), then the chunk."""

    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]

    def ids(self, context: list[int], a: int, b: int) -> list[int]:
        """The tokens that replay ``context[a:b]``."""
        head = list(self.first) if a == 0 else list(self.later) + context[max(0, a - OVERLAP) : a]
        return head + list(self.suffix) + context[a:b]

    def overhead(self) -> int:
        """Most tokens a chunk's request adds to it."""
        return max(len(self.first), len(self.later) + OVERLAP) + len(self.suffix)


def replay_prompt(tokenizer) -> ReplayPrompt:  # tokenizer: models.tokenizer.Tokenizer
    """The replay request in the model's own chat format (plain text with a newline without one)."""
    suffix = "\n"
    if getattr(tokenizer, "chat_template", None):
        marker = "\n" + "#" * 13
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "dummy context" + marker}])
            suffix = text.split(marker, 1)[1]
        except Exception:  # a template that cannot render one user turn: plain text
            suffix = "\n"
    enc = tokenizer.encode
    return ReplayPrompt(tuple(enc(FIRST)), tuple(enc(LATER)), tuple(enc(suffix)))


class KVzipPress(Press):
    name = "kvzip"
    replay = True
    chunk = 2048
    protect_first = 4  # kvpress's n_sink

    def score(self, view: LayerView) -> torch.Tensor:
        if view.acc is None:
            raise ValueError("KVzip scores come from replaying the prompt; none was replayed")
        return view.acc


def replay_peaks(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor, scale: float,
                 lo: int, hi: int, end: int, sinks: int = 4, rows: int = 256) -> torch.Tensor:
    """Replayed queries q [T, Hq, D] (RoPE applied, at q_pos [T], all >= ``end``) over the slots'
    keys [Hkv, S, D] at pos [Hkv, S] (-1: evicted): the softmax over the sinks (pos < ``sinks``),
    the chunk (``lo`` <= pos < ``hi``) and the replayed tokens up to each query; returns [Hkv, S],
    the largest weight any query of each KV head's group gives each chunk slot (0 elsewhere)."""
    t, hq, d = q.shape
    hkv, n = keys.shape[0], keys.shape[1]
    g = hq // hkv
    live = pos >= 0
    chunk = live & (pos >= lo) & (pos < hi)  # [Hkv, S]
    fixed = chunk | (live & (pos < min(sinks, lo)))
    replayed = live & (pos >= end)
    cols = (fixed | replayed).any(0).nonzero().flatten()  # the slots any softmax sees: a chunk's worth
    pos, chunk, fixed, replayed = pos[:, cols], chunk[:, cols], fixed[:, cols], replayed[:, cols]
    peak = torch.zeros(hkv, cols.shape[0])
    kt = keys[:, cols].float().transpose(1, 2)  # [Hkv, D, S']
    for a in range(0, t, rows):
        b = min(t, a + rows)
        qq = q[a:b].float().permute(1, 0, 2).reshape(hkv, g * (b - a), d)  # [Hkv, g T', D]
        s = torch.matmul(qq, kt).view(hkv, g, b - a, -1) * scale
        seen = fixed[:, None, :] | (replayed[:, None, :] & (pos[:, None, :] <= q_pos[a:b, None]))  # [Hkv, T', S]
        p = torch.softmax(s.masked_fill(~seen[:, None], float("-inf")), -1)
        peak = torch.maximum(peak, p.amax(dim=(1, 2)))
    out = torch.zeros(hkv, n)
    out[:, cols] = peak * chunk
    return out
