"""The tokenizer: a byte-level BPE trained here with Hugging Face ``tokenizers``, or a loaded
``tokenizer.json`` or ``.tiktoken`` file, behind one small :class:`Tokenizer` wrapper.

Trained tokenizers (:meth:`Tokenizer.train`) are GPT-2-style byte-level BPE: the ``ByteLevel`` pre-tokenizer
(GPT-2 split regex, no prefix space) over an initial alphabet of all 256 bytes, so every string encodes and
decodes back exactly (``docs/references.md#tokenizers``). Special tokens take the first ids, in this order:

=====================  ====  ========================================================================
token                  id    use
=====================  ====  ========================================================================
``<|endoftext|>``      0     end of a document: written after every document in the token shards, and
                             the ``eos_id`` used to stop generation
``<|im_start|>``       1     reserved for a chat template (ChatML role header)
``<|im_end|>``         2     reserved for a chat template (end of a chat turn)
``<|pad|>``            3     reserved for padding batches of unequal length
=====================  ====  ========================================================================

Reserving the chat tokens now means supervised fine-tuning later needs no new embedding rows.

``.tiktoken`` files (base64 token + rank per line, e.g. GPT-2's ``whisper/assets/gpt2.tiktoken`` from
``openai-whisper==20250625``) are loaded through ``tiktoken`` when it is installed (an optional dependency).
Such a file holds no split regex and no special tokens; the defaults are GPT-2's (``GPT2_PAT_STR`` and
``<|endoftext|>`` = number of ranks, i.e. 50256 for GPT-2; ``docs/references.md#tokenizers``).

``text`` in encode calls is a Python ``str``; ids are Python ``int`` in ``[0, vocab_size)``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
DEFAULT_SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>", "<|pad|>")
"""Special tokens of a trained tokenizer, ids 0, 1, 2, 3 (see the module docstring)."""

GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
"""GPT-2 (r50k_base) pre-tokenizer regex, the default for ``.tiktoken`` files
(``docs/references.md#tokenizers``)."""

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "[EOS]", "<|end_of_text|>", "<eos>", "<|im_end|>")


def _hf():
    import tokenizers

    return tokenizers


def _read_config(path: Path) -> dict:
    """``tokenizer_config.json`` as a dict; raises ``ValueError`` naming the file when it is not a JSON
    object."""
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON (truncated or corrupt?): {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object (corrupt?)")
    return config


class Tokenizer:
    """Text ↔ token ids. Build with :meth:`train` or :meth:`load`; write with :meth:`save`.

    Attributes: ``vocab_size`` (size of the id space = largest id + 1, special tokens included),
    ``eos_id`` / ``eos_token`` (document separator), ``special_tokens`` (token → id), ``kind``
    (``"tokenizers"`` or ``"tiktoken"``), ``sha256`` (hash of the serialised tokenizer; recorded in shard
    metadata so shards are never paired with another tokenizer).
    """

    def __init__(
        self,
        backend,
        kind: str,
        special_tokens: dict[str, int],
        eos_token: str,
        sha256: str,
        tiktoken_meta: dict | None = None,
    ):
        if eos_token not in special_tokens:
            raise ValueError(
                f"eos token {eos_token!r} is not a special token of this tokenizer "
                f"(special tokens: {sorted(special_tokens)})"
            )
        self._backend = backend
        self.kind = kind
        self.special_tokens = dict(special_tokens)
        self.eos_token = eos_token
        self.eos_id = special_tokens[eos_token]
        self.sha256 = sha256
        self._tiktoken_meta = tiktoken_meta
        if kind == "tiktoken":
            self.vocab_size = backend.n_vocab
        else:
            self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1

    def __repr__(self) -> str:
        eos = f"{self.eos_token!r}={self.eos_id}"
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, eos={eos})"

    # ---- encode / decode -------------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``. With ``allow_special=False`` (default, right for training data) a special
        token's string inside ``text`` is encoded as ordinary text; with ``True`` it maps to its special
        id."""
        return self.encode_batch([text], allow_special)[0]

    def encode_batch(self, texts: Sequence[str], allow_special: bool = False) -> list[list[int]]:
        """:meth:`encode` over a list; the ``tokenizers`` backend encodes the items in parallel (Rust threads,
        no multiprocessing; ``RAYON_NUM_THREADS`` sets the count)."""
        texts = list(texts)
        if self.kind == "tiktoken":
            if allow_special:
                return self._backend.encode_batch(texts, allowed_special="all")
            return self._backend.encode_ordinary_batch(texts)
        self._backend.encode_special_tokens = not allow_special
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens are written out, so ``decode(encode(s)) == s`` for any ``s``)."""
        ids = [int(i) for i in ids]
        if self.kind == "tiktoken":
            return self._backend.decode(ids)
        return self._backend.decode(ids, skip_special_tokens=False)

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """Most UTF-8 bytes of text that one token stands for (special tokens included), or ``None`` where
        that bounds nothing (a ``tokenizers`` backend with a normalizer, which may shrink the text first).

        Encoding a text of ``b`` bytes gives at least ``ceil(b / max_token_bytes)`` tokens, since the tokens
        of a byte-level tokenizer cover the text's bytes; the server uses it to refuse a prompt that cannot
        fit the context without tokenizing it. A token that is part of a UTF-8 character is counted as the
        replacement character it decodes to (3 bytes, never fewer than its own), so the bound stays safe.
        Computed once, by decoding every id (~1 s for a 160K vocabulary)."""
        if self.kind == "tokenizers" and self._backend.normalizer is not None:
            return None
        longest = 1
        for i in range(self.vocab_size):
            try:
                longest = max(longest, len(self.decode([i]).encode("utf-8")))
            except (KeyError, ValueError):  # an id tiktoken leaves unused
                continue
        return longest

    def check_fits(self, model_vocab_size: int) -> None:
        """Raise ``ValueError`` when this tokenizer's ids do not fit a model with ``model_vocab_size``
        embedding rows."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"the tokenizer has {self.vocab_size} ids but the model's vocab_size is {model_vocab_size}: "
                "use a model (preset) with a vocab_size at least that large, or a smaller tokenizer"
            )

    # ---- training --------------------------------------------------------------------------------------
    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
        min_frequency: int = 2,
        length: int | None = None,
        show_progress: bool = False,
    ) -> Tokenizer:
        """Train a byte-level BPE on ``texts`` (e.g. the train documents only).

        ``vocab_size``: target size including the 256 byte tokens and ``special_tokens`` (ids 0..); a small
        corpus can stop short of it (no pair left with ``min_frequency`` occurrences). ``special_tokens[0]``
        becomes the eos token. ``length`` (number of texts) only feeds the progress bar, which ``tokenizers``
        draws on stdout and so is shown only when stdout is a terminal (else it leaves empty lines). Raises
        ``ValueError`` when ``vocab_size`` cannot hold the bytes and special tokens.
        """
        tk = _hf()
        if not special_tokens:
            raise ValueError("special_tokens must hold at least the eos token, e.g. '<|endoftext|>'")
        floor = 256 + len(special_tokens)
        if vocab_size < floor:
            raise ValueError(
                f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least {floor} "
                f"(256 bytes + {len(special_tokens)} special tokens)"
            )
        backend = tk.Tokenizer(tk.models.BPE())
        backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(special_tokens),
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress and sys.stdout.isatty(),
        )
        backend.train_from_iterator(texts, trainer, length=length)
        return cls._from_hf(backend, eos_token=special_tokens[0])

    # ---- load / save -----------------------------------------------------------------------------------
    @classmethod
    def _from_hf(cls, backend, eos_token: str | None = None) -> Tokenizer:
        specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        if eos_token is None:
            eos_token = next((t for t in _EOS_CANDIDATES if t in specials), None)
            if eos_token is None:
                raise ValueError(
                    f"cannot tell the eos token of this tokenizer (special tokens: {sorted(specials)}): "
                    f"give it a special token named one of {list(_EOS_CANDIDATES)}, or in Python pass "
                    "Tokenizer.load(path, eos_token=...)"
                )
        digest = hashlib.sha256(backend.to_str().encode()).hexdigest()
        return cls(backend, "tokenizers", specials, eos_token, digest)

    @classmethod
    def from_tiktoken_file(
        cls,
        path: str | os.PathLike,
        pat_str: str = GPT2_PAT_STR,
        special_tokens: dict[str, int] | None = None,
        eos_token: str = EOS_TOKEN,
    ) -> Tokenizer:
        """Load a ``.tiktoken`` ranks file through ``tiktoken`` (raises ``ImportError`` with the install
        command when it is missing). ``special_tokens`` defaults to ``{eos_token: number of ranks}``."""
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as e:
            raise ImportError(f"loading {os.fspath(path)!r} needs tiktoken: pip install tiktoken") from e
        path = Path(path)
        raw = path.read_bytes()
        try:
            ranks = load_tiktoken_bpe(str(path))
        except (ValueError, IndexError) as e:  # a line that is not "base64-token rank"
            raise ValueError(f"{path} is not a valid .tiktoken file (truncated or corrupt?): {e}") from e
        if special_tokens is None:
            special_tokens = {eos_token: len(ranks)}
        encoding = tiktoken.Encoding(
            path.stem, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=dict(special_tokens)
        )
        meta = {"tiktoken_file": path.name, "pat_str": pat_str, "special_tokens": dict(special_tokens)}
        digest = hashlib.sha256(raw + json.dumps(meta, sort_keys=True).encode()).hexdigest()
        return cls(
            encoding, "tiktoken", special_tokens, eos_token, digest, tiktoken_meta={**meta, "path": str(path)}
        )

    @classmethod
    def load(cls, path: str | os.PathLike, eos_token: str | None = None) -> Tokenizer:
        """Load from a folder written by :meth:`save` (or any folder with a ``tokenizer.json``), a
        ``tokenizer.json`` file, or a ``.tiktoken`` file. The eos token comes from ``eos_token``, else the
        folder's ``tokenizer_config.json``, else the first of ``<|endoftext|>``, ``</s>``, ``[EOS]``, …
        present.
        Raises ``FileNotFoundError`` for a path holding none of these, ``ValueError`` naming the file when
        ``tokenizer.json``, ``tokenizer_config.json`` or the ``.tiktoken`` file cannot be parsed.
        """
        path = Path(path)
        config = {}
        if path.is_dir():
            if (path / TOKENIZER_CONFIG).is_file():
                config = _read_config(path / TOKENIZER_CONFIG)
            if config.get("tiktoken_file"):
                return cls.from_tiktoken_file(
                    path / config["tiktoken_file"],
                    pat_str=config.get("pat_str", GPT2_PAT_STR),
                    special_tokens=config.get("special_tokens"),
                    eos_token=eos_token or config.get("eos_token", EOS_TOKEN),
                )
            tiktoken_files = sorted(path.glob("*.tiktoken"))
            if not (path / TOKENIZER_JSON).is_file() and len(tiktoken_files) == 1:
                path = tiktoken_files[0]
            else:
                path = path / TOKENIZER_JSON
        if not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer at {str(path)!r} (expected a folder with tokenizer.json, "
                "a tokenizer.json file or a .tiktoken file)"
            )
        if path.suffix == ".tiktoken":
            return cls.from_tiktoken_file(path, eos_token=eos_token or EOS_TOKEN)
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        try:
            backend = _hf().Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust backend raises a bare Exception ("expected value at line 1 ...")
            raise ValueError(f"{path} is not a valid tokenizer.json (truncated or corrupt?): {e}") from e
        return cls._from_hf(backend, eos_token=eos_token or eos)

    def save(self, folder: str | os.PathLike) -> Path:
        """Write the tokenizer into ``folder`` (created): ``tokenizer.json`` (or the ``.tiktoken`` file) and a
        ``tokenizer_config.json`` naming the eos/pad tokens, readable by :meth:`load` and by
        ``transformers.PreTrainedTokenizerFast``. Returns the folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config: dict = {"eos_token": self.eos_token, "model_max_length": None}
        if self.kind == "tiktoken":
            meta = self._tiktoken_meta
            target = folder / meta["tiktoken_file"]
            if Path(meta["path"]).resolve() != target.resolve():
                shutil.copyfile(meta["path"], target)
            config.update({k: meta[k] for k in ("tiktoken_file", "pat_str", "special_tokens")})
        else:
            self._backend.save(str(folder / TOKENIZER_JSON))
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            if "<|pad|>" in self.special_tokens:
                config["pad_token"] = "<|pad|>"
        config = {k: v for k, v in config.items() if v is not None}
        (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        return folder
