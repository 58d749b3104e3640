"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizer, balancer, data position.

A checkpoint is a folder ``step-NNNNNN/`` holding DCP's shard files and ``.metadata`` plus ``meta.json``
(the model config and the world layout it was saved from). Each rank writes only its shards; loading
re-shards onto any world size (DCP resolves the DTensor placements), so a run saved on 4 ranks resumes on 2.

Saving writes into ``step-NNNNNN.tmp/`` and rank 0 renames it into place after every rank has finished, so
a save that dies half way (a rank lost) leaves the previous checkpoint as it was and no torn folder under
the final name. Only then does rank 0 delete the older checkpoints past the newest :data:`KEEP` (the
single-process trainer's retention, :func:`openk3.train.state.save_checkpoint`) and the ``.tmp`` folders of
earlier saves that died, so a run always holds a complete checkpoint and its disk use stays bounded. Loading checks ``meta.json`` against the model first and raises ``ValueError`` naming the
differing config fields: a checkpoint of another model is refused before any tensor is read.

:func:`export_hf` gathers the full model on rank 0 and writes the Hugging Face folder
(:func:`openk3.checkpoint.io.save_pretrained`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

META = "meta.json"
KEEP = 2
"""Finished checkpoints a run keeps (the newest), as :func:`openk3.train.state.save_checkpoint` does."""
TMP_SUFFIX = ".tmp"
_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
"""The logger of DTensor's redistribution warnings (:func:`_quiet_expert_gather`)."""


def _config_dict(model: nn.Module) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(model.config), default=str))


def _differing(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differing(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key} ({x!r} saved, {y!r} now)")
    return out


def _state(model, optimizer):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def _balancer_json(balancer) -> dict | None:
    if balancer is None:
        return None
    state = balancer.state_dict()
    if state["pending"]:
        raise ValueError("the balancer holds counts of a step in progress: save between optimizer steps")
    return {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}


def finished_checkpoints(folder) -> list[Path]:
    """The finished checkpoints ``folder/step-NNNNNN`` (with ``meta.json``, no ``.tmp``), oldest first."""
    return sorted(
        p for p in Path(folder).glob("step-*") if not p.name.endswith(TMP_SUFFIX) and (p / META).is_file()
    )


def prune_checkpoints(folder, newest: Path, keep: int = KEEP) -> list[Path]:
    """Delete, in ``folder``, the finished checkpoints older than the newest ``keep`` and the ``.tmp`` folders
    of saves older than ``newest`` (left by a save that died); returns what was deleted. Call it once the
    save of ``newest`` has finished, on one rank."""
    old = finished_checkpoints(folder)[:-keep] if keep > 0 else []
    stale = [
        p for p in Path(folder).glob(f"step-*{TMP_SUFFIX}") if p.name.removesuffix(TMP_SUFFIX) < newest.name
    ]
    for path in old + stale:
        shutil.rmtree(path, ignore_errors=True)
    return old + stale


def save_checkpoint(
    folder,
    step: int,
    model,
    optimizer,
    balancer=None,
    extra: dict | None = None,
    keep: int = KEEP,
) -> Path:
    """Save a checkpoint ``folder/step-NNNNNN`` (collective: every rank calls it); returns its path.

    ``extra``: small JSON values (data position, seed) kept in ``meta.json``. The balancer (its biases are
    model buffers) must be between steps; its bookkeeping goes to ``meta.json`` too. Once the new checkpoint
    is in place, rank 0 keeps the newest ``keep`` finished ones (:func:`prune_checkpoints`; ``0`` keeps all).
    Raises ``ValueError`` for a balancer with a step in progress.
    """
    final = Path(folder) / f"step-{step:06d}"
    tmp = final.with_name(final.name + TMP_SUFFIX)
    balancer_state = _balancer_json(balancer)
    dcp.save(_state(model, optimizer), checkpoint_id=str(tmp))
    if dist.get_rank() == 0:
        meta = {
            "config": _config_dict(model),
            "world_size": dist.get_world_size(),
            "step": step,
            "balancer": balancer_state,
            "extra": extra or {},
        }
        (tmp / META).write_text(json.dumps(meta, indent=1))
    dist.barrier()
    if dist.get_rank() == 0:
        os.replace(tmp, final)
        prune_checkpoints(folder, final, keep)
    dist.barrier()
    return final


def load_checkpoint(path, model, optimizer, balancer=None) -> dict:
    """Load ``path`` into the (sharded) ``model``, ``optimizer`` and ``balancer``; returns ``{"step", **extra}``.

    Raises ``FileNotFoundError`` for a folder without ``meta.json`` (not a finished checkpoint) and
    ``ValueError`` naming the config fields when the checkpoint is of another model.
    """
    path = Path(path)
    meta_file = path / META
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a finished distributed checkpoint (no {META})")
    meta = json.loads(meta_file.read_text())
    diff = _differing(meta["config"], _config_dict(model))
    if diff:
        raise ValueError(f"checkpoint {path} is of another model: {'; '.join(diff[:5])}")
    state = _state(model, optimizer)
    # a fresh optimizer's state dict names every parameter; the saved one only those that ever had a
    # gradient (e.g. not the first layer's AttnRes query, which mixes an empty block list): those keep zeros
    dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if balancer is not None and meta["balancer"] is not None:
        balancer.load_state_dict({**meta["balancer"], "counts": None, "lo": None, "width": None})
    return {"step": meta["step"], **meta["extra"]}


class _ExpertGatherWarning(logging.Filter):
    """Drops DTensor's warning that gathering an expert-parallel parameter takes two all-gathers (its
    ``_StridedShard`` over ``efsdp`` then ``Shard(0)`` over ``ep`` cannot be merged into one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("sequential all_gather operations" in text and "non-ascending order" in text)


@contextlib.contextmanager
def _quiet_expert_gather():
    """Silence :class:`_ExpertGatherWarning`'s message (one per rank) for the ``with`` block: the export
    gathers each routed expert once per run, and the second all-gather moves no more bytes than one merged
    gather would, so the warning names no cost worth a line per rank. DTensor's other redistribution
    warnings, and this one outside the block, still show."""
    log = logging.getLogger(_REDISTRIBUTE_LOGGER)
    quiet = _ExpertGatherWarning()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def export_hf(model: nn.Module, path, **save_kwargs) -> None:
    """Write the sharded ``model`` as a Hugging Face folder at ``path`` (collective; rank 0 writes).

    Rank 0 holds the full model in CPU memory while writing (the format is one model, not shards).
    """
    from openk3.checkpoint.io import save_pretrained
    from openk3.model.modeling import build_model

    with _quiet_expert_gather():
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        single = build_model(model.config, device="cpu", init=False)
        single.load_state_dict(full)
        save_pretrained(single, path, **save_kwargs)
    dist.barrier()
