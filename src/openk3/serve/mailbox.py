"""Handing the engine thread's outputs to the asyncio event loop with one wake-up per burst.

``loop.call_soon_threadsafe`` wakes the loop by writing to its self-pipe, a system call per call
(``docs/references.md#one-host-wait-per-step``); called once per output, a step of many streams costs the
engine thread as much as the rest of its host work for that step (``docs/LOG.md``). :class:`LoopMailbox`
queues the outputs and wakes the loop once for all those posted before it runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque


class LoopMailbox:
    """Delivers ``(queue, item)`` pairs posted from any thread into ``asyncio.Queue``s of ``loop``, in posting
    order, with one ``call_soon_threadsafe`` per burst (none while a delivery is already scheduled)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[tuple[asyncio.Queue, object]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item: object) -> None:
        """Queue ``item`` for ``queue``. Raises ``RuntimeError`` when the loop is closed (the item is then
        dropped: nothing would read it)."""
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            with self._lock:
                self._scheduled = False
                self._items.clear()
            raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for queue, item in items:
            queue.put_nowait(item)
