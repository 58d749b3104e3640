"""The README's promises that code can check: its Python snippet runs as pasted, its file tree names files
that exist, and it stays within its length."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import openk3
from openk3.data import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
pytestmark = pytest.mark.usefixtures("one_thread")


def code_block(language: str, after: str = "") -> str:
    """The first fenced block of ``language`` (``""`` for a plain fence) after the text ``after``."""
    start = README.index(after) if after else 0
    match = re.search(rf"^```{language}\n(.*?)^```", README[start:], flags=re.S | re.M)
    assert match, f"no ```{language} block after {after!r}"
    return match.group(1)


def test_python_snippet_runs_as_pasted(tmp_path, monkeypatch, capsys):
    """The snippet loads ``runs/k3-tiny``; here that folder holds an untrained k3-tiny with a small BPE
    (the Quickstart's run has the same layout for ``from_pretrained``: a model folder with its tokenizer)."""
    monkeypatch.chdir(tmp_path)
    tokenizer = Tokenizer.train(["KING HENRY: to be or not to be, that is the question. " * 40], 300)
    model = openk3.build_model(openk3.get_preset("k3-tiny"), seed=0)
    openk3.save_pretrained(model, tmp_path / "runs" / "k3-tiny", tokenizer=tokenizer)
    exec(compile(code_block("python"), "README.md", "exec"), {})  # noqa: S102
    printed = capsys.readouterr().out
    assert printed.strip(), "the snippet printed no sample"
    saved = openk3.from_pretrained(tmp_path / "my-k3-tiny")
    assert (tmp_path / "my-k3-tiny" / "tokenizer.json").is_file()
    reference = openk3.from_pretrained(tmp_path / "runs" / "k3-tiny")
    for (name, a), (_, b) in zip(saved.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def tree_paths() -> list[str]:
    """Every path the file tree under "## Files" names (indentation two spaces per folder level; several
    names on a line share the first name's folder)."""
    folders: list[str] = []
    paths = []
    for line in code_block("", after="## Files").splitlines():
        indent = (len(line) - len(line.lstrip(" "))) // 2
        names = re.split(r"\s{2,}", line.strip())[0].split(", ")
        del folders[indent:]
        base = "".join(folders) + (names[0].rsplit("/", 1)[0] + "/" if "/" in names[0].rstrip("/") else "")
        for i, name in enumerate(names):
            paths.append("".join(folders) + name if i == 0 else base + name)
        if names[0].endswith("/"):
            folders.append(names[0])
    return paths


def test_file_tree_names_existing_files():
    paths = tree_paths()
    assert len(paths) > 60 and "src/openk3/model/moe.py" in paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README file tree names missing files: {missing}"


def test_readme_within_its_length():
    assert len(README.split()) <= 1200
