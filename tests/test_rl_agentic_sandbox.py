"""Agentic rollouts in real microVM sandboxes (``openk3 sandbox serve`` in a thread, driven through the e2b SDK;
QEMU under TCG here, so this takes minutes): scripted policies (no model) get reward 1 with the tool and 0
without, sandboxes are paused while the policy generates, the judge's fork leaves the trajectory's sandbox
untouched, and a VMM killed during a tool call fails the trajectory once. Skips like ``tests/test_sandbox.py``
when QEMU, the image tools or the SDK are missing."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from agentic_doubles import ScriptedEngine
from openk3.rl.agentic import AgenticConfig, AgenticRollout
from openk3.rl.agentic_tasks import Lookup, SumFile
from openk3.rl.rollout import Trajectory
from openk3.rl.tool_sandbox import E2BConnection, E2BSandboxes, SandboxDiedError
from openk3.sandbox.api import owner_of
from test_rl_agentic import CALL_END, TOK, call, no_tool, tool_user
from test_sandbox import _vmm_pids, server  # noqa: F401 (the fixture: a sandbox server in a thread)

pytestmark = pytest.mark.slow
KEY = "key-a"  # a key the server fixture accepts


def test_agentic_rollouts_in_microvms(server):  # noqa: F811 (the imported fixture)
    srv, root = server["srv"], server["root"]
    owner = owner_of(KEY)

    def state_of(sandbox_id: str) -> str:
        return srv.manager.get(sandbox_id, owner).state

    factory = E2BSandboxes(E2BConnection(srv.url, KEY))

    def run(script, metas, on_start=None):
        engine = ScriptedEngine(TOK, script, CALL_END, state_of)
        rollout = AgenticRollout(
            engine, TOK, [SumFile(), Lookup()], factory, AgenticConfig(sandbox_workers=2)
        )
        trajs = [Trajectory(rollout.prompt_ids(m), 600, m) for m in metas]
        if on_start is not None:
            on_start(trajs[0])
        return rollout, engine, rollout.generate(trajs)

    rng = random.Random(0)
    rollout, engine, trajs = run(tool_user, [SumFile.sample(rng), Lookup.sample(rng)])
    assert [t.finish_reason for t in trajs] == ["stop", "stop"]
    assert engine.running_during_generation == []
    assert [state_of(t.meta["agent"]["sandbox_id"]) for t in trajs] == ["paused", "paused"]
    sums = trajs[0]
    assert [rollout.outcome(t) for t in trajs] == [1.0, 1.0]
    assert rollout.outcome(sums) == 1.0  # the first judge's test deleted answer.txt in its fork only
    from e2b import Sandbox

    own = Sandbox.connect(sums.meta["agent"]["sandbox_id"], api_url=srv.url, sandbox_url=srv.url, api_key=KEY)
    assert own.commands.run("cat answer.txt").stdout == str(sum(sums.meta["numbers"]))
    rollout.release()
    assert srv.manager.list(owner) == []  # trajectories' sandboxes and the judges' forks all gone

    rollout, _, (t,) = run(no_tool, [SumFile.sample(rng)])
    assert rollout.outcome(t) == 0.0
    rollout.release()

    def sleeper(turn, text):
        return call("python", code="import time; time.sleep(120)") if turn == 0 else "never<stop>"

    killed = []

    def kill_during_the_call(t):
        def watch():
            deadline = time.time() + 300
            while time.time() < deadline:
                info = t.meta.get("agent") or {}
                sid = info.get("sandbox_id")
                if sid and info["tool_calls"] >= 1 and state_of(sid) == "running":
                    time.sleep(5)  # resumed, the command in flight
                    for pid in _vmm_pids(root / "sandboxes" / sid):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(sid)
                    return
                time.sleep(0.1)

        threading.Thread(target=watch, daemon=True).start()

    rollout, _, (t,) = run(sleeper, [SumFile.sample(rng)], on_start=kill_during_the_call)
    assert killed == [t.meta["agent"]["sandbox_id"]]
    assert t.finish_reason == "failed" and rollout.stats == {"tool_calls": 1, "failed_trajectories": 1}
    with pytest.raises(SandboxDiedError):
        rollout.outcome(t)
    assert killed[0] in t.meta["agent"]["failed"]  # the SDK's error, as SandboxDiedError naming the sandbox
    print("dead-sandbox failure:", t.meta["agent"]["failed"])
    rollout.release()
    assert srv.manager.list(owner) == []
