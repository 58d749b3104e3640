"""The synthetic grid: tasks × mixers × training lengths × seeds, with the hybrid scored beyond its length.

Writes ``benchmarks/results/synthetic_<device><tag>.md`` (tables; ``tag`` is the grid's, e.g. ``_recall``),
``.json`` (every cell's curve) and ``.png`` (exact-match accuracy against training steps, one line per seed;
one panel per task and length). Cells run in parallel worker processes (``--workers``; a worker keeps its
compiled kernels from cell to cell). The JSON is rewritten (whole: temporary file and rename) after every
cell; Ctrl-C keeps and draws the finished cells and ends with one line (exit 130); ``--budget-s`` ends the
grid on time: a running cell stops at its next evaluation and keeps its curve (marked as cut), a cell not
started is skipped.

    python benchmarks/synthetic.py --grid cpu                                           # CI-sized, CPU
    python benchmarks/synthetic.py --grid gpu --device cuda --shard 1/2 --budget-s 420  # one H200 call
    python benchmarks/synthetic.py --grid gpu --device cuda --shard 2/2 --budget-s 420  # a second call
    python benchmarks/synthetic.py --merge benchmarks/results/synthetic_h200.shard*.json  # one table + plot
    python benchmarks/synthetic.py --grid recall --device cuda                          # items grow with length

A grid (:class:`Grid`, presets in :data:`GRIDS`) names every choice; ``docs/synthetic.md`` says why each
value. ``--shard i/n`` runs the i-th of n contiguous slices of the grid's cell list (the list is seed-major,
so with n = the number of seeds each shard is one whole seed); ``--cells`` keeps the cells whose id
``task/mixer/length/seed`` matches one of its shell patterns. ``--merge`` joins shard JSONs of one grid
(:func:`merge` says what it refuses; ``--partial`` allows missing shards).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import multiprocessing
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from openk3.synthetic.cell import FULL_ACCURACY, CellConfig, run_cell
from openk3.synthetic.mixers import MIXERS, MixerSize
from openk3.synthetic.results import write_json
from openk3.synthetic.tasks import TASKS

CONTROLS = ["kda", "gdn", "decay", "mla"]


@dataclass(frozen=True)
class Grid:
    """One grid preset: every choice of the experiment (why each value: ``docs/synthetic.md``)."""

    tasks: list[str]
    mixers: list[str]
    lengths: list[int]
    """Training lengths (tokens per sequence)."""
    curriculum: bool
    """True: one cell per task, mixer and seed trains at the lengths in increasing order, a stage each
    (:attr:`~openk3.synthetic.cell.CellConfig.curriculum`); False: a cell per length, from scratch."""
    seeds: list[int]
    items: dict[str, int]
    """Items per sequence by task at the first length (and at every length without ``curriculum_items``:
    longer sequences then only put more noise between them)."""
    noise: dict[str, int]
    """Noise symbols filling the gaps, by task (1: one filler token, up to 120)."""
    steps: int
    """Most training steps of a cell, or of a curriculum's first stage (the schedule's length)."""
    curriculum_steps: int | None
    """Most steps of each later curriculum stage (the model arrives trained); ``None``: ``steps``."""
    curriculum_lr: float
    """Peak learning rate of each later stage, as a fraction of the mixer's ``lr``."""
    batch_size: int
    """Sequences per step, the same at every length (each step sees the same number of task instances)."""
    lr: dict[str, float]
    """Peak AdamW learning rate by mixer."""
    size: dict
    """:class:`~openk3.synthetic.mixers.MixerSize` of the controls."""
    eval_every: int
    eval_size: int
    stop_at: float | None = FULL_ACCURACY
    """Stop a cell once solved (exact match ≥ this); ``None``: run every step."""
    workers: int = 2
    """Default ``--workers``."""
    hybrid: dict | None = None
    """``{"lengths", "extrapolate", "size"}``: the 3 KDA : 1 MLA model trained at ``lengths`` (a curriculum
    when several) and scored at ``extrapolate`` × the last of them; ``None``: no hybrid cells."""
    budget_s: float | None = None
    """Default ``--budget-s``."""
    curriculum_items: dict[str, list[int]] | None = None
    """Items per sequence by task at each later curriculum length (``None``: ``items`` throughout)."""
    tag: str = ""
    """Added to the result files' names (``synthetic_<device><tag>.json``) so grids do not overwrite another's."""


GRIDS = {
    "cpu": Grid(
        tasks=["palindrome", "mqar", "stack"], mixers=CONTROLS, lengths=[32], curriculum=False, seeds=[0],
        items={"palindrome": 2, "mqar": 2, "stack": 2}, noise={t: 120 for t in TASKS},
        steps=300, curriculum_steps=None, curriculum_lr=1.0, batch_size=32, lr={m: 1e-2 for m in MIXERS},
        size=dict(hidden_size=64, num_layers=1, num_heads=2, head_dim=32),
        eval_every=25, eval_size=64, stop_at=None, workers=2,
    ),
    "gpu": Grid(
        tasks=["palindrome", "mqar", "stack"], mixers=CONTROLS, lengths=[64, 256, 512, 1024], curriculum=True,
        seeds=[0, 1], items={"palindrome": 6, "mqar": 4, "stack": 6},
        noise={"palindrome": 1, "mqar": 120, "stack": 120},
        steps=1200, curriculum_steps=500, curriculum_lr=0.3, batch_size=64, lr={m: 3e-3 for m in MIXERS},
        size=dict(hidden_size=128, num_layers=2, num_heads=2, head_dim=64),
        eval_every=25, eval_size=128, stop_at=FULL_ACCURACY, workers=15, budget_s=420,
        hybrid=dict(lengths=[64, 256], extrapolate=[4, 8],
                    size=dict(hidden_size=128, num_layers=4, num_heads=2, head_dim=64)),
    ),
    "recall": Grid(
        tasks=["palindrome", "mqar", "stack"], mixers=["kda", "gdn", "decay"], lengths=[64, 256, 512],
        curriculum=True, seeds=[0, 1], items={"palindrome": 6, "mqar": 4, "stack": 6},
        curriculum_items={"palindrome": [12, 24], "mqar": [8, 16], "stack": [12, 24]},
        noise={"palindrome": 1, "mqar": 120, "stack": 120},
        steps=1200, curriculum_steps=500, curriculum_lr=0.3, batch_size=32, lr={m: 3e-3 for m in MIXERS},
        size=dict(hidden_size=128, num_layers=2, num_heads=2, head_dim=64),
        eval_every=25, eval_size=128, stop_at=FULL_ACCURACY, workers=18, budget_s=420, tag="_recall",
    ),
}  # fmt: skip


def cell_id(c: CellConfig | dict) -> str:
    """``task/mixer/length/seed``, the name ``--cells`` matches."""
    get = c.get if isinstance(c, dict) else lambda k: getattr(c, k)
    return f"{get('task')}/{get('mixer')}/{get('seq_len')}/{get('seed')}"


def grid_cells(name: str, device: str, steps: int | None = None) -> list[CellConfig]:
    """The cells of grid ``name``, seed by seed (a cut loses seeds, not whole rows), the longest lengths first
    in each seed (the slowest cells start early) or one curriculum cell per task and mixer, each seed's hybrid
    cells after its controls."""
    g = GRIDS[name]
    common = dict(
        steps=steps or g.steps, curriculum_steps=steps or g.curriculum_steps, curriculum_lr=g.curriculum_lr,
        eval_every=g.eval_every,
        eval_size=g.eval_size, batch_size=g.batch_size,
        stop_at=g.stop_at, device=device,
    )  # fmt: skip

    def cell(task, mixer, length, seed, size=g.size, **extra) -> CellConfig:
        return CellConfig(
            task=task, mixer=mixer, seq_len=length, seed=seed, items=g.items[task], noise=g.noise[task], lr=g.lr[mixer],
            size=MixerSize(**size), **common, **extra,
        )  # fmt: skip

    cells = []
    lengths = sorted(g.lengths)
    for seed in g.seeds:
        if g.curriculum:
            cells += [
                cell(
                    task,
                    mixer,
                    lengths[0],
                    seed,
                    curriculum=lengths[1:],
                    curriculum_items=(g.curriculum_items or {}).get(task, []),
                )
                for task in g.tasks
                for mixer in g.mixers
            ]
        for length in [] if g.curriculum else lengths[::-1]:
            cells += [cell(task, mixer, length, seed) for task in g.tasks for mixer in g.mixers]
        if g.hybrid:
            h = g.hybrid
            first, *more = h["lengths"]
            cells += [
                cell(task, "hybrid", first, seed, h["size"], curriculum=more, extrapolate=h["extrapolate"])
                for task in g.tasks
            ]
    return cells


def result_path(out: Path, grid: str, device: str, shard: tuple[int, int] | None = None) -> Path:
    """``out/synthetic_<device><tag>[.shard-i-of-n].json``: the grid's tag keeps grids from overwriting one
    another's files, for a run and for the merge of its shards alike."""
    suffix = f".shard-{shard[0]}-of-{shard[1]}" if shard else ""
    return out / f"synthetic_{device}{GRIDS[grid].tag}{suffix}.json"


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` → ``(i, n)`` with ``1 ≤ i ≤ n``; raises ``argparse.ArgumentTypeError`` otherwise."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard expects i/n (e.g. 1/2), got {text!r}") from None
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"--shard {text}: expected 1 ≤ i ≤ n")
    return i, n


def select(cells: list[CellConfig], shard: tuple[int, int] | None, patterns: list[str] | None) -> list:
    """The ``i``-th of ``n`` contiguous slices of ``cells`` (near-equal sizes), then those whose
    :func:`cell_id` matches one of ``patterns``. Raises ``ValueError`` when nothing is left."""
    if shard:
        i, n = shard
        cells = cells[(i - 1) * len(cells) // n : i * len(cells) // n]
    if patterns:
        cells = [c for c in cells if any(fnmatch.fnmatchcase(cell_id(c), p) for p in patterns)]
    if not cells:
        given = ([f"--shard {shard[0]}/{shard[1]}"] if shard else []) + [
            f"--cells '{p}'" for p in patterns or []
        ]
        raise ValueError(f"no cell of the grid is selected by {' '.join(given)}")
    return cells


def _ignore_ctrl_c() -> None:
    """A worker's initializer: Ctrl-C reaches the whole process group; the parent alone handles it (it stops
    the workers), so the workers print no tracebacks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run(job: tuple[CellConfig, float | None]) -> dict | None:
    config, deadline = job
    if deadline is not None and time.time() >= deadline:
        return None  # the budget ran out before this cell started
    torch.set_num_threads(1)
    return run_cell(config, deadline=deadline)


def device_label(device: str) -> str:
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name().lower().replace("nvidia", "").strip()
    return name.split()[0] if name else "cuda"


def run_grid(
    name: str,
    device: str,
    workers: int,
    out: Path,
    budget_s: float | None = None,
    steps: int | None = None,
    shard: tuple[int, int] | None = None,
    patterns: list[str] | None = None,
) -> Path:
    """Run the selected cells of grid ``name`` (:func:`select`). With ``budget_s``, cells still training
    that many seconds after the start stop at their next evaluation (``stopped: "deadline"``) and cells not
    started are skipped. At most ``workers`` processes, never more than the selected cells. Returns the JSON's
    path (:func:`result_path`).

    Raises ``ValueError`` for ``cuda`` without CUDA or a selection of no cell (before ``out`` is created).
    On Ctrl-C (``KeyboardInterrupt``) the workers are stopped, the finished cells stay saved and rendered,
    and :class:`Interrupted` names the file."""
    start_wall, start = time.time(), time.perf_counter()
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch.cuda.is_available() is False (no GPU or a CPU build of torch)")
    cells = select(grid_cells(name, device, steps), shard, patterns)
    workers = min(workers, len(cells))
    out.mkdir(parents=True, exist_ok=True)
    label = device_label(device)
    path = result_path(out, name, label, shard)
    command = f"python benchmarks/synthetic.py --grid {name} --device {device} --workers {workers}"
    command += f" --budget-s {budget_s:g}" if budget_s else ""
    command += f" --steps {steps}" if steps else ""
    command += f" --shard {shard[0]}/{shard[1]}" if shard else ""
    command += "".join(f" --cells '{p}'" for p in patterns or [])
    header = {
        "grid": name, "preset": asdict(GRIDS[name]), "device": label, "torch": torch.__version__,
        "workers": workers, "commands": [command], "selected": [cell_id(c) for c in cells],
        "shard": list(shard) if shard else None, "overrides": {"steps": steps},
    }  # fmt: skip
    if device == "cuda":  # compile the Triton kernels once, before the workers share the cache
        run_cell(CellConfig(task="mqar", mixer="kda", seq_len=64, steps=1, eval_every=1, eval_size=4,
                            batch_size=2, device=device))  # fmt: skip
        print(f"kernels compiled in {time.perf_counter() - start:.0f} s", flush=True)
    deadline = start_wall + budget_s if budget_s else None
    results: list[dict] = []
    try:
        with multiprocessing.get_context("spawn").Pool(workers, initializer=_ignore_ctrl_c) as pool:
            pending = pool.imap_unordered(_run, [(c, deadline) for c in cells])
            for done in range(1, len(cells) + 1):
                # a cut cell ends at its next evaluation: allow it a grace period past the deadline
                left = None if deadline is None else max(deadline + 120 - time.time(), 0.0)
                try:
                    r = pending.next(timeout=left)
                except multiprocessing.TimeoutError:
                    print(
                        f"{len(cells) - done + 1} cells still running 120 s past the budget: stopped",
                        flush=True,
                    )
                    pool.terminate()
                    break
                if r is None:
                    continue
                results.append(r)
                c = r["config"]
                print(
                    f"[{done}/{len(cells)} {time.perf_counter() - start:4.0f} s] {cell_id(c):<24} "
                    f"accuracy {r['final']['accuracy']:.3f} at step {r['final']['step']} ({r['stopped']}), "
                    f"full at {r['steps_to_full']} ({r['seconds']:.0f} s)",
                    flush=True,
                )
                header["wall_s"] = time.perf_counter() - start
                write_json(path, {**header, "cells": results})
    except KeyboardInterrupt:
        header["wall_s"] = time.perf_counter() - start
        write_json(path, {**header, "cells": results})
        render(path)
        raise Interrupted(
            f"interrupted: {len(results)} of {len(cells)} cells saved in {path}; redraw with --render {path}"
        ) from None
    skipped = len(cells) - len(results)
    if skipped:
        print(f"budget of {budget_s:g} s spent: {skipped} of {len(cells)} cells not started", flush=True)
    header["wall_s"] = time.perf_counter() - start
    write_json(path, {**header, "cells": results})
    render(path)
    return path


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the grid; the message says where the finished cells are."""


def read_grid(path: Path) -> dict:
    """A JSON that :func:`run_grid` or :func:`merge` wrote; raises ``ValueError`` naming ``path`` when it
    cannot be read, is not JSON or is not a grid's JSON."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a grid JSON (not JSON: {e})") from None
    if not isinstance(data, dict) or not {"grid", "device", "cells", "selected", "commands"} <= data.keys():
        raise ValueError(f"{path} is not a grid JSON written by benchmarks/synthetic.py")
    return data


def _read_shard(path: Path) -> dict:
    """One JSON that :func:`run_grid` wrote (:func:`read_grid`); also raises ``ValueError`` for a merge."""
    data = read_grid(path)
    if isinstance(data.get("wall_s"), list):
        raise ValueError(f"{path} is not a shard: it is already a merge (pass the shard JSONs it came from)")
    return data


def _shard_of(data: dict) -> tuple[int, int]:
    """``(i, n)`` of a shard JSON (from its command line for files written before ``shard`` was recorded);
    ``(1, 1)`` for a run of the whole grid."""
    if data.get("shard"):
        return tuple(data["shard"])
    found = re.search(r"--shard (\d+)/(\d+)", data["commands"][0])
    return (int(found[1]), int(found[2])) if found else (1, 1)


def _overrides_of(data: dict) -> dict:
    """The command-line values that replaced the preset's (``steps``), from the command line for older files."""
    if "overrides" in data:
        return data["overrides"]
    found = re.search(r"--steps (\d+)", data["commands"][0])
    return {"steps": int(found[1]) if found else None}


def merge(paths: list[Path], out: Path, partial: bool = False) -> Path:
    """Join the JSONs of shards of one grid into ``out`` (then its table and plots). A shard present in
    several files (a rerun, e.g. with ``--cells``) keeps each cell from the last file that has it.

    Raises ``ValueError`` naming the file when one cannot be read, is already a merge, is of another grid,
    device, preset or ``--steps``, or is a shard of another split (``1/2`` with ``1/3``: they overlap); and,
    unless ``partial``, when shards of the split are missing (with ``partial`` the table names them); and
    when ``out`` is one of ``paths``."""
    if any(Path(p).resolve() == Path(out).resolve() for p in paths):
        raise ValueError(
            f"the merged file {out} is one of the inputs: merging would overwrite it; pass --out"
        )
    datas = [_read_shard(p) for p in paths]
    first, shard0 = datas[0], _shard_of(datas[0])
    for p, d in zip(paths, datas):
        if (d["grid"], d["device"], d.get("preset")) != (first["grid"], first["device"], first.get("preset")):
            raise ValueError(
                f"{p} is grid {d['grid']!r} on {d['device']}, not {first['grid']!r} on {first['device']}"
                + (
                    " (another preset)"
                    if d["grid"] == first["grid"] and d["device"] == first["device"]
                    else ""
                )
            )
        if _overrides_of(d) != _overrides_of(first):
            raise ValueError(f"{p} ran with {_overrides_of(d)}, {paths[0]} with {_overrides_of(first)}")
        if _shard_of(d)[1] != shard0[1]:
            i, n = _shard_of(d)
            raise ValueError(
                f"{p} is shard {i}/{n}, {paths[0]} is shard {shard0[0]}/{shard0[1]}: shards of different "
                "splits overlap"
            )
    n = shard0[1]
    missing = sorted(set(range(1, n + 1)) - {_shard_of(d)[0] for d in datas})
    if missing and not partial:
        raise ValueError(
            f"shard {', '.join(f'{i}/{n}' for i in missing)} missing: pass its JSON too, or --partial to "
            "merge without it"
        )
    cells = {cell_id(r["config"]): r for d in datas for r in d["cells"]}
    merged = {
        **first, "workers": [d["workers"] for d in datas], "commands": [c for d in datas for c in d["commands"]],
        "selected": list(dict.fromkeys(s for d in datas for s in d["selected"])),
        "wall_s": [d["wall_s"] for d in datas], "shard": None, "overrides": _overrides_of(first),
        "missing_shards": [f"{i}/{n}" for i in missing], "cells": list(cells.values()),
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, merged)
    render(out)
    return out


def _group(cells: list[dict]) -> dict[tuple, list[dict]]:
    """Results by ``(task, length, mixer)``: each stage of a curriculum cell counts at its own length."""
    groups: dict[tuple, list[dict]] = {}
    for r in cells:
        c = r["config"]
        for stage in r.get("stages") or [{**r, "seq_len": c["seq_len"]}]:
            groups.setdefault((c["task"], stage["seq_len"], c["mixer"]), []).append(stage)
    return groups


def _cell_text(runs: list[dict]) -> str:
    acc = [r["final"]["accuracy"] for r in runs]
    full = [r["steps_to_full"] for r in runs]
    spread = f" ({min(acc):.2f}–{max(acc):.2f})" if len(acc) > 1 else ""
    reached = [s for s in full if s is not None]
    steps = f"{np.mean(reached):.0f} ({len(reached)}/{len(full)})" if reached else "—"
    cut = "†" if any(r.get("stopped") == "deadline" for r in runs) else ""
    return f"{np.mean(acc):.2f}{spread} / {steps}{cut}"


def render(path: Path) -> None:
    """Write the ``.md`` table and the ``.png`` plots next to the JSON ``path`` (no plot, and any old one
    removed, when no cell finished). Raises ``ValueError`` naming ``path`` when it is not a grid's JSON."""
    data = read_grid(path)
    cells = data["cells"]
    groups = _group(cells)
    mixers = [m for m in [*CONTROLS, "hybrid"] if any(k[2] == m for k in groups)]
    rows = sorted({(k[0], k[1]) for k in groups})
    commands = data.get("commands") or [data["command"]]
    wall = data["wall_s"] if isinstance(data["wall_s"], list) else [data["wall_s"]]
    selected = data.get("selected")
    lines = [
        f"# Synthetic tasks on {data['device']} (grid `{data['grid']}`)",
        "",
        "Commands (torch " + data["torch"] + "; wall " + " + ".join(f"{w:.0f}" for w in wall) + " s; "
        f"{len(cells)} cell{'' if len(cells) == 1 else 's'}"
        + (f" of {len(selected)} selected" if selected else "")
        + "):",
        "",
        *[f"    {c}" for c in commands],
        "",
        "Each entry: exact-match accuracy on the held-out set at the cell's last evaluation (a solved cell stops",
        "there), mean over seeds (min–max) / the mean step at which accuracy first reached 0.99 (seeds that",
        "reached it / seeds); — never reached; † a seed was cut by the time budget before its last step.",
        *(
            [
                "Curriculum: each model trains at the lengths in increasing order, continuing from the previous",
                "length; the steps at a longer length count from the start of that stage.",
            ]
            if data.get("preset", {}).get("curriculum")
            else []
        ),
        "",
        "| task | length | " + " | ".join(mixers) + " |",
        "|---|---|" + "---|" * len(mixers),
    ]
    for task, length in rows:
        entries = [
            _cell_text(groups[(task, length, m)]) if (task, length, m) in groups else "" for m in mixers
        ]
        lines.append(f"| {task} | {length} | " + " | ".join(entries) + " |")
    if data.get("preset", {}).get("curriculum_items"):
        preset = data["preset"]
        lines += ["", "Items per sequence at each length (growing with the length in this grid):", ""]
        lines += [
            f"- {t}: "
            + ", ".join(
                f"{n} at {length}"
                for length, n in zip(
                    sorted(preset["lengths"]),
                    [preset["items"][t], *preset["curriculum_items"][t]],
                    strict=True,
                )
            )
            for t in preset["tasks"]
        ]
    missing = sorted(set(selected or []) - {cell_id(r["config"]) for r in cells})
    if missing:
        lines += ["", f"Not run (budget): {', '.join(missing)}."]
    if data.get("missing_shards"):
        lines += [
            "",
            f"Not merged (missing shards, their cells are not counted): {', '.join(data['missing_shards'])}.",
        ]
    hybrid = [r for r in cells if r["extrapolation"]]
    if hybrid:
        lines += ["", "Hybrid (3 KDA : 1 MLA) scored beyond its training length, same item count:", ""]
        lengths = sorted({int(k) for r in hybrid for k in r["extrapolation"]})
        lines += ["| task | trained | seed | at trained | " + " | ".join(f"at {n}" for n in lengths) + " |"]
        lines += ["|---|---|---|---|" + "---|" * len(lengths)]
        for r in sorted(hybrid, key=lambda r: (r["config"]["task"], r["config"]["seed"])):
            c, ex = r["config"], r["extrapolation"]
            last = (r.get("stages") or [{**r, "seq_len": c["seq_len"]}])[-1]
            more = " | ".join(f"{ex[str(n)]['accuracy']:.2f}" if str(n) in ex else "" for n in lengths)
            lines.append(
                f"| {c['task']} | {last['seq_len']} | {c['seed']} | {last['final']['accuracy']:.2f} | {more} |"
            )
    if not cells:
        lines += ["", "No cell finished: nothing to plot."]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if cells:
        _plot(groups, rows, mixers, path.with_suffix(".png"), data["device"])
    else:
        path.with_suffix(".png").unlink(missing_ok=True)


def _plot(groups, rows, mixers, png: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({t for t, _ in rows})
    lengths = sorted({n for _, n in rows})
    fig, axes = plt.subplots(
        len(tasks), len(lengths), figsize=(4 * len(lengths), 3 * len(tasks)), squeeze=False
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, task in enumerate(tasks):
        for j, length in enumerate(lengths):
            ax = axes[i][j]
            for k, mixer in enumerate(mixers):
                for n, r in enumerate(groups.get((task, length, mixer), [])):
                    steps = [p["step"] for p in r["curve"]]
                    acc = [p["accuracy"] for p in r["curve"]]
                    ax.plot(
                        steps, acc, color=colors[k % len(colors)], alpha=0.8, label=mixer if n == 0 else None
                    )
            ax.set_title(f"{task}, L = {length}")
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("step")
            ax.set_ylabel("exact-match accuracy")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle(f"Synthetic tasks ({device})\none line per seed; a solved cell stops", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="cpu")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workers", type=int, help="cells run at once (processes; default: the grid's)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--budget-s",
        dest="budget_s",
        type=float,
        help="end the grid after this many seconds (default: the grid's)",
    )
    parser.add_argument(
        "--steps", type=int, help="most training steps per cell and stage (default: the grid's)"
    )
    parser.add_argument("--shard", type=parse_shard, help="run the i-th of n slices of the grid, i/n")
    parser.add_argument("--cells", action="append", help="keep cells whose task/mixer/length/seed matches")
    parser.add_argument("--render", help="only redraw the table and plots of this JSON")
    parser.add_argument(
        "--merge", nargs="+", help="join these shard JSONs into --out/synthetic_<device><grid tag>.json"
    )
    parser.add_argument(
        "--partial", action="store_true", help="with --merge: merge even when shards of the split are missing"
    )
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.budget_s is not None and not (math.isfinite(args.budget_s) and args.budget_s > 0):
        parser.error(f"--budget-s must be a finite number of seconds > 0, got {args.budget_s:g}")
    if args.merge and args.render:
        parser.error("--merge and --render are separate runs: pass one")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run the command line; bad input and Ctrl-C end with one line (exit 1 and 130), not a traceback."""
    args = parse_args(argv)
    try:
        if args.render:
            render(Path(args.render))
            return
        if args.merge:
            shard = _read_shard(Path(args.merge[0]))
            out = result_path(Path(args.out), shard["grid"], shard["device"])
            print(merge([Path(p) for p in args.merge], out, args.partial))
            return
        g = GRIDS[args.grid]
        workers = args.workers or g.workers
        budget = args.budget_s or g.budget_s
        print(
            run_grid(
                args.grid, args.device, workers, Path(args.out), budget, args.steps, args.shard, args.cells
            )
        )
    except ValueError as e:
        sys.exit(f"synthetic.py: {e}")
    except Interrupted as e:
        print(f"synthetic.py: {e}", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
