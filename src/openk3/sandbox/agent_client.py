"""The host side of the guest agent protocol (:mod:`openk3.sandbox.guest_agent`): health, ``/init`` and a
plain command run, used by the manager (readiness, clock resync after restore) and the benchmark (round trips
without the e2b SDK's ``bash -l``). Users go through the e2b SDK instead."""

from __future__ import annotations

import base64
import datetime
import json
import struct
import time

import httpx


class AgentError(RuntimeError):
    """The guest agent did not answer in time or answered with an error."""


def _url(port: int, path: str) -> str:
    return f"http://127.0.0.1:{port}{path}"


def healthy(port: int, timeout_s: float = 2.0) -> bool:
    """Whether the agent answers ``GET /health`` with 204 within ``timeout_s``."""
    try:
        return httpx.get(_url(port, "/health"), timeout=timeout_s).status_code == 204
    except httpx.HTTPError:
        return False


def wait_ready(port: int, timeout_s: float, alive=lambda: True) -> float:
    """Poll ``/health`` until it answers; returns the seconds waited. Raises AgentError after ``timeout_s`` or
    as soon as ``alive()`` turns false (the VMM exited)."""
    t0 = time.monotonic()
    while not healthy(port, timeout_s=5.0):
        if not alive():
            raise AgentError("the VMM exited before the guest agent answered")
        if time.monotonic() - t0 > timeout_s:
            raise AgentError(f"guest agent did not answer /health within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def init(port: int, env_vars: dict[str, str] | None, timeout_s: float, alive=lambda: True) -> float:
    """``POST /init`` as soon as the agent answers (one request: a restored guest's first requests are slow
    under TCG, its translation cache being empty): sets the guest clock to the host's (so a restored guest is
    not behind) and the sandbox's env vars. Returns the seconds waited; raises AgentError like
    :func:`wait_ready`."""
    t0 = time.monotonic()
    while True:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            r = httpx.post(
                _url(port, "/init"), json={"envVars": env_vars or {}, "timestamp": now}, timeout=5.0
            )
            if r.status_code != 204:
                raise AgentError(f"/init answered {r.status_code}: {r.text[:200]}")
            return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if not alive():
            raise AgentError("the VMM exited before the guest agent answered")
        if time.monotonic() - t0 > timeout_s:
            raise AgentError(f"guest agent did not answer /init within {timeout_s} s")
        time.sleep(0.05)


def run(port: int, argv: list[str], timeout_s: float = 60.0) -> tuple[int, bytes, bytes]:
    """Run ``argv`` in the guest; returns (exit code, stdout, stderr)."""
    req = json.dumps({"process": {"cmd": argv[0], "args": argv[1:], "envs": {}}}).encode()
    body = struct.pack(">BI", 0, len(req)) + req
    headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
    try:
        r = httpx.post(_url(port, "/process.Process/Start"), content=body, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise AgentError(f"running {argv[0]} in the guest: {type(e).__name__}: {e}") from e
    data, out, err, code = r.content, b"", b"", None
    while data:
        flags, n = struct.unpack(">BI", data[:5])
        msg, data = json.loads(data[5 : 5 + n]), data[5 + n :]
        ev = msg.get("event", {})
        if "data" in ev:
            out += base64.b64decode(ev["data"].get("stdout", ""))
            err += base64.b64decode(ev["data"].get("stderr", ""))
        if "end" in ev:
            code = ev["end"].get("exitCode", 0)
        if flags & 2 and "error" in msg:
            raise AgentError(f"running {argv[0]}: {msg['error']}")
    if code is None:
        raise AgentError(f"running {argv[0]}: the stream ended without an exit code (HTTP {r.status_code})")
    return code, out, err
