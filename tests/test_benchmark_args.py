"""The benchmark scripts refuse bad arguments on any machine, before they ask for a GPU or time anything.

``benchmarks/kda.py`` and ``benchmarks/kda_profile.py`` need CUDA to measure; their argument checks run first,
so a typo costs no device time. Each case calls the script's ``parse_args`` in this process and reads
argparse's exit status (2) and message; one case runs a script as a user would, to check that ``main`` parses
before anything else.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def benchmarks_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


def refusal(script: str, args: list[str], capsys) -> str:
    """argparse's message when ``benchmarks/<script>.py``'s ``parse_args(args)`` refuses them (exit status 2)."""
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(script).parse_args(list(args))
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_a_script_refuses_a_bad_argument_before_anything_else():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kda_profile.py"), "--shape", "1,2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "--shape must be four integers" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sections", "chunks"], "--sections: unknown ['chunks']"),
        (["--shapes", "0"], "--shapes: unknown ['0']"),
        (["--shapes", "1,5"], "--shapes: unknown ['5']"),
        (["--fla-passes", "bwd"], "--fla-passes: unknown ['bwd']"),
        (["--sweep", "--sweep-modules", "tile"], "--sweep-modules: unknown ['tile']"),
        (["--sweep-modules", "tile_prepare"], "--sweep-modules needs --sweep"),
        (["--sweep", "--sweep-modules", "tile_forward"], "--sweep-modules: unknown ['tile_forward']"),
        (["--sweep", "--sweep-shapes", "2"], "--sweep-shapes: unknown ['2']"),
        (["--sweep-shapes", "3"], "--sweep-shapes needs --sweep"),
        (["--sweep-shapes", "1"], "--sweep-shapes needs --sweep"),
        (["--sweep", "--sweep-shapes", ","], "--sweep-shapes: give at least one shape"),
        (["--sections", "breakdown", "--breakdown-shapes", "2"], "--breakdown-shapes: unknown ['2']"),
        (["--sections", "chunk", "--breakdown-shapes", "3"], "--breakdown-shapes needs --sections"),
        (["--sections", "breakdown", "--breakdown-shapes", ","], "--breakdown-shapes: give at least one"),
        (["--set", "chunk_state:num_warps=3"], "unrecognized arguments: --set"),
        (["--iters", "0"], "--iters must be in [1, 1000]"),
        (["--iters", "100000"], "--iters must be in [1, 1000]"),
        (["--shapes", "1,1"], "--shapes: '1,1' names one twice"),
        (["--shapes", ",,"], "--shapes: give at least one shape number"),
        (["--sweep", "--sweep-shapes", "3,3"], "--sweep-shapes: '3,3' names one twice"),
        (["--sections", ","], "--sections: give at least one"),
        (["--out", str(ROOT / "pyproject.toml")], "exists and is not a directory"),
        (["--out", str(ROOT / "pyproject.toml" / "sub")], "pyproject.toml exists and is not a directory"),
        (["--out", "a" * 300], "File name too long"),
        (["--autotune-cache", str(ROOT / "pyproject.toml")], "--autotune-cache"),
    ],
)
def test_kda_benchmark_refuses_bad_arguments(args, message, capsys):
    assert message in refusal("kda", args, capsys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kernels-of", "ours", "--fla"], "not allowed with argument"),
        (["--launch", "prep"], "--launch must be one of"),
        (["--launch", "grad_wy", "--kernels-of", "fla"], "give one"),
        (["--kernels-of", "chunks"], "invalid choice: 'chunks'"),
        (["--shape", "1,2"], "--shape must be four integers"),
        (["--shape", "1,0,4,64"], "--shape needs positive sizes"),
        (["--shape", "1,64,2,100"], "the head dim D must be one of"),
    ],
)
def test_kda_profile_refuses_bad_arguments(args, message, capsys):
    assert message in refusal("kda_profile", args, capsys)


def test_kda_benchmark_options_are_a_typed_argument():
    """The trades are flags that build one ``KDAOptions`` for ours (no module setting to patch)."""
    import kda

    from openk3.ops.kda.triton.config import KDAOptions

    assert kda.parse_args([]).options == KDAOptions()
    assert kda.parse_args(["--keep-residuals"]).options == KDAOptions(keep_residuals=True)
    assert kda.parse_args(["--fp32-gated-keys"]).options == KDAOptions(fp32_gated_keys=True)


def test_tune_sums_each_configuration_over_the_swept_shapes():
    """``--tune`` picks per kernel the geometry with the least time summed over every swept shape, and drops
    one that failed at any shape, timed nothing or misses a shape; :func:`swept` turns the picks into a
    ``LaunchConfig`` and refuses a field or kernel it lacks."""
    import kda

    from openk3.ops.kda.triton.config import DEFAULT_GEOMETRY

    rows = [
        {"module": "chunk_state", "config": {}, "shape": "a", "ms": {"x": 1.0, "y": 1.0}},
        {"module": "chunk_state", "config": {}, "shape": "b", "ms": {"x": 5.0, "y": 1.0}},
        {"module": "chunk_state", "config": {"num_stages": 2}, "shape": "a", "ms": {"x": 1.5, "y": 1.0}},
        {"module": "chunk_state", "config": {"num_stages": 2}, "shape": "b", "ms": {"x": 3.0, "y": 1.0}},
        {"module": "tile_recurrence", "config": {}, "shape": "a", "ms": {"x": 2.0}},
        {"module": "tile_recurrence", "config": {"value_block": 16}, "shape": "a", "ms": {"x": 1.0}},
        {"module": "tile_recurrence", "config": {"value_block": 16}, "shape": "b", "ms": {"error": "boom"}},
        {"module": "tile_recurrence", "config": {}, "shape": "b", "ms": {"x": 2.0}},
        {
            "module": "tile_recurrence",
            "config": {"value_block": 64},
            "shape": "a",
            "ms": {"x": 0.5},
        },  # no "b"
        {"module": "tile_recurrence", "config": {"value_block": 32}, "shape": "a", "ms": {}},  # timed nothing
        {"module": "tile_recurrence", "config": {"value_block": 32}, "shape": "b", "ms": {}},
    ]
    best = kda.tune(rows)
    assert best == {"chunk_state": {"num_stages": 2}, "tile_recurrence": {}}
    launch = kda.swept(best)
    assert launch.chunk_state.num_stages == 2 and launch.tile_recurrence == DEFAULT_GEOMETRY.tile_recurrence
    assert DEFAULT_GEOMETRY.chunk_state.num_stages == 1  # the default is a value, untouched
    with pytest.raises(ValueError, match="chunk_state: .*bogus"):
        kda.swept({"chunk_state": {"bogus": 1}})
    with pytest.raises(ValueError, match="no kernel 'chunk_function'"):
        kda.swept({"chunk_function": {"num_warps": 4}})


def test_every_swept_configuration_is_a_valid_geometry():
    """Each ``SWEEP`` entry builds a ``LaunchConfig`` (a stale field would otherwise time the defaults under
    another name) and changes it; each kernel's timed launches exist."""
    import kda

    for module, configs in kda.SWEEP.items():
        assert set(kda.SWEEP_KERNELS[module]) <= set(kda.KERNEL_NAMES), module
        for config in configs:
            launch = kda.swept({module: config})
            assert (launch == kda.DEFAULT_GEOMETRY) == (config == {}), (module, config)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--sizes", "448,1792", "--batch", "8"], "one value per size"),
        (["--sizes", "450", "--batch", "1"], "multiples of 28 up to 3584"),
        (["--sizes", "3612", "--batch", "1"], "multiples of 28 up to 3584"),
        (["--iters", "0"], "--iters must be >= 1"),
    ],
)
def test_vision_benchmark_refuses_bad_arguments(args, match, capsys):
    assert match in refusal("vision", args, capsys)


@pytest.mark.parametrize("shape", ["1x10", "1x0x4x64", "axbxcxd"])
def test_kda_cpu_benchmark_refuses_malformed_shapes(shape, capsys):
    """``benchmarks/kda_cpu.py --shapes`` wants ``BxTxHxK`` with four positive integers."""
    assert f"--shapes: {shape!r} is not BxTxHxK" in refusal("kda_cpu", ["--shapes", shape], capsys)


def test_autotune_results_copied_by_relative_path(monkeypatch, tmp_path):
    """``--autotune-cache``'s copy keeps each ``<key>/<kernel>.autotune.json`` file at its relative path (Triton
    finds a result by that key directory) with its mode, and takes nothing else; a missing source has none,
    a directory given as its own destination (or linked to it) is counted without a copy, and a result that
    cannot be written is reported, not raised, after the others are copied."""
    import kda

    cache, kept = tmp_path / "triton", tmp_path / "kept"
    (cache / "KEY1").mkdir(parents=True)
    (cache / "KEY2").mkdir()
    (cache / "KEY1" / "chunk_kernel.autotune.json").write_text('{"key": [1]}')
    (cache / "KEY2" / "other_kernel.autotune.json").write_text('{"key": [2]}')
    (cache / "KEY2" / "other_kernel.cubin").write_bytes(b"\0")
    (cache / "KEY2" / "dir.autotune.json").mkdir()  # not a file: skipped
    (cache / "top.autotune.json").write_text("{}")  # not under a key directory: skipped
    assert kda.copy_autotune_results(kept, cache) == (0, [])
    assert kda.copy_autotune_results(cache, kept) == (2, [])
    assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*") if p.is_file()) == [
        "KEY1/chunk_kernel.autotune.json", "KEY2/other_kernel.autotune.json",
    ]  # fmt: skip
    fresh = tmp_path / "fresh"
    assert kda.copy_autotune_results(kept, fresh) == (2, [])
    assert (fresh / "KEY2" / "other_kernel.autotune.json").read_text() == '{"key": [2]}'
    # the kept directory may be Triton's cache itself, or a link to it: counted, left as it is
    assert kda.copy_autotune_results(cache, cache / ".") == (2, [])
    (tmp_path / "link").symlink_to(cache)
    assert kda.copy_autotune_results(cache, tmp_path / "link") == (2, [])
    assert (cache / "KEY1" / "chunk_kernel.autotune.json").read_text() == '{"key": [1]}'
    # a link to nothing is not a result: skipped
    (cache / "KEY0").mkdir()
    (cache / "KEY0" / "gone.autotune.json").symlink_to(tmp_path / "nothing")
    # a result whose target is in the way is reported, not raised, after the others are copied
    (cache / "KEY3").mkdir()
    (cache / "KEY3" / "late.autotune.json").write_text('{"key": [3]}')
    blocked = tmp_path / "blocked"
    (blocked / "KEY3").mkdir(parents=True)
    (blocked / "KEY3" / "late.autotune.json").mkdir()  # the target is a directory: cannot be replaced
    copied, problems = kda.copy_autotune_results(cache, blocked)
    assert copied == 2 and len(problems) == 1 and "late.autotune.json" in problems[0], problems
    assert not [p for p in (blocked / "KEY3").iterdir() if p.name.startswith(".")]  # no temporary left
    assert oct((blocked / "KEY1" / "chunk_kernel.autotune.json").stat().st_mode & 0o777) == oct(
        (cache / "KEY1" / "chunk_kernel.autotune.json").stat().st_mode & 0o777
    )  # the source's mode, not the temporary file's 0600


def test_directory_arguments_refuse_an_empty_name(capsys):
    """``--out ""`` and ``--autotune-cache=`` would name the current directory unseen, and ``~nosuchuser``
    has no home: refused with a usage error, not a traceback."""
    for args, message in (
        (["--out", ""], "give a directory name"),
        (["--autotune-cache="], "give a directory name"),
        (["--out=~nosuchuser_openk3/x"], "no such user's home directory"),
    ):
        assert message in refusal("kda", args, capsys)


def test_directory_argument_expands_a_leading_tilde(monkeypatch, tmp_path):
    """``--out=~/x`` (no shell expansion after ``=``) means the home directory's ``x``; ``./~`` stays a
    directory named ``~``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    import kda

    assert kda.directory_argument("~/x") == tmp_path / "x"
    assert kda.directory_argument("./~").name == "~"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sections", "gemm,loss"], "--sections: unknown ['loss']"),
        (["--device", "cuda", "--quick"], "--quick is the CPU size"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--experts", "4"], "--top-k must be between 1 and --experts (4), got 8"),
    ],
)
def test_mxfp4_benchmark_refuses(args, message, capsys):
    assert message in refusal("mxfp4", args, capsys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--micro-batch-size", "3"], "--micro-batch-size 3 must divide --batch-size 16"),
        (["--micro-batch-size", "0"], "--micro-batch-size 0 must divide"),
        (["--activation-checkpointing", "some"], "invalid choice: 'some'"),
    ],
)
def test_train_throughput_refuses(args, message, capsys):
    assert message in refusal("train_throughput", args, capsys)


def test_train_throughput_plans_the_given_micro_batch_and_checkpointing(monkeypatch):
    """The planned row runs the micro-batch and checkpointing given on the command line (the planner's own
    choice otherwise), and the comparison with transformers keeps its own planner's choice."""
    import train_throughput as tt

    seen = []
    monkeypatch.setattr(tt, "time_openk3", lambda *a, **k: seen.append(a[4]) or {"phases": {}, "step_s": 1.0})
    monkeypatch.setattr(tt.openk3, "build_model", lambda *a, **k: torch.nn.Linear(2, 2))
    monkeypatch.setattr(tt, "wrap_decoder_layers", lambda model, mode, compile: seen.append(mode))
    monkeypatch.setattr(tt, "build_optimizer", lambda model, lr: None)
    monkeypatch.setattr(tt, "QuantileBalancer", lambda model: None)
    args = tt.parse_args(["--micro-batch-size", "4", "--activation-checkpointing", "full"])
    row, _ = tt.planned_row("k3-1b", tt.get_preset("k3-1b"), args, torch.device("cpu"), 10**15, False)
    assert (row["micro_batch"], row["grad_accum"], row["checkpointing"]) == (4, 4, "full")
    assert seen == ["full", 4]
    planner, _ = tt.planned_row(
        "k3-1b", tt.get_preset("k3-1b"), tt.parse_args([]), torch.device("cpu"), 10**15, False
    )
    assert (planner["micro_batch"], planner["checkpointing"]) == (16, "none")
