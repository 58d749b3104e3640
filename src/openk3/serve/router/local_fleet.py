"""``openk3 serve`` workers as child processes on 127.0.0.1: what the fleet tests and
``benchmarks/fleet.py`` run the router against (one process per worker, each on a fixed port so it can be
killed and started again there)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcess:
    """``python -m openk3 serve --ckpt CKPT --port PORT *serve_args`` with one intra-op thread
    (``OMP_NUM_THREADS=1``), its output discarded."""

    def __init__(self, ckpt, serve_args: list[str], port: int | None = None) -> None:
        self.ckpt, self.serve_args = str(ckpt), list(serve_args)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> WorkerProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "openk3", "serve", "--ckpt", self.ckpt, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            command + self.serve_args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> WorkerProcess:
        """Wait until ``GET /health`` answers 200. Raises ``RuntimeError`` when the process exits or the
        time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker on port {self.port} exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker on port {self.port} did not start in {timeout_s:g} s")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL (a crash: no clean shutdown)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; no-op when not running."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def metric(self, name: str) -> float:
        """One unlabelled sample of the worker's ``GET /metrics``."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def start_workers(ckpt, n: int, serve_args: list[str]) -> list[WorkerProcess]:
    """Start ``n`` workers at once and wait for all; stops them all when one fails."""
    workers = [WorkerProcess(ckpt, serve_args).start() for _ in range(n)]
    try:
        return [w.wait_ready() for w in workers]
    except BaseException:
        for w in workers:
            w.stop()
        raise
