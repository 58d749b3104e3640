"""Console output that survives a closed pipe: ``openk3 train ... | tee log`` stopped by Ctrl-C.

Ctrl-C reaches the whole process group, so the reader of a pipe (``tee``, ``head``) usually exits before the
trainer has finished its step and saved. Python ignores SIGPIPE, so every later write to that pipe raises
``BrokenPipeError``; raised inside the SIGINT handler or a progress-bar update, it would end the run before
its checkpoint is written. :func:`pipe_safe_output` replaces ``sys.stdout`` / ``sys.stderr`` with
:class:`PipeSafeStream` objects for the duration of a command: a write to a closed stdout goes to stderr
instead, a write to a closed stderr is dropped, and neither raises, so the run always finishes its step,
saves and prints how to resume wherever output can still go.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from typing import TextIO


class PipeSafeStream:
    """A text stream over ``stream`` whose writes and flushes never raise for a closed pipe (``EPIPE``,
    ``BrokenPipeError``, a closed file object); once ``stream`` failed, text goes to ``fallback`` (another
    :class:`PipeSafeStream`, e.g. stdout's falls back to stderr) or nowhere. Everything else (``fileno``,
    ``isatty``, ``encoding``) is ``stream``'s."""

    def __init__(self, stream: TextIO, fallback: PipeSafeStream | None = None) -> None:
        self.stream = stream
        self.fallback = fallback
        self.broken = False
        """True once a write or flush of ``stream`` failed with a closed pipe."""

    def _failed(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            # the interpreter's final flush of the dead pipe would print "Exception ignored ... BrokenPipeError"
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self.stream.write(text)
            except (BrokenPipeError, ValueError):
                self._failed()
            except OSError as e:
                if e.errno != errno.EPIPE:
                    raise
                self._failed()
        if self.fallback is not None:
            self.fallback.write(text)
        return len(text)

    def flush(self) -> None:
        if self.broken:
            return
        try:
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            self._failed()
        except OSError as e:
            if e.errno != errno.EPIPE:
                raise
            self._failed()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def pipe_safe_output() -> Iterator[tuple[PipeSafeStream, PipeSafeStream]]:
    """Within the block, ``sys.stdout`` and ``sys.stderr`` are :class:`PipeSafeStream` objects (stdout falls
    back to stderr); yields ``(stdout, stderr)``. The original streams are put back afterwards."""
    saved = sys.stdout, sys.stderr
    err = PipeSafeStream(sys.stderr)
    out = PipeSafeStream(sys.stdout, fallback=err)
    sys.stdout, sys.stderr = out, err
    try:
        yield out, err
    finally:
        sys.stdout, sys.stderr = saved
