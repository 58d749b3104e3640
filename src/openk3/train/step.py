"""The gradient half of a training step: micro-batches through the model and the fused LM-head loss.

Shared by :class:`~openk3.train.trainer.Trainer` and ``benchmarks/train_throughput.py``, so the benchmark
times what ``openk3 train`` runs. The loss stays on the device (no host sync here).

Legend: ``B`` sequences of the step (the global batch), ``T`` tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from openk3.train.loss import lm_head_loss


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA; nothing on the CPU (fp32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_batch_loss(model: torch.nn.Module, x_BT: torch.Tensor, y_BT: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of one micro-batch (ids already on the model's device and checked against the
    vocabulary: the forward skips its per-call check, a host sync)."""
    lm = getattr(model, "language_model", model)
    with autocast_for(x_BT.device):
        h_BTD = lm.model(x_BT, check_inputs=False)
        return lm_head_loss(h_BTD, lm.lm_head.weight, y_BT)


def accumulate_gradients(
    model: torch.nn.Module,
    x_BT: torch.Tensor,
    y_BT: torch.Tensor,
    micro_batch: int,
    mark: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """Forward and backward of ``x_BT`` (targets ``y_BT``) in micro-batches of ``micro_batch`` sequences, each
    loss scaled by ``1 / micro-batches`` so the gradients add up to the batch mean's; returns the batch's mean
    loss (a 0-d tensor on the device). Each MoE block counts its routing in its own buffers during the
    forward (:mod:`openk3.model.routing_stats`), for Quantile Balancing's step. ``mark(phase)`` before each forward (``"forward"``) and backward (``"backward"``) and at the
    end (``"end"``), for timing."""
    device = next(model.parameters()).device
    x_BT, y_BT = x_BT.to(device, non_blocking=True), y_BT.to(device, non_blocking=True)
    n = x_BT.shape[0] // micro_batch
    total = torch.zeros((), device=device)
    for x_mb, y_mb in zip(x_BT.split(micro_batch), y_BT.split(micro_batch), strict=True):
        if mark:
            mark("forward")
        loss = micro_batch_loss(model, x_mb, y_mb) / n
        if mark:
            mark("backward")
        loss.backward()
        total += loss.detach()
    if mark:
        mark("end")
    return total
