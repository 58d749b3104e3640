"""``openk3 posttrain``: the post-training recipes (only ``demo`` so far)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_posttrain_parser(sub) -> None:
    p = sub.add_parser("posttrain", help="post-training recipe: SFT → RL experts per domain × effort → MOPD")
    p.add_argument("--recipe", choices=["demo"], required=True, help="which recipe to run")
    p.add_argument("--quick", action="store_true", help="a few minutes: every stage, few steps")
    p.add_argument(
        "--out", type=Path, default=Path("runs/posttrain-demo"), help="plots, table and logs go here"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of every stage (data, init, sampling)")
    p.add_argument(
        "--stages",
        type=Path,
        default=None,
        help="also save the warm-started student and the experts here (benchmarks/mopd_ablation.py --stages)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from openk3.rl.recipe import Demo, DemoConfig, quick_config

    torch.manual_seed(args.seed)
    config = quick_config() if args.quick else DemoConfig()
    config.seed = args.seed
    Demo(config, args.out).run(args.stages)
    return 0
