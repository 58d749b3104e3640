"""Work done on rank 0 alone while the other ranks wait (preparing the data shards), with its failure shared.

Without this, a bad input found by rank 0 (a missing ``--data`` folder) ends rank 0 with its one-line error
while every other rank waits in the next collective until the connection drops, then fails there with a
traceback of its own. :func:`on_rank_zero` runs the work on rank 0 and broadcasts its outcome, so every rank
raises the same error at the same point: a ``ValueError``, ``FileNotFoundError`` or ``FileExistsError`` (the
errors the command line reports as bad input) as itself, anything else as a ``RuntimeError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError)
"""Errors of bad input: the command line prints them as one line (``openk3: error: …``) and exits with 2."""


def on_rank_zero(work: Callable[[], object]) -> None:
    """Call ``work()`` on rank 0 of the default process group while the other ranks wait (one broadcast of
    a small object, a barrier in effect); when it raised, every rank raises: rank 0 its own exception, the
    others the same type of :data:`USER_ERRORS` with the same text (any other error: ``RuntimeError("rank 0
    failed: TYPE: TEXT")``)."""
    error: BaseException | None = None
    outcome: list[tuple[str, str] | None] = [None]
    if dist.get_rank() == 0:
        try:
            work()
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised again below
            error = e
            outcome[0] = (type(e).__name__, str(e))
    dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[0] is not None:
        name, text = outcome[0]
        kind = next((k for k in USER_ERRORS if k.__name__ == name), None)
        raise kind(text) if kind is not None else RuntimeError(f"rank 0 failed: {name}: {text}")
