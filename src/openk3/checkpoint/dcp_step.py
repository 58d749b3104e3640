"""A distributed run's checkpoint read in one process: ``openk3 eval`` and ``generate`` on a DCP step folder.

``openk3 train --nproc-per-node N`` (or torchrun) saves ``RUN/checkpoints/step-NNNNNN/`` with
``torch.distributed.checkpoint`` (:mod:`openk3.dist.checkpoint`): DCP's ``.metadata`` and one
``__<rank>_0.distcp`` shard file per rank, plus ``meta.json`` holding the model config (the dataclass as a
dict) and the world layout. The tensors are stored under their global names and shapes (a DTensor is saved
as its whole tensor, split in chunks), keyed ``model.<module name>`` and ``optimizer.…``; the module names
are the single-device model's (the parallelism is applied to that model, never baked into its names).

So one process reads the model back without a process group: it builds the model of ``meta.json``'s config
on the CPU and lets ``torch.distributed.checkpoint.load(..., no_dist=True)`` fill its ``state_dict()`` in
place; only the ``model.*`` entries are requested, the optimizer state is never read. The weights then go
through the same path as every other checkpoint: :func:`export_dcp_step` writes them, with the run's
tokenizer (``RUN/data/tokenizer``, what the run's ``RUN/final`` export copies too), as a Hugging Face folder,
which :func:`openk3.checkpoint.from_pretrained` loads with all its checks (names, shapes, non-finite values).
That costs one write of the model (the size of ``RUN/final``) into a folder the caller chooses, a temporary
one for the CLI; a step folder is never written to, so a running training can keep pruning its checkpoints.

:func:`checkpoint_of` resolves what a command's ``--ckpt`` names (a model folder, a run, a step folder) and
:func:`model_folder` gives the folder to load from it, so every command that reads a checkpoint
(``generate``, ``eval``, ``sft``) takes the same things.

Raises ``ValueError`` for an unreadable ``meta.json`` and ``FileNotFoundError`` when the tokenizer is missing
(a step folder copied out of its run), each naming the file and what to pass instead.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import warnings
from pathlib import Path

from torch import nn

DCP_METADATA = ".metadata"
"""The file DCP writes last into a checkpoint folder (with ``meta.json``, the mark of a finished save)."""


def is_dcp_step(path) -> bool:
    """Whether ``path`` is a finished DCP checkpoint folder (``meta.json`` and DCP's ``.metadata``)."""
    from openk3.dist.checkpoint import META

    path = Path(path)
    return (path / META).is_file() and (path / DCP_METADATA).is_file()


def newest_dcp_step(run) -> Path | None:
    """The newest finished DCP checkpoint of run folder ``run`` (or of its ``checkpoints`` folder), else
    ``None`` (a single-process run, an empty folder)."""
    from openk3.dist.checkpoint import finished_checkpoints

    run = Path(run)
    steps = finished_checkpoints(run / "checkpoints") or finished_checkpoints(run)
    steps = [p for p in steps if is_dcp_step(p)]
    return steps[-1] if steps else None


def _config_dict(saved: dict) -> dict:
    """``dataclasses.asdict`` of a config (what ``meta.json`` holds) as ``config.json`` holds it: each
    config's ``extra`` dict (the keys it keeps unparsed) spread into the config's own keys."""
    out = {k: _config_dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    extra = out.pop("extra", None)
    return {**extra, **out} if isinstance(extra, dict) else out


def dcp_step_config(step):
    """The model config saved in DCP step folder ``step`` (its ``meta.json``); raises ``ValueError`` naming
    the file when it is not JSON or holds no valid config."""
    from openk3.config import config_from_dict
    from openk3.dist.checkpoint import META

    path = Path(step) / META
    try:
        return config_from_dict(_config_dict(json.loads(path.read_text(encoding="utf-8"))["config"]))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} holds no readable model config (truncated or corrupt?): {e}") from None


def load_dcp_model(step, device="cpu") -> nn.Module:
    """The model of DCP step folder ``step`` in fp32 on ``device``, in eval mode (module doc: no process
    group needed). Tensors stored in bf16 (a CUDA run's) are widened exactly. Raises ``ValueError`` for an
    unreadable ``meta.json``; DCP's own error when a model tensor is missing from the checkpoint."""
    import torch.distributed.checkpoint as dcp

    from openk3.model.modeling import build_model

    model = build_model(dcp_step_config(step), device=device, init=False)
    state = {"model": model.state_dict()}  # the parameters' own storage: DCP copies into it in place
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(step), no_dist=True)
    return model.eval()


def run_tokenizer_of(step) -> Path:
    """The tokenizer folder of the run that holds DCP step folder ``step`` (``RUN/data/tokenizer``, written
    when the run prepared its data); raises ``FileNotFoundError`` saying what to use instead."""
    from openk3.checkpoint.io import _has_tokenizer

    step = Path(step)
    if step.parent.name != "checkpoints":
        raise FileNotFoundError(
            f"{step} is a distributed checkpoint (DCP) outside its run folder, so its run's tokenizer "
            "(RUN/data/tokenizer) is not found: read it in place (RUN/checkpoints/step-N), or use RUN/final"
        )
    folder = step.parent.parent / "data" / "tokenizer"
    if not _has_tokenizer(folder):  # tokenizer.json, or the .tiktoken file of a --tokenizer run
        raise FileNotFoundError(
            f"{step} is a distributed checkpoint (DCP) whose run's tokenizer {folder} is missing (deleted?): "
            "use RUN/final, the model folder the run writes when it ends"
        )
    return folder


def export_dcp_step(step, out) -> Path:
    """Write the model of DCP step folder ``step`` with its run's tokenizer as a Hugging Face folder ``out``
    (fp32; :func:`openk3.checkpoint.save_pretrained`'s rules for an existing ``out``); returns ``out``. The
    tokenizer is looked up first, so a step folder outside its run is refused before the model is read."""
    from openk3.checkpoint.io import save_pretrained

    tokenizer = run_tokenizer_of(step)
    save_pretrained(load_dcp_model(step), out, tokenizer=str(tokenizer))
    return Path(out)


def checkpoint_of(ckpt: str) -> Path:
    """The checkpoint ``--ckpt`` of ``openk3 generate`` and ``eval`` names: a model folder, a run's latest
    checkpoint (:func:`openk3.checkpoint.latest_checkpoint`), or a distributed run's DCP step folder: the one
    named (``RUN/checkpoints/step-N``), or for ``--ckpt RUN`` of a distributed run that has no ``RUN/final``
    yet (stopped before its end), its newest. The run's files (val split, train config) are looked up from
    it; :func:`model_folder` gives the folder to load. Raises ``FileNotFoundError`` when there is none."""
    from openk3.checkpoint.io import latest_checkpoint

    path = Path(ckpt)
    if is_dcp_step(path):
        return path
    try:
        return latest_checkpoint(path)
    except FileNotFoundError:
        step = newest_dcp_step(path)
        if step is None:
            raise
        return step


@contextlib.contextmanager
def model_folder(checkpoint: Path):
    """Yield the model folder of ``checkpoint`` (from :func:`checkpoint_of`): the folder itself, or for a
    DCP step folder a temporary Hugging Face folder of its model and its run's tokenizer, removed after the
    command (:func:`openk3.checkpoint.dcp_step.export_dcp_step`: one read and one write of the model)."""
    if not is_dcp_step(checkpoint):
        yield checkpoint
        return
    with tempfile.TemporaryDirectory(prefix="openk3-dcp-") as tmp:
        yield export_dcp_step(checkpoint, Path(tmp) / checkpoint.name)
