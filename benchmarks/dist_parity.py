"""Loss parity of the distributed layouts: the same model, data and seed trained for ``--steps`` steps by the
real trainer (``openk3 train --nproc-per-node N``, :func:`openk3.dist.train.train_distributed`) under each
layout, per-step losses against one process.

Layouts (those the world allows; ``--layouts`` picks among them):

==============  =====  ========  ====================  ====  ====
name            ranks  dp_shard  ep                    cp    seed
==============  =====  ========  ====================  ====  ====
``dp1``         1      1         1                     1     0
``dp1_seed1``   1      1         1                     1     1
``fsdp``        W      W         1                     1     0
``fsdp_ep``     W      W         largest divisor of W  1     0
                                 and ``num_experts``
``fsdp_cp``     W      W/2       1                     2     0
``fsdp_ep_cp``  W      W/2       as ``fsdp_ep``        2     0
==============  =====  ========  ====================  ====  ====

Every layout draws the same global batch per step (``--batch-size`` rows of ``--seq-len`` tokens; each data
rank takes its slice, a CP group packs its rows into one and splits it), so in exact arithmetic the losses
are those of ``dp1``. ``dp1_seed1`` changes the weights, the data split and the batches: its distance from
``dp1`` is the seed-to-seed spread, the scale a layout's difference is judged against. On the CPU (gloo,
fp32 parameters) a layout differs from ``dp1`` only by fp32 rounding (reduction order in FSDP's
reduce-scatter, EP's combine, CP's all-gathers); on CUDA (NCCL, bf16 parameters, fp32 reduce) by bf16
rounding. In a MoE model that rounding stays invisible only until it flips a discrete decision (a token's
top-k experts at a near-tie, then Quantile Balancing's counts and biases): from that step on the layout
follows a trajectory of its own, at a distance the seed spread bounds (``separated_at`` in the report; a
dense model stays at rounding level, ``--preset k3-tiny-dense``). The final ``val_loss`` is the steadier
comparison.

Reported per layout: the losses, max and mean ``|Δ|`` against ``dp1`` over the steps, the final
``val_loss`` (the trainer's final evaluation), the median tokens/s and the wall time of the launch; written
as JSON, Markdown and a PNG (curves, and ``|Δ|`` per step beside the seed-to-seed ``|Δ|``).

CPU (gloo, 2 ranks, k3-tiny; about 10 minutes on 2 shared cores)::

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/dist_parity.py --world 2 --steps 24 \\
        --out benchmarks/results/dist_parity_cpu

GPUs (NCCL, one GPU per rank, bf16)::

    python benchmarks/dist_parity.py --nccl --world 8 --preset k3-small --steps 100 --batch-size 16 \\
        --seq-len 1024 --out $OUT/dist_parity
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from openk3.config import text_config_of
from openk3.dist.launch import run_bounded
from openk3.presets import get_preset

LAYOUTS = ("dp1", "dp1_seed1", "fsdp", "fsdp_ep", "fsdp_cp", "fsdp_ep_cp")


def layout_table(world: int, num_experts: int) -> dict[str, dict]:
    """``{name: {"ranks", "dp_shard", "ep", "cp", "seed"}}`` for the layouts ``world`` ranks allow (CP
    needs an even world; EP a divisor of ``world`` and ``num_experts`` above 1)."""
    ep = max((d for d in range(1, world + 1) if world % d == 0 and num_experts % d == 0), default=1)
    table = {
        "dp1": dict(ranks=1, dp_shard=1, ep=1, cp=1, seed=0),
        "dp1_seed1": dict(ranks=1, dp_shard=1, ep=1, cp=1, seed=1),
    }
    if world > 1:
        table["fsdp"] = dict(ranks=world, dp_shard=world, ep=1, cp=1, seed=0)
        if ep > 1:
            table["fsdp_ep"] = dict(ranks=world, dp_shard=world, ep=ep, cp=1, seed=0)
    if world % 2 == 0:
        table["fsdp_cp"] = dict(ranks=world, dp_shard=world // 2, ep=1, cp=2, seed=0)
        if ep > 1:
            table["fsdp_ep_cp"] = dict(ranks=world, dp_shard=world // 2, ep=ep, cp=2, seed=0)
    return table


def train_command(layout: dict, args, out: Path) -> list[str]:
    """The ``openk3 train`` command line of one layout (the trainer's own launcher starts the ranks)."""
    return [
        sys.executable, "-m", "openk3", "train", "--nproc-per-node", str(layout["ranks"]),
        "--preset", args.preset, "--out", str(out), "--dp-shard", str(layout["dp_shard"]),
        "--ep", str(layout["ep"]), "--cp", str(layout["cp"]), "--seed", str(layout["seed"]),
        "--batch-size", str(args.batch_size), "--steps", str(args.steps),
        "--context-schedule", f"0:{args.seq_len}", "--warmup-steps", str(args.warmup_steps),
        "--lr", str(args.lr), "--save-every", str(args.steps), "--eval-every", str(args.steps + 1),
        "--device", "cuda" if args.nccl else "cpu", "--no-sample",
    ]  # fmt: skip


def run_layout(name: str, layout: dict, args, work: Path) -> dict:
    """Launch one layout under ``--run-timeout`` (the whole process group is killed on timeout); returns the
    per-step rows of its ``metrics.jsonl`` and the final ``val_loss``, or the error."""
    out = work / name
    command = train_command(layout, args, out)
    start = time.perf_counter()
    status, log = run_bounded(command, args.run_timeout)
    error = {0: None, None: f"timed out after {args.run_timeout} s"}.get(status, f"exit status {status}")
    wall = time.perf_counter() - start
    rows = []
    if (out / "metrics.jsonl").is_file():
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = {
        **layout,
        "command": " ".join(command[1:]).replace(str(out), f"OUT/{name}"),
        "wall_s": wall,
        "losses": [r["loss"] for r in rows],
        "val_loss": next((r["val_loss"] for r in rows if "val_loss" in r), None),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else None,
    }
    if error:
        result["error"] = f"{error}: " + " | ".join(log.strip().splitlines()[-3:])
    print(f"{name}: {wall:.0f} s, {len(rows)} steps" + (f", {result['error']}" if error else ""), flush=True)
    return result


SEPARATION = 1e-4
"""|Δ| (nats) above which a layout's trajectory counts as separated from ``dp1``'s: 100 ulps of a 9-nat fp32
loss. Rounding alone stays below it for several steps; a routing decision or a Quantile Balancing count that
the rounding flips moves the next losses by 1e-4 to 1e-2 at once."""


def compare(results: dict) -> None:
    """Add, against ``dp1`` over the steps both ran: ``abs_diff`` per step, ``max_abs_diff``,
    ``mean_abs_diff``, ``separated_at`` (the first step with ``|Δ| > SEPARATION``, ``None``: never) and
    ``val_abs_diff`` (of the final ``val_loss``)."""
    ref = results.get("dp1", {})
    for r in results.values():
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref.get("losses") or [], strict=False)]
        r["abs_diff"] = diffs
        r["max_abs_diff"] = max(diffs) if diffs else None
        r["mean_abs_diff"] = sum(diffs) / len(diffs) if diffs else None
        r["separated_at"] = next((i + 1 for i, d in enumerate(diffs) if d > SEPARATION), None)
        both = r["val_loss"] is not None and ref.get("val_loss") is not None
        r["val_abs_diff"] = abs(r["val_loss"] - ref["val_loss"]) if both else None


def markdown(report: dict) -> str:
    fmt = lambda v, spec: "–" if v is None else format(v, spec)  # noqa: E731
    spread = report["seed_spread"]
    lines = [
        f"# Distributed loss parity ({report['backend']}, {report['preset']}, world {report['world']})",
        "",
        f"`{report['command']}`",
        "",
        f"{report['device']}; torch {report['torch']}, Python {report['python']}. {report['steps']} steps, "
        f"global batch {report['batch_size']} × {report['seq_len']} tokens, lr {report['lr']}, "
        f"{report['warmup_steps']} warmup steps, same seed and data for every layout but `dp1_seed1`.",
        "",
        "| layout | ranks | dp_shard | ep | cp | seed | loss step 1 | loss last | max \\|Δ\\| vs dp1 "
        f"| mean \\|Δ\\| | first step \\|Δ\\| > {SEPARATION:g} | val_loss | val \\|Δ\\| | tokens/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["layouts"].items():
        losses = r["losses"]
        lines.append(
            f"| {name} | {r['ranks']} | {r['dp_shard']} | {r['ep']} | {r['cp']} | {r['seed']} "
            f"| {fmt(losses[0] if losses else None, '.6f')} | {fmt(losses[-1] if losses else None, '.6f')} "
            f"| {fmt(r['max_abs_diff'], '.2e')} | {fmt(r['mean_abs_diff'], '.2e')} "
            f"| {'never' if r['separated_at'] is None else r['separated_at']} | {fmt(r['val_loss'], '.6f')} "
            f"| {fmt(r['val_abs_diff'], '.2e')} | {fmt(r['tokens_per_s'], ',.0f')} | {r['wall_s']:.0f} |"
        )
    seed = report["layouts"].get("dp1_seed1", {})
    lines += [
        "",
        f"Seed-to-seed spread (dp1 vs dp1_seed1): max |Δ| {fmt(spread, '.3g')}, "
        f"val |Δ| {fmt(seed.get('val_abs_diff'), '.3g')}.",
    ]
    worst = report.get("worst_layout_diff")
    if worst is not None and spread:
        lines.append(
            f"Worst layout against dp1: max |Δ| {worst:.3g}, {worst / spread:.2g} of the seed spread."
        )
    errors = {n: r["error"] for n, r in report["layouts"].items() if "error" in r}
    lines += ["", *(f"- **{n} failed**: {e}" for n, e in errors.items())]
    lines += ["", "Commands (OUT is a scratch folder):", ""]
    lines += [f"- {name}: `{r['command']}`" for name, r in report["layouts"].items()]
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, r in report["layouts"].items():
        steps = range(1, len(r["losses"]) + 1)
        style = "--" if name == "dp1_seed1" else "-"
        top.plot(steps, r["losses"], style, label=name, linewidth=1)
        if name not in ("dp1", "dp1_seed1") and r["abs_diff"]:
            bottom.semilogy(steps[: len(r["abs_diff"])], [max(d, 1e-12) for d in r["abs_diff"]], label=name)
    seed = report["layouts"].get("dp1_seed1", {}).get("abs_diff")
    if seed:
        bottom.semilogy(range(1, len(seed) + 1), seed, "k--", label="dp1 seed 1 (seed spread)")
    top.set_ylabel("training loss")
    top.legend(fontsize=8)
    top.set_title(
        f"{report['preset']}, {report['backend']}, world {report['world']}: layouts against dp1 seed 0"
    )
    bottom.set_ylabel("|loss − loss(dp1, seed 0)| (0 drawn at 1e-12)")
    bottom.set_xlabel("step")
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict, args, command: str) -> dict:
    """Compare the layouts run so far with ``dp1`` and write ``OUT.json``, ``OUT.md`` and ``OUT.png``."""
    compare(results)
    parallel = [r["max_abs_diff"] for n, r in results.items() if n not in ("dp1", "dp1_seed1")]
    report = {
        "command": command,
        "backend": "nccl" if args.nccl else "gloo",
        "device": f"{args.world} × {torch.cuda.get_device_name()}"
        if args.nccl
        else f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "preset": args.preset,
        "world": args.world,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "seed_spread": results.get("dp1_seed1", {}).get("max_abs_diff"),
        "worst_layout_diff": max((d for d in parallel if d is not None), default=None),
        "layouts": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks of the parallel layouts")
    parser.add_argument(
        "--nccl", action="store_true", help="CUDA, one GPU per rank, bf16 (default: CPU gloo)"
    )
    parser.add_argument("--preset", default="k3-tiny")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=4, help="global sequences per step")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--run-timeout", type=int, default=300, help="seconds per layout before it is killed")
    parser.add_argument("--out", required=True, help="output prefix: writes OUT.json, OUT.md, OUT.png")
    parser.add_argument("--work", help="run folders (default: a temporary folder, removed at the end)")
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error(f"--world {args.world} must be at least 1")
    if args.nccl and torch.cuda.device_count() < args.world:
        parser.error(
            f"--nccl --world {args.world} needs {args.world} GPUs, found {torch.cuda.device_count()}"
        )
    if args.batch_size % args.world:  # then every layout's data ranks (W or W/2) divide it too
        parser.error(f"--batch-size {args.batch_size} must be a multiple of --world {args.world}")
    table = layout_table(args.world, text_config_of(get_preset(args.preset)).num_experts or 1)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="dist_parity_"))
    command = "python benchmarks/dist_parity.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results: dict[str, dict] = {}
    try:
        for name in (n for n in args.layouts if n in table):  # the files are rewritten after each layout
            results[name] = run_layout(name, table[name], args, work)
            report = write_report(results, args, command)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
