"""Every citation resolves inside the repository: each ``docs/references.md#anchor`` names a heading of
``docs/references.md``, and no file cites notes outside the repository (``§`` sections of notes, the notes'
file names, issue numbers: the patterns of :data:`OUTSIDE`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "tests", "benchmarks", "docs")
OUTSIDE = re.compile(r"§|reference/|PRODUCT\.md|issue [0-9]")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def cited_files():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in {".py", ".md", ".sh", ".toml"}:
                yield path


def test_every_reference_anchor_exists():
    text = (ROOT / "docs" / "references.md").read_text()
    anchors = {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    missing = []
    for path in cited_files():
        if path == Path(__file__).resolve():
            continue
        for anchor in re.findall(r"references\.md#([\w\-]+)", path.read_text()):
            if anchor not in anchors:
                missing.append(f"{path.relative_to(ROOT)}: #{anchor}")
    assert not missing, missing


def test_no_citation_points_outside_the_repository():
    this = Path(__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in cited_files()
        if path != this
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, found
