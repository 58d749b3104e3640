"""Result files of the synthetic tasks: JSON written whole, and an output path checked before any work.

A result JSON is written to a temporary file beside it and renamed over it (:func:`os.replace`, atomic on
one file system), so a crash, a Ctrl-C or a value JSON cannot hold (NaN) never leaves a truncated file: the
previous version, or none, stays.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: Path | str, obj) -> None:
    """Write ``obj`` to ``path`` as indented strict JSON (no NaN or infinity), whole or not at all.

    Raises ``ValueError`` for a value JSON cannot hold (nothing is written) and ``OSError`` for the file
    system's errors (the temporary file is removed)."""
    path = Path(path)
    text = json.dumps(obj, indent=1, allow_nan=False) + "\n"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_output(path: Path | str, flag: str) -> None:
    """Raise ``ValueError`` naming ``flag`` when a file cannot be written at ``path``: its folder is missing
    or not a folder, ``path`` is a folder, or the folder is not writable. Checked before the work whose
    result goes there, so no work is lost to a typo."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder: pass a file path, e.g. {path / 'result.json'}")
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ValueError(f"{flag} {path}: its folder {folder} {what}")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: its folder {folder} is not writable")
