"""The loss family against hand-computed values: the on-policy surrogate's gradient is REINFORCE's, the
regulariser's gradient is τ·Δ·∇log π, the masks zero exactly the tokens they should, TIS truncates."""

from __future__ import annotations

import pytest
import torch

from openk3.rl.loss import (
    LossConfig,
    clipped_surrogate,
    group_advantages,
    log_ratio_mask,
    policy_loss,
    truncated_importance_weight,
)


def toy(seed=0, B=3, T=4, V=5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    return logits, tokens, mask


def logp_of(logits, tokens):
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]


def test_group_advantages_hand_values():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    a = group_advantages(r, eps=0.0 + 1e-12)
    torch.testing.assert_close(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))  # mean 0.5, population std 0.5
    assert a[1].abs().max() == 0
    torch.testing.assert_close(group_advantages(r, scale_std=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.ones(3, 1))


def test_on_policy_gradient_is_reinforce():
    logits, tokens, mask = toy()
    adv = torch.tensor([[0.7], [-1.3], [0.4]], dtype=torch.float64).expand(3, 4)
    logp = logp_of(logits, tokens)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, LossConfig(kl_tau=0.3))
    (g,) = torch.autograd.grad(loss, logits)
    # REINFORCE by hand: −(1/N) Σ A ∇log π(y), N = number of real tokens; ∇_logits log π(y) = onehot − softmax
    p = torch.softmax(logits.detach(), -1)
    onehot = torch.nn.functional.one_hot(tokens, 5).double()
    expected = -(adv * mask)[..., None] * (onehot - p) / mask.sum()
    torch.testing.assert_close(g, expected, rtol=0, atol=1e-14)


def test_regulariser_gradient():
    logits, tokens, mask = toy(1)
    logp = logp_of(logits, tokens)
    behav = logp.detach() + torch.linspace(-0.5, 0.5, 12, dtype=torch.float64).view(3, 4)
    tau = 0.25
    zero = torch.zeros_like(logp)
    loss, _ = policy_loss(logp, behav, zero, mask, LossConfig(kl_tau=tau, tis_cap=100.0), old_logp_BT=behav)
    (g,) = torch.autograd.grad(loss, logits)
    p = torch.softmax(logits.detach(), -1)
    onehot = torch.nn.functional.one_hot(tokens, 5).double()
    expected = (tau * (logp.detach() - behav) * mask)[..., None] * (onehot - p) / mask.sum()
    torch.testing.assert_close(g, expected, rtol=0, atol=1e-14)


def test_log_ratio_mask_zeroes_exactly_outside():
    old = torch.zeros(1, 6, dtype=torch.float64)
    logp = torch.tensor([[-1.5, -1.0, -0.2, 0.0, 1.0, 1.01]], dtype=torch.float64)
    m = log_ratio_mask(logp, old, -1.0, 1.0)
    assert m.tolist() == [[0.0, 1.0, 1.0, 1.0, 1.0, 0.0]]
    # inside the loss: the masked tokens get no surrogate gradient even when their advantage is large
    logp = logp.clone().requires_grad_(True)
    adv = torch.full_like(logp, 3.0)
    cfg = LossConfig(kl_tau=0.0, clip_low=0.99, clip_high=100.0, tis_cap=1e9)
    loss, stats = policy_loss(logp, old, adv, torch.ones_like(old), cfg, old_logp_BT=old)
    (g,) = torch.autograd.grad(loss, logp)
    assert g[0, 0] == 0 and g[0, 5] == 0 and (g[0, 1:5] != 0).all()
    assert stats["masked_fraction"] == pytest.approx(2 / 6)


def test_asymmetric_clip_hand_values():
    lp = torch.log(torch.tensor([[0.5, 1.0, 1.5, 0.5, 1.5]], dtype=torch.float64))
    old = torch.zeros_like(lp)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    s = clipped_surrogate(lp, old, adv, 0.2, 0.28)
    # A>0: −min(ρ, clip(ρ)) → ρ=0.5: −0.5; ρ=1: −1; ρ=1.5: −1.28. A<0: −min(−ρ, −clip(ρ)) → ρ=0.5: 0.8; ρ=1.5: 1.5
    torch.testing.assert_close(s, torch.tensor([[-0.5, -1.0, -1.28, 0.8, 1.5]], dtype=torch.float64))


def test_truncated_importance_weight_and_bad_input():
    w = truncated_importance_weight(torch.log(torch.tensor([0.5, 3.0])), torch.zeros(2), 2.0)
    torch.testing.assert_close(w, torch.tensor([0.5, 2.0]))
    with pytest.raises(ValueError, match="no token"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), LossConfig())
    with pytest.raises(ValueError, match="shapes"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 2), LossConfig())
    with pytest.raises(ValueError, match="clip_low"):
        LossConfig(clip_low=1.0)
