"""MOPD ablations: the clip, and the teacher routing.

From one SFT base, one set of RL experts and one warm-started student (the demo recipe's stages,
:mod:`openk3.rl.recipe`), the student is distilled three ways for the same steps, the same prompts and the
same sampling seeds:

* ``clip`` — MOPD as the recipe runs it: ``clip(sg(log π_T − log π_S), −R_max, R_max)``, ``R_max`` from the
  config (2);
* ``no-clip`` — the same log-ratio unclipped (``R_max = ∞``);
* ``wrong`` — clipped, but every rollout is scored by the teacher of the *other* domain at the next effort
  (``(add, high)`` → ``(mul, medium)``, …, :func:`wrong_route`): each teacher is used, at the wrong key.

Reported: greedy accuracy and mean response length (tokens) on the table's held-out problems per domain and
effort for each teacher, the warm-started student before MOPD (``warm``: sequence-level distillation only)
and each student, the mean over the six rows, and the wall time. Run::

    python benchmarks/mopd_ablation.py --md benchmarks/results/mopd_ablation.md

(``--stages FILE`` keeps the warm-started student and the experts in ``FILE`` and reuses them on the next run,
``openk3 posttrain --recipe demo --stages FILE`` writes the same file, so
variants of the MOPD stage cost a minute; ``--quick`` for the recipe's quick sizes: every stage in seconds to minutes, too short to learn.)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from openk3.rl.recipe import Demo, DemoConfig, check_stages_path, load_stages, quick_config, stages_config
from openk3.rl.tasks import DOMAINS, EFFORTS


def wrong_route(domain: str, effort: str) -> tuple[str, str]:
    """The teacher of the other domain at the next effort (cyclically): never the rollout's own key."""
    other = DOMAINS[(DOMAINS.index(domain) + 1) % len(DOMAINS)]
    return other, EFFORTS[(EFFORTS.index(effort) + 1) % len(EFFORTS)]


VARIANTS = {
    "clip": {},
    "no-clip": {"r_max": math.inf},
    "wrong": {"route": wrong_route},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the recipe's quick sizes")
    ap.add_argument("--mopd-steps", type=int, default=None, help="override the config's MOPD steps")
    ap.add_argument("--mopd-lr", type=float, default=None, help="override the config's MOPD learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/mopd-ablation"), help="plots and logs")
    ap.add_argument("--md", type=Path, default=None, help="write the results table here")
    ap.add_argument(
        "--stages",
        type=Path,
        default=None,
        help="torch file of the warm-started student, the experts and their config: loaded if it exists (refused if "
        "made with another config or seed), else written",
    )
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    try:
        cfg = replace(quick_config() if args.quick else DemoConfig(), seed=args.seed)
        if args.mopd_steps is not None:
            cfg = replace(cfg, mopd_steps=args.mopd_steps)  # __post_init__ checks it
        if args.mopd_lr is not None:
            cfg = replace(cfg, mopd_lr=args.mopd_lr)
        if args.md is not None and not args.md.parent.is_dir():
            raise ValueError(f"--md {args.md}: the folder {args.md.parent} does not exist")
        demo = Demo(cfg, args.out)
        loaded = args.stages is not None and args.stages.exists()
        if loaded:
            warm, experts = load_stages(args.stages, cfg)
        elif args.stages is not None:
            check_stages_path(args.stages)
    except (ValueError, FileNotFoundError) as e:
        ap.exit(2, f"mopd_ablation.py: error: {e}\n")
    t0 = time.monotonic()
    if not loaded:
        base = demo.stage_sft()
        experts = demo.stage_experts(base)
        warm = demo.stage_distill(base, experts)
        if args.stages is not None:
            torch.save({"warm": warm, "experts": experts, "config": stages_config(cfg)}, args.stages)
    t_stages = time.monotonic() - t0
    students, t_mopd = {}, {}
    for name, kw in VARIANTS.items():
        t1 = time.monotonic()
        students[name] = demo.stage_mopd(warm, experts, name=f"mopd-{name}", **kw)
        t_mopd[name] = time.monotonic() - t1
    rows = []
    for d in DOMAINS:
        for e in EFFORTS:
            row = {"domain": d, "effort": e, "teacher": demo.evaluate(experts[(d, e)], d, e, table=True)}
            row["warm"] = demo.evaluate(warm, d, e, table=True)
            row.update({n: demo.evaluate(m, d, e, table=True) for n, m in students.items()})
            rows.append(row)
    wall = time.monotonic() - t0
    demo.plot()
    names = ["teacher", "warm", *VARIANTS]
    head = "| domain | effort | " + " | ".join(f"{n} acc | {n} len" for n in names) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(names))]
    for r in rows:
        cells = " | ".join(f"{r[n]['accuracy']:.2f} | {r[n]['length']:.1f}" for n in names)
        lines.append(f"| {r['domain']} | {r['effort']} | {cells} |")
    mean = {n: {k: sum(r[n][k] for r in rows) / len(rows) for k in ("accuracy", "length")} for n in names}
    lines.append("| mean | | " + " | ".join(f"{mean[n]['accuracy']:.2f} | {mean[n]['length']:.1f}" for n in names) + " |")  # fmt: skip
    final = {n: [r["reward"] for r in demo.history[f"mopd-{n}"]][-3:] for n in VARIANTS}
    config = asdict(cfg)
    config["efforts"] = dict(cfg.efforts.taus)
    text = "\n".join(
        [
            "# MOPD ablations: clip, no clip, wrong teacher",
            "",
            f"Command: `python benchmarks/mopd_ablation.py {' '.join(sys.argv[1:])}`",
            "",
            f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s). Wall time {wall:.0f} s (SFT + experts + warm start {t_stages:.0f} s{', loaded from --stages' if loaded else ''}; "
            + ", ".join(f"MOPD {n} {t:.0f} s" for n, t in t_mopd.items())
            + ").",
            "",
            f"Config: `{json.dumps(config)}`",
            "",
            f"Greedy accuracy and mean response length (tokens) per domain and effort on the {cfg.table_problems} held-out problems per domain of the demo's table; `teacher` is the "
            "expert of that (domain, effort); `warm` is the warm-started student before MOPD; `wrong` routes every rollout to the teacher of the other domain at "
            "the next effort.",
            "",
            *lines,
            "",
            "MOPD per-token reward (mean over the response tokens) of the last three steps: "
            + "; ".join(f"{n} " + ", ".join(f"{v:.3f}" for v in vals) for n, vals in final.items())
            + ".",
            "",
        ]
    )
    print(text)
    (args.out / "mopd_ablation.json").write_text(json.dumps(rows, indent=1))
    if args.md:
        args.md.write_text(text)


if __name__ == "__main__":
    main()
