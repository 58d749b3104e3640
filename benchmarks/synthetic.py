"""The synthetic grid: tasks × mixers × training lengths × seeds, with the hybrid scored beyond its length.

Writes ``benchmarks/results/synthetic_<device>.md`` (tables), ``.json`` (every cell's curve) and ``.png``
(exact-match accuracy against training steps, mean over seeds with the min–max band; one panel per task and
length). Cells run in parallel worker processes (``--workers``); the JSON is rewritten after every cell, so an
interrupted grid keeps what finished (``--budget-s`` stops it on time), and ``--render`` redraws the table and
plots from it.

    python benchmarks/synthetic.py --grid cpu                          # ≤ 10 min on a 2-core CPU
    python benchmarks/synthetic.py --grid gpu --device cuda --workers 12 --budget-s 300   # one H200

Grids (:data:`GRIDS`): every cell sees the same tokens per step (``tokens_per_step``: fewer sequences at longer
lengths, the same number of items per step since items grow as ``L // 32``); the hybrid trains at the shortest
length and is scored at ``extrapolate`` × that length with the trained item count.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from pathlib import Path

import numpy as np
import torch

from openk3.synthetic.cell import CellConfig, run_cell
from openk3.synthetic.mixers import MixerSize

CONTROLS = ["kda", "gdn", "decay", "mla"]
GRIDS = {
    "cpu": dict(
        tasks=["palindrome", "mqar", "stack"], mixers=CONTROLS, lengths=[32], seeds=[0],
        steps=300, eval_every=25, eval_size=64, tokens_per_step=1024, lr=1e-2,
        size=dict(hidden_size=64, num_layers=1, num_heads=2, head_dim=32),
        hybrid=None,
    ),
    "gpu": dict(
        tasks=["palindrome", "mqar", "stack"], mixers=CONTROLS, lengths=[256, 1024, 2048], seeds=[0, 1],
        steps=800, eval_every=50, eval_size=128, tokens_per_step=16384, lr=3e-3,
        size=dict(hidden_size=128, num_layers=4, num_heads=2, head_dim=64),
        hybrid=dict(length=256, extrapolate=[4, 8]),
    ),
}  # fmt: skip


def grid_cells(name: str, device: str, steps: int | None = None) -> list[CellConfig]:
    """The cells of grid ``name``, seed by seed (a budget cut loses seeds, not whole rows), the longest
    lengths first in each seed (the slowest cells start early)."""
    g = GRIDS[name]
    common = dict(steps=steps or g["steps"], eval_every=g["eval_every"], eval_size=g["eval_size"], lr=g["lr"])
    common.update(size=MixerSize(**g["size"]), device=device)

    def cell(task, mixer, length, seed, **extra) -> CellConfig:
        batch = max(1, g["tokens_per_step"] // length)
        return CellConfig(
            task=task, mixer=mixer, seq_len=length, seed=seed, batch_size=batch, **common, **extra
        )

    cells = [
        cell(task, mixer, length, seed)
        for seed in g["seeds"]
        for length in sorted(g["lengths"], reverse=True)
        for task in g["tasks"]
        for mixer in g["mixers"]
    ]
    if g["hybrid"]:
        h = g["hybrid"]
        for seed in g["seeds"]:  # each seed's hybrid cells right after that seed's controls
            at = max(i for i, c in enumerate(cells) if c.seed == seed) + 1
            cells[at:at] = [
                cell(task, "hybrid", h["length"], seed, extrapolate=h["extrapolate"]) for task in g["tasks"]
            ]
    return cells


def _run(config: CellConfig) -> dict:
    torch.set_num_threads(1)
    return run_cell(config)


def device_label(device: str) -> str:
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name().lower().replace("nvidia", "").strip()
    return name.split()[0] if name else "cuda"


def run_grid(
    name: str, device: str, workers: int, out: Path, budget_s: float | None = None, steps: int | None = None
) -> Path:
    """Run grid ``name``; with ``budget_s``, stop (terminating the workers) once that many seconds have
    passed and keep the cells finished by then. Returns the JSON's path."""
    cells = grid_cells(name, device, steps)
    label = device_label(device)
    path = out / f"synthetic_{label}.json"
    header = {
        "grid": name, "device": label, "torch": torch.__version__, "workers": workers,
        "command": f"python benchmarks/synthetic.py --grid {name} --device {device} --workers {workers}"
        + (f" --budget-s {budget_s:g}" if budget_s else "")
        + (f" --steps {steps}" if steps else ""),
    }  # fmt: skip
    if device == "cuda":  # compile the Triton kernels once, before the workers share the cache
        run_cell(CellConfig(task="mqar", mixer="kda", seq_len=64, steps=1, eval_every=1, eval_size=4,
                            batch_size=2, device=device))  # fmt: skip
    results, start = [], time.perf_counter()
    deadline = start + budget_s if budget_s else None
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pending = pool.imap_unordered(_run, cells)
        for _ in cells:
            left = None if deadline is None else deadline - time.perf_counter()
            try:
                r = pending.next(timeout=left if left is None else max(left, 0.0))
            except multiprocessing.TimeoutError:
                print(
                    f"budget of {budget_s} s spent: {len(cells) - len(results)} cells not finished",
                    flush=True,
                )
                pool.terminate()
                break
            results.append(r)
            c = r["config"]
            print(
                f"[{len(results)}/{len(cells)} {time.perf_counter() - start:6.0f} s] {c['task']:<10} "
                f"{c['mixer']:<6} L={c['seq_len']:<5} seed {c['seed']}: accuracy {r['final']['accuracy']:.3f} "
                f"full at {r['steps_to_full']} ({r['seconds']:.0f} s)",
                flush=True,
            )
            header["wall_s"] = time.perf_counter() - start
            path.write_text(json.dumps({**header, "cells": results}, indent=1) + "\n")
    render(path)
    return path


def _group(cells: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in cells:
        c = r["config"]
        groups.setdefault((c["task"], c["seq_len"], c["mixer"]), []).append(r)
    return groups


def _cell_text(runs: list[dict]) -> str:
    acc = [r["final"]["accuracy"] for r in runs]
    full = [r["steps_to_full"] for r in runs]
    spread = f" ({min(acc):.2f}–{max(acc):.2f})" if len(acc) > 1 else ""
    reached = [s for s in full if s is not None]
    steps = f"{np.mean(reached):.0f} ({len(reached)}/{len(full)})" if reached else "—"
    return f"{np.mean(acc):.2f}{spread} / {steps}"


def render(path: Path) -> None:
    """Write the ``.md`` table and the ``.png`` plots next to the JSON ``path``."""
    data = json.loads(path.read_text())
    cells = data["cells"]
    groups = _group(cells)
    mixers = [m for m in [*CONTROLS, "hybrid"] if any(k[2] == m for k in groups)]
    rows = sorted({(k[0], k[1]) for k in groups})
    lines = [
        f"# Synthetic tasks on {data['device']} (grid `{data['grid']}`)",
        "",
        f"Command: `{data['command']}` (torch {data['torch']}, {data['wall_s']:.0f} s wall, {len(cells)} cells).",
        "Each entry: exact-match accuracy on the held-out set at the last step, mean over seeds (min–max) / the",
        "mean step at which accuracy first reached 0.99 (seeds that reached it / seeds); — never reached.",
        "",
        "| task | length | " + " | ".join(mixers) + " |",
        "|---|---|" + "---|" * len(mixers),
    ]
    for task, length in rows:
        entries = [
            _cell_text(groups[(task, length, m)]) if (task, length, m) in groups else "" for m in mixers
        ]
        lines.append(f"| {task} | {length} | " + " | ".join(entries) + " |")
    hybrid = [r for r in cells if r["extrapolation"]]
    if hybrid:
        lines += ["", "Hybrid (3 KDA : 1 MLA) scored beyond its training length, same item count:", ""]
        lengths = sorted({int(k) for r in hybrid for k in r["extrapolation"]})
        lines += ["| task | trained | seed | at trained | " + " | ".join(f"at {n}" for n in lengths) + " |"]
        lines += ["|---|---|---|---|" + "---|" * len(lengths)]
        for r in sorted(hybrid, key=lambda r: (r["config"]["task"], r["config"]["seed"])):
            c, ex = r["config"], r["extrapolation"]
            more = " | ".join(f"{ex[str(n)]['accuracy']:.2f}" if str(n) in ex else "" for n in lengths)
            lines.append(
                f"| {c['task']} | {c['seq_len']} | {c['seed']} | {r['final']['accuracy']:.2f} | {more} |"
            )
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(groups, rows, mixers, path.with_suffix(".png"), data["device"])


def _plot(groups, rows, mixers, png: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({t for t, _ in rows})
    lengths = sorted({n for _, n in rows})
    fig, axes = plt.subplots(
        len(tasks), len(lengths), figsize=(4 * len(lengths), 3 * len(tasks)), squeeze=False
    )
    for i, task in enumerate(tasks):
        for j, length in enumerate(lengths):
            ax = axes[i][j]
            for mixer in mixers:
                runs = groups.get((task, length, mixer))
                if not runs:
                    continue
                steps = [p["step"] for p in runs[0]["curve"]]
                acc = np.array([[p["accuracy"] for p in r["curve"]] for r in runs])
                (line,) = ax.plot(steps, acc.mean(0), label=mixer)
                if len(runs) > 1:
                    ax.fill_between(steps, acc.min(0), acc.max(0), color=line.get_color(), alpha=0.2)
            ax.set_title(f"{task}, L = {length}")
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("step")
            ax.set_ylabel("exact-match accuracy")
    axes[0][0].legend()
    fig.suptitle(f"Synthetic tasks ({device})")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="cpu")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workers", type=int, default=2, help="cells run at once (processes)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--budget-s", dest="budget_s", type=float, help="stop after this many seconds")
    parser.add_argument("--steps", type=int, help="training steps per cell (default: the grid's)")
    parser.add_argument("--render", help="only redraw the table and plots of this JSON")
    args = parser.parse_args()
    if args.render:
        render(Path(args.render))
        return
    print(run_grid(args.grid, args.device, args.workers, Path(args.out), args.budget_s, args.steps))


if __name__ == "__main__":
    main()
