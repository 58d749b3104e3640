"""A blocking QMP client: JSON lines over QEMU's monitor UNIX socket
(https://www.qemu.org/docs/master/interop/qmp-spec.html). Events are read and dropped."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path


class QmpError(RuntimeError):
    """QEMU answered a command with an error, or the monitor could not be reached."""


class Qmp:
    """One QMP session. ``Qmp(path, timeout_s)`` waits up to ``timeout_s`` for the socket to accept, reads the
    greeting and enters command mode."""

    def __init__(self, path: Path, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while True:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError) as e:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise QmpError(f"QMP socket {path} did not accept within {timeout_s} s") from e
                time.sleep(0.01)
        self.sock.settimeout(timeout_s)
        self.reader = self.sock.makefile("rb")
        self._read()  # greeting
        self.execute("qmp_capabilities")

    def _read(self) -> dict:
        line = self.reader.readline()
        if not line:
            raise QmpError("QMP connection closed by QEMU")
        return json.loads(line)

    def execute(self, command: str, **arguments) -> object:
        """Run ``command`` and return its ``return`` value; raise QmpError with QEMU's description."""
        msg = {"execute": command, **({"arguments": arguments} if arguments else {})}
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            reply = self._read()
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise QmpError(f"QMP {command}: {reply['error'].get('desc', reply['error'])}")

    def close(self) -> None:
        try:
            self.reader.close()
            self.sock.close()
        except OSError:
            pass
