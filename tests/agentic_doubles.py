"""Test doubles for the agentic rollout tests (never used by the package).

* :class:`HostDirSandboxDouble` — a "sandbox" that is a host directory: commands run on the host with
  ``bash -c`` in it (cwd and HOME), fork copies the directory, pause and resume only change a state flag. It
  has **no isolation** and is not a sandbox; it checks the lifecycle the rollout must follow (no command
  while paused, nothing after kill) and can be made to die.
* :class:`ScriptedEngine` — a rollout engine without a model: a scripted policy writes each turn's text
  (from the prompt and response so far); at every step it records the sandboxes of active trajectories past
  their first tool call that are running (the rollout must keep them paused while the policy generates).
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

from openk3.rl.harness import AgentTokenizer
from openk3.rl.rollout import RolloutSampling, Segment, Trajectory
from openk3.rl.tool_sandbox import CommandResult, SandboxDiedError, SandboxFactory, ToolSandbox


class HostDirSandboxDouble(ToolSandbox):
    def __init__(self, factory: HostDirSandboxesDouble, path: Path) -> None:
        self.factory, self.path = factory, path
        self.sandbox_id = path.name
        self.state = "running"

    def _alive(self, what: str) -> None:
        if self.state == "dead":
            raise SandboxDiedError(f"sandbox {self.sandbox_id}: {what}: gone")

    def run(self, command: str, timeout_s: float) -> CommandResult:
        self._alive("run")
        assert self.state == "running", f"{self.sandbox_id}: a command ran while {self.state}"
        self.factory.commands.append((self.sandbox_id, command))
        if self.factory.die_on_command is not None and self.factory.die_on_command(command):
            self.state = "dead"
            raise SandboxDiedError(f"sandbox {self.sandbox_id}: guest crashed during the command")
        r = subprocess.run(["bash", "-c", command], cwd=self.path, env={"HOME": str(self.path), "PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
        return CommandResult(r.returncode, r.stdout, r.stderr)

    def write_file(self, path: str, text: str) -> None:
        self._alive("write")
        (self.path / path).write_text(text)

    def pause(self) -> None:
        self._alive("pause")
        assert self.state == "running", f"{self.sandbox_id}: pause while {self.state}"
        self.state = "paused"

    def resume(self) -> None:
        self._alive("resume")
        assert self.state == "paused", f"{self.sandbox_id}: resume while {self.state}"
        self.state = "running"

    def fork(self) -> HostDirSandboxDouble:
        self._alive("fork")
        child = self.factory._new()
        shutil.copytree(self.path, child.path, dirs_exist_ok=True)
        self.factory.forks.append((self.sandbox_id, child.sandbox_id))
        return child

    def kill(self) -> None:
        self.state = "dead"
        shutil.rmtree(self.path, ignore_errors=True)
        self.factory.killed.append(self.sandbox_id)


class HostDirSandboxesDouble(SandboxFactory):
    def __init__(
        self, die_on_command: Callable[[str], bool] | None = None, fail_creates: frozenset[int] = frozenset()
    ) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="sandbox-double-"))
        weakref.finalize(
            self, shutil.rmtree, self.root, ignore_errors=True
        )  # at collection or exit: no leftovers
        self.ids, self.create_calls = itertools.count(), itertools.count()
        self.all: dict[str, HostDirSandboxDouble] = {}
        self.created, self.killed, self.forks, self.commands = [], [], [], []
        self.die_on_command, self.fail_creates = die_on_command, fail_creates

    def _new(self) -> HostDirSandboxDouble:
        path = self.root / f"sb{next(self.ids)}"
        path.mkdir()
        sb = HostDirSandboxDouble(self, path)
        self.all[sb.sandbox_id] = sb
        return sb

    def create(self, template: str, timeout_s: float) -> HostDirSandboxDouble:
        if next(self.create_calls) in self.fail_creates:
            raise SandboxDiedError(f"creating a sandbox from {template!r} failed: no room")
        sb = self._new()
        self.created.append(sb.sandbox_id)
        return sb

    def state_of(self, sandbox_id: str) -> str:
        return self.all[sandbox_id].state


Script = Callable[[int, str], str]
"""``(turn, text so far) → the policy's next turn`` (special markers included; ends with ``<stop>`` to stop)."""


class ScriptedEngine:
    """The slice of :class:`~openk3.rl.rollout.RolloutEngine` the agentic rollout uses, driven by a script;
    each step writes one whole turn of every active trajectory."""

    def __init__(self, tokenizer: AgentTokenizer, script: Script, call_end_id: int,
                 state_of: Callable[[str], str]) -> None:  # fmt: skip
        self.tokenizer, self.script, self.state_of = tokenizer, script, state_of
        self.sampling = RolloutSampling(1.0, frozenset({tokenizer.stop_id, call_end_id}))
        self.sample_vocab_size, self.version = None, 0
        self._ids = itertools.count()
        self.running_during_generation: list[str] = []

    def submit(self, trajectory: Trajectory) -> str:
        trajectory.segments.append(Segment(version=self.version))
        return f"s{next(self._ids)}"

    def step(self, active: dict[str, Trajectory]) -> list[Trajectory]:
        done = []
        for rid, t in list(active.items()):
            turn = sum(1 for s in t.segments if s.observation)
            sid = t.meta["agent"]["sandbox_id"]
            if turn > 0 and self.state_of(sid) == "running":
                self.running_during_generation.append(sid)
            text = self.script(turn, self.tokenizer.decode(t.prompt_ids + t.response_ids))
            ids = self.tokenizer.encode(text.replace("<stop>", ""))
            if text.endswith("<stop>"):
                ids.append(self.tokenizer.stop_id)
            left = t.max_tokens - t.num_generated
            seg = t.segments[-1]
            seg.token_ids += ids[:left]
            seg.logprobs += [-1.0] * len(ids[:left])
            stopped = len(ids) <= left and ids[-1] in self.sampling.stop_token_ids
            t.finish_reason = "stop" if stopped else "length"
            done.append(active.pop(rid))
        return done

    def sync_weights(self, source) -> int:
        self.version += 1
        return self.version
