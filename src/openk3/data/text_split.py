"""A token split of raw text for ``openk3 eval --data FILE.txt``: the text tokenized with a given tokenizer.

:func:`write_text_split` reads text / JSONL files, folders or globs as training does
(:func:`openk3.data.corpus.read_documents`), encodes every document followed by the eos token, as
:func:`openk3.data.prepare_data` writes a split, and writes ``<name>.bin`` with its ``.json`` so
:class:`openk3.data.TokenDataset` reads it. Nothing is held out: the whole text is the split.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from openk3.data.corpus import read_documents, resolve_inputs


def write_text_split(data, tokenizer, path: str | Path) -> Path:
    """Tokenize the documents of ``data`` (a file, folder or glob) with ``tokenizer`` into the split
    ``path`` (``.bin``, uint16 when the tokenizer's ids fit, else uint32) and its ``.json`` (``num_tokens``,
    ``dtype``, ``vocab_size``, ``eos_id``, ``tokenizer_sha256``, ``documents``); returns ``path``. Raises
    ``FileNotFoundError`` / ``ValueError`` (from :func:`resolve_inputs` / :func:`read_documents`) for
    missing inputs or a corpus without usable text."""
    path = Path(path)
    docs, _ = read_documents(resolve_inputs(data))
    dtype = np.dtype(np.uint16) if tokenizer.vocab_size <= 1 << 16 else np.dtype(np.uint32)
    ids = tokenizer.encode_batch([d.text for d in docs])
    tokens = np.fromiter(itertools.chain.from_iterable(i + [tokenizer.eos_id] for i in ids), dtype=dtype)
    tokens.tofile(path)
    meta = {
        "split": "text",
        "num_tokens": int(tokens.size),
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer_sha256": tokenizer.sha256,
        "documents": [d.name for d in docs],
    }
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    return path
