"""Save and load Hugging Face-format model folders with the official tensor names.

A folder holds ``config.json``, ``model-0000i-of-0000n.safetensors`` shards and
``model.safetensors.index.json`` (``{"metadata": {"total_size": …}, "weight_map": {name: shard}}``); a single
``model.safetensors`` without an index is read too. Names go through :mod:`openk3.checkpoint.names`.
A loaded model remembers its folder's shard files (``model.weight_map``) and its tensors keep the
checkpoint's dtypes where the release's do (F32 tensors stay fp32 in a bf16 model, MXFP4 experts stay bytes),
so loading the release in bf16 and saving it writes the same files with the same tensor bytes.
A training run folder (``<run>/checkpoints/latest`` naming ``step-NNNNNN/``, :mod:`openk3.train.state`) is
resolved to its latest checkpoint by :func:`latest_checkpoint`, the one resolver that ``from_pretrained``, the
CLI and the server share.

Saving writes into a temporary sibling folder and renames it into place, so an interrupted save never
leaves a torn checkpoint; it never replaces a training checkpoint (a folder holding ``trainer_state.pt``).
Replacing a model folder keeps what the user added there (a README.md, notes): only the old save's model
files (:data:`MODEL_FILES`, and :data:`TOKENIZER_FILES` when a tokenizer is written) are dropped.
Loading is strict: it collects every missing key, unexpected key and shape mismatch and raises one
:class:`CheckpointMismatchError` listing them all, before any weight is copied. A file that is not valid
safetensors or JSON (truncated, overwritten) raises :class:`CorruptCheckpointError` naming the file.
Routed experts stored as compressed-tensors MXFP4 (``quantization_config`` in ``config.json``) are loaded and
saved as their bytes, kept packed in memory (:mod:`openk3.quant.experts`, ``docs/quantization.md``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import shutil
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from openk3.checkpoint.hf_remote import REMOTE_FILES, write_remote_code
from openk3.checkpoint.names import (
    QUANTIZED_MODULE_SUFFIXES,
    QUANTIZED_SUFFIXES,
    VISION_PREFIXES,
    expert_name,
    is_stacked,
    to_module,
)
from openk3.checkpoint.out_folder import folder_written_whole
from openk3.config import AnyConfig, KimiK3Config, load_config, save_config
from openk3.model.modeling import build_model, check_dtype
from openk3.quant.experts import use_packed_experts
from openk3.quant.mxfp4 import check_mxfp4
from openk3.quant.scheme import expert_scheme

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_SIZE = "5GB"
"""Largest shard :func:`save_pretrained` writes when it does not keep the loaded folder's shard files."""
LATEST = "latest"
"""Text file in a run's ``checkpoints`` folder holding the name of the newest checkpoint folder."""
TRAINER_STATE_FILE = "trainer_state.pt"
"""The file that makes a model folder a training checkpoint (:mod:`openk3.train.state`)."""
MODEL_FILES = ("*.safetensors", INDEX_FILE, "config.json", *REMOTE_FILES)
"""Name patterns (``fnmatch``, case-sensitive) of an earlier save's model files: :func:`save_pretrained`
drops them from a folder it replaces (the new save writes its own)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "*.tiktoken",
)
"""Name patterns of tokenizer files (ours and Hugging Face's): dropped from a replaced folder only when the new
save writes a tokenizer, so that no file of the old tokenizer sits beside the new one."""


class CheckpointMismatchError(ValueError):
    """The checkpoint does not match the model; the message lists every problem."""


class CorruptCheckpointError(ValueError):
    """A checkpoint file cannot be parsed (truncated or overwritten); the message names the file."""


@contextlib.contextmanager
def _open_shard(fname: str):
    """``safe_open(fname)``, raising :class:`CorruptCheckpointError` naming ``fname`` when its header or
    data cannot be read (a truncated download or an interrupted copy)."""
    try:
        with safe_open(fname, "pt") as f:
            yield f
    except SafetensorError as e:
        raise CorruptCheckpointError(
            f"{fname} is not a valid safetensors file (truncated or corrupt?): {e}"
        ) from e


def _module_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict(keep_vars=True))


def official_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Model tensors under their official names (stacked experts split per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in _module_tensors(model).items():
        t = t.detach()
        if is_stacked(name):
            for j in range(t.shape[0]):
                out[expert_name(name, j)] = t[j]
        else:
            out[name] = t
    return out


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = size.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def save_pretrained(
    model: nn.Module, path: str | os.PathLike, max_shard_size: int | str | None = None, tokenizer="auto"
) -> None:
    """Write ``model`` (with its ``config``) as an HF folder at ``path``, atomically.

    ``tokenizer``: ``"auto"`` (default) copies the tokenizer of the folder the model was loaded from
    (``model.name_or_path``, set by :func:`from_pretrained`) when it has one, so the saved folder works with
    ``openk3 generate/eval/serve``; an :class:`openk3.data.Tokenizer` or a tokenizer path (folder,
    ``tokenizer.json`` or ``.tiktoken``) is written instead; ``None`` writes none.

    ``max_shard_size``: bytes per ``model-0000i-of-0000n.safetensors`` shard, an int or a string such as
    ``"5GB"`` / ``"500MiB"``. ``None`` (default) keeps the shard files of the folder the model was loaded from
    (``model.weight_map``, set by :func:`from_pretrained`) when they name exactly the tensors saved, so a
    load–save round trip writes the same file set (a single ``model.safetensors`` stays one file without an
    index); otherwise shards of at most :data:`DEFAULT_SHARD_SIZE`. Each tensor is written in the model's
    dtype for it: a checkpoint in the release's dtypes loaded in bf16 (its F32 tensors stay fp32,
    :data:`~openk3.model.modeling.FP32_TENSORS`; MXFP4 experts stay bytes) saves back bit-identically.

    An existing model folder at ``path`` is replaced atomically (the new folder is renamed into place). Every
    file, subfolder and symlink of the old folder that the new save does not write is copied into the new
    folder first (a README.md, notes/, …), except the old save's model files — shards ``*.safetensors``,
    ``model.safetensors.index.json``, ``config.json`` (:data:`MODEL_FILES`) — and,
    when the new save writes a tokenizer, the old tokenizer files (:data:`TOKENIZER_FILES`); a tokenizer
    the new save does not replace is kept. Raises ``FileExistsError`` when ``path`` is a file, a training run
    folder, a non-empty folder without a ``config.json``, or a training checkpoint (a folder holding
    ``trainer_state.pt``, whose trainer state and tokenizer the replacement would lose); nothing else is ever
    deleted."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path} is a file, not a model folder; choose another path")
    if os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)):
        raise FileExistsError(
            f"{path} is a training checkpoint (it holds {TRAINER_STATE_FILE}, which `openk3 train --resume` "
            "needs, and the run's tokenizer); refusing to replace it: save the model to another folder"
        )
    if os.path.isdir(os.path.join(path, "checkpoints")) or os.path.isfile(
        os.path.join(path, "metrics.jsonl")
    ):
        raise FileExistsError(
            f"{path} is a training run folder; refusing to replace it: save the model to another folder"
        )
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileExistsError(
            f"{path} is a non-empty folder that holds no checkpoint (no config.json); "
            "refusing to replace it, choose another path"
        )
    tok = _tokenizer_to_save(model, tokenizer)
    tensors = official_state(model)
    shards = _shard_files(getattr(model, "weight_map", None), tensors, max_shard_size)
    with folder_written_whole(path) as tmp_path:
        tmp = str(tmp_path)
        save_config(model.config, tmp)
        write_remote_code(tmp)  # config.json auto_map + the code transformers loads with trust_remote_code
        weight_map, total = {}, 0
        for fname, names in shards.items():
            shard = {name: tensors[name].contiguous().cpu() for name in names}
            save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
            for name, t in shard.items():
                weight_map[name] = fname
                total += t.numel() * t.element_size()
        if list(shards) != [SINGLE_FILE]:
            with open(os.path.join(tmp, INDEX_FILE), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        if tok is not None:
            tok.save(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for name in os.listdir(tmp):  # safetensors writes owner-only files; follow the umask like the rest
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        if os.path.exists(path):
            _keep_user_files(path, tmp, tokenizer_written=tok is not None)


def _shard_files(
    layout: dict[str, str] | None, tensors: dict[str, torch.Tensor], max_shard_size: int | str | None
) -> dict[str, list[str]]:
    """Shard file name → the official tensor names it holds (see :func:`save_pretrained`'s ``max_shard_size``):
    the loaded ``layout`` when ``max_shard_size`` is ``None`` and it names exactly ``tensors`` with plain
    ``*.safetensors`` file names, else ``model-0000i-of-0000n.safetensors`` shards filled in name order."""
    if (
        max_shard_size is None
        and layout is not None
        and set(layout) == set(tensors)
        and all(os.path.basename(f) == f and f.endswith(".safetensors") for f in layout.values())
    ):
        files: dict[str, list[str]] = defaultdict(list)
        for name in sorted(tensors):
            files[layout[name]].append(name)
        return dict(sorted(files.items()))
    limit = _parse_size(DEFAULT_SHARD_SIZE if max_shard_size is None else max_shard_size)
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    n = len(groups)
    return {f"model-{i:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups, start=1)}


def _keep_user_files(old: str, new: str, tokenizer_written: bool) -> None:
    """Copy into folder ``new`` every entry of folder ``old`` that ``new`` lacks and that is not a model file
    of the old save (:data:`MODEL_FILES`; :data:`TOKENIZER_FILES` too when ``tokenizer_written``): regular
    files with their metadata (``shutil.copy2``), folders recursively, symlinks as symlinks; other entries
    (sockets, FIFOs) are left out."""
    written = set(os.listdir(new))
    stale = MODEL_FILES + (TOKENIZER_FILES if tokenizer_written else ())
    with os.scandir(old) as entries:
        for entry in entries:
            if entry.name in written or any(fnmatch.fnmatchcase(entry.name, p) for p in stale):
                continue
            target = os.path.join(new, entry.name)
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), target)
            elif entry.is_dir():
                shutil.copytree(entry.path, target, symlinks=True)
            elif entry.is_file():
                shutil.copy2(entry.path, target)


def _tokenizer_to_save(model: nn.Module, tokenizer):
    """The :class:`openk3.data.Tokenizer` :func:`save_pretrained` writes, or None (see its docstring)."""
    from openk3.data.tokenizer import Tokenizer

    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, str) and tokenizer == "auto":
        source = getattr(model, "name_or_path", None)
        if source is None or not _has_tokenizer(Path(source)):
            return None
        tokenizer = source
    return Tokenizer.load(tokenizer)


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or any(folder.glob("*.tiktoken"))


def checkpoint_with_tokenizer(path: str | os.PathLike) -> Path:
    """A model folder, or a run folder's latest checkpoint (:func:`latest_checkpoint`), that also holds a
    tokenizer (``tokenizer.json`` or a ``.tiktoken`` file), as ``openk3 generate/eval/serve`` need.

    Raises:
        FileNotFoundError: no checkpoint at ``path``, or one without a tokenizer.
    """
    folder = latest_checkpoint(path)
    if not _has_tokenizer(folder):
        raise FileNotFoundError(
            f"{folder} has no tokenizer.json or .tiktoken file (checkpoints written by `openk3 train` have "
            "one; `openk3.save_pretrained(model, path, tokenizer=...)` writes one)"
        )
    return folder


def latest_checkpoint(path: str | os.PathLike) -> Path:
    """Resolve a model folder, a training run folder or its ``checkpoints`` folder to a model folder.

    A folder with ``config.json`` is returned as is; otherwise ``<path>/checkpoints/latest`` (or
    ``<path>/latest``) names the checkpoint folder, else a distributed run's exported ``<path>/final``.
    Raises ``FileNotFoundError`` when there is none (saying so when the folder is or holds DCP checkpoints,
    which :mod:`openk3.checkpoint.dcp_step` reads, not this resolver: they are no model folder).
    """
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        marker = root / LATEST
        if marker.is_file():
            ckpt = root / marker.read_text().strip()
            if (ckpt / "config.json").is_file():
                return ckpt
            raise FileNotFoundError(f"{marker} names {ckpt}, which holds no config.json")
    if (
        path / "final" / "config.json"
    ).is_file():  # a distributed run: its DCP checkpoints resume under torchrun
        return path / "final"
    hint = ""
    if any(path.glob("*.distcp")):  # a DCP step folder (openk3.checkpoint.dcp_step reads it in one process)
        hint = (
            "; this is a distributed checkpoint (DCP): `openk3 eval` and `openk3 generate` read it as it is; "
            "elsewhere use RUN/final, the model folder a distributed run writes when it ends, or "
            "openk3.checkpoint.dcp_step.export_dcp_step(STEP, OUT) to write one"
        )
    elif any(path.glob("checkpoints/step-*/*.distcp")) or any(path.glob("step-*/*.distcp")):
        hint = (
            "; it holds distributed (DCP) checkpoints: resume the run under torchrun, or use RUN/final, the "
            "model folder a distributed run writes when it ends (`openk3 eval` and `openk3 generate` read "
            "RUN/checkpoints/step-N as it is)"
        )
    raise FileNotFoundError(
        f"no checkpoint at {path} (expected a model folder with config.json, or a run folder with "
        f"checkpoints/latest){hint}"
    )


def _checkpoint_files(path: str) -> dict[str, str]:
    """Official tensor name → shard file path."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (ValueError, AttributeError) as e:  # not JSON, or JSON that is not an object
            raise CorruptCheckpointError(f"{index} is not a valid index (truncated or corrupt?): {e}") from e
        if not isinstance(weight_map, dict):
            raise CheckpointMismatchError(f"{index} has no weight_map")
        files = {name: os.path.join(path, fname) for name, fname in weight_map.items()}
        for fname in set(files.values()):
            if not os.path.isfile(fname):
                raise CheckpointMismatchError(f"shard {fname} named in {INDEX_FILE} is missing")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with _open_shard(single) as f:
            return {name: single for name in f.keys()}
    raise FileNotFoundError(f"no {INDEX_FILE} or {SINGLE_FILE} in {path}")


def _expected_shape(model: nn.Module, shape: list[int], slot, target: torch.Tensor):
    """(shape the checkpoint tensor should have, shape it has), after layout adaptation."""
    if slot.index is not None:
        return list(target.shape[1:]), shape
    if slot.name.endswith("self_attn.A_log"):  # [H], [1, 1, H, 1] or padded [max(H, 128)]
        heads = model.get_submodule(slot.name.rsplit(".", 1)[0]).num_heads
        numel = math.prod(shape)
        ok = numel in (heads, target.numel()) and sum(s != 1 for s in shape) <= 1
        return list(target.shape), (list(target.shape) if ok else shape)
    return list(target.shape), shape


def _check_packed(name: str, fname: str, src: torch.Tensor) -> None:
    """Raise :class:`CorruptCheckpointError` naming ``name`` for an MXFP4 tensor that is not uint8 or a scale
    holding the E8M0 NaN byte (:func:`openk3.quant.mxfp4.check_mxfp4`)."""
    is_scale = name.endswith(".weight_scale")
    try:
        check_mxfp4(name, packed=None if is_scale else src, scale=src if is_scale else None)
    except ValueError as e:
        raise CorruptCheckpointError(f"{e} (in {fname}): not loaded") from None


def load_state(model: nn.Module, path: str | os.PathLike) -> None:
    """Copy the checkpoint in folder ``path`` into ``model`` (strict; raises CheckpointMismatchError, or
    CorruptCheckpointError for a shard that cannot be parsed or a tensor holding NaN or inf, named in the
    message: a run that diverged before its save, or a damaged file that still parses; the finiteness check
    runs on the model's device, after each copy)."""
    path = os.fspath(path)
    files = _checkpoint_files(path)
    targets = _module_tensors(model)
    shapes: dict[str, list[int]] = {}
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, fname in files.items():
        by_file[fname].append(name)
    for fname, names in by_file.items():
        with _open_shard(fname) as f:
            for name in names:
                shapes[name] = list(f.get_slice(name).get_shape())
    quantized = sorted(n for n in shapes if n.endswith(QUANTIZED_SUFFIXES))
    if quantized and not any(n.endswith(QUANTIZED_MODULE_SUFFIXES) for n in targets):
        raise CheckpointMismatchError(
            f"checkpoint at {path} holds {len(quantized)} MXFP4-packed tensors (e.g. {quantized[0]}) but the "
            "model's experts are dense: openk3.from_pretrained keeps them packed when config.json has a "
            "compressed-tensors quantization_config (format mxfp4-pack-quantized)"
        )
    skip = () if any(n.startswith(VISION_PREFIXES) for n in targets) else VISION_PREFIXES
    skipped = [n for n in shapes if n.startswith(skip)] if skip else []
    if skipped:
        warnings.warn(
            f"skipping {len(skipped)} vision tensors (the model is built without vision_tower/mm_projector)",
            stacklevel=2,
        )
    unexpected, mismatched, plan = [], [], []
    covered: dict[str, set[int] | bool] = {}
    for name, shape in shapes.items():
        if skip and name.startswith(skip):
            continue
        slot = to_module(name)
        target = targets.get(slot.name)
        if target is None or (slot.index is not None and slot.index >= target.shape[0]):
            unexpected.append(name)
            continue
        want, have = _expected_shape(model, shape, slot, target)
        if want != have:
            mismatched.append(f"{name}: checkpoint {have}, model {want}")
        else:
            plan.append((name, slot))
        if slot.index is None:  # present (even if mis-shaped): not reported again as missing
            covered[slot.name] = True
        else:
            covered.setdefault(slot.name, set()).add(slot.index)
    missing = []
    for mname, t in targets.items():
        got = covered.get(mname)
        if got is True:
            continue
        if is_stacked(mname):
            absent = sorted(set(range(t.shape[0])) - (got or set()))
            missing += [expert_name(mname, j) for j in absent]
        else:
            missing.append(mname)
    if missing or unexpected or mismatched:
        lines = [f"checkpoint at {path} does not match the model:"]
        for title, items in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("shape mismatches", mismatched),
        ):
            if items:
                lines.append(
                    f"  {title} ({len(items)}): "
                    + ", ".join(sorted(items)[:20])
                    + (" …" if len(items) > 20 else "")
                )
        if any(n.startswith(VISION_PREFIXES) for n in missing):
            lines.append(
                "  the checkpoint has no vision tower: from_pretrained(path, vision=False) loads the text model"
            )
        raise CheckpointMismatchError("\n".join(lines))
    with torch.no_grad():
        for fname, names in by_file.items():
            wanted = {n for n in names}
            with _open_shard(fname) as f:
                for name, slot in plan:
                    if name not in wanted:
                        continue
                    src = f.get_tensor(name)
                    dst = targets[slot.name]
                    if slot.index is not None:
                        dst = dst[slot.index]
                        if dst.dtype == torch.uint8:  # MXFP4 expert bytes: uint8, no NaN scale
                            _check_packed(name, fname, src)
                        dst.copy_(src)
                    elif name.endswith("self_attn.A_log"):
                        flat = src.reshape(-1)
                        dst.zero_()
                        dst[: flat.numel()].copy_(flat)
                    else:
                        dst.copy_(src)
                    if dst.is_floating_point() and not bool(torch.isfinite(dst).all()):
                        raise CorruptCheckpointError(
                            f"{name} in {fname} holds NaN or inf values (a run that diverged before this save, "
                            "or a damaged file): not loaded; use an earlier checkpoint"
                        )


def from_pretrained(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    vision: bool = True,
) -> nn.Module:
    """Load the model in HF folder ``path``: ``openk3.from_pretrained(path)(input_ids).logits`` is ``[B, T, V]``.

    Args:
        path: folder with ``config.json`` and safetensors weights, or a training run folder (its latest
            checkpoint is loaded, :func:`latest_checkpoint`).
        device: where the weights go (``"meta"`` reads only the config).
        dtype: model dtype; default fp32 (fp32, bf16, fp16 and fp64 are supported; others raise ValueError).
            A ``quantization_config`` of compressed-tensors MXFP4 experts (``docs/quantization.md``) keeps the
            routed experts packed (uint8) whatever ``dtype``; they are dequantised to it in each forward.
        vision: ``False`` builds a K3 model without its vision tower and projector (text only; their
            tensors in the checkpoint are skipped). A checkpoint without them needs ``vision=False`` when its
            config has a ``vision_config``.
    Returns the model in eval mode with ``name_or_path`` (the folder) and ``weight_map`` (official tensor name
    → shard file name in that folder, which :func:`save_pretrained` keeps).
    Raises:
        FileNotFoundError: no config or weights. ValueError: invalid config or dtype.
        CheckpointMismatchError: missing/unexpected keys or shape mismatches (all listed).
        CorruptCheckpointError: a shard or the index that cannot be parsed, or an MXFP4 scale tensor holding
            the E8M0 NaN byte (named in the message).
    """
    path = latest_checkpoint(path)
    config: AnyConfig = load_config(path)
    if not vision and isinstance(config, KimiK3Config):
        config.vision_config = None
    dtype = check_dtype(dtype or torch.float32)
    scheme = expert_scheme(config)  # compressed-tensors MXFP4 experts stay packed
    if scheme is None:
        model = build_model(config, device=device, dtype=dtype, init=False)
    else:
        model = use_packed_experts(build_model(config, device="meta", dtype=dtype), scheme)
        model = model if str(device) == "meta" else model.to_empty(device=device)
    if str(device) != "meta":
        load_state(model, path)
    model.eval()
    model.name_or_path = str(path)  # the folder it came from (Hugging Face's attribute name)
    if str(device) != "meta":  # official name → shard file, which save_pretrained keeps
        model.weight_map = {name: os.path.relpath(f, path) for name, f in _checkpoint_files(path).items()}
    return model


def run_folder(ckpt: Path) -> Path | None:
    """The training run folder that holds model folder ``ckpt``: ``RUN`` for ``RUN/checkpoints/step-*`` (an
    ``openk3 train`` checkpoint) and for ``RUN/final`` beside ``RUN/data`` or ``RUN/checkpoints`` (the export of
    a distributed run); ``None`` for a model folder outside a run. Its splits are ``RUN/data/{train,val}.bin``."""
    if ckpt.parent.name == "checkpoints":
        return ckpt.parent.parent
    if ckpt.name == "final" and any((ckpt.parent / name).is_dir() for name in ("data", "checkpoints")):
        return ckpt.parent
    return None
