"""A sandbox's persistent record (``<root>/sandboxes/<id>/record.json``): what a restarted server needs to
find a paused sandbox again, or to re-adopt a running one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from openk3.sandbox.vmm import RamBacking, SavedState

STATES = ("running", "paused")
ON_TIMEOUT = ("kill", "pause")


@dataclasses.dataclass
class SandboxRecord:
    """sandbox_id; owner: hash of the API key that created it; template_id: what it was created from (an E2B
    ``templateID``: a template name or a snapshot id); base_snapshot: the snapshot its disk and RAM are layered
    on; state: ``running`` or ``paused``; started_at / end_at: Unix seconds (``end_at``: when the timeout
    reaps it); on_timeout: ``kill`` or ``pause``; metadata / env_vars: as given at create; access_token:
    the envd token the proxy checks; generation: bumped by every restore (names fresh files);
    vm: ``{pid, port, disk, ram}`` while running; saved: the saved state while paused."""

    sandbox_id: str
    owner: str
    template_id: str
    base_snapshot: str
    state: str
    started_at: float
    end_at: float
    on_timeout: str = "kill"
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    env_vars: dict[str, str] = dataclasses.field(default_factory=dict)
    access_token: str = ""
    generation: int = 0
    vm: dict | None = None
    saved: SavedState | None = None

    def __post_init__(self):
        if self.state not in STATES:
            raise ValueError(f"SandboxRecord.state must be one of {STATES}, got {self.state!r}")
        if self.on_timeout not in ON_TIMEOUT:
            raise ValueError(f"SandboxRecord.on_timeout must be one of {ON_TIMEOUT}, got {self.on_timeout!r}")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["saved"] = None if self.saved is None else self.saved.to_json()
        return d

    @staticmethod
    def from_json(d: dict) -> SandboxRecord:
        saved = None if d.get("saved") is None else SavedState.from_json(d["saved"])
        return SandboxRecord(**{**d, "saved": saved})

    def vm_ram(self) -> RamBacking:
        return RamBacking.from_json(self.vm["ram"])

    def write(self, directory: Path) -> None:
        tmp = directory / "record.json.tmp"
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.rename(directory / "record.json")

    @staticmethod
    def read(directory: Path) -> SandboxRecord:
        return SandboxRecord.from_json(json.loads((directory / "record.json").read_text()))
