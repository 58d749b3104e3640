"""One training per run folder: ``RUN/train.lock``, held by the running trainer.

Two ``openk3 train --out RUN`` started together would both prepare data, both append to ``metrics.jsonl``
and overwrite each other's checkpoints. The trainer takes the lock before it writes anything in the run
folder (:func:`acquire_run_lock`) and gives it back when it ends (:meth:`RunLock.release`).

The lock is an ``fcntl.flock`` on the file, which the kernel drops when its holder exits in any way
(``kill -9``, a crash, a power loss on a local disk), so a live holder cannot be mistaken for a dead one and
a pid reused by another program cannot keep a lock alive. The file's text (JSON: ``pid``, ``host``,
``started``) names the holder in the refusal; a file whose lock is free is a stale lock of a run that did not
end cleanly, taken over with a line saying so.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = "train.lock"
"""File name of the lock inside a run folder."""


def describe_holder(text: str) -> str:
    """``pid N on host H since T`` from a lock file's text (``an unknown process`` when it is unreadable)."""
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']} since {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "an unknown process"


class RunLock:
    """A held lock on ``run_dir``; :meth:`release` (idempotent) unlocks and removes the file."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self.fd)  # closing drops the flock
        self.fd = None

    __del__ = release  # a trainer dropped without finishing gives the folder back


def acquire_run_lock(run_dir: Path, log=print) -> RunLock:
    """Lock the existing folder ``run_dir`` for this process and return the :class:`RunLock`.

    Raises ``ValueError`` naming the holder (pid, host, start time) when another process holds it; a stale
    lock file (no process holds its lock) is taken over and ``log`` gets one line naming its old holder."""
    path = Path(run_dir) / LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ValueError(f"cannot create the run lock {path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            error = _in_use(run_dir, path, fd)
            os.close(fd)
            raise error from None
        if _same_file(fd, path):
            break
        os.close(fd)  # the holder removed the file between our open and lock: lock the new one
    old = _read(fd)
    if old.strip():
        log(f"recovered a stale run lock in {run_dir}: {describe_holder(old)} no longer holds it")
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return RunLock(path, fd)


def check_run_free(run_dir: Path) -> None:
    """Raise the ``ValueError`` of :func:`acquire_run_lock` when another process holds ``run_dir``'s lock;
    takes nothing (a check before reading the run, e.g. its latest checkpoint for a resume)."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file (or an unreadable one: acquire_run_lock says so)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        raise _in_use(run_dir, path, fd) from None
    finally:
        os.close(fd)


def _in_use(run_dir: Path, path: Path, fd: int) -> ValueError:
    return ValueError(
        f"run folder {run_dir} is in use by another training ({describe_holder(_read(fd))}; lock file {path}): "
        "wait for it to end or stop it, or choose another --out"
    )


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        return ""


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False
