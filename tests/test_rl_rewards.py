"""Budget, MOPD and GenRM rewards against hand-computed values and a direct forward."""

from __future__ import annotations

import json
import math

import pytest
import torch

import openk3
from openk3.rl.logprobs import response_logprobs
from openk3.rl.rewards.budget import (
    BudgetTable,
    EffortLevels,
    ProblemBudget,
    TauSchedule,
    budget_limit,
    budget_reward,
    gate_open,
    percentile_length,
)
from openk3.rl.rewards.genrm import GenRMConfig, tournament_rewards
from openk3.rl.rewards.mopd import Teacher, TeacherRegistry, mopd_reward, teacher_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 64


# ---- budget -----------------------------------------------------------------------------------------------
def test_percentile_and_fixed_b0():
    assert percentile_length([9, 3, 5, 7], 0.5) == 5  # nearest rank ⌈0.5·4⌉ = 2nd of [3, 5, 7, 9]
    assert percentile_length([9, 3, 5, 7], 1.0) == 9
    table = BudgetTable(rho=0.5)
    b = table.estimate("x", [10, 4, 20, 6, 8], [True, False, True, True, False])
    assert b == ProblemBudget(b0=10, min_correct=6)  # correct lengths [6, 10, 20]
    with pytest.raises(ValueError, match="fixed"):
        table.estimate("x", [1], [True])
    assert table.estimate("y", [3, 4], [False, False]) is None and table.get("y") is None


def test_b0_percentile_of_a_mixed_format_reference():
    """A reference that writes the bare answer (4 tokens), the carry bits (8) or the scratchpad (16–17): the
    median of its correct lengths is the carry format, so ``τ = 0.8`` of it would shut the carry format out;
    the 0.9-percentile is the scratchpad's length."""
    lengths = [4, 4, 4, 4, 8, 8, 8, 16, 16, 17, 30]
    correct = [True] * 10 + [False]  # the 30-token sample is wrong and does not count
    assert BudgetTable(rho=0.5).estimate("x", lengths, correct) == ProblemBudget(b0=8, min_correct=4)
    b = BudgetTable(rho=0.9).estimate("x", lengths, correct)
    assert b == ProblemBudget(b0=16, min_correct=4)  # ⌈0.9·10⌉ = 9th of the sorted correct lengths
    assert budget_limit(b, 0.8) == 12 and budget_limit(b, 0.4) == 6  # carry format fits at 0.8, not at 0.4


def test_floor_lengths_lower_the_floor_not_b0():
    """A scratchpad-only reference (correct lengths 16, 17) with SFT-base samples whose shortest correct
    length is the bare answer's (5): b0 stays the reference's 0.9-percentile (17), the floor drops to 5, so the
    limit at τ = 0.35 is ⌊0.35·17⌋ = 5 instead of 16."""
    lengths, correct = [16, 17, 16, 30], [True, True, True, False]
    alone = BudgetTable(rho=0.9).estimate("x", lengths, correct)
    assert alone == ProblemBudget(b0=17, min_correct=16) and budget_limit(alone, 0.35) == 16
    b = BudgetTable(rho=0.9).estimate("x", lengths, correct, floor_lengths=[9, 5, 22])
    assert b == ProblemBudget(b0=17, min_correct=5) and budget_limit(b, 0.35) == 5
    assert BudgetTable().estimate("y", [5], [False], floor_lengths=[3]) is None  # no reference budget
    with pytest.raises(ValueError, match="floor lengths"):
        BudgetTable().estimate("z", [5], [True], floor_lengths=[0])


def test_budget_edge_exactly_at_limit():
    b = ProblemBudget(b0=13, min_correct=2)
    tau = 0.7  # ⌊0.7·13⌋ = ⌊9.1⌋ = 9
    assert budget_limit(b, tau) == 9
    assert budget_reward(1.0, 9, b, tau) == 1.0
    assert budget_reward(1.0, 10, b, tau) == -1.0
    assert budget_reward(0.0, 10, b, tau, apply=False) == 0.0
    assert budget_reward(1.0, 10**6, None, tau) == 1.0
    # the floor: τ·b0 below the shortest correct answer is raised to it
    assert budget_limit(ProblemBudget(b0=10, min_correct=8), 0.5) == 8
    assert gate_open(0.75, 0.5) and not gate_open(0.5, 0.5)


def test_tau_schedule_monotone_and_efforts():
    s = TauSchedule(2.0, 1.0, anneal_steps=10)
    taus = [s(i) for i in range(15)]
    assert taus[0] == 2.0 and taus[5] == pytest.approx(1.5) and taus[10:] == [1.0] * 5
    assert all(a >= b for a, b in zip(taus, taus[1:]))
    with pytest.raises(ValueError, match="anneals down"):
        TauSchedule(1.0, 2.0)
    e = EffortLevels()
    assert e.tau("low") < e.tau("medium") < e.tau("high")
    with pytest.raises(ValueError, match="unknown effort"):
        e.tau("extreme")
    with pytest.raises(ValueError, match="increasing"):
        EffortLevels((("low", 2.0), ("high", 1.0)))


# ---- MOPD -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    cfg = openk3.presets.k3_shaped(4, vocab_size=VOCAB)
    return openk3.build_model(cfg, seed=0).eval(), openk3.build_model(cfg, seed=1).eval()


def test_teacher_scores_equal_a_direct_forward(models):
    teacher = Teacher(models[1], "tok-a")
    prompts, responses = [[3, 5, 7], [9, 2]], [[11, 12, 13, 14], [4]]
    got = teacher_logprobs(teacher, prompts, responses)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        with torch.no_grad():  # the full sequence, unbatched: position P−1+j predicts r[j]
            logits = models[1](torch.tensor([p + r])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        direct = [lp[len(p) - 1 + j, t].item() for j, t in enumerate(r)]
        assert got[b, : len(r)].tolist() == pytest.approx(direct, abs=2e-5)
        assert (got[b, len(r) :] == 0).all()


def test_mopd_reward_zero_for_self_clip_and_sg(models):
    student = models[0]
    prompts, responses = [[3, 5, 7], [9, 2, 1, 8]], [[11, 12, 13], [4, 40]]
    s_lp, mask = response_logprobs(student, prompts, responses)
    t_self = teacher_logprobs(Teacher(student, "tok"), prompts, responses)
    r = mopd_reward(t_self, s_lp, mask, r_max=1.0)
    assert r.abs().max() < 1e-5
    t_other = teacher_logprobs(Teacher(models[1], "tok"), prompts, responses)
    r = mopd_reward(t_other, s_lp - 3 * mask, mask, r_max=0.5)  # student log-probs lowered: ratio > r_max
    assert r.max() <= 0.5 and r[mask.bool()].min() == pytest.approx(0.5) and r[~mask.bool()].abs().max() == 0
    s = s_lp.clone().requires_grad_(True)
    assert not mopd_reward(t_other, s, mask, 1.0).requires_grad  # stop-gradient


def test_registry_routes_and_refuses_other_tokenizer(models):
    reg = TeacherRegistry("tok-a")
    a, b = Teacher(models[0], "tok-a", "A"), Teacher(models[1], "tok-a", "B")
    reg.register("math", "high", a)
    reg.register("words", "low", b)
    assert reg.get("math", "high") is a and reg.get("words", "low") is b
    with pytest.raises(ValueError, match="tokenizer"):
        reg.register("code", "high", Teacher(models[0], "tok-b"))
    with pytest.raises(KeyError, match="no teacher"):
        reg.get("math", "low")


# ---- GenRM ------------------------------------------------------------------------------------------------
def scripted_judge(quality: dict[str, float], log: list[str]):
    """Reads the step from the prompt; scores each answer by its quality from ``quality``."""

    def judge(prompt: str) -> str:
        log.append(prompt.split("\n", 1)[0])
        if prompt.startswith("[READ]"):
            return "asks for the sum"
        if prompt.startswith("[RUBRIC]"):
            return "- correct value\n- shows carries"
        first = prompt.split("First answer:\n", 1)[1].split("\n\nSecond answer:", 1)[0]
        second = prompt.split("Second answer:\n", 1)[1].split("\n\nScore both", 1)[0]
        return json.dumps({"first": quality[first], "second": quality[second]})

    return judge


def test_tournament_hand_computed_and_order_invariant():
    q = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 2.0}
    log: list[str] = []
    cands = ["a", "b", "c", "d"]
    rewards, pad = tournament_rewards(
        scripted_judge(q, log), "t", cands, [1] * 4, 1.0, [True] * 4, GenRMConfig()
    )
    # a beats all (3/3); b loses all (0); c, d beat b, lose to a, tie each other: (1 + 0.5)/3
    assert rewards == pytest.approx([1.0, 0.0, 0.5, 0.5])
    assert pad.judge_calls == 6 * 2 * 3 and len(pad.entries) == 12  # 6 pairs × 2 orders × 3 steps
    assert pad.tally[0] == 3.0 * 6 and log[:3] == ["[READ]", "[RUBRIC]", "[SCORE]"]
    perm = [2, 0, 3, 1]
    r2, _ = tournament_rewards(
        scripted_judge(q, []), "t", [cands[i] for i in perm], [1] * 4, 1.0, [True] * 4, GenRMConfig()
    )
    assert r2 == pytest.approx([rewards[i] for i in perm])


def test_position_bias_cancels_guillotine_and_format_gate():
    calls = []

    def first_always(prompt):
        calls.append(prompt)
        return '{"first": 1, "second": 0}' if prompt.startswith("[SCORE]") else "ok"

    rewards, _ = tournament_rewards(
        first_always, "t", ["x", "y", "z"], [1, 1, 1], 1.0, [True] * 3, GenRMConfig()
    )
    assert rewards == [0.5, 0.5, 0.5]
    # σ·ℓ0 = 1.5·10 = 15: length 16 loses to both without a judge call; 15 does not
    calls.clear()
    q = {"x": 1.0, "y": 1.0, "long": 9.0}
    rewards, pad = tournament_rewards(
        scripted_judge(q, calls),
        "t",
        ["x", "y", "long"],
        [15, 3, 16],
        10.0,
        [True] * 3,
        GenRMConfig(sigma=1.5),
    )
    assert rewards == pytest.approx([0.75, 0.75, 0.0]) and pad.judge_calls == 6  # only x vs y was judged
    # format gate: reward 0 and loses its matches
    rewards, _ = tournament_rewards(
        scripted_judge(q, []), "t", ["x", "y"], [1, 1], 1.0, [True, False], GenRMConfig()
    )
    assert rewards == [1.0, 0.0]


def test_parse_failure_retries_then_ties():
    answers = iter(["r", "rub", "garbage", "no json", "still no", "r", "rub", "x", "y", "z"])
    rewards, pad = tournament_rewards(
        lambda p: next(answers), "t", ["a", "b"], [1, 1], 1.0, [True, True], GenRMConfig()
    )
    assert rewards == [0.5, 0.5] and pad.parse_failures == 2 and pad.judge_calls == 10
    with pytest.raises(ValueError, match="at least 2"):
        tournament_rewards(lambda p: "", "t", ["a"], [1], 1.0, [True], GenRMConfig())
    assert math.isfinite(GenRMConfig().sigma)
