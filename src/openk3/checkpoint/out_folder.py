"""The output folder of a command that writes a model or a draft (``openk3 quantize --out``,
``openk3 train-draft --out``): refused when it already holds something or cannot be made, written whole or not
at all.

:func:`check_new_folder` runs before any slow work and raises ``FileExistsError`` naming the path and what
it holds (a checkpoint, a training run, a draft, other files), so a command never writes over a run's
``final`` export, a checkpoint or a folder of one's own; and ``ValueError`` naming the path when no folder can
be made there (:func:`out_dir_problem`, which the benchmarks' ``--out`` checks use too).
:func:`folder_written_whole` is the write itself: the command fills a temporary sibling folder
(``.tmp-NAME-XXXX`` beside ``NAME``) and it is renamed into place only when everything is written, so an
interrupted write (Ctrl-C, a crash, a full disk) leaves the folder absent (or, when replacing, as it was) and
removes the temporary one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _what_it_holds(path: Path) -> str:
    """A few words on what folder ``path`` holds, for the refusal."""
    if (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file():
        return "a training run"
    if (path / "config.json").is_file():
        return "a checkpoint (config.json)"
    names = sorted(p.name for p in path.iterdir())
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"files ({shown})"


def out_dir_problem(path: str | os.PathLike, flag: str = "--out") -> str | None:
    """Why no folder can be made (or written into) at ``path``, given by the option ``flag``, or ``None``:
    ``"--out P: Q exists and is not a directory"`` for a part ``Q`` of ``P`` that is a file; when ``P`` is
    missing, ``"--out P: cannot create M (reason)"`` for its first missing part ``M`` (the child of the
    nearest existing folder), probed by making and removing ``M`` itself, so the reason is the OS's for that
    path (``/proc/q``: No such file or directory); when ``P`` is a folder, ``"--out P: P is not writable
    (creating a folder in it fails: reason)"``, probed by making and removing an empty folder in it
    (``os.access`` tells root that ``/proc`` is writable); or the OS's reason for refusing the name (``File
    name too long``). Nothing is left behind, and nothing raises."""
    path = Path(path)
    missing = None  # the part below the one being looked at, when that part is missing
    try:
        for part in (path, *path.parents):
            if not part.exists():
                missing = part
                continue
            if not part.is_dir():
                return f"{flag} {path}: {part} exists and is not a directory"
            try:
                if missing is None:
                    os.rmdir(tempfile.mkdtemp(prefix=".openk3-probe-", dir=part))
                else:
                    os.mkdir(missing)
                    os.rmdir(missing)
            except OSError as err:
                why = err.strerror or err
                if missing is None:
                    return f"{flag} {path}: {part} is not writable (creating a folder in it fails: {why})"
                return f"{flag} {path}: cannot create {missing} ({why})"
            return None
    except OSError as err:
        return f"{flag} {path}: {err.strerror or err}"
    return None


def check_new_folder(path: str | os.PathLike, flag: str = "--out") -> None:
    """Raise ``FileExistsError`` unless ``path`` is absent or an empty folder: ``"--out P already exists and
    holds a checkpoint (config.json); refusing to overwrite it: choose a new folder (or delete P first)"``;
    then ``ValueError`` with :func:`out_dir_problem`'s line when no folder can be made at ``path``. ``flag``
    names the option that gave ``path``."""
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not (path.is_dir() and not any(path.iterdir())):
        held = _what_it_holds(path) if path.is_dir() else "a file"
        raise FileExistsError(
            f"{flag} {path} already exists and holds {held}; refusing to overwrite it: choose a new folder "
            f"(or delete {path} first)"
        )
    if problem := out_dir_problem(path, flag):
        raise ValueError(problem)


@contextlib.contextmanager
def folder_written_whole(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``path``; when the block ends without an exception it is
    renamed to ``path`` (an existing ``path`` is replaced: moved aside, then deleted). On any exception,
    ``KeyboardInterrupt`` included, the temporary folder is deleted and ``path`` is left as it was."""
    path = Path(os.path.abspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it owner-only; a model folder follows the umask
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f"{tmp.name}.old")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
