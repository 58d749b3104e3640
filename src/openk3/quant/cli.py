"""``openk3 quantize``: pack a checkpoint's routed experts to MXFP4 (hooked into ``openk3.cli``)."""

from __future__ import annotations

import argparse
import os
from collections import Counter
from pathlib import Path


def written_bytes(model, folder: str | os.PathLike) -> dict:
    """What :func:`openk3.save_pretrained` wrote for ``model`` into ``folder``: ``files`` (bytes of its
    ``*.safetensors`` files on disk, headers included), ``codes`` and ``scales`` (the MXFP4 experts'
    ``weight_packed`` / ``weight_scale`` bytes), ``other`` (every other tensor's bytes by dtype name) and
    ``headers`` (the rest: the files' JSON headers)."""
    from openk3.checkpoint.io import official_state

    codes = scales = 0
    other: Counter[str] = Counter()
    for name, t in official_state(model).items():
        nbytes = t.numel() * t.element_size()
        if name.endswith(".weight_packed"):
            codes += nbytes
        elif name.endswith(".weight_scale"):
            scales += nbytes
        else:
            other[str(t.dtype).removeprefix("torch.")] += nbytes
    files = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
    return {
        "files": files,
        "codes": codes,
        "scales": scales,
        "other": dict(other),
        "headers": files - codes - scales - sum(other.values()),
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def check_out_folder(ckpt: Path, out: str | os.PathLike) -> None:
    """Raise ``ValueError`` when ``out`` is the checkpoint folder ``ckpt`` being packed, or lies inside a training
    run's ``checkpoints`` folder (one holding ``latest``, or beside the run's ``train_config.json`` /
    ``metrics.jsonl``): packing would replace a run's dense experts in place, text and vision runs alike.
    Raise ``FileExistsError`` when ``out`` holds anything else (a run's ``final`` export, another checkpoint,
    files), and ``ValueError`` naming ``out`` when no folder can be made there (``/proc/q``, a path through a
    file): :func:`openk3.checkpoint.out_folder.check_new_folder`."""
    from openk3.checkpoint.out_folder import check_new_folder

    target = Path(os.path.realpath(out))
    if target == Path(os.path.realpath(ckpt)):
        raise ValueError(
            f"--out {out} is the --ckpt checkpoint itself; refusing to replace it: write the packed model to "
            "another folder"
        )
    for parent in target.parents:
        if parent.name == "checkpoints" and (
            (parent / "latest").is_file()
            or any((parent.parent / name).is_file() for name in ("train_config.json", "metrics.jsonl"))
        ):
            raise ValueError(
                f"--out {out} is inside the training run's checkpoints folder {parent}; refusing to write "
                "there: write the packed model to another folder"
            )
    check_new_folder(out)


def cmd_quantize(args: argparse.Namespace) -> int:
    """Load ``--ckpt`` (a model folder or a run's latest checkpoint), pack its experts under the scheme of
    ``--activations`` and write the compressed-tensors layout to ``--out`` with the checkpoint's tokenizer;
    print the bytes written and what they hold. Raises ``ValueError`` / ``FileExistsError`` (before loading)
    for an ``--out`` that :func:`check_out_folder` refuses, and ``ValueError`` for a model already packed or
    without routed experts. The folder appears whole or not at all (``save_pretrained`` writes a temporary
    sibling folder and renames it)."""
    from openk3.accounting import checkpoint_bytes
    from openk3.checkpoint import from_pretrained, save_pretrained
    from openk3.checkpoint.io import latest_checkpoint
    from openk3.model.moe import RoutedExperts
    from openk3.quant.experts import pack_experts
    from openk3.quant.scheme import ExpertScheme, expert_scheme

    ckpt = latest_checkpoint(args.ckpt)
    check_out_folder(ckpt, args.out)
    model = from_pretrained(ckpt)
    if expert_scheme(model.config) is not None:
        raise ValueError(f"{model.name_or_path} already holds MXFP4 experts: nothing to pack")
    if not any(isinstance(m, RoutedExperts) for m in model.modules()):
        raise ValueError(
            f"{model.name_or_path} has no routed experts (a dense model): nothing to pack in MXFP4"
        )
    release = checkpoint_bytes(model.config)["mxfp4"]
    pack_experts(model, ExpertScheme(activations=None if args.activations == "bf16" else args.activations))
    save_pretrained(model, args.out)
    w = written_bytes(model, args.out)
    other = ", ".join(f"{dtype} {_mb(n)}" for dtype, n in sorted(w["other"].items()))
    print(
        f"wrote {args.out}: {_mb(w['files'])} of safetensors = routed experts in MXFP4 (expert inputs "
        f"{args.activations}) {_mb(w['codes'] + w['scales'])} (E2M1 codes {_mb(w['codes'])}, E8M0 scales "
        f"{_mb(w['scales'])}) + other tensors {_mb(sum(w['other'].values()))} ({other}) + headers "
        f"{_mb(w['headers'])}"
    )
    tensor_bytes = w["codes"] + w["scales"] + sum(w["other"].values())
    if tensor_bytes != release:
        print(
            f"the other tensors keep the checkpoint's dtypes; in the release's (bf16, F32 where it stores F32) "
            f"the tensors would take {_mb(release)}: load with dtype=torch.bfloat16 and save_pretrained"
        )
    return 0


def add_quantize_parser(sub) -> None:
    """Register ``openk3 quantize`` on the subparsers ``sub``."""
    q = sub.add_parser(
        "quantize",
        help="pack a checkpoint's routed experts to MXFP4 (compressed-tensors mxfp4-pack-quantized)",
    )
    q.add_argument("--ckpt", required=True, help="checkpoint folder or run folder (its latest checkpoint)")
    q.add_argument(
        "--out", required=True, help="new folder to write the packed checkpoint to (refused if it exists)"
    )
    q.add_argument(
        "--activations",
        choices=["mxfp8", "bf16"],
        default="mxfp8",
        help="expert GEMM inputs at run time: mxfp8 (as --qat mxfp4 trains) or bf16 (as the release)",
    )
    q.set_defaults(func=cmd_quantize)
