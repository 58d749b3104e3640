"""The RL loop's workers as Ray actors on a local Ray cluster: rollouts from two actors equal the local
engine's, one trainer step leaves every actor with the trainer's weights, a teacher actor scores like the
local teacher."""

from __future__ import annotations

import pytest
import torch

import openk3
from openk3.rl.rewards.mopd import Teacher, teacher_logprobs
from openk3.rl.rollout import RolloutEngine, RolloutSampling, Trajectory
from openk3.rl.step import PolicyTrainer, RLConfig
from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig

ray = pytest.importorskip("ray", reason="Ray is optional: pip install openk3[ray]")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
VOCAB = 64
TIMEOUT = 300


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def config():
    return EngineConfig(
        CacheConfig(block_size=8, num_blocks=400), SchedulerConfig(max_num_batched_tokens=256)
    )


def test_ray_rollouts_step_and_teacher(cluster):
    from openk3.rl.ray_workers import RayRollouts, RolloutWorker, TeacherWorker

    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=VOCAB), seed=0)
    greedy = RolloutSampling(temperature=0.0)
    actor = ray.remote(RolloutWorker)
    actors = [actor.remote(model, config(), greedy) for _ in range(2)]
    rollouts = RayRollouts(actors, greedy, timeout_s=TIMEOUT)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, VOCAB, (5 + i,), generator=g).tolist() for i in range(5)]
    remote = rollouts.generate([Trajectory(p, 6, {"i": i}) for i, p in enumerate(prompts)])
    local = RolloutEngine(model, config(), greedy).generate([Trajectory(p, 6) for p in prompts])
    assert [t.meta["i"] for t in remote] == list(range(5))
    for r, lo in zip(remote, local):
        assert r.response_ids == lo.response_ids
        assert r.behaviour_logprobs == pytest.approx(lo.behaviour_logprobs, abs=1e-5)

    sampled = RolloutSampling(temperature=1.0, seed=1)
    rollouts.sampling = sampled
    trainer = PolicyTrainer(model, rollouts, RLConfig(group_size=2, max_tokens=4, lr=1e-2))
    stats, trajs = trainer.step(prompts[:2], [{}, {}], lambda t: float(t.response_ids[0] % 2))
    assert rollouts.version == 1 and len(trajs) == 4
    want = float(sum(p.detach().double().sum() for p in model.parameters()))
    got = ray.get([a.state_checksum.remote() for a in actors], timeout=TIMEOUT)
    assert got == [pytest.approx(want, rel=0, abs=1e-9)] * 2

    teacher = ray.remote(TeacherWorker).remote(model, "tok")
    responses = [t.response_ids for t in remote[:3]]
    far = ray.get(teacher.score.remote(prompts[:3], responses), timeout=TIMEOUT)
    near = teacher_logprobs(Teacher(model, "tok"), prompts[:3], responses)
    torch.testing.assert_close(far, near)
