"""The QEMU backend of :mod:`openk3.sandbox.vmm`: ``qemu-system-x86_64 -M microvm`` driven through QMP.

One QEMU process per running guest: 1 virtio-blk disk (a qcow2 overlay), 1 virtio-net NIC on user-mode
networking with ``restrict=on`` (the guest reaches nothing outside; only the agent port is forwarded from a
127.0.0.1 port), the serial console appended to ``serial.log``, guest RAM a ``memory-backend-file``.

Saving uses migration to a file (``migrate exec:cat > FILE``; QEMU 7.2 has no ``file:`` URI) with the
``x-ignore-shared`` capability set exactly when the RAM is mapped shared, so that the stream then carries only
device state (tens of KiB) and the RAM file is the memory image. QEMU checks that both ends agree on
``x-ignore-shared``, so a restore sets it from :attr:`SavedState.kind`. Restoring starts QEMU with
``-S -incoming defer`` and the same command line, then ``migrate-incoming`` and ``cont``.

Under TCG the guest kernel cannot calibrate its TSC on microvm (no PIT/HPET reference) and hangs; the host's
TSC frequency is passed as ``tsc_early_khz``.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

from openk3.sandbox.image import Image
from openk3.sandbox.qmp import Qmp, QmpError
from openk3.sandbox.vmm import MachineSpec, RamBacking, SavedState, Vm, Vmm

AGENT_GUEST_PORT = 49983
QEMU = "qemu-system-x86_64"


class VmmError(RuntimeError):
    """A VMM process failed to start, restore or save; the message carries QEMU's and the console's last lines."""


def host_tsc_khz() -> int:
    """The host TSC frequency in kHz, from ``/proc/cpuinfo`` (``cpu MHz``)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    raise VmmError(
        "cannot read the host CPU frequency from /proc/cpuinfo (needed for tsc_early_khz under TCG)"
    )


def pick_accel(requested: str) -> str:
    """``kvm`` only with hardware KVM (the ``kvm_intel``/``kvm_amd`` module and a writable ``/dev/kvm``):
    a paravirtual KVM (``kvm_pvm``) cannot run the stock guest kernel, so it gets ``tcg``."""
    hardware = any(Path(f"/sys/module/{m}").exists() for m in ("kvm_intel", "kvm_amd"))
    has_kvm = hardware and os.access("/dev/kvm", os.R_OK | os.W_OK)
    if requested == "kvm" and not has_kvm:
        raise VmmError(
            "accel='kvm' asked for, but this host has no hardware KVM (kvm_intel/kvm_amd and /dev/kvm)"
        )
    if requested == "auto":
        return "kvm" if has_kvm else "tcg"
    return requested


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 6) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-n:])


class QemuVm(Vm):
    def __init__(
        self, workdir: Path, pid: int, proc: subprocess.Popen | None, port: int, disk: Path, ram: RamBacking
    ):
        self.workdir, self.pid, self.proc, self.agent_port, self.disk, self.ram = (
            workdir,
            pid,
            proc,
            port,
            disk,
            ram,
        )
        self._qmp: Qmp | None = None

    @property
    def qmp(self) -> Qmp:
        if self._qmp is None:
            self._qmp = Qmp(self.workdir / "qmp.sock")
        return self._qmp

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"

    def exit_reason(self) -> str:
        code = self.proc.poll() if self.proc is not None else None
        return (f"VMM exited with status {code}; qemu: {_tail(self.workdir / 'qemu.log')}; "
                f"console: {_tail(self.workdir / 'serial.log')}")  # fmt: skip

    def panic_line(self) -> str | None:
        try:
            text = (self.workdir / "serial.log").read_text(errors="replace")
        except OSError:
            return None
        return next((line.strip() for line in text.splitlines() if "Kernel panic" in line), None)

    def _wait_exit(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            if self.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=0.01)
            else:
                time.sleep(0.01)
        if self.alive():
            self.kill()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        else:
            while self.alive():
                time.sleep(0.01)
        self.release()

    def release(self) -> None:
        if self._qmp is not None:
            self._qmp.close()
            self._qmp = None

    def freeze(self) -> None:
        self.qmp.execute("stop")

    def save(self, stream: Path) -> SavedState:
        try:
            q = self.qmp
            q.execute(
                "migrate-set-capabilities",
                capabilities=[{"capability": "x-ignore-shared", "state": self.ram.shared}],
            )
            q.execute("migrate-set-parameters", **{"max-bandwidth": 1 << 40})
            q.execute("stop")
            q.execute("migrate", uri=f"exec:cat > {shlex.quote(str(stream))}")
            while True:
                status = q.execute("query-migrate").get("status")
                if status == "completed":
                    break
                if status in ("failed", "cancelled"):
                    raise VmmError(f"saving {self.workdir.name}: migration {status}")
                time.sleep(0.002)
            with contextlib.suppress(QmpError, OSError):
                q.execute("quit")
        except (QmpError, OSError) as e:
            raise VmmError(f"saving {self.workdir.name}: {e}; {self.exit_reason()}") from e
        self._wait_exit(10.0)
        self.release()
        kind = "device" if self.ram.shared else "full"
        return SavedState(kind, stream, self.disk, self.ram if self.ram.shared else None)


class QemuVmm(Vmm):
    """Starts microvm guests of ``image`` shaped by ``spec``."""

    def __init__(self, image: Image, spec: MachineSpec, binary: str = QEMU):
        self.image, self.spec, self.binary = image, spec, binary
        self.accel = pick_accel(spec.accel)
        append = "console=ttyS0 reboot=t panic=-1 quiet"
        if self.accel == "tcg":
            append += f" tsc_early_khz={host_tsc_khz()} tsc=reliable"
        self.append = append

    def _argv(self, workdir: Path, disk: Path, ram: RamBacking, port: int, incoming: bool) -> list[str]:
        m = self.spec.memory_mib
        accel = ["-accel", "kvm", "-cpu", "host"] if self.accel == "kvm" else [
            "-accel", f"tcg,tb-size={self.spec.tb_size_mib}", "-cpu", "max"]  # fmt: skip
        share = "on" if ram.shared else "off"
        argv = [
            self.binary, "-M", "microvm,isa-serial=on,rtc=on,memory-backend=mem0", *accel,
            "-smp", str(self.spec.vcpus), "-m", f"{m}M",
            "-nodefaults", "-no-user-config", "-nographic", "-display", "none", "-no-reboot",
            "-chardev", f"file,id=ser0,path={workdir / 'serial.log'},append=on", "-serial", "chardev:ser0",
            "-qmp", f"unix:{workdir / 'qmp.sock'},server=on,wait=off",
            "-kernel", str(self.image.kernel), "-initrd", str(self.image.initrd), "-append", self.append,
            "-object", f"memory-backend-file,id=mem0,size={m}M,mem-path={ram.path},share={share}",
            "-netdev", f"user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:{port}-:{AGENT_GUEST_PORT}",
            "-device", "virtio-net-device,netdev=n0",
            "-drive", f"id=d0,file={disk},format=qcow2,if=none,node-name=disk0,cache=unsafe",
            "-device", "virtio-blk-device,drive=d0",
        ]  # fmt: skip
        if incoming:
            argv += ["-S", "-incoming", "defer"]
        return argv

    def _spawn(self, workdir: Path, disk: Path, ram: RamBacking, incoming: bool) -> QemuVm:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "qmp.sock").unlink(missing_ok=True)
        for _ in range(3):  # the forwarded port may be taken between free_port() and QEMU binding it
            port = free_port()
            with open(workdir / "qemu.log", "ab") as log:
                proc = subprocess.Popen(self._argv(workdir, disk, ram, port, incoming), stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=log, start_new_session=True)  # fmt: skip
            vm = QemuVm(workdir, proc.pid, proc, port, disk, ram)
            try:
                vm.qmp  # noqa: B018 (connects; fails if QEMU exited on a bad command line or a taken port)
                return vm
            except QmpError as e:
                vm.kill()
                if "host forwarding" not in _tail(workdir / "qemu.log"):
                    raise VmmError(f"QEMU did not start: {e}; {vm.exit_reason()}") from e
        raise VmmError(f"QEMU could not bind a forwarded port after 3 tries; {vm.exit_reason()}")

    def boot(self, workdir: Path, disk: Path, ram: RamBacking) -> QemuVm:
        return self._spawn(workdir, disk, ram, incoming=False)

    def restore(
        self, workdir: Path, state: SavedState, disk: Path, ram: RamBacking, run: bool = True
    ) -> QemuVm:
        if state.kind == "device" and ram.path != state.ram.path:
            raise ValueError(
                f"a device state restores onto its own RAM file {state.ram.path}, got {ram.path}"
            )
        if state.kind == "full" and not ram.shared:
            raise ValueError("a full state restores into a new shared RAM file (ram.shared=True)")
        vm = self._spawn(workdir, disk, ram, incoming=True)
        try:
            q = vm.qmp
            q.execute(
                "migrate-set-capabilities",
                capabilities=[{"capability": "x-ignore-shared", "state": state.kind == "device"}],
            )
            q.execute("migrate-incoming", uri=f"exec:cat {shlex.quote(str(state.stream))}")
            deadline = time.monotonic() + 60.0
            while (status := q.execute("query-status")["status"]) == "inmigrate":
                if time.monotonic() > deadline:
                    raise VmmError(f"restoring {workdir.name}: state not loaded within 60 s")
                time.sleep(0.002)
            if status != "paused":
                raise VmmError(f"restoring {workdir.name}: VM in state {status!r} after loading")
            if run:
                q.execute("cont")
        except (QmpError, OSError, VmmError) as e:
            reason = vm.exit_reason()
            vm.kill()
            raise VmmError(f"restoring {workdir.name} from {state.stream.name}: {e}; {reason}") from e
        return vm

    def adopt(self, workdir: Path, pid: int, agent_port: int, disk: Path, ram: RamBacking) -> QemuVm | None:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        if str(workdir / "qmp.sock").encode() not in cmdline:
            return None  # the pid was reused by something else
        vm = QemuVm(workdir, pid, None, agent_port, disk, ram)
        try:
            vm.qmp.execute("query-status")
        except (QmpError, OSError):
            vm.kill()
            return None
        return vm
