"""The router's HTTP side: an OpenAI-compatible front for several ``openk3 serve`` workers.

``POST /v1/completions`` and ``POST /v1/chat/completions`` go to the worker
:class:`~openk3.serve.router.policy.RoutingPolicy` picks; the answer comes back as the worker sent it
(JSON or SSE bytes, ``usage`` and ``prompt_tokens_details.cached_tokens`` untouched) with two headers,
``X-OpenK3-Worker`` (its URL) and ``X-OpenK3-Route`` (why it was chosen). The session id is the
``X-Session-ID`` header, else the body's ``user`` field. Also ``GET /v1/models`` and ``GET
/v1/models/{id}`` (from a worker that is up), ``GET /health`` (200 while a worker is up, else 503), ``GET /metrics``, ``GET /workers`` and
``POST`` / ``DELETE /workers`` with ``{"url": ...}`` to add or remove a worker at run time.

Faults, before the first byte reaches the client (after it, a stream that breaks ends with an error event):

* unreachable (connection refused, reset, timeout): the worker is marked down, the request goes to the
  next choice; the health probe (``GET /health`` every ``health_interval_s``) brings it back (and takes a
  worker out after ``health_failures`` failed probes in a row, so one slow answer from a busy worker does
  not);
* garbage (a 2xx that is not a completion object or an SSE stream of them, an error that is not an OpenAI
  error object): the worker is marked down and quarantined for ``quarantine_s``, the request moves on;
* 429 or 5xx: the request moves on (a 503 also marks the worker down); when every worker refused, the
  client gets the last refusal as it was;
* no worker up: 503 with ``Retry-After`` (seconds to the next probe) and an OpenAI error object.

A body that is not a JSON object is answered here, 400 with ``code: "invalid_json"`` as a worker answers it;
a worker's other 4xx (a bad field: 400, a model it does not serve: 404) reaches the client as it was.

A client that disconnects cancels the worker request: the router closes its connection to the worker,
which aborts the request and frees its blocks.

Loops: each router has a random id, which its ``GET /health`` answers carry (``X-OpenK3-Router``) and which
it appends to the ``X-OpenK3-Routers`` header of every request it forwards. A worker whose health answer
carries this router's own id (its own address, under any name) is kept down and refused by ``POST /workers``
(400); a request that arrives with this router's id in that header went round a loop of routers and is
answered 508 ``routing_loop`` instead of being forwarded again, and the router that sent it there takes that
worker out for ``quarantine_s`` with the reason in ``GET /workers`` (the request moves on to the next one).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
from urllib.parse import quote

import anyio
import httpx
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from openk3.serve.metrics import CONTENT_TYPE
from openk3.serve.protocol import APIError, json_object, read_body, too_large
from openk3.serve.router.config import RouterConfig, normalize_worker_url
from openk3.serve.router.policy import Decision, RoutingPolicy, WorkerState
from openk3.serve.router.prefix_index import prompt_blocks

DISCONNECT_POLL_S = 0.1
"""How often a non-streaming request checks whether its client is still there."""
MAX_FIRST_EVENT_BYTES = 1 << 20
"""A stream whose first event is longer than this is garbage."""
PASSED_HEADERS = ("content-type", "retry-after")
ROUTER_ID_HEADER = "x-openk3-router"
"""The header of a router's ``/health`` answers (200 or 503) that carries its id."""
ROUTERS_HEADER = "x-openk3-routers"
"""The ids of the routers a request has passed, comma-separated (each router appends its own)."""
MAX_REASONS_CHARS = 600
"""Most characters of the workers' last errors that a 503 "no worker is up" quotes."""
CLIENT_CLOSED_STATUS = 499
"""Status logged for a request whose client went away before the answer (nobody receives it)."""


SELF_WORKER = "the worker's health answer carries this router's own id (it is this router's address)"
"""``last_error`` of a worker that is the router itself."""


class WorkerFailedError(Exception):
    """A worker could not serve a request: move it to the next choice."""

    def __init__(self, reason: str, message: str, down: bool, quarantine: bool = False, response=None):
        super().__init__(message)
        self.reason, self.down, self.quarantine, self.response = reason, down, quarantine, response


def _error(status: int, message: str, type: str, headers=None, code=None) -> JSONResponse:
    return JSONResponse(
        APIError(status, message, type, code=code).body(), status_code=status, headers=headers
    )


def _is_completion(obj) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("choices"), list)


def _is_error(obj) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)


class Router:
    """Routing state, the worker connection pool and the health probe loop of one router."""

    def __init__(self, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        from openk3.serve.router.metrics import RouterMetrics

        self.config = config
        self.policy = RoutingPolicy(config)
        self.metrics = RouterMetrics()
        self._transport = transport
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        self.id = secrets.token_hex(8)
        """This router's id: in its ``/health`` answer and the ``X-OpenK3-Routers`` header it forwards."""

    # ---- lifetime and health ---------------------------------------------------------------------------
    async def start(self) -> None:
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=self.config.health_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=self._transport)
        await self.probe_all()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.client is not None:
            await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.probe_all()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in list(self.policy.workers.values())))

    async def probe(self, worker: WorkerState) -> bool:
        """``GET /health``: up when it answers 200 with ``{"status": "ok"}``; a worker that answers with this
        router's own id is this router and is kept down."""
        try:
            r = await self.client.get(worker.url + "/health", timeout=self.config.health_timeout_s)
            if r.headers.get(ROUTER_ID_HEADER) == self.id:
                self._set_down(worker, SELF_WORKER)
                return False
            ok = r.status_code == 200 and r.json().get("status") == "ok"
            error = "" if ok else f"health probe answered {r.status_code}: {r.text[:80]!r}"
            limit = r.json().get("max_request_bytes") if ok else None
            worker.max_request_bytes = limit if isinstance(limit, int) and limit > 0 else None
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            ok, error = False, f"health probe failed: {type(e).__name__}: {e}"
        worker.failed_probes = 0 if ok else worker.failed_probes + 1
        if ok:
            self._set_up(worker)
        elif worker.failed_probes >= self.config.health_failures or not worker.healthy:
            self._set_down(worker, error)
        return ok

    def _set_up(self, worker: WorkerState) -> None:
        worker.healthy, worker.last_error, worker.failed_probes = True, "", 0
        self.metrics.healthy.labels(worker.url).set(1.0 if worker.is_up(time.monotonic()) else 0.0)

    def _set_down(self, worker: WorkerState, error: str, quarantine: bool = False) -> None:
        worker.healthy, worker.last_error = False, error
        if quarantine:
            worker.quarantined_until = time.monotonic() + self.config.quarantine_s
            worker.quarantine_reason = error
        self.metrics.healthy.labels(worker.url).set(0.0)

    def _inflight(self, worker: WorkerState, delta: int) -> None:
        worker.inflight += delta
        self.metrics.inflight.labels(worker.url).set(worker.inflight)

    # ---- requests --------------------------------------------------------------------------------------
    async def forward(self, path: str, http: HTTPRequest) -> Response:
        """Route one completions or chat request (see the module docstring)."""
        passed = http.headers.get(ROUTERS_HEADER, "")
        if self.id in passed.split(","):
            return _error(
                508,
                f"routing loop: this request came back to the router it passed through ({passed}); a router's "
                "workers must not lead back to it",
                "server_error",
                code="routing_loop",
            )
        raw = await read_body(http, self._body_limit())  # 413 and 400 as the server's own
        body = json_object(raw)
        session = http.headers.get("x-session-id") or (
            body["user"] if isinstance(body.get("user"), str) else None
        )
        blocks = prompt_blocks(body, self.config)
        short_key = hashlib.blake2b(
            json.dumps([body.get("prompt"), body.get("messages")], sort_keys=True).encode(), digest_size=8
        ).digest()
        headers = {"content-type": "application/json", ROUTERS_HEADER: f"{passed},{self.id}".lstrip(",")}
        if "authorization" in http.headers:
            headers["authorization"] = http.headers["authorization"]
        exclude: set[str] = set()
        refusal = None
        while (decision := self.policy.choose(session, blocks, short_key, exclude)) is not None:
            worker = decision.worker
            if worker.max_request_bytes is not None and len(raw) > worker.max_request_bytes:
                exclude.add(worker.url)  # the next worker may take it; if none does, this one's 413
                e = too_large(f"{len(raw):,} bytes", worker.max_request_bytes)
                refusal = refusal or _error(413, e.message, e.type, code=e.code)
                continue
            self.metrics.requests.labels(worker.url, decision.route).inc()
            try:
                if body.get("stream") is True:
                    return await self._stream(decision, path, raw, headers, session, http)
                return await self._unary(decision, path, raw, headers, session, http)
            except WorkerFailedError as f:
                exclude.add(worker.url)
                self.metrics.retries.labels(worker.url, f.reason).inc()
                if f.down:
                    self._set_down(worker, str(f), f.quarantine)
                refusal = f.response or refusal
        if refusal is not None:
            return refusal
        self.metrics.unavailable.inc()
        retry = str(self.config.retry_after_s)
        now = time.monotonic()
        why = "; ".join(f"{w.url}: {r}" for w in self.policy.workers.values() if (r := _why_down(w, now)))
        return _error(
            503,
            f"no worker is up; retry in {retry} s" + (f" ({why[:MAX_REASONS_CHARS]})" if why else ""),
            "server_error",
            headers={"Retry-After": retry},
            code="no_worker_available",
        )

    def _body_limit(self) -> int:
        """The most bytes of a request body worth reading: ``max_request_bytes``, or less when every worker
        has reported a smaller limit of its own (the largest of theirs), so a body that every worker would
        refuse is refused from its Content-Length, never held or uploaded."""
        own = self.config.max_request_bytes
        theirs = [w.max_request_bytes or own for w in self.policy.workers.values()]
        return min(own, max(theirs)) if theirs else own

    @staticmethod
    def _headers(decision: Decision, upstream) -> dict[str, str]:
        out = {k: v for k, v in upstream.items() if k.lower() in PASSED_HEADERS}
        out["X-OpenK3-Worker"], out["X-OpenK3-Route"] = decision.worker.url, decision.route
        return out

    def _answer(self, decision: Decision, status: int, content: bytes, headers) -> Response:
        return Response(content, status_code=status, headers=self._headers(decision, headers))

    def _refusal(self, decision: Decision, r: httpx.Response, content: bytes) -> Response:
        """A non-2xx answer: passed to the client (4xx), or a :class:`WorkerFailedError` to move on (429, 5xx,
        or not an OpenAI error object: garbage)."""
        try:
            obj = json.loads(content)
        except (json.JSONDecodeError, UnicodeDecodeError):
            obj = None
        answer = self._answer(decision, r.status_code, content, r.headers)
        if not _is_error(obj):
            raise WorkerFailedError("garbage", f"answered {r.status_code} with {content[:80]!r}", True, True)
        if r.status_code == 429:
            raise WorkerFailedError("overloaded", "answered 429", False, response=answer)
        if r.status_code == 508 and obj["error"].get("code") == "routing_loop":
            raise WorkerFailedError(  # it leads back here: out for the quarantine, the reason in /workers
                "routing_loop",
                "answered 508 routing_loop: requests sent to this worker come back to this router",
                True,
                True,
                response=answer,
            )
        if r.status_code >= 500:
            reason = "unavailable" if r.status_code == 503 else "server_error"
            raise WorkerFailedError(
                reason, f"answered {r.status_code}", r.status_code == 503, response=answer
            )
        return answer

    async def _unary(self, decision: Decision, path, raw, headers, session, http: HTTPRequest) -> Response:
        worker = decision.worker
        self._inflight(worker, +1)
        task = asyncio.create_task(self.client.post(worker.url + path, content=raw, headers=headers))
        try:
            if await self._client_left(task, http):
                return Response(status_code=CLIENT_CLOSED_STATUS)
            r = task.result()
        except httpx.HTTPError as e:
            raise WorkerFailedError("unreachable", f"{type(e).__name__}: {e}", True) from None
        finally:
            self._inflight(worker, -1)
        if not 200 <= r.status_code < 300:
            return self._refusal(decision, r, r.content)
        try:
            obj = r.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            obj = None
        if not _is_completion(obj):
            raise WorkerFailedError(
                "garbage", f"answered {r.status_code} with {r.content[:80]!r}", True, True
            )
        self.metrics.record_usage(worker.url, obj.get("usage"))
        self.policy.record_success(decision, session)
        self._set_up(worker)
        return self._answer(decision, r.status_code, r.content, r.headers)

    async def _client_left(self, task: asyncio.Task, http: HTTPRequest) -> bool:
        """Wait for ``task``; when the client disconnects first, cancel it (closing the worker connection,
        which aborts the worker's request) and return True."""
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await http.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError, StopAsyncIteration):
                    await task
                self.metrics.disconnects.inc()
                return True
        return False

    async def _stream(self, decision: Decision, path, raw, headers, session, http: HTTPRequest) -> Response:
        worker = decision.worker
        self._inflight(worker, +1)
        r = None
        try:
            r = await self.client.send(
                self.client.build_request("POST", worker.url + path, content=raw, headers=headers),
                stream=True,
            )
            if not 200 <= r.status_code < 300:
                content = await r.aread()
                refusal = self._refusal(decision, r, content)  # or it raises: closed below
                await self._close(r, worker)
                return refusal
            chunks = r.aiter_raw()
            task = asyncio.create_task(self._first_event(chunks))
            if await self._client_left(task, http):  # left during the prefill
                await self._close(r, worker)
                return Response(status_code=CLIENT_CLOSED_STATUS)
            head = task.result()
            if not head:
                raise WorkerFailedError("garbage", "ended its stream before the first event", True, True)
            first = head.partition(b"\n\n")[0]
            try:
                obj = json.loads(first[len(b"data: ") :]) if first.startswith(b"data: ") else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                obj = None
            if not _is_completion(obj):
                raise WorkerFailedError("garbage", f"streamed {head[:80]!r}", True, True)
        except (httpx.HTTPError, httpx.StreamError) as e:
            await self._close(r, worker)
            raise WorkerFailedError("unreachable", f"{type(e).__name__}: {e}", True) from None
        except BaseException:
            await self._close(r, worker)
            raise
        self.policy.record_success(decision, session)
        self._set_up(worker)
        return StreamingResponse(
            self._relay(worker, r, head, chunks),
            status_code=r.status_code,
            headers=self._headers(decision, r.headers),
        )

    @staticmethod
    async def _first_event(chunks) -> bytes:
        """Bytes up to and including the end of the first SSE event (or the first MAX_FIRST_EVENT_BYTES, or all
        there were when the stream ended first)."""
        head = b""
        with contextlib.suppress(StopAsyncIteration):
            while b"\n\n" not in head and len(head) <= MAX_FIRST_EVENT_BYTES:
                head += await anext(chunks)
        return head

    async def _close(self, r: httpx.Response | None, worker: WorkerState) -> None:
        """Close the worker response (also when the caller is being cancelled) and count it out."""
        with anyio.CancelScope(shield=True):
            if r is not None:
                await r.aclose()
            self._inflight(worker, -1)

    async def _relay(self, worker: WorkerState, r: httpx.Response, head: bytes, chunks):
        """The stream's bytes as the worker sent them; usage events are counted on the way."""
        pending, done = head, False
        try:
            yield head
            pending = self._scan_usage(worker, pending)
            async for chunk in chunks:
                yield chunk
                pending = self._scan_usage(worker, pending + chunk)
            done = True
        except httpx.HTTPError as e:
            done = True
            self._set_down(worker, f"stream broke: {type(e).__name__}: {e}")
            err = APIError(502, f"the worker stopped mid-stream: {type(e).__name__}", "server_error").body()
            yield b"data: " + json.dumps(err).encode() + b"\n\n"
        finally:
            if not done:
                self.metrics.disconnects.inc()
            await self._close(r, worker)

    def _scan_usage(self, worker: WorkerState, pending: bytes) -> bytes:
        """Count the ``usage`` of the complete events in ``pending``; returns the incomplete rest."""
        *events, rest = pending.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: {") and b'"prompt_tokens"' in event:
                with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                    self.metrics.record_usage(worker.url, json.loads(event[6:]).get("usage"))
        return rest

    async def models(self, path: str) -> Response:
        """``GET path`` (the model list, or one model: its card or its 404) from the first worker up."""
        for worker in self.policy.workers.values():
            if worker.is_up(time.monotonic()):
                try:
                    r = await self.client.get(worker.url + path, timeout=self.config.health_timeout_s)
                except httpx.HTTPError as e:
                    self._set_down(worker, f"{type(e).__name__}: {e}")
                    continue
                if r.status_code in (200, 404):
                    return Response(r.content, status_code=r.status_code, media_type="application/json")
        retry = str(self.config.retry_after_s)
        return _error(503, "no worker is up", "server_error", headers={"Retry-After": retry})

    def workers(self) -> list[dict]:
        now = time.monotonic()
        return [
            {
                "url": w.url,
                "up": w.is_up(now),
                "in_flight": w.inflight,
                "quarantined_s": max(0.0, round(w.quarantined_until - now, 3)),
                "quarantine_reason": w.quarantine_reason if now < w.quarantined_until else "",
                "prefix_blocks": len(w.index),
                "last_error": w.last_error,
            }
            for w in self.policy.workers.values()
        ]


def _why_down(worker: WorkerState, now: float) -> str:
    """What keeps ``worker`` out: its quarantine's reason while that lasts, else its last error."""
    return worker.quarantine_reason if now < worker.quarantined_until else worker.last_error


def build_router_app(config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The router app; its lifespan opens the worker connections and runs the health probes."""
    router = Router(config, transport)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="openk3 router", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return _error(
            e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error"
        )

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await router.forward("/v1/completions", http)

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        return await router.forward("/v1/chat/completions", http)

    @app.get("/v1/models")
    async def models():
        return await router.models("/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return await router.models("/v1/models/" + quote(model_id, safe=""))

    @app.get("/health")
    async def health():
        up = sum(w["up"] for w in router.workers())
        me = {ROUTER_ID_HEADER: router.id}
        if up:
            body = {"status": "ok", "workers_up": up, "workers": len(router.policy.workers)}
            return JSONResponse(body, headers=me)
        retry = str(config.retry_after_s)
        return _error(503, "no worker is up", "server_error", headers={"Retry-After": retry, **me})

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/workers")
    async def workers():
        return {"workers": router.workers()}

    async def _url(http: HTTPRequest) -> str:
        raw = await read_body(http, router.config.max_request_bytes)
        try:
            body = json.loads(raw)
            return normalize_worker_url(body["url"])
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError, AttributeError):
            raise APIError(400, 'the body must be {"url": "http://host:port"}', param="url") from None
        except ValueError as e:
            raise APIError(400, str(e), param="url") from None

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.post("/workers")
    async def add_worker(http: HTTPRequest):
        url = await _url(http)
        known = url in router.policy.workers
        worker = router.policy.add_worker(url)
        await router.probe(worker)
        if worker.last_error == SELF_WORKER:
            if not known:
                router.policy.remove_worker(url)
            raise APIError(400, f"{url} is this router itself: {SELF_WORKER}", param="url")
        return {"workers": router.workers()}

    @app.delete("/workers")
    async def remove_worker(http: HTTPRequest):
        url = await _url(http)
        if url not in router.policy.workers:
            raise APIError(404, f"{url} is not a worker of this router", param="url")
        router.policy.remove_worker(url)
        return {"workers": router.workers()}

    return app


def run_router(config: RouterConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve the router until interrupted (``openk3 route``); raises ``ValueError`` when ``host:port``
    cannot be listened on. Prints the bound address (the port the system picked for ``port=0``)."""
    import uvicorn

    from openk3.serve.server import listen_socket

    with listen_socket(host, port) as sock:
        app = build_router_app(config)
        shown = f"[{host}]" if ":" in host else host
        print(
            f"openk3 route: http://{shown}:{sock.getsockname()[1]}/v1 → {len(config.workers)} workers "
            f"({', '.join(config.workers)})",
            flush=True,
        )
        uvicorn_config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=3)
        with contextlib.suppress(KeyboardInterrupt):
            uvicorn.Server(uvicorn_config).run(sockets=[sock])
