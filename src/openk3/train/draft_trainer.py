"""Training and evaluating a speculative draft on a frozen target (``openk3 train-draft``, ``openk3 eval
--draft``; ``docs/speculative.md``).

One step: the target reads a window of tokens (no grad) and gives its logits and the tapped features; the
draft is unrolled for ``ttt_steps`` steps on its own outputs (EAGLE-3's training-time test): step ``s`` at row
``i`` reads token ``x_{i+1+s}`` with the feature of step ``s − 1`` (step 0: the target's at ``i``), attends
to the target-feature positions ``≤ i`` and to its own row's earlier steps (:func:`~openk3.model.draft.ttt_mask`),
and is scored against the target's distribution at ``i + 1 + s``. The per-step losses (LK or KL,
:mod:`openk3.train.draft_loss`) are weighted ``0.8^s`` (SpecForge's default) and averaged.

Legend: ``B`` windows, ``T`` tokens per window, ``R = T − 1`` draft rows, ``V`` vocabulary, ``F`` features.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from openk3.model.draft import EagleDraft, ttt_mask
from openk3.train.draft_loss import DRAFT_LOSSES, acceptance_rate

TTT_STEP_WEIGHT = 0.8
"""Weight ``0.8^s`` of unroll step ``s`` in the training loss (SpecForge's default)."""


def target_pass(lm: nn.Module, draft: EagleDraft, ids_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target on a window: ``(logits [B, T, V], taps [B, T, F])`` without gradient (the taps from
    :meth:`~openk3.model.modeling.KimiLinearModel.forward_with_features`)."""
    with torch.no_grad():
        h_BTD, taps_BTF = lm.model.forward_with_features(ids_BT, draft.draft_config.feature_layers)
        return lm.lm_head(h_BTD), taps_BTF


def ttt_unroll(
    draft: EagleDraft, lm: nn.Module, taps_BTF: torch.Tensor, ids_BT: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Draft logits of unroll steps ``0..steps−1``: entry ``s`` is ``[B, R, V]``, row ``i`` predicting token
    ``i + 2 + s`` (valid for ``i ≤ T − 2 − s``; later rows read a clamped token and must be masked)."""
    B, T = ids_BT.shape
    R = T - 1
    embed = lm.model.embed_tokens
    pos_R = torch.arange(R, device=ids_BT.device)
    h_BRD = draft.fuse(taps_BTF[:, :R])
    past = None
    out = []
    for s in range(steps):
        tokens_BR = ids_BT[:, (pos_R + 1 + s).clamp_max(T - 1)]
        g_BRD, new = draft(h_BRD, tokens_BR, embed, mask_TS=ttt_mask(R, s, ids_BT.device), past=past)
        out.append(draft.logits(g_BRD, lm.lm_head))
        past = new if past is None else (torch.cat([past[0], new[0]], 1), torch.cat([past[1], new[1]], 1))
        h_BRD = g_BRD
    return out


def step_masks(T: int, steps: int, device=None) -> list[torch.Tensor]:
    """Bool ``[R]`` per unroll step: rows whose predicted token lies inside the window."""
    pos_R = torch.arange(T - 1, device=device)
    return [pos_R <= T - 2 - s for s in range(steps)]


def draft_loss(draft: EagleDraft, lm: nn.Module, ids_BT: torch.Tensor, loss: str, steps: int) -> torch.Tensor:
    """The training loss of one batch: ``Σ_s 0.8^s · loss_s / Σ_s 0.8^s``."""
    logits_BTV, taps_BTF = target_pass(lm, draft, ids_BT)
    T = ids_BT.shape[1]
    fn = DRAFT_LOSSES[loss]
    total, norm = 0.0, 0.0
    for s, (q_BRV, m_R) in enumerate(
        zip(ttt_unroll(draft, lm, taps_BTF, ids_BT, steps), step_masks(T, steps, ids_BT.device))
    ):
        p_BRV = logits_BTV[:, 1 + s :]
        rows = p_BRV.shape[1]
        w = TTT_STEP_WEIGHT**s
        total = total + w * fn(p_BRV, q_BRV[:, :rows], m_R[:rows].expand(ids_BT.shape[0], rows))
        norm += w
    return total / norm


def mixed_precision(device: torch.device | str, amp_dtype: torch.dtype | None):
    """The autocast context of one forward of a draft step (or of an evaluation batch): none for
    ``amp_dtype=None``, else autocast to ``amp_dtype`` without its weight-cast cache.

    Autocast keeps the low-precision copy of each fp32 weight it casts until the outermost autocast
    context exits. A training loop inside one autocast context (or inside any other, even a disabled one,
    which still counts as an outer level) therefore ran every forward on the copies made at its first
    step: the draft's linear weights never moved in the forward while AdamW updated the fp32 masters (a
    k3-small draft stayed at α ≈ 0.15 on an H200; on the CPU a bf16 draft stayed at loss 1.3, α 0.26, where
    fp32 reached 0.15 and 0.82). Without the cache every forward casts the current weights (a cast per use
    of a weight: a few small kernels). Raises ``ValueError`` when autocast is already on: the backward and
    the AdamW step must run outside it."""
    device_type = torch.device(device).type
    if torch.is_autocast_enabled(device_type):
        raise ValueError(
            "train_draft and acceptance_by_step must not run inside torch.autocast (its weight-cast cache "
            "would keep the first step's weights in every forward): pass amp_dtype, which autocasts each "
            "forward alone"
        )
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=amp_dtype, cache_enabled=False)


@torch.no_grad()
def acceptance_by_step(
    draft: EagleDraft, lm: nn.Module, batches, steps: int, amp_dtype: torch.dtype | None = None
) -> list[float]:
    """Mean acceptance rate ``α`` at each unroll step over ``batches`` (token windows ``[B, T]``): step 0 is the
    first drafted token, step ``s`` the ``s+1``-th of a chain whose earlier tokens were the data's. The
    forwards run under autocast to ``amp_dtype`` (``None``: the weights' dtype)."""
    sums, counts = [0.0] * steps, [0] * steps
    for ids_BT in batches:
        with mixed_precision(ids_BT.device, amp_dtype):
            logits_BTV, taps_BTF = target_pass(lm, draft, ids_BT)
            unrolled = ttt_unroll(draft, lm, taps_BTF, ids_BT, steps)
        for s, q_BRV in enumerate(unrolled):
            p_BRV = logits_BTV[:, 1 + s :]
            a = acceptance_rate(p_BRV, q_BRV[:, : p_BRV.shape[1]])
            sums[s] += float(a.sum())
            counts[s] += a.numel()
    return [x / max(n, 1) for x, n in zip(sums, counts)]


def expected_accepted_length(alphas: list[float], k: int) -> float:
    """Tokens per target forward for chains of ``k`` drafts when draft ``j`` is accepted with probability
    ``alphas[j]`` given the earlier ones: ``1 + Σ_{j<k} Π_{s≤j} α_s`` (the last ``α`` repeats beyond the
    list). With one ``α`` for all steps this is ``(1 − α^{k+1}) / (1 − α)`` (Leviathan et al. 2023)."""
    total, prod = 1.0, 1.0
    for j in range(k):
        prod *= alphas[min(j, len(alphas) - 1)]
        total += prod
    return total


@dataclass
class DraftTrainResult:
    losses: list[float]
    """Loss of each step this call ran."""
    seconds: float
    step: int
    """Steps done in all (``start_step`` + this call's); below ``num_steps`` when ``stop`` ended the run."""
    optimizer_state: dict
    """The AdamW state after :attr:`step` (what a resume passes back as ``optimizer_state``)."""


def train_draft(
    draft: EagleDraft,
    lm: nn.Module,
    batches,
    num_steps: int,
    lr: float = 1e-3,
    log_every: int = 0,
    log=print,
    start_step: int = 0,
    optimizer_state: dict | None = None,
    stop=None,
    amp_dtype: torch.dtype | None = None,
) -> DraftTrainResult:
    """AdamW steps ``start_step..num_steps−1`` (cosine decay to 10 %, 5 % warm-up, over ``num_steps``) of the
    draft on ``batches`` (an iterator of token windows ``[B, T]``, positioned at ``start_step``), the target
    frozen. Loss and unroll from the draft's config. ``optimizer_state`` (from an earlier result) continues
    an interrupted run exactly; ``stop()`` (if given) is asked before each step and ends the run early when
    true.

    ``amp_dtype`` (e.g. bf16 on CUDA): the target pass, the unroll and the loss run under autocast to it,
    the weights, gradients and AdamW state stay in their dtype, and the backward, the clipping and the
    step run outside autocast (PyTorch's recipe; called inside autocast the function raises, see
    :func:`mixed_precision`)."""
    cfg = draft.draft_config
    lm.requires_grad_(False)
    draft.train()
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    if optimizer_state is not None:
        opt.load_state_dict(optimizer_state)
    warm = max(1, num_steps // 20)

    def lr_at(step: int) -> float:
        if step < warm:
            return lr * (step + 1) / warm
        t = (step - warm) / max(1, num_steps - warm)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    losses, t0 = [], time.perf_counter()
    step = start_step
    while step < num_steps and not (stop is not None and stop()):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        ids_BT = next(batches)
        with mixed_precision(ids_BT.device, amp_dtype):
            loss = draft_loss(draft, lm, ids_BT, cfg.loss, cfg.ttt_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if log_every and step % log_every == 0:
            log(
                f"step {step}/{num_steps}  {cfg.loss} loss {losses[-1]:.4f}  ({time.perf_counter() - t0:.0f} s)"
            )
    draft.eval()
    return DraftTrainResult(losses, time.perf_counter() - t0, step, opt.state_dict())
