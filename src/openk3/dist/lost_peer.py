"""A rank whose peer is gone: one line, not a traceback.

When a rank dies (killed, out of memory, a crash), every other rank fails in its next collective: at once
with gloo's "Connection closed by peer" / "Connection reset by peer" (or "Broken pipe"), or after the
collective timeout when the peer hangs instead ("Timed out waiting 300000ms for recv operation"). The
traceback of that failure says where the survivor happened to be waiting, not what went wrong, and under
``openk3 train --nproc-per-node`` it printed a screenful above the launcher's line naming the rank that
died. :func:`lost_peer_reason` recognises such a failure from its message (the exception, its cause and
context, and the per-rank failures of a ``CheckpointException``, which DCP raises from a save or load);
:func:`exit_lost_peer` ends the rank with :data:`~openk3.dist.launch.PEER_LOST_EXIT` and one line: recorded
in the rank's error file (``TORCHELASTIC_ERROR_FILE``) for the launcher, printed on stderr unless the
launcher prints the report (:data:`~openk3.dist.launch.LAUNCHER_ENV`). Any other error keeps its traceback.
"""

from __future__ import annotations

import os
import re
import sys
from typing import NoReturn

from openk3.dist.launch import LAUNCHER_ENV, PEER_LOST_EXIT

CONNECTION_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
)
"""Message fragments of a collective whose peer went away (gloo's TCP pairs; NCCL's "remote process exited
or there was a network error")."""
TIMED_OUT = ("Timed out waiting", "timed out")
"""Message fragments of a collective whose peer never joined within the process group's timeout."""


class LostPeerError(RuntimeError):
    """The one-line report of a rank whose peer is gone (the type the launcher reads in the error file)."""


def _first_sentence(line: str) -> str:
    """``line`` without gloo's ``[file.cc:N]`` prefix, up to its first sentence's end."""
    line = re.sub(r"^\[[^\]]*\]\s*", "", line.strip())
    return re.split(r"(?<=[^.])\. ", line, maxsplit=1)[0].rstrip(".")


def lost_peer_reason(error: BaseException) -> tuple[str, str] | None:
    """``(kind, detail)`` when ``error`` is a collective failing because a peer is gone: ``kind`` is
    ``"lost"`` (the connection dropped) or ``"timeout"`` (no answer within the timeout), ``detail`` the
    backend's sentence (``"Connection closed by peer [127.0.0.1]:19352"``); ``None`` for any other error."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(error, RuntimeError | CheckpointException):  # bad input, a Ctrl-C: not a peer's loss
        return None
    pending, seen = [error], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CheckpointException):
            pending.extend(exc for exc, _ in e.failures.values())
        elif isinstance(e, RuntimeError):  # gloo raises RuntimeError, NCCL DistBackendError (a subclass)
            for line in str(e).splitlines():
                if any(mark in line for mark in CONNECTION_LOST):
                    return "lost", _first_sentence(line)
                if any(mark in line for mark in TIMED_OUT):
                    return "timeout", _first_sentence(line)
        pending.extend((e.__cause__, e.__context__))
    return None


def lost_peer_line(rank: int, kind: str, detail: str) -> str:
    """The line for rank ``rank``: what happened (``kind`` of :func:`lost_peer_reason`) and the backend's
    ``detail`` (which names the timeout, e.g. ``Timed out waiting 300000ms ...``)."""
    if kind == "timeout":
        return f"rank {rank} stopped: another rank did not join a collective in time ({detail})"
    return f"rank {rank} stopped: it lost its connection to another rank, which died or was killed ({detail})"


def exit_lost_peer(line: str) -> NoReturn:
    """Record ``line`` in this rank's error file (under torch's elastic agent), print it as ``openk3:
    error: LINE`` unless the launcher reports the world, and exit with :data:`PEER_LOST_EXIT`.

    The exit skips the interpreter's shutdown (``os._exit``, as :mod:`openk3.__main__` does for bad input):
    with a broken process group that shutdown is slow enough for the agent, which has seen the dead rank,
    to end this one with SIGTERM first (exit status -15, not 3, in every trial with ``SystemExit``), and a
    C++ destructor can abort in it; either hides the exit status the launcher reads. Callers leave their
    ``finally`` blocks first."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        try:  # recorded from its own handler with no traceback: the file holds the line, not the stack
            raise LostPeerError(line) from None
        except LostPeerError as e:
            ErrorHandler().record_exception(e.with_traceback(None))
    if os.environ.get(LAUNCHER_ENV) != "1":
        print(f"openk3: error: {line}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(PEER_LOST_EXIT)
