"""Agentic rollouts as Ray actors on a local Ray cluster (host-directory sandbox doubles, a tiny K3): two
actors' greedy trajectories equal one local AgenticRollout's, and a PolicyTrainer step judges each trajectory on
the actor that holds its sandbox, dropping the one whose sandbox failed."""

from __future__ import annotations

import random
import sys

import pytest

import agentic_doubles
import openk3
from agentic_doubles import HostDirSandboxesDouble
from openk3.rl.agentic import AgenticConfig, AgenticRollout
from openk3.rl.agentic_tasks import Lookup, SumFile
from openk3.rl.rollout import RolloutEngine, RolloutSampling, Trajectory
from openk3.rl.step import PolicyTrainer, RLConfig
from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig
from test_rl_agentic import CALL_END, TOK

ray = pytest.importorskip("ray", reason="Ray is optional: pip install openk3[ray]")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
TIMEOUT = 300


@pytest.fixture(scope="module")
def cluster():
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(agentic_doubles)  # the test doubles travel by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_agentic_rollout_actors(cluster):
    from openk3.rl.agentic_workers import AgenticRolloutWorker, RayAgenticRollouts

    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=TOK.vocab_size), seed=0)
    cfg = EngineConfig(
        CacheConfig(block_size=16, num_blocks=400), SchedulerConfig(max_num_batched_tokens=1024)
    )
    greedy = RolloutSampling(0.0, frozenset({TOK.stop_id, CALL_END}))
    groups = [SumFile(), Lookup()]
    worker = ray.remote(AgenticRolloutWorker)
    actors = [worker.remote(model, cfg, greedy, TOK, groups, HostDirSandboxesDouble(fail_creates=frozenset({k})),
                            AgenticConfig(sandbox_workers=1), TOK.vocab_size) for k in (0, 2)]  # fmt: skip
    rollouts = RayAgenticRollouts(actors, TOK, groups, greedy, TOK.vocab_size, TIMEOUT)
    rng = random.Random(0)
    metas = [SumFile.sample(rng), Lookup.sample(rng), SumFile.sample(rng)]
    far = rollouts.generate([Trajectory(rollouts.prompt_ids(m), 10, dict(m)) for m in metas])
    local = AgenticRollout(
        RolloutEngine(model, cfg, greedy, TOK.vocab_size), TOK, groups, HostDirSandboxesDouble()
    )
    near = local.generate([Trajectory(local.prompt_ids(m), 10, dict(m)) for m in metas])
    assert [t.meta["agent"]["worker"] for t in far] == [0, 1, 0]
    assert [t.response_ids for t in far[1:]] == [t.response_ids for t in near[1:]]
    assert far[0].finish_reason == "failed"  # actor 0's first creation fails: ended at once, or at the end
    assert near[0].response_ids[: len(far[0].response_ids)] == far[0].response_ids
    local.release()

    sampled = RolloutSampling(1.0, frozenset({TOK.stop_id, CALL_END}), seed=0)
    rollouts.sampling = sampled
    trainer = PolicyTrainer(model, rollouts, RLConfig(group_size=2, max_tokens=8, lr=1e-3))

    def outcome(t):  # the task reward (judged on the trajectory's actor) plus a spread to train on
        return rollouts.outcome(t) + sum(t.response_ids) % 7 / 7

    stats, trajs = trainer.step([rollouts.prompt_ids(m) for m in metas[:2]], metas[:2], outcome)
    assert [t.meta["agent"]["worker"] for t in trajs] == [0, 1, 0, 1]
    assert [t.finish_reason == "failed" for t in trajs] == [
        False,
        False,
        False,
        True,
    ]  # actor 1's third creation
    assert stats["dropped_rollouts"] == 1.0 and rollouts.version == 1 and "loss" in stats
    assert rollouts.stats()["failed_trajectories"] == 2
    rollouts.release()
