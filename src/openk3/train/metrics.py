"""Training logs: ``metrics.jsonl`` (one JSON object per train step or evaluation) and the loss plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

TENSORBOARD_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "seq_len": "train/seq_len",
    "maxvio": "train/maxvio",
    "val_loss_subset": "val/loss_subset",
    "val_loss": "val/loss",
}
"""``metrics.jsonl`` keys mirrored to TensorBoard, and their tags."""


class MetricsLog:
    """Append-only JSONL log. Rows with ``step`` > ``resume_step`` are dropped when resuming.

    ``tensorboard_dir``: also write each row's :data:`TENSORBOARD_SCALARS` there as TensorBoard events
    (``torch.utils.tensorboard.SummaryWriter``; events past ``resume_step`` are purged on a resume). Raises
    ``ValueError`` naming the install command when the ``tensorboard`` package is missing."""

    def __init__(
        self,
        path: str | os.PathLike,
        resume_step: int | None = None,
        tensorboard_dir: str | os.PathLike | None = None,
    ) -> None:
        self.path = Path(path)
        self.writer = None
        if tensorboard_dir is not None:
            check_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(
                str(tensorboard_dir), purge_step=None if resume_step is None else resume_step + 1
            )
        self.kept: list[dict] = []
        """Rows kept from an earlier part of the run (when resuming)."""
        if resume_step is not None and self.path.exists():
            rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            self.kept = [r for r in rows if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()

    def write(self, row: dict) -> None:
        """Append ``row`` as one JSON line; non-finite floats are written as ``null`` (valid JSON)."""
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(_finite_or_null(row), allow_nan=False) + "\n")
        if self.writer is not None:
            for key, tag in TENSORBOARD_SCALARS.items():
                if isinstance(row.get(key), (int, float)):
                    self.writer.add_scalar(tag, row[key], row["step"])
            if any(k.startswith("val_loss") for k in row):
                self.writer.flush()  # live in TensorBoard at each evaluation

    def close(self) -> None:
        """Flush and close the TensorBoard writer (the JSONL file is closed after every row)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def check_tensorboard() -> None:
    """Raise ``ValueError`` naming the install command when the ``tensorboard`` package is missing."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            '--tensorboard needs the tensorboard package: pip install -e ".[tensorboard]" (or pip install tensorboard)'
        )


def _finite_or_null(value):
    """``value`` with every NaN/inf float (inside dicts and lists too) replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def read_metrics(path: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(metrics_path: str | os.PathLike, out_png: str | os.PathLike) -> None:
    """Train/val loss (left) and max violation (right) against step, as a PNG (matplotlib, Agg backend).

    Val points: the periodic evals on a fixed subset (``val_loss_subset``) as a line, the end-of-run eval
    (``val_loss``, a larger part of the val set) as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if "loss" in r]
    subset = [r for r in rows if "val_loss_subset" in r]
    final = [r for r in rows if "val_loss" in r]
    fig, (ax_loss, ax_vio) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    if subset:
        ax_loss.plot(
            [r["step"] for r in subset], [r["val_loss_subset"] for r in subset], "o-", label="val (subset)"
        )
    if final:
        ax_loss.plot(
            [r["step"] for r in final], [r["val_loss"] for r in final], "D", label="val (final eval)"
        )
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    vio = [r for r in train if r.get("maxvio") is not None]
    ax_vio.plot([r["step"] for r in vio], [r["maxvio"] for r in vio], lw=1, color="tab:red")
    ax_vio.set_xlabel("step")
    ax_vio.set_ylabel("max violation (max load / mean − 1)")
    ax_vio.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
