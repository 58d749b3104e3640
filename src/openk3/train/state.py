"""Training checkpoints: a Hugging Face model folder plus the state needed to resume exactly.

``<run>/checkpoints/step-000300/`` holds ``config.json`` + safetensors shards (the model, loadable with
``openk3.from_pretrained``), ``tokenizer.json`` (copied from the data folder), and ``trainer_state.pt``
(step, optimizer, Quantile Balancing, data position, RNG states, the train config). It is written into a
temporary folder and renamed into place, and ``<run>/checkpoints/latest`` (a text file) is updated only
after that, so a crash mid-save never leaves a torn or half-referenced checkpoint. The resolver from a run
folder to its latest checkpoint, :func:`latest_checkpoint`, lives in :mod:`openk3.checkpoint.io` (shared with
``openk3.from_pretrained``) and is re-exported here.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from openk3.checkpoint import save_pretrained
from openk3.checkpoint.io import LATEST, TRAINER_STATE_FILE, CorruptCheckpointError, latest_checkpoint

__all__ = [
    "LATEST",
    "STATE_FILE",
    "latest_checkpoint",
    "load_trainer_state",
    "resume_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

STATE_FILE = TRAINER_STATE_FILE
"""``trainer_state.pt``: its presence marks a training checkpoint (``save_pretrained`` refuses to replace one)."""


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: Path, step: int, model, trainer_state: dict, tokenizer_dir: Path | None, keep: int = 2
) -> Path:
    """Write ``step-{step:06d}`` atomically, point ``latest`` at it, keep the newest ``keep`` checkpoints."""
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"step-{step:06d}"
    tmp = ckpt_root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tmp, tokenizer=None)  # the run's tokenizer files are copied byte for byte
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
    torch.save(trainer_state, tmp / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = ckpt_root / (LATEST + ".tmp")
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, ckpt_root / LATEST)
    steps = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_trainer_state(ckpt: Path) -> dict:
    """The trainer state saved in checkpoint folder ``ckpt`` (step, optimizer, balancer, data position, RNG
    states, ``train_config``).

    Raises ``FileNotFoundError`` naming the missing ``trainer_state.pt`` (a model-only folder, e.g. one
    written by ``save_pretrained``, cannot be resumed), ``CorruptCheckpointError`` (a ``ValueError``) when the
    file cannot be read or holds no trainer state."""
    file = Path(ckpt) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} is missing: {ckpt} holds model weights but not the trainer state (step, optimizer, data "
            f"position, RNG) that a resume needs, so it is not a training checkpoint (a folder written by "
            f"save_pretrained?). Point {Path(ckpt).parent / LATEST} at an older step-* folder that has "
            f"{STATE_FILE}, or start a new run in another --out"
        )
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ... for a damaged file
        raise CorruptCheckpointError(
            f"{file} is not a valid trainer state (truncated or corrupt?): {e}"
        ) from e
    if not isinstance(state, dict) or "train_config" not in state:
        raise CorruptCheckpointError(
            f"{file} holds no trainer state (no train_config): corrupt or foreign file"
        )
    return state


def refuse_existing_run(run_dir: str | os.PathLike) -> None:
    """Raise ``ValueError`` when ``run_dir`` already holds a run's checkpoints, for a training started there
    without ``--resume``: it would restart at step 1, truncate ``metrics.jsonl`` and prune the old run's
    checkpoints as older than its own (a distributed run keeps the newest two by step number, so the new
    run's saves were the ones pruned). Both kinds count, whichever trainer asks: a single-process run's
    ``checkpoints/latest`` and step folders, and a distributed run's DCP step folders (which have no
    ``latest``); the message says which kind, and so how to continue it."""
    from openk3.checkpoint.dcp_step import is_dcp_step
    from openk3.dist.checkpoint import TMP_SUFFIX

    checkpoints = Path(run_dir) / "checkpoints"  # a save cut short (``.tmp``) is no checkpoint to resume
    steps = [p for p in sorted(checkpoints.glob("step-*")) if not p.name.endswith(TMP_SUFFIX)]
    if not steps and not (checkpoints / LATEST).exists():
        return

    if any(is_dcp_step(p) for p in steps):
        how = "continue it with --resume and --nproc-per-node as it was started (a distributed run)"
    else:
        how = "continue it with --resume"
    raise ValueError(f"{run_dir} already holds a run with checkpoints: {how}, or choose another --out")


def resume_checkpoint(run_dir: str | os.PathLike) -> Path:
    """The checkpoint ``openk3 train --out RUN --resume`` continues from: :func:`latest_checkpoint` of
    ``run_dir``, once the run is known to have saved one.

    A run saves its first checkpoint at step ``save_every`` (or at its end, when shorter); Ctrl-C and
    SIGTERM save one at any step. A run killed before then (``kill -9``, the OOM killer, a second Ctrl-C, a
    crash) leaves ``train_config.json``, ``data/`` and ``metrics.jsonl`` but no ``checkpoints/``: nothing to
    resume, and ``latest_checkpoint``'s "no checkpoint" would not say why. So ``FileNotFoundError`` is raised
    with a line that names the run, the last step it logged and the step of its first save (from its
    ``train_config.json`` and ``metrics.jsonl``), and says to start it again without ``--resume`` (the same
    ``--out`` re-uses its prepared data; a fresh one starts elsewhere). A missing folder, or one that holds
    no run, is named as such."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(
            f"--resume: there is no run at {run_dir} (no such folder): start it without --resume"
        )
    checkpoints = run_dir / "checkpoints"
    if (
        (run_dir / "config.json").is_file()
        or (checkpoints / LATEST).exists()
        or any(checkpoints.glob("step-*"))
    ):
        return latest_checkpoint(run_dir)
    if not any((run_dir / name).exists() for name in ("train_config.json", "metrics.jsonl", "data")):
        raise FileNotFoundError(
            f"--resume: {run_dir} holds no run (no checkpoints/, train_config.json or data/): start one there "
            "without --resume"
        )
    raise FileNotFoundError(
        f"--resume: run folder {run_dir} has no checkpoint yet: {_stopped_before_first_save(run_dir)}; start "
        "it again without --resume (the same flags and --out: its prepared data is re-used) or with a fresh "
        "--out"
    )


def _stopped_before_first_save(run_dir: Path) -> str:
    """Where a run without a checkpoint stopped, from its ``metrics.jsonl`` (the last step logged; a torn
    last line is skipped) and ``train_config.json`` (``save_every``, ``steps``), e.g. ``it stopped at step 3,
    before its first save at step 100 (--save-every 100)``."""
    last = 0
    try:
        for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
            try:
                last = max(last, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    except (OSError, UnicodeDecodeError):
        pass
    try:
        config = json.loads((run_dir / "train_config.json").read_text(encoding="utf-8"))
        save_every, steps = int(config["save_every"]), int(config["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return (
            f"it stopped at step {last} (metrics.jsonl), before its first save"
            if last
            else "it stopped before its first step (while preparing its data or building the model)"
        )
    first = min(save_every, steps)
    where = f"at step {last} (metrics.jsonl)" if last else "before its first step"
    return f"it stopped {where}, before its first save at step {first} (--save-every {save_every})"
