"""Templates and snapshots on disk: a frozen guest (RAM file, device state, qcow2 disk) that sandboxes are
restored from copy-on-write. A template is a snapshot taken right after a cold boot; a fork leaves an unnamed
snapshot behind that lives as long as a sandbox uses it.

Layout: ``<root>/<snapshot_id>/{ram.img, state.bin, disk.qcow2, meta.json}``. A snapshot's disk is a qcow2
overlay whose backing file is its parent snapshot's disk (or the image's root file system), so ``parent`` must
outlive it. Files in a snapshot directory are never written after ``meta.json`` exists.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import shutil
import time
from pathlib import Path

from openk3.sandbox.vmm import SavedState

KINDS = ("template", "snapshot", "fork")


class NotFoundError(KeyError):
    """No sandbox or snapshot by that id (or it belongs to another API key)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclasses.dataclass
class Snapshot:
    """snapshot_id: unique id; names: aliases (a template's name, a user's snapshot name); kind: one of KINDS;
    owner: the API key hash that may use it (None: every key, for templates); parent: the snapshot whose disk
    this one's disk is layered over (None: the image); created: Unix seconds; state: the frozen guest."""

    snapshot_id: str
    names: list[str]
    kind: str
    owner: str | None
    parent: str | None
    created: float
    state: SavedState

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Snapshot.kind must be one of {KINDS}, got {self.kind!r}")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["state"] = self.state.to_json()
        return d

    @staticmethod
    def from_json(d: dict) -> Snapshot:
        return Snapshot(**{**d, "state": SavedState.from_json(d["state"])})

    def size_bytes(self) -> dict[str, int]:
        """Allocated bytes on disk of the RAM file, the device state and the disk layer."""
        files = {"ram": self.state.ram.path, "state": self.state.stream, "disk": self.state.disk}
        return {k: p.stat().st_blocks * 512 for k, p in files.items()}


class SnapshotStore:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def new_dir(self) -> tuple[str, Path]:
        """A fresh id and its (empty) directory."""
        snapshot_id = "s" + secrets.token_hex(8)
        path = self.root / snapshot_id
        path.mkdir()
        return snapshot_id, path

    def put(self, snapshot: Snapshot) -> Snapshot:
        """Commit: writes ``meta.json`` last, so a half-written snapshot has none and :meth:`collect` removes it."""
        (self.root / snapshot.snapshot_id / "meta.json").write_text(json.dumps(snapshot.to_json(), indent=1))
        return snapshot

    def all(self) -> list[Snapshot]:
        out = []
        for meta in sorted(self.root.glob("*/meta.json")):
            out.append(Snapshot.from_json(json.loads(meta.read_text())))
        return out

    def get(self, ref: str, owner: str | None) -> Snapshot:
        """The snapshot with id or name ``ref`` that ``owner`` may use; NotFoundError otherwise."""
        for s in self.all():
            if (s.snapshot_id == ref or ref in s.names) and s.owner in (None, owner):
                return s
        raise NotFoundError(f"template or snapshot {ref!r} not found")

    def delete(self, snapshot_id: str) -> None:
        shutil.rmtree(self.root / snapshot_id, ignore_errors=True)

    def collect(self, in_use: set[str]) -> list[str]:
        """Delete fork snapshots no sandbox uses (directly or as an ancestor) and half-written directories;
        returns the deleted ids."""
        snaps = {s.snapshot_id: s for s in self.all()}
        keep = set()
        stack = [sid for sid in in_use if sid in snaps] + [
            s.snapshot_id for s in snaps.values() if s.kind != "fork"
        ]
        while stack:
            sid = stack.pop()
            if sid in keep or sid not in snaps:
                continue
            keep.add(sid)
            if snaps[sid].parent:
                stack.append(snaps[sid].parent)
        gone = [sid for sid in snaps if sid not in keep]
        gone += [
            p.name for p in self.root.iterdir() if p.is_dir() and not (p / "meta.json").exists() and _stale(p)
        ]
        for sid in gone:
            self.delete(sid)
        return gone


def _stale(path: Path, age_s: float = 600.0) -> bool:
    """A directory without ``meta.json`` older than ``age_s`` is a leftover of a crash, not one being written."""
    return time.time() - path.stat().st_mtime > age_s
