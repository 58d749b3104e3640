"""The E2B-compatible HTTP API (FastAPI): the control-plane routes the ``e2b`` SDK calls
(https://github.com/e2b-dev/E2B, ``spec/openapi.yml``) and a proxy that forwards its envd traffic (requests
carrying ``E2b-Sandbox-Id``) to the sandbox's guest agent.

Point the unmodified SDK at it with ``E2B_API_URL=E2B_SANDBOX_URL=http://HOST:PORT`` and ``E2B_API_KEY``.

Auth: every control request needs ``X-API-Key`` from the configured set (401 otherwise); a sandbox or snapshot
made with one key is invisible (404) to every other key. envd requests are checked against the sandbox's
``envdAccessToken`` (``X-Access-Token``), which only the key that created the sandbox receives.

Routes: ``POST /v2/sandboxes`` (also ``/sandboxes``) 201; ``GET /v2/sandboxes`` (also ``/sandboxes``);
``GET|DELETE /sandboxes/{id}``; ``POST /sandboxes/{id}/timeout`` 204; ``/pause`` 204 (409 when paused);
``/resume`` 201 (409 when running); ``POST /v2/sandboxes/{id}/connect`` (and ``/sandboxes/{id}/connect``)
200 running / 201 resumed; ``/fork`` 201 ``[{sandbox}|{error}]``; ``POST /sandboxes/{id}/snapshots`` 201;
``GET /snapshots``; ``DELETE /templates/{id}``. Errors: ``{"code", "message"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import json
import secrets
import urllib.parse

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from openk3.sandbox.manager import AlreadyPausedError, SandboxError, SandboxManager
from openk3.sandbox.record import SandboxRecord
from openk3.sandbox.store import NotFoundError

ENVD_VERSION = "0.5.7"
"""The envd version the API reports: new enough for the SDK's default user and octet-stream uploads."""
ENVD_PORT = "49983"
HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
               "proxy-authorization", "proxy-authenticate", "trailer"}  # fmt: skip


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def owner_of(api_key: str) -> str:
    """The owner id of an API key (a hash: keys are not written to disk)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def create_app(manager: SandboxManager, api_keys: list[str], reap_interval_s: float = 1.0,
               health_interval_s: float = 30.0, on_shutdown=None) -> FastAPI:  # fmt: skip
    """The app over ``manager``. ``api_keys``: accepted keys (at least one). A background task applies
    timeouts every ``reap_interval_s`` and health-checks running guests every ``health_interval_s``.
    ``on_shutdown``: called (in a thread) when the app shuts down, before the server returns: uvicorn runs it
    on SIGINT and SIGTERM alike (it re-raises SIGTERM only afterwards, which ends the process)."""
    if not api_keys or not all(api_keys):
        raise ValueError("create_app needs at least one non-empty API key")
    owners = {owner_of(k) for k in api_keys}
    spec = manager.config.spec

    async def reaper():
        last_probe = 0.0
        while True:
            await asyncio.sleep(reap_interval_s)
            now = asyncio.get_running_loop().time()
            probe = now - last_probe >= health_interval_s
            last_probe = now if probe else last_probe
            with contextlib.suppress(Exception):
                await run_in_threadpool(manager.reap, None, probe)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        task = asyncio.create_task(reaper())
        yield
        task.cancel()
        await app.state.client.aclose()
        if on_shutdown is not None:
            await run_in_threadpool(on_shutdown)

    app = FastAPI(title="openk3 sandbox (E2B-compatible)", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse({"code": e.status, "message": str(e)}, status_code=e.status)

    def owner(request: Request) -> str:
        key = request.headers.get("x-api-key")
        if not key:
            raise ApiError(401, "missing X-API-Key header")
        o = owner_of(key)
        if o not in owners:
            raise ApiError(401, "invalid API key")
        return o

    async def body(request: Request) -> dict:
        raw = await request.body()
        try:
            d = json.loads(raw) if raw.strip() else {}
        except ValueError as e:
            raise ApiError(400, f"request body is not JSON: {e}") from e
        if not isinstance(d, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(d).__name__}")
        return d

    async def call(fn, *args):
        """``fn(*args)`` in the thread pool (the manager blocks on QEMU), its errors mapped to HTTP."""
        try:
            return await run_in_threadpool(fn, *args)
        except NotFoundError as e:
            raise ApiError(404, str(e)) from e
        except AlreadyPausedError as e:
            raise ApiError(409, str(e)) from e
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e)) from e
        except SandboxError as e:
            raise ApiError(500, str(e)) from e

    def sandbox_json(r: SandboxRecord, with_token: bool = True) -> dict:
        d = {"templateID": r.template_id, "sandboxID": r.sandbox_id, "clientID": "openk3",
             "envdVersion": ENVD_VERSION, "domain": None, "trafficAccessToken": None}  # fmt: skip
        if with_token:
            d["envdAccessToken"] = r.access_token
        return d

    def detail_json(r: SandboxRecord) -> dict:
        return {**sandbox_json(r, with_token=False), "startedAt": _iso(r.started_at), "endAt": _iso(r.end_at),
                "cpuCount": spec.vcpus, "memoryMB": spec.memory_mib, "diskSizeMB": manager.image_disk_mib,
                "state": r.state, "metadata": r.metadata}  # fmt: skip

    # -- control plane -----------------------------------------------------------------------------------------

    @app.post("/v2/sandboxes", status_code=201)
    @app.post("/sandboxes", status_code=201)
    async def create(request: Request):
        o, b = owner(request), await body(request)
        template = b.get("templateID")
        if template is None or template == "":
            raise ApiError(400, "templateID is required")
        if not isinstance(template, str):
            raise ApiError(
                400, f"templateID must be a string (a template or snapshot name or id), got {template!r}"
            )
        on_timeout = "pause" if b.get("autoPause") else "kill"
        r = await call(manager.create, template, o, b.get("timeout"), b.get("metadata") or {},
                       b.get("envVars") or {}, on_timeout)  # fmt: skip
        return sandbox_json(r)

    @app.get("/v2/sandboxes")
    @app.get("/sandboxes")
    async def list_sandboxes(request: Request):
        o = owner(request)
        states = set()
        for s in request.query_params.getlist("state"):
            states.update(x for x in s.split(",") if x)
        wanted = dict(urllib.parse.parse_qsl(request.query_params.get("metadata") or ""))
        out = []
        for r in manager.list(o):
            if states and r.state not in states:
                continue
            if any(r.metadata.get(k) != v for k, v in wanted.items()):
                continue
            out.append(detail_json(r))
        return out

    @app.get("/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str, request: Request):
        return detail_json(await call(manager.get, sandbox_id, owner(request)))

    @app.delete("/sandboxes/{sandbox_id}", status_code=204)
    async def kill(sandbox_id: str, request: Request):
        await call(manager.kill, sandbox_id, owner(request))
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
    async def set_timeout(sandbox_id: str, request: Request):
        o, b = owner(request), await body(request)
        await call(manager.set_timeout, sandbox_id, o, b.get("timeout"))
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/pause", status_code=204)
    async def pause(sandbox_id: str, request: Request):
        await call(manager.pause, sandbox_id, owner(request))
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/resume", status_code=201)
    async def resume(sandbox_id: str, request: Request):
        o, b = owner(request), await body(request)
        if not await call(manager.resume, sandbox_id, o, b.get("timeout")):
            raise ApiError(409, f"sandbox {sandbox_id!r} is already running")
        return sandbox_json(await call(manager.get, sandbox_id, o))

    @app.post("/v2/sandboxes/{sandbox_id}/connect")
    @app.post("/sandboxes/{sandbox_id}/connect")
    async def connect(sandbox_id: str, request: Request):
        o, b = owner(request), await body(request)
        resumed = await call(manager.resume, sandbox_id, o, b.get("timeout"))
        return JSONResponse(
            sandbox_json(await call(manager.get, sandbox_id, o)), status_code=201 if resumed else 200
        )

    @app.post("/sandboxes/{sandbox_id}/fork", status_code=201)
    async def fork(sandbox_id: str, request: Request):
        o, b = owner(request), await body(request)
        results = await call(manager.fork, sandbox_id, o, b.get("count") or 1, b.get("timeout"))
        return [{"sandbox": sandbox_json(r)} if isinstance(r, SandboxRecord) else {"error": {"code": 500, "message": str(r)}}
                for r in results]  # fmt: skip

    @app.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
    async def snapshot(sandbox_id: str, request: Request):
        o, b = owner(request), await body(request)
        snap = await call(manager.snapshot, sandbox_id, o, b.get("name"))
        return {"snapshotID": snap.snapshot_id, "names": snap.names}

    @app.get("/snapshots")
    async def list_snapshots(request: Request):
        o = owner(request)
        return [{"snapshotID": s.snapshot_id, "names": s.names} for s in manager.store.all()
                if s.owner == o and s.kind == "snapshot"]  # fmt: skip

    @app.delete("/templates/{ref}", status_code=204)
    async def delete_snapshot(ref: str, request: Request):
        await call(manager.delete_snapshot, ref, owner(request))
        return Response(status_code=204)

    # -- envd proxy --------------------------------------------------------------------------------------------

    @app.middleware("http")
    async def envd_proxy(request: Request, call_next):
        sandbox_id = request.headers.get("e2b-sandbox-id")
        if sandbox_id is None:
            return await call_next(request)

        def error(status: int, message: str):
            return JSONResponse({"code": status, "message": message}, status_code=status)

        if request.headers.get("e2b-sandbox-port", ENVD_PORT) != ENVD_PORT:
            return error(502, f"only the envd port {ENVD_PORT} is served")
        try:
            record, port = manager.agent_port(sandbox_id)
        except NotFoundError as e:
            # the SDK's is_running() reads 502 on envd's health route as "not running" (E2B's proxy answers so)
            return error(502 if request.url.path == "/health" else 404, str(e))
        token = request.headers.get("x-access-token", "")
        if not secrets.compare_digest(token.encode(), record.access_token.encode()):
            return error(401, f"wrong or missing X-Access-Token for sandbox {sandbox_id}")
        if port is None:
            return error(502, f"sandbox {sandbox_id} is paused; connect to it to resume")
        url = f"http://127.0.0.1:{port}{request.url.path}"
        if request.url.query:
            url += "?" + request.url.query
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        client: httpx.AsyncClient = request.app.state.client
        req = client.build_request(request.method, url, headers=headers, content=await request.body())
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            reason = await run_in_threadpool(manager.check, sandbox_id)
            return error(
                502,
                f"sandbox {sandbox_id}: guest agent unreachable ({type(e).__name__}){'; ' + reason if reason else ''}",
            )
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, headers=out_headers,
                                 background=BackgroundTask(resp.aclose))  # fmt: skip

    return app
