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
from openk3.rl.rollout import RolloutEngine, RolloutSampling, Segment, Trajectory
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
    done, stats = partial.run(eng, [[t] for t in trajs])  # groups of one
    assert stats.finished == 1 and stats.paused == 3 and [g[0].meta["i"] for g in done] == [0]
    assert all(0 < g[0].num_generated < n for g, n in zip(partial.buffer, [20, 9, 17]))
    rounds = 1
    while partial.buffer:
        more, _ = partial.run(eng, [])
        done += more
        rounds += 1
    done = [t for g in done for t in g]
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
    done, _ = partial.run(eng, [[Trajectory(ps[0], 2)], [Trajectory(ps[1], 30)]])
    ((waiting,),) = partial.buffer
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
    ((t,),) = partial.run(eng, [])[0]
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
    partial.buffer = [[stale]]
    ((fresh,),), stats = partial.run(eng, [])
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
    done, stats = partial.run(eng, [[Trajectory(p, 6)] for p in ps])
    assert stats.finished + stats.paused == 5 and not eng.pending
    eng.sync_weights(model)  # nothing left queued


def test_group_aware_pause_keeps_groups_whole(model):
    """λ = 1/3 of three groups: the pause comes when the first group has *every* member finished; a group with
    one member done and one not goes back whole, and the resumed groups equal an uninterrupted rollout."""
    ps = prompts(3, seed=7)
    caps = {"a": [3, 4], "b": [2, 30], "c": [25, 26]}
    eng = RolloutEngine(model, config(), RolloutSampling(temperature=0.0))
    whole = {
        k: [t.response_ids for t in eng.generate([Trajectory(p, n) for n in caps[k]])]
        for k, p in zip("abc", ps)
    }
    eng = RolloutEngine(model, config(), RolloutSampling(temperature=0.0))
    partial = PartialRollout(PartialRolloutConfig(finish_fraction=1 / 3))
    groups = [[Trajectory(p, n, {"g": k}) for n in caps[k]] for k, p in zip("abc", ps)]
    done, stats = partial.run(eng, groups)
    assert [[t.meta["g"] for t in g] for g in done] == [["a", "a"]] and all(t.finished for t in done[0])
    assert stats.finished == 1 and stats.paused == 2
    b, c = partial.buffer
    assert [t.meta["g"] for t in b] == ["b", "b"] and b[0].finished and not b[1].finished
    assert b[0].num_generated == 2 and 0 < b[1].num_generated < 30 and not any(t.finished for t in c)
    b0_segments = len(b[0].segments)
    partial.config = PartialRolloutConfig(finish_fraction=1.0)
    more, stats = partial.run(eng, [])
    assert sorted(g[0].meta["g"] for g in more) == ["b", "c"] and stats.paused == 0 and not partial.buffer
    assert len(b[0].segments) == b0_segments  # a finished member is not resubmitted
    for g in done + more:
        assert [t.response_ids for t in g] == whole[g[0].meta["g"]]


def test_stale_group_restarts_every_member(model):
    eng = RolloutEngine(model, config(), RolloutSampling(temperature=0.0))
    partial = PartialRollout(PartialRolloutConfig(finish_fraction=1.0, max_staleness=1))
    ps = prompts(1, seed=8)
    old = [Trajectory(ps[0], 3), Trajectory(ps[0], 3)]
    old[0].segments, old[0].finish_reason = [Segment([5, 6, 7], [-1.0] * 3, 0)], "length"
    old[1].segments = [Segment([5], [-1.0], 0)]
    eng.sync_weights(model)
    partial.buffer = [list(old)]
    (group,), stats = partial.run(eng, [])  # one version behind: kept, only the unfinished member resumes
    assert stats.dropped_stale == 0 and group[0].response_ids == [5, 6, 7] and group[1].versions == [0, 1, 1]
    eng.sync_weights(model)
    eng.sync_weights(model)
    partial.buffer = [[old[0], Trajectory(ps[0], 3)]]
    partial.buffer[0][1].segments = [Segment([5], [-1.0], 2)]
    (group,), stats = partial.run(eng, [])  # the finished member is 3 versions behind: the group restarts
    assert stats.dropped_stale == 1 and all(t.versions == [3, 3, 3] for t in group)
    with pytest.raises(ValueError, match="at least one"):
        partial.run(eng, [[]])


def test_rollout_engine_never_sheds_load(model):
    """A serving scheduler rejects requests that waited past ``queue_timeout_s``; the rollout engine's does
    not, so a batch larger than the running set finishes whole however slow the machine."""
    cfg = config()
    cfg.scheduler.max_num_seqs, cfg.scheduler.queue_timeout_s = 2, 1e-9
    eng = RolloutEngine(model, cfg, RolloutSampling(temperature=0.0))
    ps = prompts(5, seed=9)
    trajs = eng.generate([Trajectory(p, 3) for p in ps])
    assert all(t.finish_reason == "length" for t in trajs) and cfg.scheduler.queue_timeout_s == 1e-9
    for p, t in zip(ps, trajs):
        assert t.response_ids == greedy(model, torch.tensor([p]), 3)[0].tolist()
