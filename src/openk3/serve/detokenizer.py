"""Incremental detokenization with stop strings held back until resolved.

Each push decodes all output ids so far (byte-level BPE decodes a prefix of ids to a prefix of the text,
except for a trailing incomplete UTF-8 character, shown as U+FFFD and held back). Text that could still
become the start of a stop string is held back too, so a client never receives part of a stop string; when
a stop string appears, the text ends just before it.
"""

from __future__ import annotations

from collections.abc import Iterable

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """``push(ids) -> (new_text, stopped)``, then ``flush()`` for the rest when the request ends."""

    def __init__(self, tokenizer, stop: Iterable[str] = (), skip_ids: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_ids = set(skip_ids)
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _held_back(self, end: int) -> int:
        """Length of the longest suffix of ``text[emitted:end]`` that starts some stop string."""
        for k in range(min(max((len(s) for s in self.stop), default=1) - 1, end - self.emitted), 0, -1):
            tail = self.text[end - k : end]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def push(self, token_ids: Iterable[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.token_ids += [t for t in token_ids if t not in self.skip_ids]
        self.text = self.tokenizer.decode(self.token_ids)
        if self.stop:
            hits = [i for i in (self.text.find(s, self.emitted) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                out, self.emitted, self.stopped = self.text[self.emitted : cut], cut, True
                self.text = self.text[:cut]
                return out, True
        end = len(self.text)
        while end > self.emitted and self.text[end - 1] == REPLACEMENT_CHAR:
            end -= 1
        end -= self._held_back(end)
        out, self.emitted = self.text[self.emitted : end], max(end, self.emitted)
        return out, False

    def flush(self) -> str:
        """Everything not yet emitted (the held-back tail) once no more tokens come."""
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out
