"""One RL update end to end on a tiny model: group advantages over surviving rollouts, a reward that raises
drops its rollout and training continues, the engine gets the new weights; the demo's tasks and CLI."""

from __future__ import annotations

import random

import pytest
import torch

import openk3
from openk3.cli import build_parser
from openk3.rl.rollout import RolloutEngine, RolloutSampling
from openk3.rl.step import PolicyTrainer, RLConfig, masked_group_advantages
from openk3.rl.tasks import (
    DOMAINS,
    EFFORTS,
    CharTokenizer,
    is_correct,
    parse_answer,
    sample_problem,
    solution,
    written_effort,
)
from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def test_masked_group_advantages_hand_values():
    nan = float("nan")
    r = torch.tensor([[1.0, 0.0, nan, 1.0], [1.0, nan, nan, nan]])
    adv, keep = masked_group_advantages(r, eps=0.0)
    # group 0 over {1, 0, 1}: mean 2/3, population std √2/3 → (1/3)/(√2/3) = 1/√2, (−2/3)/(√2/3) = −√2
    torch.testing.assert_close(adv[0], torch.tensor([2**-0.5, -(2**0.5), 0.0, 2**-0.5]))
    assert keep.tolist() == [[True, True, False, True], [False, False, False, False]]


def test_step_drops_a_raising_reward_and_syncs():
    tok = CharTokenizer()
    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=tok.vocab_size), seed=0)
    cfg = EngineConfig(
        CacheConfig(block_size=8, num_blocks=400),
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32),
    )
    engine = RolloutEngine(model, cfg, RolloutSampling(1.0, frozenset({tok.stop_id}), seed=0))
    trainer = PolicyTrainer(model, engine, RLConfig(group_size=4, max_tokens=6, lr=1e-3))
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def outcome(t):
        calls.append(t)
        if len(calls) == 2:
            raise RuntimeError("reward service down")
        return float(len(calls) % 2)

    prompts = [tok.encode("HA12+34="), tok.encode("LC1+2+3+4=")]
    stats, trajs = trainer.step(prompts, [{}, {}], outcome)
    assert len(trajs) == 8 and stats["dropped_rollouts"] == 1.0 and "loss" in stats
    assert engine.version == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for a, b in zip(engine.model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert all(t.versions == [0] * t.num_generated for t in trajs)


def test_tasks_solutions_are_correct_and_lengths_ordered():
    tok, rng = CharTokenizer(), random.Random(0)
    for d in DOMAINS:
        for _ in range(50):
            p = sample_problem(d, rng)
            lengths = []
            for e in EFFORTS:
                text = solution(p, e)
                assert is_correct(p, text) and tok.decode(tok.encode(text)) == text
                lengths.append(len(text))
            assert lengths[0] > lengths[1] > lengths[2]  # high > medium > low
    assert parse_answer("no bar") is None and parse_answer("|12x") is None
    with pytest.raises(ValueError, match="alphabet"):
        tok.encode("x")


def test_written_effort_reads_each_format():
    rng = random.Random(1)
    for d in DOMAINS:
        for _ in range(50):
            p = sample_problem(d, rng)
            for e in EFFORTS:
                assert written_effort(p, solution(p, e)) == e
    add, chain = sample_problem("add", rng), sample_problem("chain", rng)
    assert written_effort(add, "12") == "other" and written_effort(add, "c1|3") == "other"
    assert written_effort(chain, "1,2,3,4|5") == "other" and written_effort(chain, "|5") == "low"


def test_demo_efforts_separate_the_formats_on_every_problem():
    """With b0 at the scratchpad's length, the demo's τ per effort admits each effort's own format and shuts
    out the next longer one on every problem of both domains (enumerated)."""
    from openk3.rl.recipe import DemoConfig
    from openk3.rl.rewards.budget import ProblemBudget, budget_limit
    from openk3.rl.tasks import Problem

    efforts = DemoConfig().efforts
    problems = [Problem("add", (a, b)) for a in range(10, 100) for b in range(10, 100)]
    problems += [
        Problem("chain", (a, b, c, d))
        for a in range(10)
        for b in range(10)
        for c in range(10)
        for d in range(10)
    ]
    for p in problems:
        n = {e: len(solution(p, e)) + 1 for e in EFFORTS}  # + the stop token
        for e, longer in (("medium", "high"), ("low", "medium")):
            limit = budget_limit(ProblemBudget(b0=n["high"], min_correct=n["low"]), efforts.tau(e))
            assert n[e] <= limit < n[longer], (p, e, limit, n)


def test_posttrain_cli_parses():
    args = build_parser().parse_args(["posttrain", "--recipe", "demo", "--quick", "--out", "/tmp/x"])
    assert args.quick and args.recipe == "demo" and callable(args.func)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["posttrain", "--recipe", "other"])


@pytest.mark.slow
def test_demo_quick_runs_end_to_end(tmp_path):
    from openk3.rl.recipe import Demo, quick_config

    cfg = quick_config()
    Demo(cfg, tmp_path).run()
    for name in ("sft", "rl-add-high", "rl-add-low", "rl-chain-medium", "mopd"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0
    text = (tmp_path / "results.md").read_text()
    assert text.count("\n| add |") == 3 and text.count("\n| chain |") == 3


def test_partial_step_trains_complete_groups_only():
    """With partial rollout (λ = 1/3) a step trains the groups whose every member finished, each group whole;
    the rest wait and train later, with tokens from the older version counted as stale."""
    from openk3.rl.partial_rollout import PartialRolloutConfig

    tok = CharTokenizer()
    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=tok.vocab_size), seed=1)
    cfg = EngineConfig(
        CacheConfig(block_size=8, num_blocks=400),
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32),
    )
    engine = RolloutEngine(
        model, cfg, RolloutSampling(3.0, frozenset({tok.stop_id}), seed=0)
    )  # hot: lengths vary
    partial = PartialRolloutConfig(finish_fraction=1 / 3, max_staleness=4)
    trainer = PolicyTrainer(model, engine, RLConfig(group_size=3, max_tokens=30, lr=1e-3, partial=partial))
    prompts = [tok.encode(f"HC{i}+1+2+3=") for i in range(6)]
    trained, outstanding, paused = [], 0, 0
    for step in range(3):
        batch = prompts[2 * step : 2 * step + 2]
        stats, trajs = trainer.step(
            batch, [{"i": 2 * step + k} for k in range(2)], lambda t: float(t.num_generated)
        )
        assert len(trajs) == 3 * stats["groups_trained"] and stats["groups_trained"] >= 1
        for g in range(0, len(trajs), 3):
            group = trajs[g : g + 3]
            assert all(t.finished for t in group) and len({t.meta["i"] for t in group}) == 1
            trained.append(group[0].meta["i"])
        outstanding += 2
        assert stats["groups_trained"] + stats["groups_paused"] == outstanding
        outstanding -= int(stats["groups_trained"])
        paused += stats["groups_paused"]
    assert engine.version == 3 and len(trained) == len(set(trained)) and paused > 0
    trainer.partial.config = PartialRolloutConfig(finish_fraction=1.0, max_staleness=4)
    stats, trajs = trainer.step([], [], lambda t: float(t.num_generated))
    trained += [trajs[g].meta["i"] for g in range(0, len(trajs), 3)]
    assert sorted(trained) == list(range(6)) and not trainer.partial.buffer
    if any(len(t.segments) > 1 for t in trajs):
        assert stats["stale_token_fraction"] > 0
