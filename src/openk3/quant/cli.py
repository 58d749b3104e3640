"""``openk3 quantize``: pack a checkpoint's routed experts to MXFP4 (hooked into ``openk3.cli``)."""

from __future__ import annotations

import argparse


def cmd_quantize(args: argparse.Namespace) -> int:
    """Load ``--ckpt`` (a model folder or a run's latest checkpoint), pack its experts under the scheme of
    ``--activations`` and write the compressed-tensors layout to ``--out`` with the checkpoint's tokenizer."""
    from openk3.accounting import checkpoint_bytes
    from openk3.checkpoint import from_pretrained, save_pretrained
    from openk3.quant.experts import pack_experts
    from openk3.quant.scheme import ExpertScheme, expert_scheme

    model = from_pretrained(args.ckpt)
    if expert_scheme(model.config) is not None:
        raise ValueError(f"{model.name_or_path} already holds MXFP4 experts: nothing to pack")
    sizes = checkpoint_bytes(model.config)
    pack_experts(model, ExpertScheme(activations=None if args.activations == "bf16" else args.activations))
    save_pretrained(model, args.out)
    print(
        f"wrote {args.out}: routed experts in MXFP4 (expert inputs {args.activations}); checkpoint "
        f"{sizes['mxfp4'] / 1e6:,.1f} MB in the official dtypes, {sizes['bf16'] / 1e6:,.1f} MB in bf16"
    )
    return 0


def add_quantize_parser(sub) -> None:
    """Register ``openk3 quantize`` on the subparsers ``sub``."""
    q = sub.add_parser(
        "quantize",
        help="pack a checkpoint's routed experts to MXFP4 (compressed-tensors mxfp4-pack-quantized)",
    )
    q.add_argument("--ckpt", required=True, help="checkpoint folder or run folder (its latest checkpoint)")
    q.add_argument("--out", required=True, help="folder to write the packed checkpoint to")
    q.add_argument(
        "--activations",
        choices=["mxfp8", "bf16"],
        default="mxfp8",
        help="expert GEMM inputs at run time: mxfp8 (as --qat mxfp4 trains) or bf16 (as the release)",
    )
    q.set_defaults(func=cmd_quantize)
