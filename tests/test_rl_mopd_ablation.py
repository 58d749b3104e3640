"""The MOPD ablation's variants do what they say: the wrong routing scores with another teacher, and the
no-clip variant passes log-ratios beyond ``R_max`` through (checked against a direct forward of each teacher)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import openk3
from openk3.rl.recipe import mopd_dense_reward
from openk3.rl.rewards.mopd import Teacher, TeacherRegistry
from openk3.rl.rollout import Segment, Trajectory
from openk3.rl.tasks import DOMAINS, EFFORTS

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 32


@pytest.fixture
def ablation(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import mopd_ablation

    return mopd_ablation


def direct_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    """``log π(r_j | p, r_<j)`` from one unbatched forward in float64 (position ``P−1+j`` predicts ``r_j``)."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0].double(), -1)
    return [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(response)]


def test_wrong_route_never_keeps_the_key_and_uses_every_teacher(ablation):
    keys = [(d, e) for d in DOMAINS for e in EFFORTS]
    routed = [ablation.wrong_route(d, e) for d, e in keys]
    assert all(r != k and r[0] != k[0] and r[1] != k[1] for k, r in zip(keys, routed))
    assert sorted(routed) == sorted(keys)  # a permutation: each teacher scores, at the wrong key


def test_wrong_routing_scores_with_the_other_teacher_and_no_clip_is_unclipped(ablation):
    cfg = openk3.presets.k3_shaped(4, vocab_size=VOCAB)
    models = {
        k: openk3.build_model(cfg, seed=i).eval()
        for i, k in enumerate((d, e) for d in DOMAINS for e in EFFORTS)
    }
    registry = TeacherRegistry("tok")
    for (d, e), m in models.items():
        registry.register(d, e, Teacher(m, "tok", f"{d}-{e}"))
    prompt, response = [3, 5, 7, 9], [11, 12, 13, 14, 15]
    behaviour = [-20.0, -0.01, -3.0, -15.0, -1.0]  # ratios far beyond ±2 on some tokens
    traj = Trajectory(
        prompt, 8, {"domain": "add", "effort": "high"}, [Segment(response, behaviour, 0)], "stop"
    )

    own = torch.tensor(direct_logprobs(models[("add", "high")], prompt, response)) - torch.tensor(behaviour)
    other_key = ablation.wrong_route("add", "high")
    other = torch.tensor(direct_logprobs(models[other_key], prompt, response)) - torch.tensor(behaviour)
    assert (own - other).abs().max() > 0.1  # the two teachers disagree, so the routing is visible

    right = mopd_dense_reward(registry, [traj], 2.0)[0]
    wrong = mopd_dense_reward(registry, [traj], 2.0, ablation.wrong_route)[0]
    assert right.tolist() == pytest.approx(own.clamp(-2, 2).tolist(), abs=1e-4)
    assert wrong.tolist() == pytest.approx(other.clamp(-2, 2).tolist(), abs=1e-4)

    unclipped = mopd_dense_reward(registry, [traj], ablation.VARIANTS["no-clip"]["r_max"])[0]
    assert unclipped.tolist() == pytest.approx(own.tolist(), abs=1e-4)
    assert unclipped.abs().max() > 10  # really beyond R_max = 2
    assert math.isinf(ablation.VARIANTS["no-clip"]["r_max"]) and "route" not in ablation.VARIANTS["clip"]
    assert ablation.VARIANTS["wrong"]["route"] is ablation.wrong_route


def test_demo_config_refuses_a_non_positive_mopd_lr():
    from openk3.rl.recipe import DemoConfig

    with pytest.raises(ValueError, match="mopd_lr must be positive"):
        DemoConfig(mopd_lr=0.0)
