"""Losses that train a speculative draft ``q`` towards the target ``p`` (both at temperature 1).

* acceptance rate ``α = Σₓ min(p(x), q(x)) = 1 − TV(p, q)``: the probability that the speculative sampling
  rule accepts a token drawn from ``q`` (Leviathan et al. 2023, ``docs/references.md#speculative-decoding``);
* **LK loss** ``−log α`` (Samarin et al. 2026, the K3 form): it maximises acceptance directly;
  ``∂α/∂q(x) = 1[q(x) < p(x)]``, so mass moves only onto tokens the draft under-covers;
* **KL loss** ``KL(p ‖ q) = Σₓ p (log p − log q)``, the usual distillation surrogate, for comparison.

Each takes logits ``[*, V]`` (target, draft) and an optional bool ``mask`` ``[*]`` of the positions that count,
and returns the mean over those positions (a 0-dim tensor in fp32, fp64 for fp64 inputs). The target gets no
gradient. ``α`` is clamped at :data:`ALPHA_FLOOR` inside the log so a position with disjoint supports gives
a finite loss.
"""

from __future__ import annotations

import torch

ALPHA_FLOOR = 1e-12
"""Smallest ``α`` inside ``−log α`` (a finite loss and gradient where ``p`` and ``q`` do not overlap)."""


def _compute(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def acceptance_rate(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """``α = Σ min(p, q)`` per position ``[*]`` (``p`` from ``target_logits``, no gradient)."""
    p = torch.softmax(_compute(target_logits.detach()), -1)
    q = torch.softmax(_compute(draft_logits), -1)
    return torch.minimum(p, q).sum(-1)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return x.mean()
    if mask.shape != x.shape:
        raise ValueError(
            f"mask must have shape {tuple(x.shape)} (one entry per position), got {tuple(mask.shape)}"
        )
    return (x * mask).sum() / mask.sum().clamp_min(1)


def lk_loss(
    target_logits: torch.Tensor, draft_logits: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``mean(−log Σₓ min(p, q))`` over the masked positions."""
    alpha = acceptance_rate(target_logits, draft_logits)
    return _masked_mean(-torch.log(alpha.clamp_min(ALPHA_FLOOR)), mask)


def kl_loss(
    target_logits: torch.Tensor, draft_logits: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``mean(KL(p ‖ q))`` over the masked positions."""
    logp = torch.log_softmax(_compute(target_logits.detach()), -1)
    logq = torch.log_softmax(_compute(draft_logits), -1)
    return _masked_mean((logp.exp() * (logp - logq)).sum(-1), mask)


DRAFT_LOSSES = {"lk": lk_loss, "kl": kl_loss}
