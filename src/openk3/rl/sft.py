"""Supervised fine-tuning on (prompt, response) pairs: the mean negative log-likelihood of the response
tokens (the prompt is context only), AdamW."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch import nn

from openk3.rl.logprobs import response_logprobs


def sft(
    model: nn.Module,
    examples: list[tuple[list[int], list[int]]],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    on_eval: Callable[[int, list[float]], None] | None = None,
    eval_every: int = 0,
) -> list[float]:
    """Train ``model`` in place for ``steps`` batches drawn from ``examples``; returns the loss per step
    (nats per response token). The learning rate warms up over 20 steps and decays linearly to a tenth.
    ``on_eval(step, losses)`` runs every ``eval_every`` steps and after the last, with the model in eval
    mode. Raises ``ValueError`` for no examples or steps/batch below 1."""
    if not examples or steps < 1 or batch_size < 1:
        raise ValueError(
            f"sft needs examples, steps >= 1 and batch_size >= 1; got {len(examples)}, {steps}, {batch_size}"
        )
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    model.train()
    losses = []
    for step in range(steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        logp_BT, mask_BT = response_logprobs(model, [p for p, _ in batch], [r for _, r in batch])
        loss = -(logp_BT * mask_BT).sum() / mask_BT.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if on_eval is not None and ((eval_every and (step + 1) % eval_every == 0) or step + 1 == steps):
            model.eval()
            on_eval(step + 1, losses)
            model.train()
    return losses
