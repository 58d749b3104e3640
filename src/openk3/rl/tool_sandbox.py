"""The sandbox an agentic rollout runs its tool calls in: what the harness needs from one, and the
implementation over the ``e2b`` SDK (against ``openk3 sandbox serve``, docs/sandbox.md, or any E2B-compatible
service).

An agentic trajectory owns one sandbox for its whole life:

* it is created from a template and set up by the task group, then **paused** (no VMM process, no CPU) while
  the policy generates;
* each tool call **resumes** it, runs one command, and pauses it again;
* the reward **forks** it (a copy-on-write child) and judges inside the child, so the trajectory's own sandbox
  is never touched by the judge; the child is killed afterwards;
* a sandbox that is gone (guest crash, killed VMM, hung guest failed by the server's health probe) raises
  :class:`SandboxDiedError`; the rollout marks the trajectory failed and never retries it.

A command that exits non-zero is a normal result (the policy sees its output), not an error. A sandbox server
that cannot be reached is an error up front: :meth:`SandboxFactory.check` (called when an
:class:`~openk3.rl.agentic.AgenticRollout` is created) raises :class:`SandboxServerError`.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from urllib.parse import urlparse


class SandboxDiedError(RuntimeError):
    """The sandbox is gone or no longer answers; the message says which sandbox and why."""


class SandboxServerError(ConnectionError):
    """The sandbox server cannot be used (unreachable, or it refuses the API key); the message names its URL."""


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str


class ToolSandbox(abc.ABC):
    """One sandbox. Every method raises :class:`SandboxDiedError` when the sandbox is gone."""

    sandbox_id: str

    @abc.abstractmethod
    def run(self, command: str, timeout_s: float) -> CommandResult:
        """Run ``command`` (a shell command line, cwd = the guest user's home) in the running sandbox; a command
        still running after ``timeout_s`` seconds is ended and reported with exit code 124."""

    @abc.abstractmethod
    def write_file(self, path: str, text: str) -> None:
        """Write ``text`` to ``path`` (relative paths are under the home directory)."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Save the running sandbox and stop it."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Restore a paused sandbox; its processes go on where they stopped."""

    @abc.abstractmethod
    def fork(self) -> ToolSandbox:
        """A running copy-on-write child of the sandbox as it is now; the sandbox itself stays as it was
        (paused stays paused)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """End the sandbox and free what it holds (a sandbox already gone is not an error)."""


class SandboxFactory(abc.ABC):
    def check(self) -> None:
        """Raise :class:`SandboxServerError` when no sandbox can be created (the server is unreachable); a
        factory with no server has nothing to check."""
        return

    @abc.abstractmethod
    def create(self, template: str, timeout_s: float) -> ToolSandbox:
        """A running sandbox from ``template`` that lives ``timeout_s`` seconds of running time."""


@dataclass(frozen=True)
class E2BConnection:
    """Where the E2B-compatible API is: ``openk3 sandbox serve`` prints its URL. ``api_url=None`` uses the SDK's
    defaults (``E2B_API_URL``, ``E2B_SANDBOX_URL``, ``E2B_API_KEY`` or E2B's cloud)."""

    api_url: str | None = None
    api_key: str | None = None
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.request_timeout_s > 0:
            raise ValueError(f"E2BConnection.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.api_url is not None:
            url = urlparse(self.api_url)
            if url.scheme not in ("http", "https") or not url.netloc:
                raise ValueError(
                    f"E2BConnection.api_url must be an http(s) URL such as http://127.0.0.1:3000, "
                    f"got {self.api_url!r}"
                )

    def check(self, timeout_s: float = 10.0) -> None:
        """Raise :class:`SandboxServerError` naming the URL when ``GET /sandboxes`` (the list every
        E2B-compatible API serves) does not answer 200 within ``timeout_s``: nothing listens there, or the API
        key is refused. ``api_url=None`` checks ``E2B_API_URL`` when it is set, else nothing."""
        import httpx

        base = self.api_url or os.environ.get("E2B_API_URL")
        if not base:
            return
        key = self.api_key or os.environ.get("E2B_API_KEY") or ""
        try:
            r = httpx.get(base.rstrip("/") + "/sandboxes", headers={"X-API-Key": key}, timeout=timeout_s)
        except httpx.HTTPError as e:
            raise SandboxServerError(
                f"the sandbox server at {base} is unreachable ({type(e).__name__}: {e}); "
                "is `openk3 sandbox serve` running there?"
            ) from None
        if r.status_code in (401, 403):
            raise SandboxServerError(f"the sandbox server at {base} refused the API key ({r.status_code})")
        if r.status_code != 200:
            raise SandboxServerError(
                f"the sandbox server at {base} answered GET /sandboxes with {r.status_code}: {r.text[:200]}"
            )

    def opts(self) -> dict:
        o: dict = {"request_timeout": self.request_timeout_s}
        if self.api_url is not None:
            o.update(api_url=self.api_url, sandbox_url=self.api_url)
        if self.api_key is not None:
            o["api_key"] = self.api_key
        return o


def _died(sandbox_id: str, what: str, e: Exception) -> SandboxDiedError:
    return SandboxDiedError(f"sandbox {sandbox_id}: {what} failed: {type(e).__name__}: {str(e)[:300]}")


class E2BSandbox(ToolSandbox):
    """A sandbox driven through the unmodified ``e2b`` SDK. Any SDK error other than a command's own non-zero
    exit or timeout means the sandbox is gone or unreachable: :class:`SandboxDiedError`."""

    def __init__(self, sandbox, connection: E2BConnection) -> None:
        self._sb, self.connection = sandbox, connection
        self.sandbox_id: str = sandbox.sandbox_id

    def run(self, command: str, timeout_s: float) -> CommandResult:
        from e2b import CommandExitException, TimeoutException

        try:
            r = self._sb.commands.run(command, timeout=timeout_s)
            return CommandResult(r.exit_code, r.stdout, r.stderr)
        except CommandExitException as e:
            return CommandResult(e.exit_code, e.stdout, e.stderr)
        except TimeoutException:
            return CommandResult(124, "", f"command timed out after {timeout_s} s")
        except Exception as e:
            raise _died(self.sandbox_id, f"running {command[:80]!r}", e) from e

    def write_file(self, path: str, text: str) -> None:
        try:
            self._sb.files.write(path, text)
        except Exception as e:
            raise _died(self.sandbox_id, f"writing {path}", e) from e

    def pause(self) -> None:
        try:
            self._sb.pause()
        except Exception as e:
            raise _died(self.sandbox_id, "pause", e) from e

    def resume(self) -> None:
        try:
            self._sb = self._sb.connect()
        except Exception as e:
            raise _died(self.sandbox_id, "resume", e) from e

    def fork(self) -> E2BSandbox:
        from e2b import Sandbox

        try:
            (child,) = Sandbox.fork(self.sandbox_id, count=1, **self.connection.opts())
        except Exception as e:
            raise _died(self.sandbox_id, "fork", e) from e
        if isinstance(child, Exception):
            raise _died(self.sandbox_id, "fork", child)
        return E2BSandbox(child, self.connection)

    def kill(self) -> None:
        from e2b import Sandbox

        try:
            Sandbox.kill(self.sandbox_id, **self.connection.opts())
        except Exception as e:  # gone already, or the server is unreachable: nothing left to free here
            if "not found" not in str(e).lower():
                raise _died(self.sandbox_id, "kill", e) from e


class E2BSandboxes(SandboxFactory):
    def __init__(self, connection: E2BConnection | None = None) -> None:
        self.connection = connection or E2BConnection()

    def check(self) -> None:
        self.connection.check()

    def create(self, template: str, timeout_s: float) -> E2BSandbox:
        from e2b import Sandbox

        try:
            sb = Sandbox.create(template, timeout=int(max(1, timeout_s)), **self.connection.opts())
        except Exception as e:
            raise SandboxDiedError(
                f"creating a sandbox from {template!r} failed: {type(e).__name__}: {e}"
            ) from e
        return E2BSandbox(sb, self.connection)
