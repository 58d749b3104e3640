"""Same-budget training ablations on the default corpus (Shakespeare), reported in the README.

Variants (identical data, tokenizer, steps, batch, context schedule, lr schedule and seed):

* ``qb``    — the default run: ``k3-tiny`` with Quantile Balancing;
* ``sign``  — ``k3-tiny`` with the DeepSeek sign rule (γ = 1e-3) instead of QB;
* ``dense`` — ``k3-tiny-dense``: a dense SwiGLU transformer (all MLA, plain residuals) with the same
  active parameters as ``k3-tiny``.

Run each variant (they are independent and can run in parallel), then assemble the table::

    python benchmarks/ablations.py run qb      # writes runs/ablation-qb/
    python benchmarks/ablations.py run sign
    python benchmarks/ablations.py run dense
    python benchmarks/ablations.py report --md benchmarks/results/ablations.md

Final maxvio is the mean over the last 10 steps (the per-step value is noisy at 2,048 tokens per step).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from openk3.data import TokenDataset
from openk3.train.metrics import read_metrics
from openk3.train.trainer import TrainConfig, train, unigram_entropy

VARIANTS = {
    "qb": dict(preset="k3-tiny", balance="quantile"),
    "sign": dict(preset="k3-tiny", balance="sign"),
    "dense": dict(preset="k3-tiny-dense", balance="none"),
}


def run(variant: str, root: Path, steps: int | None) -> None:
    out = root / f"ablation-{variant}"
    config = TrainConfig(
        out=str(out), sample_prompt=None, **VARIANTS[variant], **({"steps": steps} if steps else {})
    )
    start = time.perf_counter()
    summary = train(config)
    summary["wall_s"] = time.perf_counter() - start
    summary["threads"] = torch.get_num_threads()
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


def report(root: Path, md: str | None) -> None:
    rows = []
    for variant in VARIANTS:
        out = root / f"ablation-{variant}"
        if not (out / "summary.json").is_file():
            continue
        summary = json.loads((out / "summary.json").read_text())
        metrics = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        vio = [r["maxvio"] for r in metrics[-10:] if r.get("maxvio") is not None]
        config = json.loads((out / "train_config.json").read_text())
        rows.append((variant, config, summary, float(np.mean(vio)) if vio else None))
    val = TokenDataset(root / "ablation-qb" / "data" / "val.bin")
    lines = [
        f"Shakespeare val set: {val.num_tokens:,} tokens, unigram entropy {unigram_entropy(val.tokens_N):.3f} "
        f"nats/token. CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}.",
        "",
        "| variant | model | balancing | steps | val loss (nats) | val ppl | final maxvio (last 10 steps) | wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, config, summary, vio in rows:
        lines.append(
            f"| {variant} | {config['preset']} | {config['balance']} | {summary['step']} | "
            f"{summary['val_loss']:.3f} | {summary['val_ppl']:.1f} | {'—' if vio is None else f'{vio:.3f}'} | "
            f"{summary['wall_s'] / 60:.1f} min |"
        )
    text = "\n".join(lines)
    print(text)
    if md:
        Path(md).write_text(
            "Commands: `python benchmarks/ablations.py run {qb,sign,dense}` then "
            "`python benchmarks/ablations.py report`\n\n" + text + "\n"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("variant", choices=sorted(VARIANTS))
    r.add_argument("--steps", type=int)
    rep = sub.add_parser("report")
    rep.add_argument("--md")
    parser.add_argument("--root", default="runs")
    args = parser.parse_args()
    if args.cmd == "run":
        run(args.variant, Path(args.root), args.steps)
    else:
        report(Path(args.root), args.md)


if __name__ == "__main__":
    main()
