"""``openk3 synthetic``: train and score one cell of the synthetic grid.

    openk3 synthetic --task mqar --mixer kda --seq-len 1024
    openk3 synthetic --task palindrome --mixer hybrid --seq-len 256 --extrapolate 4,8 --device cuda

It prints the accuracy curve as it is measured and a summary line; ``--json PATH`` writes the whole result
(:func:`openk3.synthetic.cell.run_cell`), checked before training and written whole. Training that diverges
(a non-finite loss) stops at once with one line.
"""

from __future__ import annotations

import argparse
import re

_FLAGS = {"num_layers": "--layers", "num_heads": "--heads"}
"""Config fields whose flag is not ``--`` + the field name with dashes."""


def _flag_error(error: ValueError) -> ValueError:
    """``error`` of :class:`~openk3.synthetic.cell.CellConfig` or :class:`~openk3.synthetic.mixers.MixerSize`
    with each ``CellConfig.field=`` (and a bare ``seq_len=``) written as the command-line flag."""

    def flag(field: str) -> str:
        return _FLAGS.get(field, "--" + field.replace("_", "-"))

    text = re.sub(r"(?:CellConfig|MixerSize)\.(\w+)=", lambda m: flag(m[1]) + " ", str(error))
    text = re.sub(r"\bseq_len=", "--seq-len ", text).replace("expected None or a", "expected a")
    return ValueError(text)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return values


def add_parser(sub) -> None:
    """Register the ``synthetic`` subcommand on the top-level subparsers ``sub``."""
    from openk3 import cli_types
    from openk3.synthetic.mixers import MIXERS
    from openk3.synthetic.tasks import TASKS

    p = sub.add_parser("synthetic", help="train and score one synthetic-task cell (palindrome, MQAR, stack)")
    p.add_argument("--task", choices=TASKS, required=True, help="the synthetic task")
    p.add_argument("--mixer", choices=MIXERS, required=True, help="the sequence mixer of every layer")
    p.add_argument(
        "--seq-len", dest="seq_len", type=cli_types.positive_int, default=256, help="tokens per sequence"
    )
    p.add_argument(
        "--items",
        type=cli_types.positive_int,
        help="items per sequence (default seq-len // 32, at least 2); MQAR holds at most 64",
    )
    p.add_argument(
        "--noise",
        type=cli_types.positive_int,
        default=120,
        help="noise symbols filling the gaps (1: one filler token)",
    )
    p.add_argument("--steps", type=cli_types.positive_int, default=600, help="training steps")
    p.add_argument(
        "--batch-size", dest="batch_size", type=cli_types.positive_int, default=32, help="sequences per step"
    )
    p.add_argument("--lr", type=cli_types.positive_float, default=2e-3, help="AdamW learning rate")
    p.add_argument(
        "--eval-every",
        dest="eval_every",
        type=cli_types.positive_int,
        default=50,
        help="steps between evaluations",
    )
    p.add_argument(
        "--eval-size", dest="eval_size", type=cli_types.positive_int, default=128, help="held-out sequences"
    )
    p.add_argument(
        "--stop-at",
        dest="stop_at",
        type=cli_types.positive_float,
        help="stop once held-out exact-match accuracy reaches this (e.g. 0.99); default: run every step",
    )
    p.add_argument(
        "--curriculum",
        type=_ints,
        default=[],
        help="longer lengths trained after seq-len with the same model, a stage each, e.g. 512,1024",
    )
    p.add_argument(
        "--curriculum-items",
        dest="curriculum_items",
        type=_ints,
        default=[],
        help="items per sequence at each --curriculum length, e.g. 16,32 (default: --items throughout)",
    )
    p.add_argument(
        "--curriculum-steps",
        dest="curriculum_steps",
        type=cli_types.positive_int,
        help="most steps of each curriculum stage (default: --steps)",
    )
    p.add_argument(
        "--curriculum-lr",
        dest="curriculum_lr",
        type=cli_types.positive_float,
        default=0.3,
        help="peak learning rate of each curriculum stage as a fraction of --lr",
    )
    p.add_argument(
        "--extrapolate",
        type=_ints,
        default=[],
        help="score at the end at these multiples of the last training length (the last --curriculum "
        "length, else --seq-len), same item count, e.g. 4,8",
    )
    p.add_argument(
        "--hidden-size", dest="hidden_size", type=cli_types.positive_int, default=128, help="model width"
    )
    p.add_argument("--layers", type=cli_types.positive_int, default=4, help="decoder layers")
    p.add_argument("--heads", type=cli_types.positive_int, default=2, help="heads per mixer")
    p.add_argument("--head-dim", dest="head_dim", type=cli_types.positive_int, default=64, help="head size")
    p.add_argument("--seed", type=cli_types.seed, default=0, help="seed of data and init, in [0, 2^63)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the cell trains")
    p.add_argument("--json", help="write the full result to this file (checked before training)")
    p.set_defaults(func=cmd_synthetic)


def cmd_synthetic(args: argparse.Namespace) -> int:
    from openk3.synthetic.cell import CellConfig, run_cell
    from openk3.synthetic.mixers import MixerSize
    from openk3.synthetic.results import check_output, write_json

    try:
        size = MixerSize(args.hidden_size, args.layers, args.heads, args.head_dim)
        config = CellConfig(
            task=args.task, mixer=args.mixer, seq_len=args.seq_len, items=args.items, noise=args.noise,
            seed=args.seed, steps=args.steps, batch_size=args.batch_size, lr=args.lr, eval_every=args.eval_every,
            eval_size=args.eval_size, stop_at=args.stop_at, curriculum=args.curriculum,
            curriculum_items=args.curriculum_items, curriculum_steps=args.curriculum_steps, curriculum_lr=args.curriculum_lr,
            extrapolate=args.extrapolate, size=size, device=args.device,
        )  # fmt: skip
    except ValueError as e:
        raise _flag_error(e) from None
    if args.json:
        check_output(args.json, "--json")

    def log(point: dict) -> None:
        print(
            f"L {point['seq_len']:>5}  step {point['step']:>6}  accuracy {point['accuracy']:.3f}  token accuracy "
            f"{point['token_accuracy']:.3f}  answer loss {point['loss']:.4f}",
            flush=True,
        )

    result = run_cell(config, log)
    full = result["steps_to_full"]
    print(
        f"{args.task} / {args.mixer} / {args.seq_len} tokens / {config.items} items / seed {args.seed}: "
        f"accuracy {result['final']['accuracy']:.3f}, "
        f"{'full accuracy at step ' + str(full) if full is not None else 'full accuracy not reached'}, "
        f"{result['params']:,} parameters, {result['seconds']:.1f} s"
    )
    for stage in result["stages"][1:]:
        full = stage["steps_to_full"]
        print(
            f"  then at {stage['seq_len']} tokens ({stage['items']} items): accuracy {stage['final']['accuracy']:.3f}, "
            f"{'full accuracy at stage step ' + str(full) if full is not None else 'full accuracy not reached'}"
        )
    scored_items = result["stages"][-1]["items"]  # the extrapolation keeps the last stage's item count
    for length, scores in result["extrapolation"].items():
        print(f"  at {length} tokens ({scored_items} items): accuracy {scores['accuracy']:.3f}")
    if args.json:
        write_json(args.json, result)
    return 0
