"""The VMM interface: what the sandbox manager needs from a virtual machine monitor.

A VMM starts a guest either by booting the image or by restoring a saved state, and a running guest can be
saved (the VMM process exits afterwards: a saved guest costs no CPU and no resident memory) or killed. The guest
RAM is always a file (:class:`RamBacking`): mapped shared, the file *is* the guest memory, so saving writes
only the device state; mapped private over a frozen file, guests share its clean pages copy-on-write, and saving
must write the whole memory into the stream (:class:`SavedState` ``kind="full"``).

QEMU (:mod:`openk3.sandbox.qemu`) is the backend that runs on this machine kind; a Firecracker backend would
implement the same two classes.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class MachineSpec:
    """The virtual machine's shape.

    memory_mib: guest RAM in MiB (also the size of the RAM file).
    vcpus: virtual CPUs.
    accel: ``"kvm"``, ``"tcg"`` or ``"auto"`` (hardware KVM when ``kvm_intel``/``kvm_amd`` is loaded, else TCG).
    tb_size_mib: TCG translation cache cap in MiB (host memory per running guest; ignored under KVM).
    """

    memory_mib: int = 256
    vcpus: int = 1
    accel: str = "auto"
    tb_size_mib: int = 64

    def __post_init__(self):
        if self.memory_mib < 128:
            raise ValueError(
                f"MachineSpec.memory_mib must be >= 128 (the guest runs python3), got {self.memory_mib}"
            )
        if self.vcpus < 1:
            raise ValueError(f"MachineSpec.vcpus must be >= 1, got {self.vcpus}")
        if self.accel not in ("kvm", "tcg", "auto"):
            raise ValueError(f"MachineSpec.accel must be 'kvm', 'tcg' or 'auto', got {self.accel!r}")
        if self.tb_size_mib < 16:
            raise ValueError(f"MachineSpec.tb_size_mib must be >= 16, got {self.tb_size_mib}")


@dataclasses.dataclass(frozen=True)
class RamBacking:
    """Guest RAM as a file: ``shared=True`` maps it ``MAP_SHARED`` (writes land in the file), ``False`` maps
    it ``MAP_PRIVATE`` over a frozen file (copy-on-write; the file never changes)."""

    path: Path
    shared: bool

    def to_json(self) -> dict:
        return {"path": str(self.path), "shared": self.shared}

    @staticmethod
    def from_json(d: dict) -> RamBacking:
        return RamBacking(Path(d["path"]), bool(d["shared"]))


@dataclasses.dataclass(frozen=True)
class SavedState:
    """A saved guest: ``kind="device"``: device state in ``stream``, memory in ``ram`` (restore maps the same
    file); ``kind="full"``: device state and every non-zero memory page in ``stream`` (``ram`` is None).
    ``disk`` is the qcow2 the guest wrote last (frozen while the state is kept)."""

    kind: str
    stream: Path
    disk: Path
    ram: RamBacking | None

    def __post_init__(self):
        if self.kind not in ("device", "full"):
            raise ValueError(f"SavedState.kind must be 'device' or 'full', got {self.kind!r}")
        if (self.kind == "device") != (self.ram is not None):
            raise ValueError(f"SavedState.ram must be set exactly when kind='device' (kind={self.kind!r})")

    def to_json(self) -> dict:
        return {"kind": self.kind, "stream": str(self.stream), "disk": str(self.disk),
                "ram": None if self.ram is None else self.ram.to_json()}  # fmt: skip

    @staticmethod
    def from_json(d: dict) -> SavedState:
        ram = None if d["ram"] is None else RamBacking.from_json(d["ram"])
        return SavedState(d["kind"], Path(d["stream"]), Path(d["disk"]), ram)


class Vm(abc.ABC):
    """A running guest (one VMM process)."""

    pid: int
    agent_port: int
    """127.0.0.1 port forwarded to the guest agent (port 49983 inside)."""
    ram: RamBacking
    disk: Path

    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the VMM process still runs."""

    @abc.abstractmethod
    def save(self, stream: Path) -> SavedState:
        """Stop the guest, write its state to ``stream`` (device only if the RAM is shared, else full) and end
        the VMM process."""

    @abc.abstractmethod
    def kill(self) -> None:
        """End the VMM process at once (the guest is lost)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Let go of the guest without stopping it (closes the monitor session, so a later :meth:`Vmm.adopt`
        can connect)."""

    @abc.abstractmethod
    def freeze(self) -> None:
        """Stop the vCPUs in place (the process stays; used to simulate a hung guest and for short pauses)."""

    @abc.abstractmethod
    def exit_reason(self) -> str:
        """Why the VMM process ended (exit status and the last lines it or the guest console wrote)."""

    @abc.abstractmethod
    def panic_line(self) -> str | None:
        """The guest console's first ``Kernel panic`` line, or None: a guest that stops answering while this
        is set is crashing (its VMM exits once the panic is printed), not hung."""


class Vmm(abc.ABC):
    """Starts guests."""

    accel: str
    """The accelerator actually used (``"kvm"`` or ``"tcg"``)."""

    @abc.abstractmethod
    def boot(self, workdir: Path, disk: Path, ram: RamBacking) -> Vm:
        """Cold-boot the image with ``disk`` as root disk and ``ram`` as memory."""

    @abc.abstractmethod
    def restore(self, workdir: Path, state: SavedState, disk: Path, ram: RamBacking, run: bool = True) -> Vm:
        """Start a guest from ``state`` with ``disk`` (a qcow2 whose contents equal ``state.disk``) and ``ram``
        (for a device state: ``state.ram.path`` mapped shared or private; for a full state: a new file).
        ``run=False`` leaves it stopped (to save it again at once)."""

    @abc.abstractmethod
    def adopt(self, workdir: Path, pid: int, agent_port: int, disk: Path, ram: RamBacking) -> Vm | None:
        """Take over a guest started by an earlier process of the runtime (None if it is gone)."""
