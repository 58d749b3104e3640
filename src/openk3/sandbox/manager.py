"""The sandbox manager: create, kill, pause, resume, snapshot and fork microVM sandboxes, reap them on timeout,
detect crashed or hung guests, and find paused sandboxes again after a restart.

Every sandbox is restored from a snapshot (a template is the snapshot of a freshly booted guest):

- **create**: a new qcow2 overlay over the snapshot's disk, the snapshot's RAM file mapped private
  (copy-on-write: siblings share its clean pages), its device state loaded; then ``/init`` resyncs the clock.
- **pause**: save and end the VMM. A sandbox whose RAM is its own shared file saves device state only; a
  copy-on-write sandbox must write all its memory (``full``) and gets its own RAM file on resume.
- **resume**: restore the saved state; the guest continues where it stopped (processes keep running).
- **snapshot**: pause, move the state into the store (the RAM file, the device state, the disk layer, now
  frozen), and restore the sandbox as a copy-on-write child of it with a new overlay (same id; a paused one stays
  paused).
- **fork(n)**: a snapshot, then ``n`` children of it, each on its own (a failed child does not fail the rest).

Layout: ``<root>/snapshots`` (the :class:`SnapshotStore`) and ``<root>/sandboxes/<id>/`` (record.json, disk
overlays, saved states, an owned RAM file, qmp.sock, serial.log, qemu.log).

Thread safety: public methods may be called from many threads; each sandbox has its own lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import shutil
import subprocess
import threading
import time
from pathlib import Path

from openk3.sandbox import agent_client
from openk3.sandbox.agent_client import AgentError
from openk3.sandbox.image import Image
from openk3.sandbox.qemu import QemuVmm, VmmError
from openk3.sandbox.record import SandboxRecord
from openk3.sandbox.store import NotFoundError, Snapshot, SnapshotStore
from openk3.sandbox.vmm import MachineSpec, RamBacking, SavedState, Vm


class SandboxError(RuntimeError):
    """An operation on a sandbox failed; the message says which and why."""


class AlreadyPausedError(SandboxError):
    pass


class SandboxFailedError(NotFoundError):
    """The sandbox is gone because its guest crashed or hung (the message has the reason)."""


@dataclasses.dataclass(frozen=True)
class ManagerConfig:
    """root: state directory; spec: machine shape; boot_timeout_s: cold boot to agent ready (templates);
    ready_timeout_s: restore to agent ready; health_timeout_s: a running guest's agent must answer /health
    within this or it counts as hung; default_timeout_s: a sandbox's life when create gives none."""

    root: Path
    spec: MachineSpec = MachineSpec()
    boot_timeout_s: float = 180.0
    ready_timeout_s: float = 60.0
    health_timeout_s: float = 10.0
    default_timeout_s: float = 300.0

    def __post_init__(self):
        for name in ("boot_timeout_s", "ready_timeout_s", "health_timeout_s", "default_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ManagerConfig.{name} must be > 0, got {getattr(self, name)}")


class _Live:
    """A sandbox the manager holds: its record, its VMM process while running, its lock."""

    def __init__(self, record: SandboxRecord, vm: Vm | None):
        self.record, self.vm, self.lock, self.gone = record, vm, threading.RLock(), False


def _qcow2_overlay(backing: Path, path: Path) -> None:
    r = subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(backing), str(path)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        raise SandboxError(f"qemu-img create {path.name} over {backing}: {r.stderr.strip()}")


class SandboxManager:
    def __init__(self, config: ManagerConfig, image: Image):
        self.config, self.image = config, image
        self.vmm = QemuVmm(image, config.spec)
        self.image_disk_mib = int(json.loads((image.root / "image.json").read_text())["disk_mib"])
        self.store = SnapshotStore(config.root / "snapshots")
        self.sandboxes_dir = config.root / "sandboxes"
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self.failures: dict[str, str] = {}
        self._recover()

    # -- bookkeeping -------------------------------------------------------------------------------------------

    def _dir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    def _entry(self, sandbox_id: str, owner: str) -> _Live:
        with self._lock:
            live = self._live.get(sandbox_id)
        if live is None or live.record.owner != owner:
            if sandbox_id in self.failures and live is None:
                raise SandboxFailedError(f"sandbox {sandbox_id!r} failed: {self.failures[sandbox_id]}")
            raise NotFoundError(f"sandbox {sandbox_id!r} not found")
        return live

    def _locked(self, sandbox_id: str, owner: str) -> _Live:
        """The entry, locked by the caller (``with live.lock``), re-checked for removal."""
        live = self._entry(sandbox_id, owner)
        live.lock.acquire()
        if live.gone:
            live.lock.release()
            raise NotFoundError(f"sandbox {sandbox_id!r} not found")
        return live

    def _persist(self, live: _Live) -> None:
        r, vm = live.record, live.vm
        r.vm = (
            None
            if vm is None
            else {"pid": vm.pid, "port": vm.agent_port, "disk": str(vm.disk), "ram": vm.ram.to_json()}
        )
        r.write(self._dir(r.sandbox_id))

    def _remove(self, live: _Live) -> None:
        if live.vm is not None:
            live.vm.kill()
            live.vm = None
        live.gone = True
        with self._lock:
            self._live.pop(live.record.sandbox_id, None)
        shutil.rmtree(self._dir(live.record.sandbox_id), ignore_errors=True)

    def collect_garbage(self) -> list[str]:
        """Delete fork snapshots no sandbox uses and half-written sandbox directories; returns what went."""
        with self._lock:
            in_use = {live.record.base_snapshot for live in self._live.values()}
            known = set(self._live)
        gone = self.store.collect(in_use)
        for d in self.sandboxes_dir.iterdir():
            if (
                d.name not in known
                and not (d / "record.json").exists()
                and time.time() - d.stat().st_mtime > 600
            ):
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.name)
        return gone

    def _recover(self) -> None:
        """After a restart: paused sandboxes come back as they were; running ones are re-adopted if their VMM
        still runs (else they are failed); directories without a record are removed."""
        for d in sorted(self.sandboxes_dir.iterdir()):
            if not (d / "record.json").exists():
                shutil.rmtree(d, ignore_errors=True)
                continue
            record = SandboxRecord.read(d)
            vm = None
            if record.state == "running":
                v = record.vm or {}
                vm = self.vmm.adopt(
                    d, v.get("pid", -1), v.get("port", 0), Path(v.get("disk", "")), record.vm_ram()
                )
                if vm is None:
                    self.failures[record.sandbox_id] = "its VMM was gone when the server restarted"
                    shutil.rmtree(d, ignore_errors=True)
                    continue
            self._live[record.sandbox_id] = _Live(record, vm)

    # -- templates ---------------------------------------------------------------------------------------------

    def build_template(self, name: str = "base") -> Snapshot:
        """Cold-boot the image, wait for the agent, warm the guest's page cache with one ``bash -l`` command,
        and freeze it as the template ``name``. Reuses an existing template of that name."""
        with contextlib.suppress(NotFoundError):
            return self.store.get(name, None)
        snapshot_id, sdir = self.store.new_dir()
        disk, ram = sdir / "disk.qcow2", RamBacking(sdir / "ram.img", shared=True)
        _qcow2_overlay(self.image.rootfs, disk)
        vm = self.vmm.boot(sdir, disk, ram)
        try:
            agent_client.wait_ready(vm.agent_port, self.config.boot_timeout_s, vm.alive)
            code, _, err = agent_client.run(vm.agent_port, ["/bin/bash", "-l", "-c", "sync"], timeout_s=60)
            if code != 0:
                raise SandboxError(f"template {name}: warm-up command failed ({code}): {err[-200:]!r}")
            state = vm.save(sdir / "state.bin")
        except (AgentError, VmmError) as e:
            reason = vm.exit_reason()
            vm.kill()
            shutil.rmtree(sdir, ignore_errors=True)
            raise SandboxError(f"template {name}: {e}; {reason}") from e
        for leftover in ("qmp.sock",):
            (sdir / leftover).unlink(missing_ok=True)
        return self.store.put(Snapshot(snapshot_id, [name], "template", None, None, time.time(), state))

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def _ready(self, vm: Vm, env_vars: dict[str, str]) -> None:
        agent_client.init(vm.agent_port, env_vars, self.config.ready_timeout_s, vm.alive)

    def _start_child(self, snap: Snapshot, owner: str, template_id: str, timeout_s: float | None,
                     metadata: dict, env_vars: dict, on_timeout: str) -> SandboxRecord:  # fmt: skip
        sandbox_id = "i" + secrets.token_hex(8)
        d = self._dir(sandbox_id)
        d.mkdir()
        try:
            disk = d / "disk-0.qcow2"
            _qcow2_overlay(snap.state.disk, disk)
            vm = self.vmm.restore(d, snap.state, disk, RamBacking(snap.state.ram.path, shared=False))
            try:
                self._ready(vm, env_vars)
            except AgentError as e:
                reason = vm.exit_reason()
                vm.kill()
                raise SandboxError(f"restored guest did not become ready: {e}; {reason}") from e
        except (VmmError, SandboxError) as e:
            shutil.rmtree(d, ignore_errors=True)
            raise SandboxError(f"creating a sandbox from {template_id!r}: {e}") from e
        now = time.time()
        record = SandboxRecord(sandbox_id, owner, template_id, snap.snapshot_id, "running", now,
                               now + (timeout_s or self.config.default_timeout_s), on_timeout, dict(metadata),
                               dict(env_vars), secrets.token_hex(16))  # fmt: skip
        live = _Live(record, vm)
        self._persist(live)
        with self._lock:
            self._live[sandbox_id] = live
        return record

    def create(self, template: str, owner: str, timeout_s: float | None = None, metadata: dict | None = None,
               env_vars: dict | None = None, on_timeout: str = "kill") -> SandboxRecord:  # fmt: skip
        """A running sandbox restored from template or snapshot ``template``; NotFoundError if ``owner`` has none."""
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout_s}")
        snap = self.store.get(template, owner)
        return self._start_child(snap, owner, template, timeout_s, metadata or {}, env_vars or {}, on_timeout)

    def get(self, sandbox_id: str, owner: str) -> SandboxRecord:
        return self._entry(sandbox_id, owner).record

    def list(self, owner: str) -> list[SandboxRecord]:
        with self._lock:
            return [live.record for live in self._live.values() if live.record.owner == owner]

    def agent_port(self, sandbox_id: str, owner: str | None = None) -> tuple[SandboxRecord, int | None]:
        """The record and the agent's 127.0.0.1 port (None while paused); ``owner=None`` skips the key check
        (the envd proxy authenticates by the sandbox's access token instead)."""
        with self._lock:
            live = self._live.get(sandbox_id)
        if live is None or (owner is not None and live.record.owner != owner):
            raise NotFoundError(f"sandbox {sandbox_id!r} not found")
        return live.record, None if live.vm is None else live.vm.agent_port

    def kill(self, sandbox_id: str, owner: str) -> None:
        live = self._locked(sandbox_id, owner)
        try:
            self._remove(live)
        finally:
            live.lock.release()
        self.collect_garbage()

    def set_timeout(self, sandbox_id: str, owner: str, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout_s}")
        live = self._locked(sandbox_id, owner)
        try:
            live.record.end_at = time.time() + timeout_s
            self._persist(live)
        finally:
            live.lock.release()

    def _save(self, live: _Live) -> SavedState:
        r = live.record
        r.generation += 1
        try:
            state = live.vm.save(self._dir(r.sandbox_id) / f"state-{r.generation}.bin")
        except VmmError as e:
            self._check_alive(live)
            raise SandboxError(f"pausing {r.sandbox_id}: {e}") from e
        live.vm, r.state, r.saved = None, "paused", state
        self._persist(live)
        return state

    def pause(self, sandbox_id: str, owner: str) -> SavedState:
        """Save the guest and end its VMM; AlreadyPausedError if it is paused."""
        live = self._locked(sandbox_id, owner)
        try:
            if live.vm is None:
                raise AlreadyPausedError(f"sandbox {sandbox_id!r} is already paused")
            return self._save(live)
        finally:
            live.lock.release()

    def _restore_saved(self, live: _Live, run: bool = True) -> None:
        r = live.record
        d, st = self._dir(r.sandbox_id), r.saved
        ram = st.ram if st.kind == "device" else RamBacking(d / f"ram-{r.generation}.img", shared=True)
        r.generation += 1
        try:
            vm = self.vmm.restore(d, st, st.disk, ram, run=run)
            if run:
                self._ready(vm, r.env_vars)
        except (VmmError, AgentError) as e:
            if "vm" in locals():
                vm.kill()
            if st.kind == "full":
                ram.path.unlink(missing_ok=True)
            raise SandboxError(f"resuming {r.sandbox_id}: {e}") from e
        live.vm, r.state, r.saved = vm, "running", None
        if st.stream.parent == d:  # the stream of a snapshot stays with the snapshot
            st.stream.unlink(missing_ok=True)
        self._persist(live)

    def resume(self, sandbox_id: str, owner: str, timeout_s: float | None = None) -> bool:
        """Restore a paused sandbox (True) or leave a running one be (False); ``timeout_s`` renews its life."""
        live = self._locked(sandbox_id, owner)
        try:
            if timeout_s is not None:
                live.record.end_at = time.time() + timeout_s
            elif live.vm is None:  # a resumed sandbox gets at least the default life
                live.record.end_at = max(live.record.end_at, time.time() + self.config.default_timeout_s)
            if live.vm is not None:
                self._persist(live)
                return False
            self._restore_saved(live)
            return True
        finally:
            live.lock.release()

    def snapshot(
        self, sandbox_id: str, owner: str, name: str | None = None, kind: str = "snapshot"
    ) -> Snapshot:
        """Freeze the sandbox into a new snapshot (named ``name`` if given); the sandbox goes on as its
        copy-on-write child (running if it ran, paused if it was paused)."""
        live = self._locked(sandbox_id, owner)
        try:
            return self._snapshot(live, name, kind)
        finally:
            live.lock.release()

    def _snapshot(self, live: _Live, name: str | None, kind: str) -> Snapshot:
        r = live.record
        d = self._dir(r.sandbox_id)
        was_running = live.vm is not None
        st = self._save(live) if was_running else r.saved
        snapshot_id, sdir = self.store.new_dir()
        try:
            if (
                st.kind == "full"
            ):  # copy-on-write memory: load it into the snapshot's own RAM file, save again
                vm = self.vmm.restore(d, st, st.disk, RamBacking(sdir / "ram.img", shared=True), run=False)
                st_full, st = st, vm.save(d / f"state-{r.generation}-dev.bin")
                st_full.stream.unlink(missing_ok=True)
            if st.ram.path.parent == d:  # the sandbox's own RAM file becomes the snapshot's
                st.ram.path.rename(sdir / "ram.img")
                ram_path = sdir / "ram.img"
            else:  # already in this snapshot (full case) or another snapshot's file, unchanged since
                ram_path = st.ram.path
            if st.stream.parent == d:
                st.stream.rename(sdir / "state.bin")
            else:
                shutil.copyfile(st.stream, sdir / "state.bin")
            st.disk.rename(sdir / "disk.qcow2")
        except (VmmError, OSError) as e:
            shutil.rmtree(sdir, ignore_errors=True)
            raise SandboxError(f"snapshot of {r.sandbox_id}: {e}") from e
        frozen = SavedState(
            "device", sdir / "state.bin", sdir / "disk.qcow2", RamBacking(ram_path, shared=True)
        )
        names = [name] if name else []
        snap = self.store.put(
            Snapshot(snapshot_id, names, kind, r.owner, r.base_snapshot, time.time(), frozen)
        )
        # the sandbox goes on as a child of the snapshot
        r.generation += 1
        disk = d / f"disk-{r.generation}.qcow2"
        _qcow2_overlay(frozen.disk, disk)
        r.base_snapshot = snapshot_id
        r.saved = SavedState("device", frozen.stream, disk, RamBacking(ram_path, shared=False))
        r.state = "paused"
        self._persist(live)
        if was_running:
            self._restore_saved(live)
        return snap

    def fork(self, sandbox_id: str, owner: str, count: int = 1, timeout_s: float | None = None) -> list:
        """``count`` copy-on-write children of the sandbox as it is now (it keeps running). Returns one entry per
        child: its SandboxRecord, or the SandboxError that child failed with."""
        if not 1 <= count <= 64:
            raise ValueError(f"fork count must be in [1, 64], got {count}")
        live = self._locked(sandbox_id, owner)
        try:
            snap = self._snapshot(live, None, "fork")
            parent = live.record
        finally:
            live.lock.release()
        out = []
        for _ in range(count):
            try:
                out.append(self._start_child(snap, owner, parent.template_id, timeout_s, parent.metadata,
                                             parent.env_vars, parent.on_timeout))  # fmt: skip
            except SandboxError as e:
                out.append(e)
        self.collect_garbage()
        return out

    def delete_snapshot(self, ref: str, owner: str) -> None:
        snap = self.store.get(ref, owner)
        if snap.owner is None:
            raise ValueError(f"{ref!r} is a template; templates are not deleted through the API")
        snap.kind = "fork"  # unnamed: collected once no sandbox uses it
        snap.names = []
        self.store.put(snap)
        self.collect_garbage()

    # -- faults and timeouts -----------------------------------------------------------------------------------

    def _fail(self, live: _Live, reason: str) -> None:
        self.failures[live.record.sandbox_id] = reason
        self._remove(live)

    def _check_alive(self, live: _Live) -> None:
        if live.vm is not None and not live.vm.alive():
            self._fail(live, f"guest crashed: {live.vm.exit_reason()}")

    def check(self, sandbox_id: str) -> str | None:
        """Probe a running sandbox: a VMM that exited (guest panic, killed process) or an agent that does not
        answer /health within ``health_timeout_s`` fails it, freeing its resources. A guest that stops
        answering is *crashed* when its VMM exited during the probe or its console shows a kernel panic (under
        TCG on a loaded host printing the panic can outlast the probe), else *hung*. Returns the failure
        reason or None."""
        with self._lock:
            live = self._live.get(sandbox_id)
        if live is None:
            return self.failures.get(sandbox_id)
        with live.lock:
            if live.gone or live.vm is None:
                return None
            self._check_alive(live)
            if not live.gone and not agent_client.healthy(live.vm.agent_port, self.config.health_timeout_s):
                self._check_alive(live)  # the VMM may have exited while the probe waited
                panic = None if live.gone else live.vm.panic_line()
                if panic:
                    self._fail(live, f"guest crashed: {panic}")
                elif not live.gone:
                    self._fail(
                        live,
                        f"guest hung: its agent did not answer /health within {self.config.health_timeout_s} s",
                    )
        return self.failures.get(sandbox_id)

    def reap(self, now: float | None = None, probe: bool = False) -> dict[str, str]:
        """Apply timeouts to running sandboxes (kill, or pause where ``on_timeout="pause"``; paused ones are
        kept until resumed or killed) and, with ``probe``, health-check them. Returns {sandbox_id: what
        happened}."""
        now = time.time() if now is None else now
        with self._lock:
            lives = list(self._live.values())
        done = {}
        for live in lives:
            r = live.record
            if r.end_at <= now and live.vm is not None:  # a paused sandbox waits for its resume
                with live.lock:
                    if live.gone or live.vm is None:
                        continue
                    if r.on_timeout == "pause":
                        with contextlib.suppress(SandboxError):
                            self._save(live)
                            done[r.sandbox_id] = "paused (timeout)"
                            continue
                    self._remove(live)
                    done[r.sandbox_id] = "killed (timeout)"
            elif probe and live.vm is not None:
                reason = self.check(r.sandbox_id)
                if reason:
                    done[r.sandbox_id] = reason
        if done:
            self.collect_garbage()
        return done

    def shutdown(self, pause_running: bool = False) -> None:
        """Stop managing: pause running sandboxes (``pause_running``) or leave their VMMs to be re-adopted."""
        with self._lock:
            lives = list(self._live.values())
        for live in lives:
            with live.lock:
                if live.vm is None or live.gone:
                    continue
                if pause_running:
                    with contextlib.suppress(SandboxError):
                        self._save(live)
                else:
                    live.vm.release()
