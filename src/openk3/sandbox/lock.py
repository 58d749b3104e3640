"""The server lock: one ``openk3 sandbox serve`` per state root.

``ROOT/server.lock`` is held with an exclusive ``fcntl.flock`` for the server's lifetime and says
``pid host port``. The kernel drops a flock when its holder exits, however it exits, so a lock file left by a
dead server is free to take; the line it held is reported as taken over. A clean exit empties the file.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO


class RootBusyError(RuntimeError):
    """Another live server holds the state root."""


def hold_root(root: Path, host: str, port: int) -> tuple[IO[str], str | None]:
    """Lock ``root`` for this process. Returns the open lock file (keep it open: closing it frees the root) and
    the stale holder's line (``pid host port`` of a server that exited without unlocking) or None.
    Raises :class:`RootBusyError` naming the holder when a live server has it."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "server.lock"
    f = open(path, "a+")  # noqa: SIM115 (held open for the server's lifetime)
    f.seek(0)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = f.read().strip() or "unknown"
        f.close()
        raise RootBusyError(
            f"state root {root} is in use by another openk3 sandbox server (pid host port: {holder}); "
            "stop it or pass another --root"
        ) from None
    stale = f.read().strip() or None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()} {host} {port}\n")
    f.flush()
    return f, stale


def release_root(f: IO[str]) -> None:
    """Empty and unlock the lock file from :func:`hold_root` (a clean exit: no stale line is left). Once."""
    if f.closed:
        return
    f.seek(0)
    f.truncate()
    f.close()
