"""The engine on a background thread, for the asyncio HTTP server.

:meth:`AsyncEngine.submit` and :meth:`AsyncEngine.abort` are thread-safe; they take the engine lock, which
the engine thread holds only while scheduling and updating (not while the model runs). Each request's
outputs go to its callback, called on the engine thread (the API hops back to its event loop with
``loop.call_soon_threadsafe``). An exception inside a step ends every request with an error and the
engine keeps serving new ones. :meth:`AsyncEngine.shutdown` (the server's first step when it is asked to
exit) aborts every request and refuses new ones, so open streams end within one step instead of running
to their ``max_tokens``.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable

from openk3.serve.engine import EngineStats, LLMEngine
from openk3.serve.request import Request, RequestOutput

logger = logging.getLogger("openk3.serve")

IDLE_WAIT_S = 0.05
"""How long the idle engine thread sleeps between checks (it is woken at once by a submit)."""


class EngineClosedError(RuntimeError):
    """A request was submitted after :meth:`AsyncEngine.shutdown`."""


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, on_step: Callable[[list[RequestOutput], float], None] | None = None
    ):
        self.engine = engine
        self.on_step = on_step
        """Called after each step with its outputs and duration in seconds (metrics)."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._callbacks: dict[str, Callable[[RequestOutput], None]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.num_step_errors = 0

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._closed = False
            self._thread = threading.Thread(target=self._run, name="openk3-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def shutdown(self) -> None:
        """Refuse new requests and abort every tracked one: each callback receives a finished output with
        ``finish_reason="abort"`` at the engine's next step. The engine thread keeps running until
        :meth:`stop`."""
        with self._lock:
            self._closed = True
            for request_id in list(self._callbacks):
                self.engine.abort_request(request_id)
        self._wake.set()

    def submit(self, request: Request, callback: Callable[[RequestOutput], None]) -> None:
        """Queue ``request``; raises ``ValueError`` or ``QueueFullError`` (see :meth:`LLMEngine.add_request`),
        ``EngineClosedError`` after :meth:`shutdown`."""
        with self._lock:
            if self._closed:
                raise EngineClosedError("the server is shutting down")
            self.engine.add_request(request)
            self._callbacks[request.request_id] = callback
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Cancel a request (its blocks are freed at the start of the next step). Unknown ids are ignored."""
        with self._lock:
            if request_id in self._callbacks:
                self.engine.abort_request(request_id)
        self._wake.set()

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def num_tracked_requests(self) -> int:
        with self._lock:
            return len(self._callbacks)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                busy = self.engine.has_unfinished_requests()
            if not busy:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                outputs = self.engine.step(self._lock)
            except Exception as e:  # keep serving: fail this step's requests, log the trace
                self.num_step_errors += 1
                logger.error("engine step failed:\n%s", traceback.format_exc())
                with self._lock:
                    outputs = self.engine.fail_all(f"engine error: {type(e).__name__}: {e}")
            self._dispatch(outputs)
            if self.on_step is not None:
                self.on_step(outputs, time.perf_counter() - t0)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._lock:  # once per step, not per output
            callbacks = [
                self._callbacks.pop(out.request_id, None)
                if out.finished
                else self._callbacks.get(out.request_id)
                for out in outputs
            ]
        for out, callback in zip(outputs, callbacks):
            if callback is not None:
                try:
                    callback(out)
                except Exception:  # e.g. the event loop closed at shutdown: never kill the engine thread
                    logger.warning(
                        "output callback of %s failed:\n%s", out.request_id, traceback.format_exc()
                    )
