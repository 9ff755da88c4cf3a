"""Presses: score-based token eviction, the cache's retention axis (``press=NAME`` in ``--kv``).

Prefill-time presses score a prompt's tokens once, when the prompt is in: ``knorm``, ``snapkv``,
``expected``, ``kvzip`` (which has the model replay the prompt to score it). Decode-time presses rescore as generation goes: ``tova``, ``h2o``. Each press is a
scoring rule over one layer's slots (press/base.py); the cache decides how many go and which are
protected, evicts them and packs what stays into fewer pages.
"""

from __future__ import annotations

from kvcache.press.base import LayerView, Press, choose
from kvcache.press.expected import ExpectedAttentionPress
from kvcache.press.h2o import H2OPress
from kvcache.press.knorm import KNormPress
from kvcache.press.kvzip import KVzipPress, ReplayPrompt, replay_prompt
from kvcache.press.snapkv import SnapKVPress
from kvcache.press.tova import TOVAPress

PRESSES: dict[str, type[Press]] = {p.name: p for p in (KNormPress, SnapKVPress, ExpectedAttentionPress,
                                                      TOVAPress, H2OPress, KVzipPress)}
# presses whose choice depends on nothing after the tokens they compress: a compressed shared
# prefix is the same whatever follows it
QUESTION_AGNOSTIC = ("knorm", "expected", "kvzip")


def make_press(name: str) -> Press:
    return PRESSES[name]()


__all__ = ["PRESSES", "QUESTION_AGNOSTIC", "LayerView", "Press", "ReplayPrompt", "choose", "make_press",
           "replay_prompt"]
