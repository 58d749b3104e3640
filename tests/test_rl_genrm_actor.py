"""The GenRM judge as a Ray actor on a local Ray cluster: the actors' rewards equal the in-process tournament's,
equal hand-computed ranks for a scripted judge, follow a permutation of the candidates, and a model-backed judge
gives the same rewards in the actor as in the driver; ``submit`` returns before the judging is done."""

from __future__ import annotations

import itertools
import time

import pytest

import openk3
from openk3.rl.genrm_actor import EngineJudge, GenRMGroup, JudgeWorker, RayGenRM, judge_group
from openk3.rl.harness import AgentTokenizer
from openk3.rl.rewards.genrm import GenRMConfig, tournament_rewards
from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig

ray = pytest.importorskip("ray", reason="Ray is optional: pip install openk3[ray]")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
TIMEOUT = 300


class CountJudge:
    """Scores each answer by how many ``x`` it holds (more is better); optionally slow."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def __call__(self, prompt: str) -> str:
        time.sleep(self.delay_s)
        if not prompt.startswith("[SCORE]"):
            return "more x is better"
        first = prompt.split("First answer:\n", 1)[1].split("\n\nSecond answer:\n", 1)
        second = first[1].split("\n\nScore both", 1)[0]
        return f'{{"first": {first[0].count("x")}, "second": {second.count("x")}}}'


@pytest.fixture(scope="module")
def cluster():
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the scripted judge travels by value
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def groups() -> list[GenRMGroup]:
    a = GenRMGroup("say x", ["xxx", "x", "xx", "none"], [3, 1, 2, 4], 4.0, [True] * 4)
    b = GenRMGroup(
        "say x", ["xx", "x", "xxxxxxxxxx", "xxx", "bad"], [2, 1, 10, 3, 3], 4.0, [True] * 4 + [False]
    )
    return [a, b, a]


def test_judge_actors_equal_in_process_and_hand_values(cluster):
    config = GenRMConfig(sigma=1.5)
    judges = RayGenRM([ray.remote(JudgeWorker).remote(CountJudge(), config) for _ in range(2)], TIMEOUT)
    got = judges.rewards(groups())
    local = [judge_group(CountJudge(), g, config) for g in groups()]
    assert [r for r, _ in got] == [r for r, _ in local]
    assert [p.judge_calls for _, p in got] == [p.judge_calls for _, p in local]
    # hand values: ranks by x-count / (G-1); in b, "x"*10 is past σ·ℓ0 = 6 (loses to all but the gated "bad",
    # a tie) and "bad" fails the format gate (reward 0)
    assert got[0][0] == pytest.approx([1.0, 1 / 3, 2 / 3, 0.0])
    assert got[1][0] == pytest.approx([3 / 4, 2 / 4, 0.5 / 4, 4 / 4, 0.0])
    # invariant to candidate order: every permutation of group a gives the permuted rewards
    a = groups()[0]
    perms = list(itertools.permutations(range(4)))[::5]
    permuted = [GenRMGroup(a.task, [a.candidates[i] for i in p], [a.lengths[i] for i in p], 4.0, [True] * 4)
                for p in perms]  # fmt: skip
    for p, (r, _) in zip(perms, judges.rewards(permuted)):
        assert r == pytest.approx([got[0][0][i] for i in p])


def test_submit_returns_before_judging_ends(cluster):
    judges = RayGenRM([ray.remote(JudgeWorker).remote(CountJudge(delay_s=0.05), GenRMConfig())], TIMEOUT)
    ray.get(judges.actors[0].rewards.remote([]), timeout=TIMEOUT)  # the actor is up
    t0 = time.perf_counter()
    refs = judges.submit(groups()[:1])  # 6 pairs × 2 orders × 3 calls × 0.05 s = 1.8 s
    submitted = time.perf_counter() - t0
    ((r, _),) = judges.collect(refs)
    assert submitted < 1.0 < time.perf_counter() - t0
    assert r == pytest.approx([1.0, 1 / 3, 2 / 3, 0.0])
    with pytest.raises(ValueError, match="at least one"):
        RayGenRM([])


def test_model_judge_in_an_actor_equals_the_driver(cluster):
    tok = AgentTokenizer()
    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=tok.vocab_size), seed=0)
    cfg = EngineConfig(
        CacheConfig(block_size=16, num_blocks=200), SchedulerConfig(max_num_batched_tokens=512)
    )
    group = GenRMGroup("add 2+2", ["4", "5"], [1, 1], 2.0, [True, True])
    config = GenRMConfig(max_retries=0)
    actor = ray.remote(JudgeWorker).remote(EngineJudge(model, tok, 8, cfg), config)
    ((far, far_pad),) = RayGenRM([actor], TIMEOUT).rewards([group])
    near, near_pad = tournament_rewards(EngineJudge(model, tok, 8, cfg), group.task, group.candidates,
                                        group.lengths, group.reference_length, group.format_ok, config)  # fmt: skip
    assert far == near and sum(far) == pytest.approx(1.0)
    assert [e.rubric for e in far_pad.entries] == [e.rubric for e in near_pad.entries]
