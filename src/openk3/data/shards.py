"""Token shards: the prepared, tokenized corpus on disk, and the batches read from it.

Legend (shape suffixes): ``B`` batch rows, ``T`` tokens per row (``seq_len``), ``N`` tokens in a split.

On-disk layout written by :func:`prepare_data` into ``out_dir``::

    data.json          manifest: inputs (path, name, size, mtime, ctime, SHA-256 of each file), parameters,
                       fingerprint, corpus report, splits
    tokenizer/         tokenizer.json (or .tiktoken) + tokenizer_config.json  (Tokenizer.load reads it)
    train.bin          raw little-endian token ids, uint16 when every id fits (vocab_size ≤ 65536) else uint32
    train.json         metadata of the split: dtype, num_tokens, vocab_size, eos_id, tokenizer sha256, …
    val.bin, val.json  the same for the held-out documents

A split is the concatenation, in input order, of ``encode(document) + [eos_id]`` for each of its documents:
every document is followed by one ``<|endoftext|>``, so ``num_tokens = Σ len(encode(doc)) + num_documents``.
Documents are encoded as plain text (a special token's string inside a document is not a special token).

:func:`prepare_data` re-uses existing shards when the fingerprint is unchanged; otherwise it rebuilds them,
writing every file under a temporary name and renaming it into place, and writing ``data.json`` last, so an
interrupted build is never taken for a finished one. The fingerprint is the SHA-256 of: each input file's name
relative to the inputs' common folder and the SHA-256 of its bytes (:func:`openk3.data.corpus.source_records`;
a hash recorded in ``data.json`` is reused while the file's size, mtime and ctime are unchanged), the JSONL
text field, the tokenizer (its own SHA-256) or tokenizer-training settings, the model vocab size, the split
settings and the format version. It does not change when a file is touched, restored byte for byte or the
corpus folder is moved; it changes when any byte of an input changes or a file is added, removed or renamed.

A ``data.json`` written before content hashes (its sources have no ``sha256``) recorded a fingerprint of
input paths, sizes and mtimes; while that older fingerprint still matches the inputs, the build is re-used
and its manifest upgraded in place (hashes added, new fingerprint), otherwise it is rebuilt.

When it builds, :func:`prepare_data` prints the corpus problems (:meth:`CorpusReport.summary`: invalid UTF-8
replaced, binary files skipped, bad JSONL records and empty documents skipped) as one line to stderr; nothing
when the corpus is clean.

:class:`TokenDataset` memory-maps one split; :class:`RandomBatches` draws training batches from it with a
resumable position (``state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from openk3.data.corpus import (
    CorpusReport,
    Document,
    SourceFile,
    read_documents,
    resolve_inputs,
    source_records,
    split_documents,
)
from openk3.data.tokenizer import DEFAULT_SPECIAL_TOKENS, Tokenizer

SHARD_FORMAT_VERSION = 1
"""Bumped whenever the layout or content of the shards changes; a different version forces a rebuild."""

SPLITS = ("train", "val")
_MAX_LISTED_DOCUMENTS = 10_000
"""Document names are listed in the metadata up to this many per split (a count is always written)."""
_ENCODE_BATCH_CHARS = 1 << 21
"""Characters per ``encode_batch`` call (about 2 MB of text), also the progress-bar granularity."""


def shard_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id of a ``vocab_size``-id tokenizer fits (``vocab_size ≤ 65536``), else
    ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass
class SplitInfo:
    """One written split: ``path`` of its ``.bin``, token and document counts, document names (up to
    10,000)."""

    path: Path
    num_tokens: int
    num_documents: int
    documents: list[str]


@dataclass
class DataInfo:
    """What :func:`prepare_data` built (or re-used)."""

    out_dir: Path
    tokenizer: Tokenizer
    splits: dict[str, SplitInfo]
    report: CorpusReport
    reused: bool
    """True when existing shards matched the inputs and nothing was read or tokenized."""
    dtype: str
    model_vocab_size: int
    seconds: dict[str, float]
    """Wall-clock seconds: ``read``, ``tokenizer`` (training or loading), ``encode``, ``total``."""

    @property
    def train_path(self) -> Path:
        return self.splits["train"].path

    @property
    def val_path(self) -> Path:
        return self.splits["val"].path

    @property
    def tokenizer_dir(self) -> Path:
        return self.out_dir / "tokenizer"

    def lines(self) -> list[str]:
        """Human-readable summary (what the CLI prints)."""
        head = "re-used existing shards in" if self.reused else "wrote shards to"
        out = [f"{head} {self.out_dir}"]
        out += self.report.lines()
        out.append(
            f"tokenizer: {self.tokenizer.kind}, {self.tokenizer.vocab_size} ids "
            f"(model vocab_size {self.model_vocab_size}), eos {self.tokenizer.eos_token!r} = "
            f"{self.tokenizer.eos_id}, shards {self.dtype}"
        )
        for name, s in self.splits.items():
            out.append(f"{name}: {s.num_documents} document(s), {s.num_tokens:,} tokens -> {s.path.name}")
        out.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()))
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


# ---- fingerprint and manifest ----------------------------------------------------------------------------
def _sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _tokenizer_spec(tokenizer: Tokenizer | None, vocab_size: int, min_frequency: int) -> dict:
    if tokenizer is not None:
        return {"given": tokenizer.sha256}
    import tokenizers

    return {
        "train_bpe": {
            "vocab_size": vocab_size,
            "special_tokens": list(DEFAULT_SPECIAL_TOKENS),
            "min_frequency": min_frequency,
            "tokenizers": tokenizers.__version__,
        }
    }


def _read_manifest(out_dir: Path) -> dict | None:
    """The parsed ``data.json`` of ``out_dir``; None when missing, unreadable or not a JSON object."""
    try:
        manifest = json.loads((out_dir / "data.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _sources_of(manifest: dict | None) -> list:
    sources = manifest.get("sources") if isinstance(manifest, dict) else None
    return sources if isinstance(sources, list) else []


def _is_legacy(manifest: dict | None) -> bool:
    """A manifest written before content hashes: a source without ``sha256``."""
    return any(not isinstance(r, dict) or "sha256" not in r for r in _sources_of(manifest))


def _legacy_fingerprint(sources: list[SourceFile], params: dict) -> str:
    """The fingerprint openk3 recorded before content hashes: ``params`` with ``sources_sha256`` taken over
    the inputs' absolute paths, names, sizes and mtimes."""
    listed = [{"path": s.path, "name": s.name, "size": s.size, "mtime_ns": s.mtime_ns} for s in sources]
    return _sha256_json({**params, "sources_sha256": _sha256_json(listed)})


def _accepted_fingerprint(manifest: dict | None, sources: list[SourceFile], params: dict) -> str:
    """The fingerprint a build in the folder of ``manifest`` must record to be re-used: the one of
    ``params``, or, for a legacy manifest whose recorded fingerprint still matches the inputs' paths, sizes and
    mtimes (:func:`_legacy_fingerprint`), that recorded one."""
    if _is_legacy(manifest):
        recorded = manifest.get("fingerprint")
        if recorded == _legacy_fingerprint(sources, params):
            return recorded
    return _sha256_json(params)


def _refresh_manifest(out_dir: Path, manifest: dict, params: dict, records: list[dict]) -> None:
    """Rewrite a re-used build's manifest with the current source ``records`` (fresh stats and hashes, so the
    next call reuses them) and, for a legacy build, the content-based fingerprint (also in the split
    metadata). Split metadata first, ``data.json`` last, each renamed into place. Best effort: a folder that
    cannot be written (read-only shards) keeps its manifest, which stays valid (the next call re-hashes)."""
    fingerprint = _sha256_json(params)
    updates = []
    if manifest.get("fingerprint") != fingerprint:
        for name in SPLITS:
            meta_path = out_dir / f"{name}.json"
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                continue
            updates.append(
                (meta_path, {**meta, "fingerprint": fingerprint, "sources_sha256": params["sources_sha256"]})
            )
    new = {
        **manifest,
        "fingerprint": fingerprint,
        "sources_sha256": params["sources_sha256"],
        "sources": records,
    }
    updates.append((out_dir / "data.json", new))
    try:
        for path, obj in updates:
            _write_json(_tmp(path), obj)
            os.replace(_tmp(path), path)
    except OSError:
        for path, _ in updates:
            _tmp(path).unlink(missing_ok=True)


def _reuse(out_dir: Path, manifest: dict | None, fingerprint: str, t0: float) -> DataInfo | None:
    """The existing build in ``out_dir`` (its parsed ``manifest``) when it matches ``fingerprint`` and is
    complete, else None."""
    if (
        not manifest
        or manifest.get("fingerprint") != fingerprint
        or manifest.get("version") != SHARD_FORMAT_VERSION
    ):
        return None
    try:
        tokenizer = Tokenizer.load(out_dir / "tokenizer")
    except (OSError, ValueError, ImportError):
        return None
    if tokenizer.sha256 != manifest["tokenizer"]["sha256"]:
        return None
    itemsize = np.dtype(manifest["dtype"]).itemsize
    splits = {}
    for name in SPLITS:
        s = manifest["splits"][name]
        path = out_dir / f"{name}.bin"
        if not path.is_file() or path.stat().st_size != s["num_tokens"] * itemsize:
            return None
        splits[name] = SplitInfo(path, s["num_tokens"], s["num_documents"], s["documents"])
    return DataInfo(
        out_dir,
        tokenizer,
        splits,
        CorpusReport.from_dict(manifest["report"]),
        True,
        manifest["dtype"],
        manifest["model_vocab_size"],
        {"total": time.perf_counter() - t0},
    )


# ---- writing ---------------------------------------------------------------------------------------------
def _batches(docs: list[Document]) -> Iterator[list[Document]]:
    batch, chars = [], 0
    for d in docs:
        batch.append(d)
        chars += len(d.text)
        if chars >= _ENCODE_BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _write_split(path: Path, docs: list[Document], tokenizer: Tokenizer, dtype: np.dtype, bar) -> int:
    """Encode ``docs`` (each followed by eos) into the raw file ``path``; return the token count."""
    eos = [tokenizer.eos_id]
    n = 0
    with open(path, "wb") as f:
        for batch in _batches(docs):
            ids = tokenizer.encode_batch([d.text for d in batch])
            flat = np.fromiter(itertools.chain.from_iterable(i + eos for i in ids), dtype=dtype)
            flat.tofile(f)
            n += flat.size
            bar.update(sum(len(d.text) for d in batch))
    return n


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _write_build(
    out_dir: Path, parts: dict[str, list[Document]], tokenizer: Tokenizer, split_meta: dict, progress: bool
) -> dict[str, SplitInfo]:
    """Write tokenizer, shards and per-split metadata under temporary names, then rename them into place.

    ``data.json`` is deleted first (the folder is no finished build until the caller writes it again); on any
    error the temporary files are removed and the error re-raised."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "data.json").unlink(missing_ok=True)
    dtype = np.dtype(split_meta["dtype"])
    tok_tmp = _tmp(out_dir / "tokenizer")
    final = [out_dir / f"{name}{ext}" for name in SPLITS for ext in (".bin", ".json")]
    try:
        shutil.rmtree(tok_tmp, ignore_errors=True)
        tokenizer.save(tok_tmp)
        splits = {}
        total_chars = sum(len(d.text) for docs in parts.values() for d in docs)
        bar = tqdm(total=total_chars, unit="char", unit_scale=True, desc="tokenizing", disable=not progress)
        with bar:
            for name in SPLITS:
                path = out_dir / f"{name}.bin"
                n = _write_split(_tmp(path), parts[name], tokenizer, dtype, bar)
                names = [d.name for d in parts[name]]
                listed = names if len(names) <= _MAX_LISTED_DOCUMENTS else []
                splits[name] = SplitInfo(path, n, len(names), listed)
                meta = {
                    **split_meta,
                    "split": name,
                    "num_tokens": n,
                    "num_documents": len(names),
                    "documents": listed,
                }
                _write_json(_tmp(path.with_suffix(".json")), meta)
    except BaseException:
        shutil.rmtree(tok_tmp, ignore_errors=True)
        for path in final:
            _tmp(path).unlink(missing_ok=True)
        raise
    shutil.rmtree(out_dir / "tokenizer", ignore_errors=True)
    os.replace(tok_tmp, out_dir / "tokenizer")
    for path in final:
        os.replace(_tmp(path), path)
    return splits


def _build_params(data, vocab_size, tokenizer, val_fraction, seed, text_field, min_frequency, manifest):
    """(sources, their records, the parameters hashed into the fingerprint); checks the tokenizer fits and
    ``val_fraction``, resolves and hashes the inputs (reusing the hashes recorded in ``manifest`` for
    unchanged files; raising as :func:`prepare_data` says). Only names and content hashes of the sources
    enter the fingerprint, never their paths or stats."""
    if tokenizer is not None:
        tokenizer.check_fits(vocab_size)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must lie strictly between 0 and 1")
    sources = resolve_inputs(data)
    records = source_records(sources, _sources_of(manifest))
    params = {
        "version": SHARD_FORMAT_VERSION,
        "sources_sha256": _sha256_json([{"name": r["name"], "sha256": r["sha256"]} for r in records]),
        "text_field": text_field,
        "tokenizer": _tokenizer_spec(tokenizer, vocab_size, min_frequency),
        "model_vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "seed": seed,
    }
    return sources, records, params


def data_fingerprint(
    data=None,
    *,
    vocab_size: int,
    tokenizer: Tokenizer | str | os.PathLike | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    text_field: str = "text",
    min_frequency: int = 2,
    out_dir: str | os.PathLike | None = None,
) -> str:
    """The fingerprint :func:`prepare_data` would compare with the one in ``data.json`` for these arguments
    (same meaning; a 64-hex-digit SHA-256, see the module doc), computed by hashing the input files but
    without decoding, tokenizing or writing anything: a build whose ``data.json`` holds another fingerprint
    would be rebuilt.

    ``out_dir`` (default ``None``): the folder of an earlier build. Its ``data.json`` lends the file hashes
    it recorded for files whose stats are unchanged (:func:`openk3.data.corpus.source_records`), so nothing is
    read; and when it was written before content hashes and still matches the inputs' paths, sizes and mtimes,
    its recorded fingerprint is returned (:func:`prepare_data` re-uses that build). Without ``out_dir`` every
    input file is read and hashed. Raises as :func:`prepare_data` does for missing inputs or a bad tokenizer.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = Tokenizer.load(tokenizer)
    manifest = _read_manifest(Path(out_dir)) if out_dir is not None else None
    sources, _, params = _build_params(
        data, vocab_size, tokenizer, val_fraction, seed, text_field, min_frequency, manifest
    )
    return _accepted_fingerprint(manifest, sources, params)


def prepare_data(
    data=None,
    *,
    out_dir: str | os.PathLike,
    vocab_size: int,
    tokenizer: Tokenizer | str | os.PathLike | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    text_field: str = "text",
    min_frequency: int = 2,
    progress: bool = True,
) -> DataInfo:
    """Read a corpus, split it by document, get a tokenizer and write the token shards (see the module doc).

    Args:
        data: ``None`` for the default Shakespeare corpus, or a file, folder, glob or list of them
            (:func:`openk3.data.corpus.resolve_inputs`).
        out_dir: folder for the shards (created).
        vocab_size: the model's ``vocab_size``; a trained BPE is sized to it, a given tokenizer must fit.
        tokenizer: ``None`` trains a byte-level BPE on the train documents only; else a :class:`Tokenizer`
            or a path :meth:`Tokenizer.load` accepts (folder, ``tokenizer.json`` or ``.tiktoken``).
        val_fraction, seed: document split (:func:`openk3.data.corpus.split_documents`); defaults 0.1, 0.
        text_field: JSONL field holding the text (default ``"text"``).
        min_frequency: BPE training: minimum pair count for a merge (default 2).
        progress: show progress bars (BPE training and tokenization).

    Input files are identified by content (module doc): a build is re-used after a file was touched, restored
    byte for byte or the corpus folder moved; the re-used ``data.json`` is then rewritten with the files'
    new stats (same fingerprint, shards untouched). When building, a file that looks binary is skipped and the
    corpus problems are printed to stderr in one line (:meth:`CorpusReport.summary`); the full report is in
    ``data.json`` (``"report"``).

    Returns a :class:`DataInfo` (``reused=True`` when the existing shards matched). Raises
    ``FileNotFoundError`` for a missing input path or corpus package, ``ValueError`` for a corpus without 2
    usable documents, a bad ``val_fraction`` or a tokenizer larger than ``vocab_size``.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = Tokenizer.load(tokenizer)
    old = _read_manifest(out_dir)
    sources, records, params = _build_params(
        data, vocab_size, tokenizer, val_fraction, seed, text_field, min_frequency, old
    )
    fingerprint = _sha256_json(params)
    reused = _reuse(out_dir, old, _accepted_fingerprint(old, sources, params), t0)
    if reused is not None:
        if old.get("fingerprint") != fingerprint or old.get("sources") != records:
            _refresh_manifest(out_dir, old, params, records)
        return reused

    seconds = {}
    docs, report = read_documents(sources, text_field=text_field)
    problems = report.summary()
    if problems:
        print(f"openk3: corpus: {problems} (details: {out_dir / 'data.json'})", file=sys.stderr)
    parts = dict(zip(SPLITS, split_documents(docs, val_fraction, seed), strict=True))
    seconds["read"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    if tokenizer is None:
        train_docs = parts["train"]
        tokenizer = Tokenizer.train(
            (d.text for d in train_docs),
            vocab_size,
            min_frequency=min_frequency,
            length=len(train_docs),
            show_progress=progress,
        )
        tokenizer.check_fits(vocab_size)
    seconds["tokenizer"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    dtype = shard_dtype(tokenizer.vocab_size)
    split_meta = {
        "version": SHARD_FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "model_vocab_size": vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer_sha256": tokenizer.sha256,
        "sources_sha256": params["sources_sha256"],
        "fingerprint": fingerprint,
    }
    splits = _write_build(out_dir, parts, tokenizer, split_meta, progress)
    seconds["encode"] = time.perf_counter() - t2
    seconds["total"] = time.perf_counter() - t0
    manifest = {
        **params,
        "fingerprint": fingerprint,
        "sources": records,
        "dtype": dtype.name,
        "tokenizer": {
            "path": "tokenizer",
            "kind": tokenizer.kind,
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "spec": params["tokenizer"],
        },
        "splits": {
            k: {
                "path": v.path.name,
                "num_tokens": v.num_tokens,
                "num_documents": v.num_documents,
                "documents": v.documents,
            }
            for k, v in splits.items()
        },
        "report": report.to_dict(),
        "seconds": seconds,
    }
    _write_json(_tmp(out_dir / "data.json"), manifest)
    os.replace(_tmp(out_dir / "data.json"), out_dir / "data.json")
    return DataInfo(out_dir, tokenizer, splits, report, False, dtype.name, vocab_size, seconds)


# ---- reading ---------------------------------------------------------------------------------------------
class TokenDataset:
    """One split, memory-mapped read-only: ``TokenDataset("out/train.bin")`` (metadata from ``train.json``).

    Attributes: ``tokens_N`` (``np.memmap``, uint16/uint32), ``num_tokens``, ``vocab_size``, ``eos_id``,
    ``meta`` (the split's JSON). Raises ``FileNotFoundError`` when the ``.bin`` or its ``.json`` is missing.
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        meta_path = path.with_suffix(".json")
        if not path.is_file() or not meta_path.is_file():
            missing = path if not path.is_file() else meta_path
            raise FileNotFoundError(
                f"no token shard at {str(path)!r} ({missing.name} is missing): token splits (train.bin/val.bin "
                "with their .json) are written by `openk3 train` into RUN/data/, or by "
                "openk3.data.prepare_data(out_dir=...)"
            )
        self.path = path
        self.meta = json.loads(meta_path.read_text())
        dtype = np.dtype(self.meta["dtype"])
        expected = int(self.meta["num_tokens"]) * dtype.itemsize
        actual = path.stat().st_size
        if actual != expected:
            raise ValueError(
                f"token shard {str(path)!r} is {actual:,} bytes, but {meta_path.name} says "
                f"{self.meta['num_tokens']:,} {dtype.name} tokens = {expected:,} bytes: the shard is "
                "truncated or damaged; run prepare_data (or `openk3 train`) again, it rebuilds shards of the "
                "wrong size"
            )
        # np.memmap cannot map an empty file
        self.tokens_N = np.memmap(path, dtype=dtype, mode="r") if expected else np.zeros(0, dtype)
        self.num_tokens = int(self.tokens_N.size)
        self.vocab_size = int(self.meta["vocab_size"])
        self.eos_id = int(self.meta["eos_id"])

    def __len__(self) -> int:
        return self.num_tokens

    def check_tokenizer(self, tokenizer: Tokenizer, owner: str) -> None:
        """Raise ``ValueError`` unless this split was tokenized with ``tokenizer``: the ``tokenizer_sha256``
        recorded in its ``.json`` (:attr:`Tokenizer.sha256` of the tokenizer :func:`prepare_data` used) must
        equal ``tokenizer.sha256``. ``owner`` names where ``tokenizer`` comes from (e.g. a checkpoint
        folder), for the message. A split without the field (written by another tool) is not checked."""
        recorded = self.meta.get("tokenizer_sha256")
        if recorded is not None and recorded != tokenizer.sha256:
            raise ValueError(
                f"{self.path} was tokenized with another tokenizer than {owner}'s ({self.path.with_suffix('.json').name}"
                f" records tokenizer_sha256 {recorded[:12]}…, {owner} has {tokenizer.sha256[:12]}…): its token "
                "ids would mean other text to this model. Use the val.bin of the run that wrote the "
                "checkpoint, or tokenize your text with the checkpoint's tokenizer "
                "(openk3.data.prepare_data(..., tokenizer=<checkpoint folder>))"
            )

    def _check(self, batch_size: int, seq_len: int) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size={batch_size} and seq_len={seq_len} must be positive")
        if self.num_tokens < seq_len + 1:
            raise ValueError(
                f"{self.path.name} holds {self.num_tokens} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}: use shorter windows (train: --context-schedule, eval: --seq-len) or a larger corpus"
            )

    def _windows(self, starts_B: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        w_BT1 = self.tokens_N[starts_B[:, None] + np.arange(seq_len + 1)]
        w_BT1 = torch.from_numpy(w_BT1.astype(np.int64))
        return w_BT1[:, :-1].contiguous(), w_BT1[:, 1:].contiguous()

    def get_batch(
        self,
        batch_size: int,
        seq_len: int,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` windows at uniform random starts in ``[0, N − seq_len − 1]`` (drawn with
        ``torch.randint`` from ``generator``). Returns ``(x_BT, y_BT)``, int64 on CPU, ``y_BT[:, t] =
        x_BT[:, t + 1]`` within the split (next-token targets). Windows cross document boundaries (the eos
        tokens mark them). Raises ``ValueError`` when the split holds fewer than ``seq_len + 1`` tokens."""
        self._check(batch_size, seq_len)
        starts_B = torch.randint(0, self.num_tokens - seq_len, (batch_size,), generator=generator)
        return self._windows(starts_B.numpy(), seq_len)

    def num_windows(self, seq_len: int) -> int:
        """Non-overlapping windows :meth:`iter_sequential` yields: ``(N − 1) // seq_len``."""
        return (self.num_tokens - 1) // seq_len

    def iter_sequential(
        self,
        batch_size: int,
        seq_len: int,
        max_batches: int | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic evaluation batches: window ``i`` is ``x = tokens[i·T : i·T + T]``, ``y`` one token
        later, for ``i = 0 … num_windows − 1`` in order, ``batch_size`` windows per batch (the last batch may
        be smaller). Every token but the first and the last ``(N − 1) mod T`` is a target exactly once.
        ``max_batches`` stops early. Yields ``(x_BT, y_BT)`` int64."""
        self._check(batch_size, seq_len)
        n_win = self.num_windows(seq_len)
        for b, first in enumerate(range(0, n_win, batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            starts_B = np.arange(first, min(first + batch_size, n_win), dtype=np.int64) * seq_len
            yield self._windows(starts_B, seq_len)


def _step_seed(seed: int, step: int) -> int:
    digest = hashlib.sha256(f"openk3-batches\0{seed}\0{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class RandomBatches:
    """Endless random training batches from a :class:`TokenDataset` with an exactly resumable position.

    Batch ``s`` (0-based) is ``dataset.get_batch(batch_size, seq_len, g_s)`` with a generator seeded from
    ``sha256(seed, s)``, so it depends only on ``(seed, s)``: the position is the pair, ``state_dict()``
    saves it (JSON-serialisable ints) and ``load_state_dict`` restores it, after which the next batches are
    bit-identical to those of the uninterrupted run.
    """

    def __init__(self, dataset: TokenDataset, batch_size: int, seq_len: int, seed: int = 0):
        dataset._check(batch_size, seq_len)
        self.dataset = dataset
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.step = 0
        """Batches drawn so far (the index of the next batch)."""

    def __iter__(self) -> RandomBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(_step_seed(self.seed, self.step))
        self.step += 1
        return self.dataset.get_batch(self.batch_size, self.seq_len, g)

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "step": self.step,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": self.dataset.num_tokens,
            "tokenizer_sha256": self.dataset.meta["tokenizer_sha256"],
        }

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Restore ``seed`` and ``step``. With ``strict`` (default) raise ``ValueError`` when the saved
        ``batch_size``, ``seq_len``, split size or tokenizer differ (the batches would not be the same);
        ``strict=False`` restores the position anyway (e.g. after a planned change of ``seq_len``)."""
        if strict:
            now = self.state_dict()
            diff = [
                k
                for k in ("batch_size", "seq_len", "num_tokens", "tokenizer_sha256")
                if state.get(k) != now[k]
            ]
            if diff:
                raise ValueError(
                    ", ".join(f"{k}: saved {state.get(k)!r}, now {now[k]!r}" for k in diff)
                    + " (pass strict=False to resume the position anyway)"
                )
        self.seed = int(state["seed"])
        self.step = int(state["step"])
