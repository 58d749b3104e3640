"""Incremental detokenization with stop strings held back until resolved.

Each push decodes a short window of ids, not the whole output (vLLM's ``prefix_offset``/``read_offset``
scheme): the ids from the start of the last committed piece to the end, minus the text of that piece,
is the new text. Byte-level BPE decodes a prefix of ids to a prefix of the text, except for a trailing
incomplete UTF-8 character, shown as U+FFFD: such a tail is not committed until a later token completes it
(or :meth:`~IncrementalDetokenizer.flush` writes it out). Text that could still become the start of a stop
string is held back too, so a client never receives part of a stop string; when a stop string appears, the
text ends just before it.
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
        """Committed text (no incomplete character at its end)."""
        self.emitted = 0
        self.stopped = False
        self.prefix_offset = 0
        """``token_ids[prefix_offset:read_offset]`` decode to the last committed piece of ``text``."""
        self.read_offset = 0

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
        piece = self._new_text()
        if not piece.endswith(REPLACEMENT_CHAR):
            self.text += piece
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        if self.stop:
            hits = [i for i in (self.text.find(s, self.emitted) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                out, self.emitted, self.stopped = self.text[self.emitted : cut], cut, True
                self.text = self.text[:cut]
                return out, True
        end = len(self.text)
        end -= self._held_back(end)
        out, self.emitted = self.text[self.emitted : end], max(end, self.emitted)
        return out, False

    def _new_text(self) -> str:
        """Text of the ids after ``read_offset``, decoded in the window from ``prefix_offset``."""
        if self.read_offset == len(self.token_ids):
            return ""
        before = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        return self.tokenizer.decode(self.token_ids[self.prefix_offset :])[len(before) :]

    def flush(self) -> str:
        """Everything not yet emitted (the held-back tail) once no more tokens come."""
        if not self.stopped:
            self.text += self._new_text()
            self.prefix_offset = self.read_offset = len(self.token_ids)
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out
