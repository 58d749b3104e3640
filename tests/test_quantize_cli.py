"""``openk3 quantize`` refusals: it never packs a training run's checkpoint in place (text or vision), and it
names a model without routed experts instead of writing a quantization_config for nothing."""

from __future__ import annotations

import hashlib

import pytest

import openk3
from openk3.checkpoint.out_folder import out_dir_problem
from openk3.cli import main
from openk3.presets import dense_baseline, k3_shaped
from openk3.quant.scheme import expert_scheme
from vision_tiny import tiny_config

VOCAB = 512


def digest(folder) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


@pytest.fixture
def vision_run(tmp_path):
    """A run folder as ``openk3 train-vision`` leaves it: checkpoints/step-000006 (no trainer_state.pt),
    checkpoints/latest and metrics.jsonl."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-000006"
    model = openk3.build_model(tiny_config(vocab_size=VOCAB, placeholder=VOCAB - 1), seed=0)
    openk3.save_pretrained(model, ckpt, tokenizer=None)
    (run / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    (run / "metrics.jsonl").write_text("{}\n")
    return run, ckpt


def test_quantize_refuses_to_replace_a_vision_checkpoint(vision_run, capsys):
    run, ckpt = vision_run
    before = digest(ckpt)
    for src, out, says in [
        (ckpt, ckpt, "is the --ckpt checkpoint itself; refusing to replace it"),
        (run, ckpt, "is the --ckpt checkpoint itself; refusing to replace it"),
        (ckpt, run / "checkpoints" / "step-000007", "is inside the training run's checkpoints folder"),
    ]:
        assert main(["quantize", "--ckpt", str(src), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"--out {out} {says}" in err, err
    assert digest(ckpt) == before
    assert not (run / "checkpoints" / "step-000007").exists()


def test_quantize_writes_a_vision_checkpoint_outside_the_run(vision_run, tmp_path, capsys):
    """The guard is about run folders, not names: a ``checkpoints`` folder of one's own takes the output."""
    run, ckpt = vision_run
    before = digest(ckpt)
    out = tmp_path / "mine" / "checkpoints" / "packed"
    assert main(["quantize", "--ckpt", str(run), "--out", str(out)]) == 0
    assert "routed experts in MXFP4" in capsys.readouterr().out
    packed = openk3.from_pretrained(out)
    assert expert_scheme(packed.config) is not None
    assert packed.config.vision_config is not None
    assert digest(ckpt) == before


def test_quantize_refuses_a_model_without_routed_experts(tmp_path, capsys):
    src = tmp_path / "dense"
    openk3.save_pretrained(
        openk3.build_model(dense_baseline(k3_shaped(4, vocab_size=VOCAB)), seed=0), src, tokenizer=None
    )
    assert main(["quantize", "--ckpt", str(src), "--out", str(tmp_path / "packed")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("has no routed experts (a dense model): nothing to pack in MXFP4"), err
    assert not (tmp_path / "packed").exists()


def test_quantize_refuses_any_existing_out_naming_it(tmp_path, capsys):
    """``--out RUN/final`` (a distributed run's export) from another checkpoint, a training run, a folder of
    one's own: one line names the path and what it holds, and nothing there changes."""
    model = openk3.build_model(k3_shaped(4, vocab_size=VOCAB), seed=0)
    run, src = tmp_path / "run", tmp_path / "src"
    openk3.save_pretrained(model, run / "final", tokenizer=None)
    (run / "data").mkdir()
    openk3.save_pretrained(model, src, tokenizer=None)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    for out, held in [
        (run / "final", "a checkpoint (config.json)"),
        (run, "files (data, final)"),
        (notes, "files (todo.txt)"),
        (notes / "todo.txt", "a file"),
    ]:
        before = digest(out) if out.is_dir() else out.read_bytes()
        assert main(["quantize", "--ckpt", str(src), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"openk3: error: --out {out} already exists and holds {held}; refusing to overwrite it: choose a "
            f"new folder (or delete {out} first)\n"
        ), err
        assert (digest(out) if out.is_dir() else out.read_bytes()) == before
    (tmp_path / "empty").mkdir()  # an empty folder is a new one
    assert main(["quantize", "--ckpt", str(src), "--out", str(tmp_path / "empty")]) == 0
    assert expert_scheme(openk3.from_pretrained(tmp_path / "empty").config) is not None


def test_an_interrupted_quantize_leaves_no_folder(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the shards are written: ``--out`` does not appear and no temporary folder is left."""
    import openk3.checkpoint.io as io

    src = tmp_path / "src"
    openk3.save_pretrained(openk3.build_model(k3_shaped(4, vocab_size=VOCAB), seed=0), src, tokenizer=None)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(io, "save_file", interrupted)
    assert main(["quantize", "--ckpt", str(src), "--out", str(tmp_path / "packed")]) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_quantize_refuses_an_out_where_no_folder_can_be_made(tmp_path, capsys, monkeypatch):
    """``--out /proc/q`` (nothing can be made in ``/proc``, not even by root) or a path through a file: one line
    names ``--out``'s path, not the temporary folder the write would have used, before the model loads."""
    import openk3.checkpoint

    src = tmp_path / "src"
    openk3.save_pretrained(openk3.build_model(k3_shaped(4, vocab_size=VOCAB), seed=0), src, tokenizer=None)
    monkeypatch.setattr(openk3.checkpoint, "from_pretrained", lambda *a, **k: pytest.fail("loaded the model"))
    for out, says in [
        ("/proc/q", "cannot create /proc/q (No such file or directory)"),
        (str(src / "config.json" / "q"), f"{src / 'config.json'} exists and is not a directory"),
    ]:
        assert main(["quantize", "--ckpt", str(src), "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"openk3: error: --out {out}: {says}") and err.count("\n") == 1, err
        assert ".tmp-" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_out_dir_problem_names_the_path_that_cannot_be_made_and_its_own_reason(tmp_path):
    """The reason is the OS's for the named path: the first missing part is made (and removed) itself, and an
    existing folder is probed by making a folder in it; a creatable path leaves nothing behind."""
    assert out_dir_problem("/proc/q") == "--out /proc/q: cannot create /proc/q (No such file or directory)"
    assert (
        out_dir_problem("/proc/x/y", "--dir")
        == "--dir /proc/x/y: cannot create /proc/x (No such file or directory)"
    )
    assert out_dir_problem("/proc") == (
        "--out /proc: /proc is not writable (creating a folder in it fails: No such file or directory)"
    )
    (tmp_path / "f").write_text("")
    assert (
        out_dir_problem(tmp_path / "f" / "q")
        == f"--out {tmp_path / 'f' / 'q'}: {tmp_path / 'f'} exists and is not a directory"
    )
    assert out_dir_problem(tmp_path / "a" / "b") is None and out_dir_problem(tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
