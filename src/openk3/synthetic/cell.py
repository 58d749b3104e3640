"""Train and evaluate one cell of the synthetic grid: one task, one mixer, one training length (or a
curriculum of lengths), one seed.

The model (:mod:`openk3.synthetic.mixers`) trains with AdamW on fresh batches (linear warmup over the first
10% of steps, then cosine to 10% of the peak), the loss being the cross-entropy on the answer positions only.
Every ``eval_every`` steps it is scored on a fixed held-out set drawn from another stream of the same seed:

* ``accuracy``: exact match, the fraction of sequences whose every answer is the argmax prediction (teacher
  forced, the answers before it given);
* ``token_accuracy``: the fraction of answer tokens predicted.

With ``stop_at``, training ends at the first evaluation whose exact-match accuracy reaches it (steps to
solve is the paper's measure, and a solved cell frees its device for the others). With ``curriculum``, the
same model then trains at each longer length in turn, a stage each, so the mechanism found at the shortest
length is reused and each stage measures the steps needed to bridge the longer distances. At the end,
``extrapolate`` lengths (multiples of the last training length) are scored with the trained number
of items, only the noise growing. Everything is deterministic given the seed on the CPU (the GPU's kernels
may round differently from run to run).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from openk3.devices import check_device
from openk3.model.modeling import build_model
from openk3.synthetic.mixers import MIXERS, MixerSize, mixer_config
from openk3.synthetic.tasks import (
    NUM_KEYS,
    NUM_NOISE,
    VOCAB_SIZE,
    check_task,
    default_items,
    make_batch,
    min_length,
)

FULL_ACCURACY = 0.99
"""Exact-match accuracy counted as solved (``steps_to_full``)."""


@dataclass
class CellConfig:
    task: str = "mqar"
    mixer: str = "kda"
    seq_len: int = 256
    items: int | None = None
    """Items per sequence; ``None``: :func:`~openk3.synthetic.tasks.default_items` (``seq_len // 32``)."""
    noise: int = NUM_NOISE
    """Noise symbols filling the gaps (1: a single filler token; see :func:`~openk3.synthetic.tasks.make_batch`)."""
    seed: int = 0
    steps: int = 600
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.1
    eval_every: int = 50
    eval_size: int = 128
    """Held-out sequences scored at each evaluation."""
    stop_at: float | None = None
    """Stop training at the first evaluation with exact-match accuracy ≥ this (e.g. 0.99); ``None``: run
    all ``steps``. The learning-rate schedule is always laid over ``steps``."""
    curriculum: list[int] = field(default_factory=list)
    """Longer lengths trained after ``seq_len``, in order, continuing the same model and optimizer (each a
    stage of up to ``curriculum_steps`` steps with its own warmup to ``curriculum_lr`` × ``lr`` and cosine,
    ending early at ``stop_at``)."""
    curriculum_items: list[int] = field(default_factory=list)
    """Items per sequence of each ``curriculum`` stage, in order (empty: ``items`` at every stage). Growing
    counts make a longer stage harder in what must be stored, not only in the distance to bridge."""
    curriculum_steps: int | None = None
    """Most steps of each curriculum stage after the first; ``None``: ``steps``."""
    curriculum_lr: float = 0.3
    """Peak learning rate of the stages after the first, as a fraction of ``lr`` (the model arrives trained;
    warming up to the full ``lr`` again undoes part of what it learned)."""
    extrapolate: list[int] = field(default_factory=list)
    """Multiples of the last trained length scored at the end (e.g. ``[4, 8]``)."""
    size: MixerSize = field(default_factory=MixerSize)
    device: str = "cpu"

    def __post_init__(self) -> None:
        check_task(self.task)
        if self.mixer not in MIXERS:
            raise ValueError(f"CellConfig.mixer={self.mixer!r} is invalid: choose one of {', '.join(MIXERS)}")
        if isinstance(self.size, dict):
            self.size = MixerSize(**self.size)
        if self.curriculum_steps is None:
            self.curriculum_steps = self.steps
        for name in ("seq_len", "steps", "curriculum_steps", "batch_size", "eval_every", "eval_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CellConfig.{name}={value!r} is invalid: expected an int >= 1")
        if (
            isinstance(self.noise, bool)
            or not isinstance(self.noise, int)
            or not 1 <= self.noise <= NUM_NOISE
        ):
            raise ValueError(f"CellConfig.noise={self.noise!r} is invalid: expected an int in 1..{NUM_NOISE}")
        if self.items is None:
            self.items = default_items(self.task, self.seq_len)
        for name, counts in (("items", [self.items]), ("curriculum_items", self.curriculum_items)):
            if self.task == "mqar" and any(isinstance(n, int) and n > NUM_KEYS for n in counts):
                value = self.items if name == "items" else counts
                raise ValueError(
                    f"CellConfig.{name}={value!r} is invalid: mqar holds at most {NUM_KEYS} key-value pairs "
                    "per sequence"
                )
        if self.seq_len < min_length(self.task, self.items):
            raise ValueError(
                f"CellConfig.seq_len={self.seq_len} is too short for {self.items} {self.task} items "
                f"(needs {min_length(self.task, self.items)})"
            )
        if not all(
            isinstance(n, int) and n > self.seq_len for n in self.curriculum
        ) or self.curriculum != sorted(set(self.curriculum)):
            raise ValueError(
                f"CellConfig.curriculum={self.curriculum!r} is invalid: expected increasing lengths above "
                f"seq_len={self.seq_len}"
            )
        if self.curriculum_items and (
            len(self.curriculum_items) != len(self.curriculum)
            or not all(isinstance(n, int) and n >= 1 for n in self.curriculum_items)
        ):
            raise ValueError(
                f"CellConfig.curriculum_items={self.curriculum_items!r} is invalid: expected one int >= 1 per "
                f"curriculum length {self.curriculum!r}"
            )
        for length, items in zip(self.curriculum, self.curriculum_items, strict=False):
            if length < min_length(self.task, items):
                raise ValueError(
                    f"CellConfig.curriculum_items={self.curriculum_items!r} is invalid: {items} {self.task} items "
                    f"need {min_length(self.task, items)} tokens, the curriculum length is {length}"
                )
        if not all(isinstance(m, int) and m >= 1 for m in self.extrapolate):
            raise ValueError(f"CellConfig.extrapolate={self.extrapolate!r} is invalid: expected ints >= 1")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"CellConfig.lr={self.lr!r} is invalid: expected a finite number > 0")
        if not (math.isfinite(self.curriculum_lr) and 0 < self.curriculum_lr <= 1):
            raise ValueError(
                f"CellConfig.curriculum_lr={self.curriculum_lr!r} is invalid: expected a number in (0, 1]"
            )
        if self.stop_at is not None and not 0 < self.stop_at <= 1:
            raise ValueError(
                f"CellConfig.stop_at={self.stop_at!r} is invalid: expected None or a number in (0, 1]"
            )


def _to_device(batch, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(batch.tokens_NL).to(device), torch.from_numpy(batch.answer_NL).to(device)


def _logits(model, tokens_NL: torch.Tensor, device: torch.device) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        return model(tokens_NL[:, :-1]).logits.float()


@torch.no_grad()
def evaluate(model, batch, device: torch.device, micro_batch: int = 32) -> dict:
    """``accuracy`` (exact match per sequence), ``token_accuracy`` and ``loss`` (nats per answer token)."""
    model.eval()
    tokens_NL, answer_NL = _to_device(batch, device)
    exact, right, count, loss = 0, 0, 0, 0.0
    for tok, ans in zip(tokens_NL.split(micro_batch), answer_NL.split(micro_batch)):
        logits = _logits(model, tok, device)
        target, mask = tok[:, 1:], ans[:, 1:]
        hit = (logits.argmax(-1) == target) | ~mask
        exact += int(hit.all(-1).sum())
        right += int((hit & mask).sum())
        count += int(mask.sum())
        loss += float(F.cross_entropy(logits[mask], target[mask], reduction="sum"))
    model.train()
    n = tokens_NL.shape[0]
    return {"accuracy": exact / n, "token_accuracy": right / count, "loss": loss / count}


def _lr_factor(step: int, steps: int) -> float:
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def run_cell(
    config: CellConfig, log: Callable[[dict], None] | None = None, deadline: float | None = None
) -> dict:
    """Train and score one cell; returns its result (JSON-serialisable).

    Keys: ``config``, ``params``, ``stages`` (one per training length: ``seq_len``, ``curve`` with
    ``step``, ``accuracy``, ``token_accuracy``, ``loss``, ``train_loss`` (None before the first step) per
    evaluation, step 0 included,
    ``final`` the last evaluation, ``steps_to_full`` the first step with accuracy ≥ :data:`FULL_ACCURACY` or
    None, ``stopped``: ``"steps"`` all steps ran, ``"solved"`` ``stop_at`` reached, ``"deadline"`` cut at
    ``deadline``, and ``seconds``), the first stage's ``curve``, ``final``, ``steps_to_full`` and ``stopped``
    at the top level, ``extrapolation`` (``{length: scores}``) and ``seconds``. ``log`` receives each curve
    point (with its ``seq_len``) as it is measured. ``deadline`` (``time.time()`` seconds) ends training at
    the first evaluation after it, keeping the curve so far; later stages are then not run.

    Raises :class:`~openk3.train.trainer.DivergenceError` at the first non-finite training loss (before that
    step updates the model), and ``ValueError`` for ``cuda`` without CUDA."""
    device = torch.device(config.device)
    check_device(device)
    torch.manual_seed(config.seed)
    model = build_model(mixer_config(config.mixer, VOCAB_SIZE, config.size), device=device, seed=config.seed)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or name.endswith(("A_log", "dt_bias")) else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.98),
    )
    train_rng = np.random.default_rng([config.seed, 0])
    start = time.perf_counter()
    stages = []
    items_per_stage = [config.items, *(config.curriculum_items or [config.items] * len(config.curriculum))]
    for i, (length, items) in enumerate(
        zip([config.seq_len, *config.curriculum], items_per_stage, strict=True)
    ):
        held_rng = np.random.default_rng([config.seed, 1] if i == 0 else [config.seed, 1, length])
        held_out = make_batch(config.task, config.eval_size, length, items, held_rng, config.noise)
        steps, lr = (
            (config.steps, config.lr)
            if i == 0
            else (config.curriculum_steps, config.lr * config.curriculum_lr)
        )
        stages.append(
            _train_stage(
                model, optimizer, config, length, items, steps, lr, held_out, train_rng, log, deadline
            )
        )
        if stages[-1]["stopped"] == "deadline":
            break
    extrapolation = {}
    for multiple in config.extrapolate:
        length = multiple * stages[-1]["seq_len"]
        rng = np.random.default_rng([config.seed, 2, multiple])
        batch = make_batch(config.task, config.eval_size, length, stages[-1]["items"], rng, config.noise)
        extrapolation[str(length)] = evaluate(model, batch, device, micro_batch=max(1, 32 // multiple))
    first = stages[0]
    return {
        "config": asdict(config),
        "params": sum(p.numel() for p in model.parameters()),
        **{key: first[key] for key in ("curve", "final", "steps_to_full", "stopped")},
        "stages": stages,
        "extrapolation": extrapolation,
        "seconds": time.perf_counter() - start,
    }


def _train_stage(
    model,
    optimizer,
    config: CellConfig,
    length: int,
    items: int,
    steps: int,
    lr: float,
    held_out,
    train_rng,
    log,
    deadline,
) -> dict:
    """Up to ``steps`` steps at ``length`` tokens and ``items`` items (warmup to ``lr`` and cosine over them); see :func:`run_cell`."""
    device = next(model.parameters()).device
    curve, steps_to_full, train_loss, stopped = [], None, None, "steps"
    start = time.perf_counter()
    for step in range(steps + 1):
        if step % config.eval_every == 0 or step == steps:
            point = {"step": step, **evaluate(model, held_out, device), "train_loss": train_loss}
            curve.append(point)
            if log is not None:
                log({**point, "seq_len": length})
            if steps_to_full is None and point["accuracy"] >= FULL_ACCURACY:
                steps_to_full = step
            if config.stop_at is not None and point["accuracy"] >= config.stop_at:
                stopped = "solved"
            elif deadline is not None and step < steps and time.time() >= deadline:
                stopped = "deadline"
        if step == steps or stopped != "steps":
            break
        for group in optimizer.param_groups:
            group["lr"] = lr * _lr_factor(step, steps)
        tokens_NL, answer_NL = _to_device(
            make_batch(config.task, config.batch_size, length, items, train_rng, config.noise), device
        )
        logits = _logits(model, tokens_NL, device)
        mask = answer_NL[:, 1:]
        loss = F.cross_entropy(logits[mask], tokens_NL[:, 1:][mask])
        train_loss = loss.item()
        if not math.isfinite(train_loss):
            from openk3.train.trainer import DivergenceError

            raise DivergenceError(
                f"training diverged: the answer loss is {train_loss} at step {step + 1} at {length} tokens "
                f"(lr {optimizer.param_groups[0]['lr']:.3g}); lower --lr"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return {
        "seq_len": length, "items": items, "curve": curve, "final": curve[-1], "steps_to_full": steps_to_full,
        "stopped": stopped, "seconds": time.perf_counter() - start,
    }  # fmt: skip
