"""Incremental detokenization with stop strings, for streaming: never a partial UTF-8 character,
never half a stop string (the last len(longest stop) - 1 characters are held back), and the
streamed pieces concatenate to the full decode of the output, cut at the stop string.
"""

from __future__ import annotations

from engine.model.tokenizer import Tokenizer


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self._tok = tokenizer
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # decode window start
        self._read_offset = 0  # tokens already turned into `text`
        self.text = ""  # all decoded text so far (may include held-back tail)
        self._emitted = 0  # chars of `text` handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Feeds one token; returns the newly streamable text. Sets `stopped` on a stop string."""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            search_from = max(0, len(self.text) - self._holdback)
            self.text += new
            for s in self._stop:
                at = self.text.find(s, search_from)
                if at != -1:
                    self.text = self.text[:at]
                    self.stopped = True
            if self.stopped:
                return self._release(len(self.text))
        return self._release(len(self.text) - self._holdback)

    def finish(self) -> str:
        """Everything not yet emitted (call once, when the request ends)."""
        if not self.stopped:
            self.text = self._tok.decode(self._ids)
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted:upto]
        self._emitted = upto
        return out
