"""The synthetic grid's machinery: early stopping, the time budget, shards, ``--cells`` and the merge.

* A cell stops at the first evaluation that reaches ``stop_at`` and at the first one past its deadline.
* Shards partition the grid's cells (every cell in exactly one shard; with n = seeds, one seed per shard).
* Two runs of different cells merge into one JSON whose table has both, rendered from the cells' own results.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest

from openk3.synthetic import cell as cell_module
from openk3.synthetic.cell import CellConfig, run_cell
from openk3.synthetic.mixers import MixerSize

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")
TINY = MixerSize(hidden_size=16, num_layers=1, num_heads=2, head_dim=8)


@pytest.fixture
def synthetic(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import synthetic

    return synthetic


def test_a_cell_stops_once_solved(monkeypatch):
    scores = iter([0.0, 0.5, 0.995, 1.0])
    monkeypatch.setattr(
        cell_module,
        "evaluate",
        lambda *a, **k: {"accuracy": next(scores), "token_accuracy": 0.0, "loss": 1.0},
    )
    config = CellConfig(
        task="stack", mixer="decay", seq_len=40, steps=30, eval_every=2, eval_size=4, batch_size=2,
        stop_at=0.99, size=TINY,
    )  # fmt: skip
    result = run_cell(config)
    assert [p["step"] for p in result["curve"]] == [0, 2, 4]
    assert result["stopped"] == "solved" and result["steps_to_full"] == 4 and result["final"]["step"] == 4


def test_a_cell_stops_at_its_deadline_and_keeps_its_curve():
    config = CellConfig(
        task="mqar", mixer="mla", seq_len=40, steps=50, eval_every=5, eval_size=4, batch_size=2, size=TINY
    )
    result = run_cell(config, deadline=time.time() - 1)
    assert result["stopped"] == "deadline" and [p["step"] for p in result["curve"]] == [0]
    assert run_cell(config.__class__(**{**config.__dict__, "steps": 3}))["stopped"] == "steps"


def test_stop_at_is_checked():
    with pytest.raises(ValueError, match="stop_at"):
        CellConfig(stop_at=1.5)


def test_a_curriculum_continues_the_model_at_each_longer_length(synthetic, monkeypatch, tmp_path):
    lengths = []
    real = cell_module.evaluate

    def evaluate(model, batch, *args, **kwargs):
        lengths.append(batch.tokens_NL.shape[1])
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(cell_module, "evaluate", evaluate)
    config = CellConfig(
        task="stack", mixer="kda", seq_len=24, curriculum=[40, 56], steps=2, eval_every=1, eval_size=4,
        batch_size=2, extrapolate=[2], size=TINY,
    )  # fmt: skip
    result = run_cell(config)
    assert [s["seq_len"] for s in result["stages"]] == [24, 40, 56]
    assert [[p["step"] for p in s["curve"]] for s in result["stages"]] == [[0, 1, 2]] * 3
    assert lengths == [24] * 3 + [40] * 3 + [56] * 3 + [112] and list(result["extrapolation"]) == ["112"]
    assert result["curve"] == result["stages"][0]["curve"]
    # the model carries over: stage 2 starts from stage 1's weights, so its first score is not a fresh model's
    fresh = run_cell(CellConfig(**{**config.__dict__, "seq_len": 40, "curriculum": [], "extrapolate": []}))
    assert result["stages"][1]["curve"][0]["loss"] != fresh["curve"][0]["loss"]
    groups = synthetic._group([result])  # the table and plots: one entry per stage at its own length
    assert sorted(groups) == [("stack", n, "kda") for n in (24, 40, 56)]
    assert groups[("stack", 40, "kda")] == [result["stages"][1]]
    data = {"grid": "gpu", "preset": {"curriculum": True}, "device": "cpu", "torch": "t", "commands": ["c"]}
    (tmp_path / "r.json").write_text(json.dumps({**data, "wall_s": 1.0, "selected": [], "cells": [result]}))
    synthetic.render(tmp_path / "r.json")  # extrapolation is scored from the last stage, 56 tokens
    final = result["stages"][-1]["final"]["accuracy"]
    assert (
        f"| stack | 56 | 0 | {final:.2f} | {result['extrapolation']['112']['accuracy']:.2f} |"
        in (tmp_path / "r.md").read_text()
    )
    cut = run_cell(config, deadline=time.time() - 1)
    assert [s["seq_len"] for s in cut["stages"]] == [24] and cut["stopped"] == "deadline"
    with pytest.raises(ValueError, match="curriculum"):
        CellConfig(seq_len=64, curriculum=[32])
    with pytest.raises(ValueError, match="curriculum_lr"):
        CellConfig(curriculum_lr=0.0)


def test_curriculum_items_grow_the_stored_items_stage_by_stage(synthetic, monkeypatch):
    """Each stage trains and is scored on its own item count; the extrapolation keeps the last one."""
    answers = []
    real = cell_module.evaluate

    def evaluate(model, batch, *args, **kwargs):
        answers.append((batch.tokens_NL.shape[1], int(batch.answer_NL[0].sum())))
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(cell_module, "evaluate", evaluate)
    config = CellConfig(
        task="mqar", mixer="decay", seq_len=24, items=2, curriculum=[40, 64], curriculum_items=[4, 8], steps=1,
        eval_every=1, eval_size=2, batch_size=2, extrapolate=[2], size=TINY,
    )  # fmt: skip
    result = run_cell(config)
    assert [(s["seq_len"], s["items"]) for s in result["stages"]] == [(24, 2), (40, 4), (64, 8)]
    # an MQAR sequence of n pairs scores exactly n answers (each queried key's value)
    assert answers == [(24, 2)] * 2 + [(40, 4)] * 2 + [(64, 8)] * 2 + [(128, 8)]
    with pytest.raises(ValueError, match="one int >= 1 per curriculum length"):
        CellConfig(task="mqar", seq_len=24, items=2, curriculum=[40, 64], curriculum_items=[4])
    with pytest.raises(ValueError, match="8 mqar items need 33 tokens, the curriculum length is 30"):
        CellConfig(task="mqar", seq_len=24, items=2, curriculum=[30], curriculum_items=[8])
    cells = synthetic.grid_cells("recall", "cpu")  # the recall grid doubles the items with each length
    assert {(c.task, c.seq_len, tuple(c.curriculum), tuple(c.curriculum_items)) for c in cells} == {
        ("palindrome", 64, (256, 512), (12, 24)), ("mqar", 64, (256, 512), (8, 16)),
        ("stack", 64, (256, 512), (12, 24)),
    }  # fmt: skip


def test_shards_partition_the_grid(synthetic):
    cells = synthetic.grid_cells("gpu", "cpu")
    ids = [synthetic.cell_id(c) for c in cells]
    assert len(ids) == len(set(ids)) == (3 * 4 + 3) * 2
    assert all(c.curriculum == [256, 512, 1024] for c in cells if c.mixer != "hybrid")
    assert all(c.curriculum == [256] and c.extrapolate == [4, 8] for c in cells if c.mixer == "hybrid")
    for n in (1, 2, 3, 5):
        shards = [
            [synthetic.cell_id(c) for c in synthetic.select(cells, (i, n), None)] for i in range(1, n + 1)
        ]
        assert sum(shards, []) == ids
    first, second = (synthetic.select(cells, (i, 2), None) for i in (1, 2))
    assert {c.seed for c in first} == {0} and {c.seed for c in second} == {1}
    picked = synthetic.select(cells, None, ["mqar/kda/*", "stack/*/64/1"])
    assert [synthetic.cell_id(c) for c in picked] == [
        "mqar/kda/64/0", "mqar/kda/64/1", "stack/kda/64/1", "stack/gdn/64/1", "stack/decay/64/1",
        "stack/mla/64/1", "stack/hybrid/64/1",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="no cell"):
        synthetic.select(cells, None, ["copy/*"])


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--shard", "3/2"], "1 ≤ i ≤ n"), (["--shard", "a"], "i/n"), (["--workers", "0"], "--workers")],
)
def test_bad_arguments_are_refused(synthetic, args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        synthetic.parse_args(args)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def _shard_file(synthetic, path: Path, pattern: str) -> Path:
    """A shard's JSON as ``run_grid`` writes it, from cells trained here for 2 steps (no worker processes)."""
    grid = synthetic.GRIDS["cpu"]
    cells = synthetic.select(synthetic.grid_cells("cpu", "cpu", steps=2), None, [pattern])
    results = [run_cell(CellConfig(**{**c.__dict__, "size": TINY, "eval_size": 4})) for c in cells]
    header = {
        "grid": "cpu", "preset": synthetic.asdict(grid), "device": "cpu", "torch": "t", "workers": 1,
        "commands": [f"python benchmarks/synthetic.py --cells '{pattern}'"], "wall_s": 1.0,
        "selected": [synthetic.cell_id(c) for c in cells],
    }  # fmt: skip
    path.write_text(json.dumps({**header, "cells": results}))
    return path


def test_two_shards_merge_into_one_table(synthetic, tmp_path):
    parts = [_shard_file(synthetic, tmp_path / f"{p[6:9]}.json", p) for p in ("stack/kda/*", "stack/mla/*")]
    merged = synthetic.merge(parts, tmp_path / "synthetic_cpu.json")
    data = json.loads(merged.read_text())
    assert sorted(synthetic.cell_id(r["config"]) for r in data["cells"]) == [
        "stack/kda/32/0",
        "stack/mla/32/0",
    ]
    assert len(data["commands"]) == 2 and "--cells 'stack/mla/*'" in data["commands"][1]
    table = merged.with_suffix(".md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| stack | 32 |"))
    accuracies = [float(e.split(" / ")[0]) for e in row.strip("|").split("|")[2:]]
    assert accuracies == [r["final"]["accuracy"] for r in data["cells"]]
    assert merged.with_suffix(".png").stat().st_size > 0
    other = json.loads(parts[0].read_text())
    other["grid"] = "gpu"
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="grid 'gpu'"):
        synthetic.merge([parts[1], tmp_path / "other.json"], tmp_path / "x.json")


@pytest.mark.slow  # 16–74 s at load averages of 7–9 (the worker processes import torch; 2 steps per cell)
def test_the_grid_runs_end_to_end_in_worker_processes(synthetic, tmp_path, monkeypatch):
    monkeypatch.setitem(
        synthetic.GRIDS,
        "cpu",
        synthetic.Grid(**{**synthetic.GRIDS["cpu"].__dict__, "size": TINY.__dict__, "eval_size": 4}),
    )
    path = synthetic.run_grid("cpu", "cpu", 2, tmp_path, steps=2, patterns=["stack/kda/*", "stack/mla/*"])
    data = json.loads(path.read_text())
    assert sorted(synthetic.cell_id(r["config"]) for r in data["cells"]) == [
        "stack/kda/32/0",
        "stack/mla/32/0",
    ]
    assert all(r["stopped"] == "steps" and r["final"]["step"] == 2 for r in data["cells"])
    assert "| stack | 32 |" in path.with_suffix(".md").read_text()


def _fake_shard(synthetic, path: Path, shard=None, steps=None, **extra) -> Path:
    """A shard JSON's header with no cells (the merge's checks run before any cell is read)."""
    command = "python benchmarks/synthetic.py --grid cpu"
    command += f" --steps {steps}" if steps else ""
    command += f" --shard {shard[0]}/{shard[1]}" if shard else ""
    header = {
        "grid": "cpu", "preset": synthetic.asdict(synthetic.GRIDS["cpu"]), "device": "cpu", "torch": "t",
        "workers": 1, "commands": [command], "wall_s": 1.0, "selected": [], "cells": [],
        "shard": list(shard) if shard else None, "overrides": {"steps": steps}, **extra,
    }  # fmt: skip
    path.write_text(json.dumps(header))
    return path


def _merge_error(synthetic, tmp_path, *files) -> str:
    with pytest.raises(SystemExit) as stop:
        synthetic.main(["--merge", *map(str, files), "--out", str(tmp_path / "out")])
    return str(stop.value.code)


def test_merge_names_a_file_it_cannot_use(synthetic, tmp_path):
    one = _fake_shard(synthetic, tmp_path / "one.json", (1, 2))
    message = _merge_error(synthetic, tmp_path, tmp_path / "absent.json", one)
    assert "absent.json: cannot read it" in message and "\n" not in message
    (tmp_path / "table.md").write_text("# Synthetic tasks\n")
    assert "table.md is not a grid JSON" in _merge_error(synthetic, tmp_path, one, tmp_path / "table.md")
    merged = _fake_shard(synthetic, tmp_path / "synthetic_cpu.json", wall_s=[1.0, 2.0])
    assert "synthetic_cpu.json is not a shard" in _merge_error(synthetic, tmp_path, merged, one)


def test_merge_refuses_other_steps_overlapping_and_missing_shards(synthetic, tmp_path):
    a = _fake_shard(synthetic, tmp_path / "a.json", (1, 2), steps=5)
    b = _fake_shard(synthetic, tmp_path / "b.json", (2, 2), steps=3)
    assert "b.json ran with {'steps': 3}" in _merge_error(synthetic, tmp_path, a, b)
    old = json.loads(b.read_text())
    del old["overrides"], old["shard"]  # a file written before they were recorded: read from its command
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert "old.json ran with {'steps': 3}" in _merge_error(synthetic, tmp_path, a, tmp_path / "old.json")
    third = _fake_shard(synthetic, tmp_path / "third.json", (1, 3), steps=5)
    assert "third.json is shard 1/3" in _merge_error(synthetic, tmp_path, a, third)
    assert "shard 2/2 missing" in _merge_error(synthetic, tmp_path, a)
    part = json.loads(_shard_file(synthetic, tmp_path / "kda.json", "stack/kda/*").read_text())
    part |= {"shard": [1, 2], "overrides": {"steps": None}}
    (tmp_path / "kda.json").write_text(json.dumps(part))
    merged = synthetic.merge([tmp_path / "kda.json"], tmp_path / "synthetic_cpu.json", partial=True)
    assert json.loads(merged.read_text())["missing_shards"] == ["2/2"]
    assert "missing shards, their cells are not counted): 2/2." in merged.with_suffix(".md").read_text()


def test_merge_keeps_the_grid_tag_and_never_overwrites_an_input(synthetic, tmp_path):
    recall = synthetic.asdict(synthetic.GRIDS["recall"])
    a, b = (
        _fake_shard(synthetic, tmp_path / f"{i}.json", (i, 2), grid="recall", preset=recall) for i in (1, 2)
    )
    synthetic.main(["--merge", str(a), str(b), "--out", str(tmp_path / "out")])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "synthetic_cpu_recall.json",
        "synthetic_cpu_recall.md",
    ]
    whole = _fake_shard(synthetic, tmp_path / "synthetic_cpu.json")  # a run of the whole grid, no shard
    before = whole.read_text()
    with pytest.raises(SystemExit) as stop:
        synthetic.main(["--merge", str(whole), "--out", str(tmp_path)])
    assert "is one of the inputs" in str(stop.value.code) and whole.read_text() == before


@pytest.mark.parametrize("value", ["nan", "inf", "0"])
def test_a_budget_must_be_a_finite_number_of_seconds(synthetic, capsys, value):
    with pytest.raises(SystemExit) as stop:
        synthetic.parse_args(["--budget-s", value])
    assert (
        stop.value.code == 2
        and "--budget-s must be a finite number of seconds > 0" in capsys.readouterr().err
    )


class _InProcessPool:
    """``multiprocessing``'s spawn context stand-in: the cells run here, in order, each after 10 ms (a worker's
    start); ``interrupt_after`` results, then Ctrl-C. Records the worker counts asked for."""

    TimeoutError = multiprocessing.TimeoutError

    def __init__(self, interrupt_after=None):
        self.sizes, self.interrupt_after = [], interrupt_after

    def get_context(self, method):
        return self

    def Pool(self, workers, initializer=None):  # noqa: N802 (the name multiprocessing uses)
        self.sizes.append(workers)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def imap_unordered(self, fn, jobs):
        results = map(lambda job: time.sleep(0.01) or fn(job), jobs)  # a worker takes time to start
        outer = self

        class Pending:
            given = 0

            def next(self, timeout=None):
                if self.given == outer.interrupt_after:
                    raise KeyboardInterrupt
                self.given += 1
                return next(results)

        return Pending()


@pytest.fixture
def tiny_cpu_grid(synthetic, monkeypatch):
    monkeypatch.setitem(
        synthetic.GRIDS,
        "cpu",
        synthetic.Grid(**{**synthetic.GRIDS["cpu"].__dict__, "size": TINY.__dict__, "eval_size": 4}),
    )


def test_a_grid_where_no_cell_ran_writes_its_table_without_a_plot(synthetic, tmp_path, monkeypatch):
    pool = _InProcessPool()
    monkeypatch.setattr(synthetic, "multiprocessing", pool)
    synthetic.main(["--budget-s", "0.001", "--cells", "stack/kda/*", "--out", str(tmp_path)])
    assert pool.sizes == [1]  # one selected cell: one worker, not the preset's 2
    table = (tmp_path / "synthetic_cpu.md").read_text()
    assert "0 cells of 1 selected" in table and "No cell finished" in table
    assert not (tmp_path / "synthetic_cpu.png").exists()


def test_ctrl_c_saves_and_renders_the_finished_cells(synthetic, tmp_path, monkeypatch, capsys, tiny_cpu_grid):
    monkeypatch.setattr(synthetic, "multiprocessing", _InProcessPool(interrupt_after=1))
    args = ["--steps", "1", "--cells", "stack/kda/*", "--cells", "stack/mla/*", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as stop:
        synthetic.main(args)
    path = tmp_path / "synthetic_cpu.json"
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 130 and len(err) == 1
    assert err[0] == f"synthetic.py: interrupted: 1 of 2 cells saved in {path}; redraw with --render {path}"
    assert [synthetic.cell_id(r["config"]) for r in json.loads(path.read_text())["cells"]] == [
        "stack/kda/32/0"
    ]
    assert "1 cell of 2 selected" in path.with_suffix(".md").read_text() and path.with_suffix(".png").exists()


def test_bad_selections_and_render_inputs_are_one_line_errors(synthetic, tmp_path):
    def error(*args) -> str:
        with pytest.raises(SystemExit) as stop:
            synthetic.main([*args])
        message = str(stop.value.code)
        assert "\n" not in message and "Traceback" not in message
        return message

    assert "no cell of the grid is selected" in error("--cells", "copy/*", "--out", str(tmp_path / "new"))
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"a": 1}')
    assert "absent.json: cannot read it" in error("--render", str(tmp_path / "absent.json"))
    assert "garbage.json is not a grid JSON (not JSON" in error("--render", str(tmp_path / "garbage.json"))
    assert "other.json is not a grid JSON" in error("--render", str(tmp_path / "other.json"))
    if not synthetic.torch.cuda.is_available():
        assert "--device cuda: torch.cuda.is_available() is False" in error(
            "--device", "cuda", "--out", str(tmp_path / "new")
        )
    assert not (tmp_path / "new").exists()
