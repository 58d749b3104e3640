"""The policy-gradient loss family shared by the public RL frameworks, in the form Kimi uses.

Legend: ``P`` prompts (groups), ``G`` samples per prompt, ``B`` trajectories (``P·G``), ``T`` response
tokens (padded; ``mask_BT`` marks the real ones). Log-probs are natural-log, fp32.

Pieces (each one function):

* :func:`group_advantages` — ``A_i = (r_i − mean_g r) / (std_g r + eps)`` over a prompt's group (GRPO,
  DeepSeekMath arXiv 2402.03300 sec. 4.1); ``scale_std=False`` keeps ``r_i − mean`` (Dr. GRPO, arXiv 2503.20783).
* :func:`clipped_surrogate` — PPO's ``−min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A)`` with ``ρ = π_θ/π_old``, the
  asymmetric "clip-higher" of DAPO (arXiv 2503.14476 sec. 3.1).
* :func:`log_ratio_mask` — Kimi K2.5's token mask ``1[α ≤ log(π_θ/π_old) ≤ β]`` regardless of the sign of
  A (K2.5 report arXiv 2602.02276 sec. 4.4.2).
* :func:`squared_log_ratio` — the Kimi K1.5/K2 per-token regulariser ``(τ/2)(log π_θ − log π_behav)²`` whose
  gradient is ``τ(log π_θ − log π_behav)∇log π_θ`` (K1.5 arXiv 2501.12599 sec. 2.3; K2 arXiv 2507.20534 sec. 3.2.3;
  the same term is prime-rl's ``kl_tau`` and ROLL's ``kimi15``).
* :func:`truncated_importance_weight` — TIS ``min(π_old/π_behav, C)`` detached, correcting a behaviour
  policy (the rollout engine, or an older policy version in partial rollout) that differs from the
  trainer's (F. Yao et al. "Your efficient RL framework secretly brings you off-policy RL"; slime's
  ``vanilla_tis_function``, verl rollout correction).
* :func:`policy_loss` — their token-mean composition (DAPO's global token normalisation):
  ``L = Σ_bt m·w·mask_lr·pg + (τ/2)(Δ)² over the tokens / Σ_bt m``.

With ``π_θ = π_old = π_behav`` (on-policy) the gradient of :func:`policy_loss` is the REINFORCE gradient
``−(1/N) Σ A_b ∇log π_θ(y_bt)`` (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossConfig:
    """Knobs of :func:`policy_loss` (defaults: DAPO's clip, the prime-rl/K2.5 ``τ``, slime's TIS cap)."""

    clip_low: float = 0.2
    """ε_low: the ratio is clipped below at ``1 − clip_low`` (for A < 0)."""
    clip_high: float = 0.28
    """ε_high: the ratio is clipped above at ``1 + clip_high`` (for A > 0)."""
    kl_tau: float = 1e-3
    """τ of the squared log-ratio regulariser ``(τ/2)(log π_θ − log π_behav)²`` (0 disables it)."""
    log_ratio_low: float = -1.0
    """α of the K2.5 mask: tokens with ``log(π_θ/π_old) < α`` get no gradient."""
    log_ratio_high: float = 1.0
    """β of the K2.5 mask: tokens with ``log(π_θ/π_old) > β`` get no gradient."""
    tis_cap: float = 2.0
    """C: the importance weight ``π_old/π_behav`` is truncated at C."""

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if not self.kl_tau >= 0:
            raise ValueError(f"kl_tau must be >= 0, got {self.kl_tau}")
        if not self.log_ratio_low < 0 < self.log_ratio_high:
            raise ValueError(
                f"log_ratio_low < 0 < log_ratio_high must hold (the on-policy token must pass), got "
                f"{self.log_ratio_low}, {self.log_ratio_high}"
            )
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")


def group_advantages(rewards_PG: torch.Tensor, scale_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages ``[P, G]`` from rewards ``[P, G]`` (population std; a group with equal
    rewards gets 0). Raises ``ValueError`` for a group of one sample (its advantage is always 0)."""
    if rewards_PG.dim() != 2 or rewards_PG.shape[1] < 2:
        raise ValueError(
            f"rewards must be [P, G] with G >= 2 samples per prompt, got {tuple(rewards_PG.shape)}"
        )
    centred = rewards_PG - rewards_PG.mean(1, keepdim=True)
    if not scale_std:
        return centred
    return centred / (rewards_PG.std(1, unbiased=False, keepdim=True) + eps)


def clipped_surrogate(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_BT: torch.Tensor, clip_low: float, clip_high: float
) -> torch.Tensor:
    """Per-token ``−min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A)``, ``ρ = exp(logp − old_logp)`` (old detached)."""
    ratio_BT = torch.exp(logp_BT - old_logp_BT.detach())
    clipped_BT = ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    return -torch.minimum(ratio_BT * adv_BT, clipped_BT * adv_BT)


def log_ratio_mask(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``1[low ≤ log π_θ − log π_old ≤ high]`` as a float tensor (no gradient)."""
    d_BT = (logp_BT - old_logp_BT).detach()
    return ((d_BT >= low) & (d_BT <= high)).to(logp_BT.dtype)


def squared_log_ratio(logp_BT: torch.Tensor, behav_logp_BT: torch.Tensor, tau: float) -> torch.Tensor:
    """Per-token ``(τ/2)(log π_θ − log π_behav)²`` (behaviour detached)."""
    return 0.5 * tau * (logp_BT - behav_logp_BT.detach()) ** 2


def truncated_importance_weight(
    old_logp_BT: torch.Tensor, behav_logp_BT: torch.Tensor, cap: float
) -> torch.Tensor:
    """``min(exp(log π_old − log π_behav), cap)``, detached (TIS)."""
    return torch.exp(old_logp_BT - behav_logp_BT).clamp(max=cap).detach()


def policy_loss(
    logp_BT: torch.Tensor,
    behav_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    config: LossConfig,
    old_logp_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean loss over ``mask_BT`` and its statistics.

    Args:
        logp_BT: ``log π_θ`` of the realised tokens (with gradient).
        behav_logp_BT: the behaviour log-probs recorded by the rollout engine when each token was sampled.
        adv_BT: per-token advantage (an outcome advantage broadcast over the tokens, plus any dense term).
        mask_BT: 1 for tokens that train (0 for padding, masked old segments, dropped rollouts).
        old_logp_BT: ``π_old`` recomputed by the trainer before the update; ``None`` takes the behaviour
            log-probs ("bypass" mode: π_old = π_behav, the TIS weight is 1).
    Raises ``ValueError`` when the shapes differ or no token trains.
    """
    shapes = {tuple(t.shape) for t in (logp_BT, behav_logp_BT, adv_BT, mask_BT)}
    if old_logp_BT is not None:
        shapes.add(tuple(old_logp_BT.shape))
    if len(shapes) != 1:
        raise ValueError(f"policy_loss needs equal [B, T] shapes, got {sorted(shapes)}")
    n = mask_BT.sum()
    if n <= 0:
        raise ValueError("policy_loss: the mask selects no token")
    old_BT = behav_logp_BT if old_logp_BT is None else old_logp_BT
    weight_BT = truncated_importance_weight(old_BT, behav_logp_BT, config.tis_cap)
    keep_BT = log_ratio_mask(logp_BT, old_BT, config.log_ratio_low, config.log_ratio_high)
    pg_BT = clipped_surrogate(logp_BT, old_BT, adv_BT, config.clip_low, config.clip_high)
    reg_BT = squared_log_ratio(logp_BT, behav_logp_BT, config.kl_tau)
    loss = ((weight_BT * keep_BT * pg_BT + reg_BT) * mask_BT).sum() / n
    with torch.no_grad():
        m = mask_BT.bool()
        stats = {
            "masked_fraction": float(1 - keep_BT[m].mean()),
            "tis_weight": float(weight_BT[m].mean()),
            "log_ratio_sq": float(((logp_BT - behav_logp_BT)[m] ** 2).mean()),
        }
    return loss, stats
