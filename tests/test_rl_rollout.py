"""Rollouts from openk3's engine: recorded behaviour log-probs equal a direct forward's; a paused and resumed
rollout at temperature 0 with unchanged weights equals an uninterrupted one token for token; versions,
staleness, the mask of old segments and weight sync."""

from __future__ import annotations

import pytest
import torch

import openk3
from openk3.generate import greedy
from openk3.rl.logprobs import response_logprobs
from openk3.rl.partial_rollout import PartialRollout, PartialRolloutConfig, train_mask
from openk3.rl.rollout import RolloutEngine, RolloutSampling, Trajectory
from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=VOCAB), seed=0).eval()


def config():
    return EngineConfig(
        CacheConfig(block_size=4, num_blocks=600, checkpoint_interval=1),
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, long_prefill_token_threshold=32),
    )


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(5 + 3 * i),), generator=g).tolist() for i in range(n)]


def test_greedy_rollout_matches_reference_and_logprobs(model):
    eng = RolloutEngine(model, config(), RolloutSampling(temperature=0.0))
    ps = prompts(3)
    trajs = eng.generate([Trajectory(p, 7) for p in ps])
    for p, t in zip(ps, trajs):
        assert t.response_ids == greedy(model, torch.tensor([p]), 7)[0].tolist()
        assert t.finish_reason == "length" and t.versions == [0] * 7 and t.segment_ids == [0] * 7
    lp, _ = response_logprobs(model, ps, [t.response_ids for t in trajs])
    for b, t in enumerate(trajs):
        assert t.behaviour_logprobs == pytest.approx(lp[b, :7].tolist(), abs=1e-4)


def test_sampled_logprobs_use_the_temperature(model):
    eng = RolloutEngine(model, config(), RolloutSampling(temperature=0.7, seed=3))
    ps = prompts(2, seed=1)
    trajs = eng.generate([Trajectory(p, 5) for p in ps])
    lp, _ = response_logprobs(model, ps, [t.response_ids for t in trajs], temperature=0.7)
    for b, t in enumerate(trajs):
        assert t.behaviour_logprobs == pytest.approx(lp[b, :5].tolist(), abs=1e-4)


def test_pause_and_resume_equals_uninterrupted(model):
    ps = prompts(4, seed=2)
    lengths = [3, 20, 9, 17]
    eng = RolloutEngine(model, config(), RolloutSampling(temperature=0.0))
    whole = eng.generate([Trajectory(p, n) for p, n in zip(ps, lengths)])

    eng = RolloutEngine(model, config(), RolloutSampling(temperature=0.0))
    partial = PartialRollout(PartialRolloutConfig(finish_fraction=0.25))
    trajs = [Trajectory(p, n, {"i": i}) for i, (p, n) in enumerate(zip(ps, lengths))]
    done, stats = partial.run(eng, trajs)
    assert stats.finished == 1 and stats.paused == 3 and [t.meta["i"] for t in done] == [0]
    assert all(0 < t.num_generated < n for t, n in zip(partial.buffer, [20, 9, 17]))
    rounds = 1
    while partial.buffer:
        more, _ = partial.run(eng, [])
        done += more
        rounds += 1
    assert rounds >= 3
    by_i = {t.meta["i"]: t for t in done}
    for i, w in enumerate(whole):
        t = by_i[i]
        assert t.response_ids == w.response_ids
        assert t.behaviour_logprobs == pytest.approx(w.behaviour_logprobs, abs=1e-4)
    assert max(len(t.segments) for t in done) >= 2
    assert eng.engine.stats().prefix_hit_tokens > 0  # resumes were served from the prefix cache


def test_versions_staleness_mask_and_weight_sync(model):
    trainer = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=VOCAB), seed=5)
    eng = RolloutEngine(model, config(), RolloutSampling(temperature=0.0))
    partial = PartialRollout(PartialRolloutConfig(finish_fraction=0.5, max_staleness=1, old_segments="mask"))
    ps = prompts(2, seed=4)
    done, _ = partial.run(eng, [Trajectory(ps[0], 2), Trajectory(ps[1], 30)])
    (waiting,) = partial.buffer
    k = waiting.num_generated
    with pytest.raises(RuntimeError, match="sync_weights"):
        eng.submit(Trajectory(ps[0], 4))
        eng.sync_weights(trainer)
    eng.abort({})
    eng = RolloutEngine(model, config(), RolloutSampling(temperature=0.0))
    assert eng.sync_weights(trainer) == 1
    for a, b in zip(eng.model.parameters(), trainer.parameters()):
        assert torch.equal(a, b)
    partial.config = PartialRolloutConfig(finish_fraction=1.0, max_staleness=1, old_segments="mask")
    (t,) = partial.run(eng, [])[0]
    assert t.versions == [0] * k + [1] * (30 - k) and t.segment_ids == [0] * k + [1] * (30 - k)
    assert train_mask(t, 1, "mask") == [0.0] * k + [1.0] * (30 - k)
    assert train_mask(t, 1, "correct") == [1.0] * 30
    # the resumed part is the new policy's greedy continuation of prompt + old tokens
    cont = greedy(trainer, torch.tensor([ps[1] + t.response_ids[:k]]), 30 - k)[0].tolist()
    assert t.response_ids[k:] == cont
    # staleness: a trajectory two versions behind is dropped and started over
    stale = Trajectory(ps[0], 3)
    stale.segments = [type(t.segments[0])([5], [-1.0], version=0)]
    eng.sync_weights(trainer)
    partial.buffer = [stale]
    (fresh,), stats = partial.run(eng, [])
    assert stats.dropped_stale == 1 and fresh.versions == [2, 2, 2]


def test_bad_config():
    with pytest.raises(ValueError, match="finish_fraction"):
        PartialRolloutConfig(finish_fraction=0.0)
    with pytest.raises(ValueError, match="old_segments"):
        PartialRolloutConfig(old_segments="drop")


def test_more_trajectories_than_the_waiting_queue(model):
    cfg = config()
    cfg.scheduler.max_waiting = 2
    eng = RolloutEngine(model, cfg, RolloutSampling(temperature=0.0))
    ps = prompts(5, seed=6)
    trajs = eng.generate([Trajectory(p, 3) for p in ps])
    for p, t in zip(ps, trajs):
        assert t.response_ids == greedy(model, torch.tensor([p]), 3)[0].tolist()
    partial = PartialRollout(PartialRolloutConfig(finish_fraction=0.2))
    done, stats = partial.run(eng, [Trajectory(p, 6) for p in ps])
    assert stats.finished + stats.paused == 5 and not eng.pending
    eng.sync_weights(model)  # nothing left queued
