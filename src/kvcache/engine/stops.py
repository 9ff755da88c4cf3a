"""Text of a growing completion: incremental detokenization, stop strings, streaming hold-back."""

from __future__ import annotations

from kvcache.models.tokenizer import IncrementalDecoder, Tokenizer


class TextTracker:
    """Builds a sample's text token by token and finds stop strings.

    ``pending()`` returns text that is safe to stream: it holds back a tail that could still
    become the start of a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], keep: tuple[int, ...] = ()) -> None:
        self.decoder = IncrementalDecoder(tokenizer, keep=frozenset(keep))
        self.stops = stops
        self.text = ""
        self.emitted = 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, token_id: int) -> bool:
        """Add a token; True when a stop string now appears (the text is cut before it)."""
        delta = self.decoder.add(token_id)
        if not delta:
            return False
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        for stop in self.stops:
            at = self.text.find(stop, start)
            if at != -1:
                self.text = self.text[:at]
                return True
        return False

    def pending(self, final: bool) -> str:
        """Text not yet streamed; unless ``final``, minus what might begin a stop string."""
        end = len(self.text) if final or not self.stops else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
