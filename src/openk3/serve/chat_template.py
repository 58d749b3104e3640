"""Chat messages → prompt token ids.

Uses the ``chat_template`` (Jinja, rendered in a sandbox with ``messages`` and
``add_generation_prompt=True``) of the checkpoint's ``tokenizer_config.json`` when there is one. Otherwise the
documented default is ChatML over the tokenizer's reserved special tokens (openk3.data.tokenizer: ids of
``<|im_start|>`` and ``<|im_end|>``)::

    <|im_start|>{role}\\n{content}<|im_end|>\\n   … per message, then   <|im_start|>assistant\\n

In the default, message text is encoded as plain text (a special token's string inside a message does
not become the special token). Generation stops at ``<|im_end|>`` as well as at the eos token.

A message's ``content`` may also be a list of pieces: text (``str``) and token ids (``list[int]``, an
image's placeholder tokens), kept in order; the default template takes them, a Jinja template does not.
"""

from __future__ import annotations

import json
from pathlib import Path

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class ChatTemplate:
    def __init__(self, tokenizer, jinja_source: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = None
        if jinja_source:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            self.template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
                jinja_source
            )
        specials = tokenizer.special_tokens
        self.im_start = specials.get(IM_START)
        self.im_end = specials.get(IM_END)
        self.stop_token_ids = {tokenizer.eos_id} | ({self.im_end} if self.im_end is not None else set())

    @classmethod
    def from_folder(cls, tokenizer, folder: str | Path) -> ChatTemplate:
        """Read ``chat_template`` from ``folder/tokenizer_config.json`` if present."""
        path = Path(folder) / "tokenizer_config.json"
        source = json.loads(path.read_text()).get("chat_template") if path.is_file() else None
        return cls(tokenizer, source if isinstance(source, str) else None)

    def encode(self, messages: list[dict]) -> list[int]:
        """``messages``: ``[{"role": ..., "content": str | list[str | list[int]]}, ...]`` → prompt ids ending in
        the assistant header. Raises ``ValueError`` for token-id pieces under a Jinja template."""
        tok = self.tokenizer
        if any(isinstance(m["content"], list) for m in messages):
            if self.template is not None:
                raise ValueError("this checkpoint's chat template (Jinja) does not take images")
            return self._encode_pieces(messages)
        if self.template is not None:
            text = self.template.render(
                messages=messages, add_generation_prompt=True, eos_token=tok.eos_token
            )
            return tok.encode(text, allow_special=True)
        if self.im_start is None or self.im_end is None:  # no reserved tokens: plain-text turns
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
            return tok.encode(text)
        ids: list[int] = []
        for m in messages:
            ids += (
                [self.im_start]
                + tok.encode(f"{m['role']}\n{m['content']}")
                + [self.im_end]
                + tok.encode("\n")
            )
        return ids + [self.im_start] + tok.encode("assistant\n")

    def _encode_pieces(self, messages: list[dict]) -> list[int]:
        """The default template over content pieces: text runs encoded, id pieces inserted as they are."""
        tok = self.tokenizer
        chatml = self.im_start is not None and self.im_end is not None
        ids: list[int] = []
        for m in messages:
            pieces = m["content"] if isinstance(m["content"], list) else [m["content"] or ""]
            head = f"{m['role']}\n" if chatml else f"{m['role']}: "
            body: list[int] = []
            for piece in pieces:
                if isinstance(piece, str):
                    body += tok.encode(head + piece)
                else:
                    body += (tok.encode(head) if head else []) + list(piece)
                head = ""
            if chatml:
                ids += [self.im_start] + body + [self.im_end] + tok.encode("\n")
            else:
                ids += body + tok.encode("\n")
        return ids + ([self.im_start] + tok.encode("assistant\n") if chatml else tok.encode("assistant:"))
