"""MicroVM sandboxes driven through the unmodified ``e2b`` SDK against ``openk3.sandbox``'s E2B API.

The VM tests boot real guests (QEMU microvm; TCG where there is no hardware KVM), at most two running at once.
They need qemu-system-x86 and the cached guest image (built on first use: about 3 minutes, needs root and the
Debian packages that scripts/test.sh installs); without them they skip, saying what is missing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from openk3.sandbox.qemu import VmmError
from openk3.sandbox.store import NotFoundError, Snapshot, SnapshotStore
from openk3.sandbox.vmm import MachineSpec, RamBacking, SavedState

# -- fast tests: no guest ---------------------------------------------------------------------------------------


def test_spec_and_state_errors_name_the_field():
    with pytest.raises(ValueError, match="memory_mib"):
        MachineSpec(memory_mib=64)
    with pytest.raises(ValueError, match="accel"):
        MachineSpec(accel="hvf")
    with pytest.raises(ValueError, match="ram"):
        SavedState("device", Path("s"), Path("d"), None)
    with pytest.raises(ValueError, match="kind"):
        SavedState("diff", Path("s"), Path("d"), None)


def _fake_snapshot(store: SnapshotStore, kind: str, parent: str | None, names=()) -> str:
    sid, d = store.new_dir()
    state = SavedState("device", d / "state.bin", d / "disk.qcow2", RamBacking(d / "ram.img", True))
    owner = None if kind == "template" else "owner"  # templates are usable by every key
    store.put(Snapshot(sid, list(names), kind, owner, parent, time.time(), state))
    return sid


def test_guest_agent_maps_directory_errors_to_invalid_argument(tmp_path):
    from openk3.sandbox.guest_agent import CONNECT_STATUS, os_error

    (tmp_path / "f").write_text("")
    cases = [
        (tmp_path, "path /p is a directory"),
        (tmp_path / "f" / "x", "path /p: a component of it is not a directory"),
    ]
    for path, message in cases:
        with pytest.raises(OSError) as e:
            open(path, "wb")  # noqa: SIM115 (it fails)
        err = os_error(e.value, "/p")
        assert (CONNECT_STATUS[err.code], str(err)) == (400, message)


def test_store_collects_only_unused_fork_snapshots(tmp_path):
    store = SnapshotStore(tmp_path)
    base = _fake_snapshot(store, "template", None, ["base"])
    used = _fake_snapshot(store, "fork", base)
    child_of_used = _fake_snapshot(store, "fork", used)  # in use: keeps `used` alive as its parent
    named = _fake_snapshot(store, "snapshot", used, ["mine"])
    unused = _fake_snapshot(store, "fork", base)
    assert store.collect({child_of_used}) == [unused]
    assert {s.snapshot_id for s in store.all()} == {base, used, child_of_used, named}
    assert store.get("mine", "owner").snapshot_id == named
    with pytest.raises(NotFoundError):
        store.get("mine", "someone else")
    assert store.get("base", "someone else").snapshot_id == base


# -- VM tests ---------------------------------------------------------------------------------------------------


def _skip_reason() -> str | None:
    from openk3.sandbox.image import missing_tools

    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86 qemu-utils)"
    missing = missing_tools()
    if missing:
        return f"guest image tools missing: {', '.join(missing)}"
    try:
        import e2b  # noqa: F401
    except ImportError:
        return "the e2b SDK is not installed (pip install -e .[sandbox])"
    return None


class Server:
    """An openk3 sandbox server in a thread (uvicorn) over a manager rooted at ``root``."""

    def __init__(self, root: Path, image, keys: list[str]):
        import uvicorn

        from openk3.sandbox.api import create_app
        from openk3.sandbox.manager import ManagerConfig, SandboxManager

        self.manager = SandboxManager(ManagerConfig(root=root, health_timeout_s=5.0), image)
        self.manager.build_template("base")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        app = create_app(self.manager, keys, reap_interval_s=0.5, health_interval_s=3600)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from openk3.sandbox.image import build_image

    try:
        image = build_image()
    except RuntimeError as e:
        pytest.skip(f"guest image not buildable here: {e}")
    root = tmp_path_factory.mktemp("sandbox-state")
    srv = Server(root, image, ["key-a", "key-b"])
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY="key-a")
    box = {"srv": srv, "image": image, "root": root}
    yield box
    box["srv"].stop()
    for live in list(box["srv"].manager._live.values()):
        if live.vm is not None:
            live.vm.kill()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _vmm_pids(root: Path) -> list[int]:
    """QEMU processes whose command line names a file under ``root``."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmd and str(root).encode() in cmd:
                pids.append(int(p.name))
    return pids


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_commands_files_and_key_isolation(server):
    from e2b import CommandExitException, InvalidArgumentException, Sandbox, SandboxNotFoundException

    sb = Sandbox.create("base", timeout=300, envs={"OPENK3_X": "x1"}, metadata={"run": "t1"})
    try:
        assert sb.commands.run("echo $OPENK3_X").stdout == "x1\n"
        assert sb.commands.run("echo $Y", envs={"Y": "y2"}).stdout == "y2\n"
        r = sb.commands.run("echo out; echo err >&2; python3 -c 'print(6*7)'")
        assert (r.exit_code, r.stdout, r.stderr) == (0, "out\n42\n", "err\n")
        with pytest.raises(CommandExitException) as e:
            sb.commands.run("echo partial; exit 3")
        assert e.value.exit_code == 3 and e.value.stdout == "partial\n"
        payload = os.urandom(1 << 20)
        sb.files.write("/root/data.bin", payload)
        assert sb.files.read("/root/data.bin", format="bytes") == payload
        assert (
            sb.commands.run("sha256sum /root/data.bin").stdout.split()[0]
            == hashlib.sha256(payload).hexdigest()
        )
        sb.files.write("notes/a.txt", "hello")  # relative to the home directory
        assert sb.commands.run("cat /root/notes/a.txt").stdout == "hello"
        assert {e.name for e in sb.files.list("/root/notes")} == {"a.txt"}
        assert sb.files.exists("/root/notes/a.txt") and not sb.files.exists("/root/nope")
        with pytest.raises(InvalidArgumentException, match="/root is a directory"):
            sb.files.write("/root", "x")
        info = sb.get_info()
        assert info.state.value == "running" and info.template_id == "base" and info.metadata == {"run": "t1"}
        # another key sees nothing of it
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(sb.sandbox_id, api_key="key-b")
        assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list(api_key="key-b").next_items()]
        assert sb.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
        assert Sandbox.kill(sb.sandbox_id, api_key="key-b") is False
        # a wrong key is refused
        with pytest.raises(Exception, match="401|invalid API key"):
            Sandbox.list(api_key="wrong").next_items()
        # egress is blocked: user-mode networking with restrict=on drops every outgoing connection
        probe = "python3 -c \"import socket; socket.create_connection(('10.0.2.2', 22), timeout=3)\""
        with pytest.raises(CommandExitException):
            sb.commands.run(probe)
    finally:
        sb.kill()
    assert sb.is_running() is False
    # unknown ids: 404 on every route
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("i0000000000000000")
    assert Sandbox.kill("i0000000000000000") is False


@pytest.mark.slow
def test_pause_leaves_no_process_and_resume_continues(server):
    from e2b import Sandbox

    sb = Sandbox.create("base", timeout=300)
    root = server["root"]
    try:
        sb.files.write("/root/count.sh", "i=0; while :; do i=$((i+1)); echo $i > /tmp/n; sleep 0.2; done\n")
        pid = sb.commands.run("nohup sh /root/count.sh >/dev/null 2>&1 & echo $!").stdout.strip()
        before = int(sb.commands.run("sleep 1; cat /tmp/n").stdout)
        assert before > 0
        assert len(_vmm_pids(root / "sandboxes" / sb.sandbox_id)) == 1
        assert sb.pause() is True
        assert _vmm_pids(root / "sandboxes" / sb.sandbox_id) == []  # no VMM process while paused
        assert sb.get_info().state.value == "paused"
        assert Sandbox.pause(sb.sandbox_id) is False  # already paused: the API answers 409
        resumed = Sandbox.connect(sb.sandbox_id)
        assert len(_vmm_pids(root / "sandboxes" / sb.sandbox_id)) == 1
        assert resumed.commands.run(f"kill -0 {pid} && echo alive").stdout == "alive\n"
        after = int(resumed.commands.run("sleep 1; cat /tmp/n").stdout)
        assert after > before  # the loop started before the pause kept counting after it
        # a second pause/resume cycle (now the RAM is the sandbox's own file: device state only)
        resumed.pause()
        again = Sandbox.connect(sb.sandbox_id)
        assert int(again.commands.run("sleep 0.6; cat /tmp/n").stdout) > after
    finally:
        Sandbox.kill(sb.sandbox_id)


@pytest.mark.slow
def test_fork_isolation_and_snapshot_restore(server):
    from e2b import Sandbox

    manager = server["srv"].manager
    parent = Sandbox.create("base", timeout=300)
    kids = []
    try:
        parent.commands.run("echo before > /root/parent; echo ram-before > /dev/shm/m")
        parent.pause()  # at most two running guests: fork from the paused parent
        kids = Sandbox.fork(parent.sandbox_id, count=2)
        assert len(kids) == 2 and all(isinstance(k, Sandbox) for k in kids)
        snap_id = manager.get(
            kids[0].sandbox_id, manager.get(parent.sandbox_id, _owner("key-a")).owner
        ).base_snapshot
        snap = manager.store.get(snap_id, _owner("key-a"))
        digests = {p: _sha(p) for p in (snap.state.ram.path, snap.state.disk, snap.state.stream)}
        for i, k in enumerate(kids):
            assert k.commands.run("cat /root/parent /dev/shm/m").stdout == "before\nram-before\n"
            k.commands.run(f"echo kid{i} > /root/kid; echo ram{i} > /dev/shm/m")
        for i, k in enumerate(kids):
            out = k.commands.run("cat /root/kid /dev/shm/m; ls /root").stdout.split()
            assert out[:2] == [f"kid{i}", f"ram{i}"] and "kid" in out
        for k in kids:
            k.kill()
        kids = []
        p = Sandbox.connect(parent.sandbox_id)
        p.commands.run("echo later > /root/parent")
        assert p.commands.run("cat /dev/shm/m; ls /root").stdout.split()[:1] == ["ram-before"]
        assert "kid" not in p.commands.run("ls /root").stdout.split()
        assert {q: _sha(q) for q in digests} == digests  # the snapshot never changes
        # named snapshot -> kill -> restore
        info = p.create_snapshot()
        p.kill()
        restored = Sandbox.create(info.snapshot_id, timeout=300)
        try:
            assert restored.commands.run("cat /root/parent /dev/shm/m").stdout == "later\nram-before\n"
            # each child of a fork succeeds or fails on its own: the first child's restore is made to fail
            real, calls = manager.vmm.restore, []

            def flaky(workdir, *args, **kwargs):
                if workdir.name != restored.sandbox_id:  # a child, not the parent going on
                    calls.append(workdir.name)
                    if len(calls) == 1:
                        raise VmmError("injected restore failure")
                return real(workdir, *args, **kwargs)

            manager.vmm.restore = flaky
            try:
                results = Sandbox.fork(restored.sandbox_id, count=2)
            finally:
                manager.vmm.restore = real
            assert isinstance(results[0], Exception) and "injected" in str(results[0])
            assert isinstance(results[1], Sandbox)
            assert results[1].commands.run("cat /root/parent").stdout == "later\n"
            results[1].kill()
            assert not (server["root"] / "sandboxes" / calls[0]).exists()  # the failed child left nothing
        finally:
            restored.kill()
        assert info.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
    finally:
        for k in kids:
            k.kill()
        Sandbox.kill(parent.sandbox_id)


def _owner(key: str) -> str:
    from openk3.sandbox.api import owner_of

    return owner_of(key)


@pytest.mark.slow
def test_timeout_reaps(server):
    from e2b import Sandbox, SandboxNotFoundException

    sb = Sandbox.create("base", timeout=2)
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            sb.get_info()
        except SandboxNotFoundException:
            break
        time.sleep(0.5)
    else:
        pytest.fail("a sandbox with timeout=2 s was still there after 20 s")
    assert not (server["root"] / "sandboxes" / sb.sandbox_id).exists()
    assert _vmm_pids(server["root"] / "sandboxes" / sb.sandbox_id) == []
    # a paused sandbox waits for its resume past its timeout
    sb = Sandbox.create("base", timeout=8)  # room for the pause on a loaded machine
    sb.pause()
    time.sleep(10)
    assert sb.get_info().state.value == "paused"
    Sandbox.kill(sb.sandbox_id)


@pytest.mark.slow
def test_crash_hang_killed_vmm_and_full_disk(server):
    from e2b import NotEnoughSpaceException, Sandbox, SandboxNotFoundException

    manager = server["srv"].manager
    # guest kernel panic: the VMM exits (panic=-1, -no-reboot), the sandbox is failed and freed
    sb = Sandbox.create("base", timeout=300)
    sb.commands.run(
        "echo 1 > /proc/sys/kernel/sysrq; (sleep 0.5; echo c > /proc/sysrq-trigger) >/dev/null 2>&1 &"
    )
    vm, deadline = manager._live[sb.sandbox_id].vm, time.time() + 240
    while (
        vm.alive() and time.time() < deadline
    ):  # the panic takes a moment under TCG (minutes on a loaded host)
        time.sleep(0.2)
    assert "crashed" in (manager.check(sb.sandbox_id) or "")
    with pytest.raises(SandboxNotFoundException):
        sb.get_info()
    r = httpx.get(f"{server['srv'].url}/sandboxes/{sb.sandbox_id}", headers={"X-API-Key": "key-a"})
    assert r.status_code == 404 and "failed: guest crashed" in r.json()["message"]
    assert not (server["root"] / "sandboxes" / sb.sandbox_id).exists()
    # a killed VMM process
    sb = Sandbox.create("base", timeout=300)
    (pid,) = _vmm_pids(server["root"] / "sandboxes" / sb.sandbox_id)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(Exception):  # noqa: B017 (the SDK's error for a 502 depends on the call)
        sb.commands.run("true", request_timeout=10)
    assert "crashed" in manager.failures[sb.sandbox_id]
    # a hung guest (vCPUs stopped): the health probe fails it
    sb = Sandbox.create("base", timeout=300)
    manager._live[sb.sandbox_id].vm.freeze()
    assert "hung" in (manager.check(sb.sandbox_id) or "")
    assert _vmm_pids(server["root"] / "sandboxes" / sb.sandbox_id) == []
    # a full guest disk: writes fail with NotEnoughSpace, the guest keeps answering
    sb = Sandbox.create("base", timeout=300)
    try:
        sb.commands.run(
            # every free block, the 5% reserved for root included, then what is left byte by byte
            "fallocate -l $(( $(stat -f -c '%f * %S' /) - 65536 )) /fill; dd if=/dev/zero of=/fill2 bs=4k 2>/dev/null; true"
        )
        with pytest.raises(NotEnoughSpaceException):
            sb.files.write("/root/big.bin", os.urandom(1 << 20))
        assert sb.commands.run("rm /fill /fill2; echo ok").stdout == "ok\n"
        sb.files.write("/root/big.bin", b"x" * 1000)
        assert sb.files.read("/root/big.bin") == "x" * 1000
    finally:
        sb.kill()


@pytest.mark.slow
def test_rm_rf_and_fork_bomb_stay_inside(server):
    from e2b import Sandbox

    victim, other = Sandbox.create("base", timeout=300), Sandbox.create("base", timeout=300)
    try:
        other.commands.run("echo safe > /root/mine")
        victim.commands.run("rm -rf --no-preserve-root / >/dev/null 2>&1 || true", request_timeout=120)
        with pytest.raises(Exception):  # noqa: B017 (bash is gone from the victim's disk)
            victim.commands.run("ls /", request_timeout=20)
        assert other.commands.run("cat /root/mine").stdout == "safe\n"
    finally:
        victim.kill()
    fresh = Sandbox.create("base", timeout=300)  # the template's disk is untouched
    try:
        assert fresh.commands.run("ls /bin/bash && cat /etc/debian_version").exit_code == 0
        fresh.commands.run(":(){ :|:& };:", background=True)  # a fork bomb
        time.sleep(5)
        t0 = time.monotonic()
        assert other.commands.run("cat /root/mine").stdout == "safe\n"
        assert time.monotonic() - t0 < 30
        t0 = time.monotonic()
        assert fresh.kill() is True
        assert time.monotonic() - t0 < 10
        assert _vmm_pids(server["root"] / "sandboxes" / fresh.sandbox_id) == []
    finally:
        Sandbox.kill(fresh.sandbox_id)
        other.kill()


@pytest.mark.slow
def test_server_restart_keeps_paused_and_adopts_running(server):
    from e2b import Sandbox

    paused = Sandbox.create("base", timeout=300)
    paused.commands.run("echo kept > /root/k")
    paused.pause()
    running = Sandbox.create("base", timeout=300)
    running.commands.run("echo alive > /root/r")
    server["srv"].stop()
    server["srv"].manager.shutdown(pause_running=False)  # running VMMs stay up, to be re-adopted
    srv = Server(server["root"], server["image"], ["key-a", "key-b"])  # a new server over the same state
    server["srv"] = srv
    os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url)
    states = {s.sandbox_id: s.state.value for s in Sandbox.list().next_items()}
    assert states[paused.sandbox_id] == "paused" and states[running.sandbox_id] == "running"
    back = Sandbox.connect(paused.sandbox_id)
    assert back.commands.run("cat /root/k").stdout == "kept\n"
    assert Sandbox.connect(running.sandbox_id).commands.run("cat /root/r").stdout == "alive\n"
    back.kill()
    Sandbox.kill(running.sandbox_id)


def test_api_auth_and_bad_input_without_guests(tmp_path):
    """The control plane's 401/400/404 answers (no guest is started: the image is a stand-in)."""
    from fastapi.testclient import TestClient

    from openk3.sandbox.api import create_app
    from openk3.sandbox.image import Image
    from openk3.sandbox.manager import ManagerConfig, SandboxManager

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "image.json").write_text('{"disk_mib": 1024}')
    manager = SandboxManager(ManagerConfig(root=tmp_path / "state"), Image(tmp_path / "img"))
    with TestClient(create_app(manager, ["k"])) as client:
        assert client.get("/v2/sandboxes").status_code == 401
        assert client.get("/v2/sandboxes", headers={"X-API-Key": "other"}).status_code == 401
        key = {"X-API-Key": "k"}
        assert client.get("/v2/sandboxes", headers=key).json() == []
        r = client.post("/v2/sandboxes", json={}, headers=key)
        assert r.status_code == 400 and "templateID" in r.json()["message"]
        r = client.post("/v2/sandboxes", json={"templateID": 5}, headers=key)
        assert r.status_code == 400 and "templateID must be a string" in r.json()["message"]
        r = client.post("/v2/sandboxes", json={"templateID": "nope"}, headers=key)
        assert r.status_code == 404 and "nope" in r.json()["message"]
        for method, path in [("get", "/sandboxes/ix"), ("delete", "/sandboxes/ix"), ("post", "/sandboxes/ix/pause"),
                             ("post", "/v2/sandboxes/ix/connect"), ("post", "/sandboxes/ix/fork")]:  # fmt: skip
            r = client.request(method.upper(), path, headers=key, json={})
            assert r.status_code == 404 and r.json()["code"] == 404, (method, path, r.text)
        r = client.post("/v2/sandboxes", content=b"[1]", headers=key)
        assert r.status_code == 400 and "JSON object" in r.json()["message"]
        r = client.get("/files", headers={"E2b-Sandbox-Id": "ix"})  # envd traffic for an unknown sandbox
        assert r.status_code == 404 and "'ix' not found" in r.json()["message"]
        r = client.get(
            "/health", headers={"E2b-Sandbox-Id": "ix"}
        )  # what the SDK's is_running() reads as False
        assert r.status_code == 502 and "'ix' not found" in r.json()["message"]
    with pytest.raises(ValueError, match="API key"):
        create_app(manager, [])


def _stand_in_manager(tmp_path: Path):
    """A manager over a stand-in image: enough for the control plane, no guest can start."""
    from openk3.sandbox.image import Image
    from openk3.sandbox.manager import ManagerConfig, SandboxManager

    (tmp_path / "img").mkdir(exist_ok=True)
    (tmp_path / "img" / "image.json").write_text('{"disk_mib": 1024}')
    return SandboxManager(ManagerConfig(root=tmp_path / "state"), Image(tmp_path / "img"))


_SIGTERM_SERVER = """
import sys, uvicorn
from pathlib import Path
from openk3.sandbox.api import create_app
sys.path.insert(0, {tests!r})
from test_sandbox import _stand_in_manager
mark = Path({mark!r})
app = create_app(_stand_in_manager(Path({tmp!r})), ["k"], on_shutdown=lambda: mark.write_text("shut down"))
uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning")
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_app_shutdown_hook_runs_on_sigterm_and_sigint(tmp_path, sig):
    """uvicorn re-raises SIGTERM after its shutdown, which ends the process: the hook must run before that."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mark = tmp_path / "mark"
    code = _SIGTERM_SERVER.format(
        tests=str(Path(__file__).parent), mark=str(mark), tmp=str(tmp_path), port=port
    )
    p = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if (
                    httpx.get(f"http://127.0.0.1:{port}/v2/sandboxes", headers={"X-API-Key": "k"}).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            pytest.fail("the server did not come up in 30 s")
        p.send_signal(sig)
        p.wait(timeout=30)
    finally:
        p.kill()
    assert mark.read_text() == "shut down"


_CLI_SERVER = """
import sys
from pathlib import Path
import openk3.sandbox.image as image
from openk3.sandbox.manager import SandboxManager
sys.path.insert(0, {tests!r})
from test_sandbox import _stand_in_manager
stand_in = _stand_in_manager(Path({tmp!r}))
image.build_image = lambda config: stand_in.image  # no guest image, no template boot: the CLI around them
SandboxManager.build_template = lambda self, name: None
SandboxManager.shutdown = lambda self, pause_running: print("shutdown pause_running=" + str(pause_running))
from openk3.cli import main
sys.exit(main(["sandbox", "serve", "--port", "0", "--root", {root!r}, "--api-key", "k"]))
"""


def test_cli_serve_says_ready_and_pauses_on_sigterm(tmp_path):
    import subprocess
    import sys

    root = tmp_path / "state-served"
    code = _CLI_SERVER.format(tests=str(Path(__file__).parent), tmp=str(tmp_path), root=str(root))
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        lines = [p.stdout.readline(), p.stdout.readline()]
        assert lines[0].startswith("accelerator ") and lines[0].endswith("\n")
        ready = lines[1].rstrip("\n")
        assert ready.startswith("ready: http://127.0.0.1:") and ready.endswith(
            "(template base booted in 0.0 s)"
        )
        url = ready.split()[1]
        assert httpx.get(f"{url}/v2/sandboxes", headers={"X-API-Key": "k"}).json() == []
        assert (root / "server.lock").read_text().startswith(f"{p.pid} 127.0.0.1 ")
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert out == "shutdown pause_running=True\n", err
    assert p.returncode == -signal.SIGTERM  # uvicorn re-raises the signal after its shutdown
    assert (root / "server.lock").read_text() == ""  # unlocked: the next server takes it silently


def test_state_root_lock_refuses_a_second_server_and_takes_over_a_stale_one(tmp_path, capsys):
    import subprocess
    import sys

    from openk3.sandbox.lock import RootBusyError, hold_root

    # a server that exited without unlocking (killed): its line is left, its flock is gone with it
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from openk3.sandbox.lock import hold_root; "
                    f"f, _ = hold_root(Path({str(tmp_path)!r}), 'h', 1); sys.exit(0)"], check=True)  # fmt: skip
    dead = (tmp_path / "server.lock").read_text().strip()
    f, stale = hold_root(tmp_path, "127.0.0.1", 3000)
    assert stale == dead and dead.endswith(" h 1")
    assert (tmp_path / "server.lock").read_text() == f"{os.getpid()} 127.0.0.1 3000\n"
    # a second holder in another process is refused, naming this one
    r = subprocess.run([sys.executable, "-c", "from pathlib import Path; from openk3.sandbox.lock import hold_root; "
                        f"hold_root(Path({str(tmp_path)!r}), 'h', 2)"], capture_output=True, text=True)  # fmt: skip
    assert r.returncode != 0 and f"RootBusyError: state root {tmp_path} is in use" in r.stderr
    assert f"{os.getpid()} 127.0.0.1 3000" in r.stderr
    # the CLI refuses with one line before any work
    from openk3.cli import main

    assert main(["sandbox", "serve", "--root", str(tmp_path), "--api-key", "k"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("openk3 sandbox: error: state root") and "3000" in err[0]
    f.close()
    with pytest.raises(RootBusyError):  # flock is per open file: a second open in one process conflicts too
        g, _ = hold_root(tmp_path, "a", 1)
        hold_root(tmp_path, "b", 2)


def test_cli_serve_rejects_a_bad_flag_before_any_work(capsys, tmp_path):
    from openk3.cli import main

    with pytest.raises(SystemExit) as e:
        main(["sandbox", "serve", "--port", "99999"])
    assert e.value.code == 2
    assert "argument --port: a port is 0 to 65535, got 99999" in capsys.readouterr().err
    with socket.socket() as taken:  # a port in use fails before the image or the template (no cache is made)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["sandbox", "serve", "--port", str(port), "--root", str(tmp_path / "state"), "--api-key", "k"]
        assert main([*args, "--cache-dir", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"openk3 sandbox: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert not (tmp_path / "cache").exists() and (tmp_path / "state" / "server.lock").read_text() == ""

    assert main(["sandbox", "serve", "--memory-mib", "64", "--api-key", "k"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["openk3: error: MachineSpec.memory_mib must be >= 128 (the guest runs python3), got 64"]


@pytest.mark.parametrize(
    "console", ["", "sysrq: Trigger a crash\nKernel panic - not syncing: sysrq triggered crash\n"]
)
def test_a_silent_guest_is_crashed_when_its_console_shows_a_panic_else_hung(tmp_path, console):
    """The health probe tells a panicking guest (its VMM still printing the panic, slow under TCG) from a hung
    one by the console, without QEMU: a sleeping process stands in for the VMM, and the agent port is closed."""
    import subprocess

    from openk3.sandbox.manager import _Live
    from openk3.sandbox.qemu import QemuVm
    from openk3.sandbox.record import SandboxRecord

    manager = _stand_in_manager(tmp_path)
    work = tmp_path / "vm"
    work.mkdir()
    (work / "serial.log").write_text("Linux version 6.1\n" + console)
    with socket.socket() as s:  # a port nothing listens on: /health is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["sleep", "60"])
    vm = QemuVm(work, proc.pid, proc, port, work / "disk.qcow2", RamBacking(work / "ram", False))
    record = SandboxRecord("sb1", "o", "base", "base", "running", time.time(), time.time() + 60)
    manager._live["sb1"] = _Live(record, vm)
    reason = manager.check("sb1")
    assert proc.poll() is not None  # the stand-in VMM was killed and reaped either way
    if console:
        assert reason == "guest crashed: Kernel panic - not syncing: sysrq triggered crash"
    else:
        assert reason.startswith("guest hung: its agent did not answer /health")
    assert "sb1" not in manager._live and manager.failures["sb1"] == reason
