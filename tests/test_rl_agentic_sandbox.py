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


def test_k3_tiny_rl_step_on_agentic_tasks_in_microvms(server):  # noqa: F811 (the imported fixture)
    """One PolicyTrainer step of k3-tiny (untrained) on both task groups, every tool call and judge in real
    microVMs: the step completes, observations (here mostly the harness's error answers to stray
    ``</tool_call>`` tokens) are masked, every sandbox and fork is gone after ``release``."""
    import torch

    import openk3
    from openk3.rl.rollout import RolloutEngine, RolloutSampling
    from openk3.rl.step import PolicyTrainer, RLConfig
    from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig

    torch.set_num_threads(1)
    srv = server["srv"]
    model = openk3.build_model(openk3.presets.k3_shaped(8, vocab_size=TOK.vocab_size), seed=0)  # k3-tiny
    cfg = EngineConfig(
        CacheConfig(block_size=16, num_blocks=600), SchedulerConfig(max_num_batched_tokens=2048)
    )
    engine = RolloutEngine(model, cfg, RolloutSampling(1.0, frozenset({TOK.stop_id, CALL_END}), seed=0),
                           sample_vocab_size=TOK.vocab_size)  # fmt: skip
    rollout = AgenticRollout(engine, TOK, [SumFile(), Lookup()], E2BSandboxes(E2BConnection(srv.url, KEY)))
    trainer = PolicyTrainer(model, rollout, RLConfig(group_size=4, max_tokens=48, lr=1e-3))
    rng = random.Random(0)
    metas = [SumFile.sample(rng), Lookup.sample(rng)]
    t0 = time.perf_counter()
    stats, trajs = trainer.step([rollout.prompt_ids(m) for m in metas], metas, rollout.outcome)
    seconds = time.perf_counter() - t0
    observations = sum(s.observation for t in trajs for s in t.segments)
    print(
        f"k3-tiny agentic RL step: {seconds:.1f} s, {observations} observations, stats {stats}, {rollout.stats}"
    )
    assert engine.version == 1 and stats["dropped_rollouts"] == 0 and "loss" in stats
    assert all(t.finish_reason in ("stop", "length") for t in trajs)
    assert [t.loss_mask.count(0.0) for t in trajs] == [
        sum(len(s.token_ids) for s in t.segments if s.observation) for t in trajs
    ]
    states = {
        state
        for t in trajs
        for state in [srv.manager.get(t.meta["agent"]["sandbox_id"], owner_of(KEY)).state]
    }
    assert states == {"paused"}
    rollout.release()
    assert srv.manager.list(owner_of(KEY)) == []
