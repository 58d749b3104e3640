"""The agent inside the guest: an HTTP server on port 49983 speaking the subset of the envd protocol that the
``e2b`` SDK uses (https://github.com/e2b-dev/E2B, ``spec/envd``), written for the guest's python3 (3.11,
standard library only). Its state (env vars, running commands) lives in one :class:`AgentState` on the server. The image builder copies this file to ``/opt/openk3/agent.py``; it runs as PID 1.

Routes (Connect protocol, JSON codec; https://connectrpc.com/docs/protocol):

- ``GET /health`` -> 204; ``POST /init`` ``{envVars, timestamp, ...}`` -> 204 (sets the guest clock from
  ``timestamp``, RFC 3339 or Unix seconds, so a restored guest is not behind the host; stores the env vars).
- ``POST /process.Process/Start``: server stream (``application/connect+json``). Request: one envelope
  ``[flags u8][length u32 BE][JSON]`` with ``{"process": {"cmd", "args", "envs", "cwd"}}``. Response envelopes:
  ``{"event": {"start": {"pid"}}}``, ``{"event": {"data": {"stdout"|"stderr": base64}}}``,
  ``{"event": {"end": {"exitCode", "exited", "status"}}}``, then the end-of-stream envelope (flags 0x02).
- ``POST /process.Process/List`` / ``SendSignal`` (unary JSON).
- ``GET /files?path=P`` (raw bytes) and ``POST /files?path=P`` (multipart ``file`` or octet-stream body).
- ``POST /filesystem.Filesystem/Stat|ListDir|MakeDir|Remove|Move`` (unary JSON).

Errors are Connect errors ``{"code": "not_found", "message": ...}`` with the matching HTTP status. Commands run
as root, each in its own session (``SendSignal`` signals the whole process group). PID 1 also reaps orphans.
"""

import base64
import datetime
import email.parser
import grp
import json
import os
import pwd
import queue
import signal
import stat
import struct
import subprocess
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = 49983
HOME = "/root"
BASE_ENV = (
    ("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
    ("HOME", HOME),
    ("LANG", "C.UTF-8"),
)
CONNECT_STATUS = {"invalid_argument": 400, "not_found": 404, "already_exists": 409, "resource_exhausted": 429,
                  "internal": 500}  # fmt: skip


class RpcError(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


def os_error(e, path):
    if isinstance(e, FileNotFoundError):
        return RpcError("not_found", f"path {path} not found")
    if isinstance(e, FileExistsError):
        return RpcError("already_exists", f"path {path} already exists")
    if isinstance(e, IsADirectoryError):
        return RpcError("invalid_argument", f"path {path} is a directory")
    if isinstance(e, NotADirectoryError):
        return RpcError("invalid_argument", f"path {path}: a component of it is not a directory")
    if getattr(e, "errno", None) == 28:
        return RpcError("resource_exhausted", f"no space left on device writing {path}")
    return RpcError("internal", f"{type(e).__name__}: {e}")


def resolve(path):
    if not path:
        raise RpcError("invalid_argument", "path is empty")
    return os.path.normpath(path if path.startswith("/") else os.path.join(HOME, path))


def entry(path):
    st = os.lstat(path)
    kind = "FILE_TYPE_DIRECTORY" if stat.S_ISDIR(st.st_mode) else "FILE_TYPE_FILE"
    if stat.S_ISLNK(st.st_mode):
        kind = "FILE_TYPE_SYMLINK"
    mtime = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc)
    try:
        owner, group = pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        owner, group = str(st.st_uid), str(st.st_gid)
    return {"name": os.path.basename(path) or "/", "type": kind, "path": path, "size": st.st_size,
            "mode": stat.S_IMODE(st.st_mode), "permissions": stat.filemode(st.st_mode), "owner": owner,
            "group": group, "modifiedTime": mtime.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}  # fmt: skip


def fs_stat(req):
    path = resolve(req.get("path", ""))
    try:
        return {"entry": entry(path)}
    except OSError as e:
        raise os_error(e, path) from e


def fs_list(req):
    path, depth = resolve(req.get("path", "")), int(req.get("depth") or 1)
    if not os.path.isdir(path):
        raise RpcError(
            "not_found" if not os.path.exists(path) else "invalid_argument", f"{path} is not a directory"
        )
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        rel = os.path.relpath(dirpath, path)
        level = 0 if rel == "." else rel.count("/") + 1
        for name in sorted(dirnames + filenames):
            out.append(entry(os.path.join(dirpath, name)))
        if level + 1 >= depth:
            dirnames[:] = []
    return {"entries": out}


def fs_make_dir(req):
    path = resolve(req.get("path", ""))
    try:
        os.makedirs(path)
    except OSError as e:
        raise os_error(e, path) from e
    return {"entry": entry(path)}


def fs_remove(req):
    path = resolve(req.get("path", ""))
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            subprocess.run(["rm", "-rf", "--", path], check=True)
        else:
            os.remove(path)
    except OSError as e:
        raise os_error(e, path) from e
    return {}


def fs_move(req):
    src, dst = resolve(req.get("source", "")), resolve(req.get("destination", ""))
    try:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.rename(src, dst)
    except OSError as e:
        raise os_error(e, src) from e
    return {"entry": entry(dst)}


class AgentState:
    """What the agent remembers between requests: the env vars ``/init`` set and the running commands
    (pid -> (Popen, config)), the latter only touched under ``lock``."""

    def __init__(self):
        self.env = dict(BASE_ENV)
        self.procs = {}
        self.lock = threading.Lock()


def proc_list(state, req):
    with state.lock:
        procs = state.procs.items()
        return {"processes": [{"config": cfg, "pid": pid} for pid, (p, cfg) in procs if p.poll() is None]}


def proc_signal(state, req):
    pid = int(req.get("process", {}).get("pid", 0))
    sig = {"SIGNAL_SIGKILL": signal.SIGKILL, "SIGNAL_SIGTERM": signal.SIGTERM}.get(req.get("signal"))
    if sig is None:
        raise RpcError("invalid_argument", f"unknown signal {req.get('signal')!r}")
    with state.lock:
        if pid not in state.procs:
            raise RpcError("not_found", f"process {pid} not found")
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    return {}


def set_clock(ts):
    if isinstance(ts, str):
        ts = datetime.datetime.fromisoformat(_iso(ts)).timestamp()
    time.clock_settime(time.CLOCK_REALTIME, float(ts))


def _iso(ts):
    """RFC 3339 with up to nanoseconds -> something ``fromisoformat`` (3.11) reads."""
    ts = ts.replace("Z", "+00:00")
    if "." in ts:
        head, frac = ts.split(".", 1)
        n = len(frac) - len(frac.lstrip("0123456789"))
        digits, zone = frac[:n], frac[n:]
        ts = f"{head}.{digits[:6].ljust(6, '0')}{zone}"
    return ts


UNARY = {"/filesystem.Filesystem/Stat": fs_stat, "/filesystem.Filesystem/ListDir": fs_list,
         "/filesystem.Filesystem/MakeDir": fs_make_dir, "/filesystem.Filesystem/Remove": fs_remove,
         "/filesystem.Filesystem/Move": fs_move}  # fmt: skip
STATEFUL = {"/process.Process/List": proc_list, "/process.Process/SendSignal": proc_signal}


def envelope(obj, flags=0):
    data = json.dumps(obj).encode()
    return struct.pack(">BI", flags, len(data)) + data


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def reply(self, status, payload=None, ctype="application/json"):
        data = (
            b""
            if payload is None
            else (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
        )
        self.send_response(status)
        if payload is not None:
            self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def rpc_error(self, e):
        self.reply(CONNECT_STATUS.get(e.code, 500), {"code": e.code, "message": str(e)})

    def query_path(self):
        q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
        return resolve(q.get("path", [""])[0])

    def do_GET(self):
        route = urllib.parse.urlparse(self.path).path
        try:
            if route == "/health":
                return self.reply(204)
            if route == "/files":
                path = self.query_path()
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError as e:
                    raise os_error(e, path) from e
                return self.reply(200, data, "application/octet-stream")
            self.reply(404, {"code": 404, "message": f"no route GET {route}"})
        except RpcError as e:
            self.rpc_error(e)

    def do_POST(self):
        route = urllib.parse.urlparse(self.path).path
        try:
            if route == "/init":
                req = json.loads(self.body() or b"{}")
                self.server.state.env.update(req.get("envVars") or {})
                if req.get("timestamp"):
                    set_clock(req["timestamp"])
                return self.reply(204)
            if route == "/files":
                try:
                    return self.reply(200, self.write_files())
                except RpcError as e:  # the /files route reports a full disk as HTTP 507, as envd does
                    if e.code != "resource_exhausted":
                        raise
                    return self.reply(507, {"code": 507, "message": str(e)})
            if route == "/process.Process/Start":
                return self.start()
            if route in UNARY:
                return self.reply(200, UNARY[route](json.loads(self.body() or b"{}")))
            if route in STATEFUL:
                return self.reply(200, STATEFUL[route](self.server.state, json.loads(self.body() or b"{}")))
            self.reply(404, {"code": "not_found", "message": f"no route POST {route}"})
        except RpcError as e:
            self.rpc_error(e)
        except (ValueError, KeyError) as e:
            self.rpc_error(RpcError("invalid_argument", f"bad request: {e}"))

    def write_files(self):
        body, ctype = self.body(), self.headers.get("Content-Type", "")
        if ctype.startswith("multipart/form-data"):
            msg = email.parser.BytesParser().parsebytes(
                b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + body
            )
            items = [(part.get_filename(), part.get_payload(decode=True)) for part in msg.get_payload()]
            default = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query).get("path", [None])[0]
            items = [
                (resolve(default if len(items) == 1 and default else name), data) for name, data in items
            ]
        else:
            items = [(self.query_path(), body)]
        out = []
        for path, data in items:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
            except OSError as e:
                raise os_error(e, path) from e
            out.append({"name": os.path.basename(path), "type": "file", "path": path})
        return out

    def start(self):
        raw = self.body()
        flags, n = struct.unpack(">BI", raw[:5])
        req = json.loads(raw[5 : 5 + n])
        cfg = req.get("process") or {}
        state = self.server.state
        env = dict(state.env)
        env.update(cfg.get("envs") or {})
        with state.lock:  # registered before the reaper can see it exit
            try:
                p = subprocess.Popen([cfg["cmd"], *cfg.get("args", [])], cwd=cfg.get("cwd") or HOME, env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)  # fmt: skip
            except OSError as e:
                raise os_error(e, cfg.get("cmd")) from e
            state.procs[p.pid] = (p, cfg)
        self.send_response(200)
        self.send_header("Content-Type", "application/connect+json")
        self.end_headers()
        events = queue.Queue()

        def pump(stream, name):
            for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
                events.put({"data": {name: base64.b64encode(chunk).decode()}})
            events.put(None)

        for stream, name in ((p.stdout, "stdout"), (p.stderr, "stderr")):
            threading.Thread(target=pump, args=(stream, name), daemon=True).start()
        try:
            self.wfile.write(envelope({"event": {"start": {"pid": p.pid}}}))
            self.wfile.flush()
            open_streams = 2
            while open_streams:
                ev = events.get()
                if ev is None:
                    open_streams -= 1
                    continue
                self.wfile.write(envelope({"event": ev}))
                self.wfile.flush()
            code = p.wait()
            status = f"exit status {code}" if code >= 0 else f"signal: {signal.Signals(-code).name.lower()}"
            end = {"exitCode": code if code >= 0 else -1, "exited": code >= 0, "status": status}
            self.wfile.write(envelope({"event": {"end": end}}))
            self.wfile.write(envelope({}, flags=2))
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away (background command dropped); the process keeps running
        finally:
            p.wait()
            with state.lock:
                state.procs.pop(p.pid, None)


def reap_orphans(state):
    """PID 1's duty: reap exited children that no ``Popen`` waits for (``WNOWAIT`` peeks first)."""
    while True:
        time.sleep(1.0)
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            continue
        if info is None:
            continue
        with state.lock:
            owned = info.si_pid in state.procs
        if not owned:
            try:
                os.waitpid(info.si_pid, os.WNOHANG)
            except ChildProcessError:
                pass


def main():
    os.chdir(HOME)
    server = ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    server.daemon_threads = True
    server.state = AgentState()
    if os.getpid() == 1:
        threading.Thread(target=reap_orphans, args=(server.state,), daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
