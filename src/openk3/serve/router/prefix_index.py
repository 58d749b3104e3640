"""The router's approximate view of every worker's prefix cache: hash-chained prompt blocks per worker.

The router does not tokenize. A prompt is cut into blocks of ``chunk_chars`` characters (text, chat
messages flattened to text) or ``chunk_tokens`` ids (token-id prompts); block ``i`` is named by
``hash(name of block i − 1, block i)``, so equal names mean equal whole prefixes (the chain the servers
use for their own blocks; llm-d's approximate prefix scorer works the same way,
``docs/references.md#cache-aware-routing``). A worker's index holds the names of the prompts it served,
least recently used first, bounded; the match of a prompt on a worker is the number of its leading blocks
in that worker's index. Only full blocks count.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict

from openk3.serve.router.config import RouterConfig

ROOT = hashlib.blake2b(b"openk3 router prefix root", digest_size=8).digest()


def _chain(pieces: list[bytes]) -> list[bytes]:
    names, parent = [], ROOT
    for piece in pieces:
        parent = hashlib.blake2b(parent + piece, digest_size=8).digest()
        names.append(parent)
    return names


def flatten_messages(messages) -> str:
    """Chat messages as one text: ``role NUL content SOH`` per message (text parts of a list content
    joined), so a conversation's text is a prefix of its continuation's. Malformed entries count as empty
    (the worker answers the 400)."""
    out = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            texts = (p.get("text") for p in content if isinstance(p, dict))
            content = "".join(t for t in texts if isinstance(t, str))
        out.append(f"{m.get('role', '')}\x00{content if isinstance(content, str) else ''}\x01")
    return "".join(out)


def prompt_blocks(body: dict, config: RouterConfig) -> list[bytes]:
    """Chained names of the full prefix blocks of a completions or chat request body (``prompt``: a
    string, token ids, or a list of either, the first one counting; ``messages``: a chat). Anything else
    has no blocks."""
    if "messages" in body:
        return _text_blocks(flatten_messages(body["messages"]), config.chunk_chars)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _text_blocks(prompt, config.chunk_chars)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        n = config.chunk_tokens
        try:
            ids = array.array("q", prompt).tobytes()
        except OverflowError:
            return []
        return _chain([ids[i * 8 * n : (i + 1) * 8 * n] for i in range(len(prompt) // n)])
    return []


def _text_blocks(text: str, n: int) -> list[bytes]:
    return _chain([text[i * n : (i + 1) * n].encode("utf-8", "surrogatepass") for i in range(len(text) // n)])


class PrefixIndex:
    """Block names a worker served, least recently used first, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._names: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._names)

    def match(self, blocks: list[bytes]) -> int:
        """Leading blocks of ``blocks`` this worker holds."""
        n = 0
        for name in blocks:
            if name not in self._names:
                break
            n += 1
        return n

    def insert(self, blocks: list[bytes]) -> None:
        """Record a served prompt's blocks as most recently used (its first block the most: a match needs
        the leading ones), dropping the least recently used beyond capacity."""
        for name in reversed(blocks):
            self._names[name] = None
            self._names.move_to_end(name)
        while len(self._names) > self.capacity:
            self._names.popitem(last=False)

    def clear(self) -> None:
        self._names.clear()
