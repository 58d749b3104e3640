"""What a new user's trial of training, evaluation and generation found: a context schedule that shrinks or
outlasts the run, a ``--resume`` of a run killed before its first checkpoint, a distributed run's DCP step
folder given to ``eval``/``generate``, and samples that did not end their line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import openk3
from openk3.cli import main
from openk3.presets import get_preset
from openk3.train.trainer import TrainConfig, Trainer
from test_cli_user import TEXT

SMALL = ["--batch-size", "2", "--warmup-steps", "0", "--eval-every", "100", "--no-sample"]
"""Flags of a small, fast run (2 sequences per step)."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Eight small works: a val split of a few hundred tokens, so a run's final evaluation is quick."""
    folder = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(TEXT * 2):
        (folder / f"work{i}.txt").write_text(text * 10)
    return folder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A k3-tiny checkpoint (random weights) with a small BPE tokenizer, outside any run folder."""
    from openk3.data import Tokenizer

    folder = tmp_path_factory.mktemp("ckpt") / "k3-tiny"
    openk3.save_pretrained(openk3.build_model(get_preset("k3-tiny"), seed=0), folder)
    Tokenizer.train([t * 20 for t in TEXT], 300).save(folder)
    return folder


def test_a_shrinking_or_late_context_schedule_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """A context schedule only grows, within the run's steps: ``0:32,2:16,3:24`` and entries at or past
    ``--steps`` were accepted (the run then evaluated at a length it never trained on). Each is one line
    naming the entries, before the data (a missing corpus here) is read, and, under ``--nproc-per-node``,
    before any rank starts; so is a schedule written with a leading ``-`` (``--context-schedule -1:64``)."""
    import openk3.dist.launch

    out = tmp_path / "run"
    base = ["train", "--out", str(out), "--data", str(tmp_path / "no-corpus"), "--no-sample"]
    cases = [
        (["--steps", "3", "--context-schedule", "0:32,2:16,3:24"],
         "context schedule '0:32,2:16,3:24': 2:16, 3:24 shorten the context, which only grows over training "
         "(progressive context): make each length at least the one before"),
        (["--steps", "3", "--context-schedule", "0:32,2:48,3:64"],
         "context schedule '0:32,2:48,3:64': 3:64 starts at or after --steps 3, so the run would never train "
         "at that length, yet its evaluations would use the longest: drop it or raise --steps"),
        (["--context-schedule", "0:32,200:64,300:128"],
         "context schedule '0:32,200:64,300:128': 200:64, 300:128 start at or after --steps 200 (the "
         "default), so the run would never train at those lengths, yet its evaluations would use the "
         "longest: drop them or raise --steps"),
        # a value that starts with '-' reached argparse as a flag ("expected one argument")
        (["--context-schedule", "-1:64"], "context schedule '-1:64': the first entry must start at step 0"),
        (["--context-schedule=-1:64"], "context schedule '-1:64': the first entry must start at step 0"),
    ]  # fmt: skip
    monkeypatch.setattr(openk3.dist.launch, "launch", lambda *a: pytest.fail("the ranks were started"))
    for flags, line in cases:
        for launcher in ([], ["--nproc-per-node", "2"]):
            assert main([*base, *flags, *launcher]) == 2
            assert capsys.readouterr().err == f"openk3: error: {line}\n"
    assert not out.exists()
    with pytest.raises(ValueError, match=r"context schedule \[\(0, 32\), \(2, 16\)\]: 2:16 shortens"):
        TrainConfig(context_schedule=[(0, 32), (2, 16)])  # the Python API refuses it too
    assert TrainConfig(context_schedule=[(0, 32), (2, 32), (4, 48)]).context_schedule[-1] == (4, 48)


class _Killed(BaseException):
    """Stands for ``kill -9``: not an ``Exception``, and no Ctrl-C (which would save a checkpoint)."""


def test_resume_of_a_run_killed_before_its_first_checkpoint_says_so(corpus, tmp_path, capsys, monkeypatch):
    """A run killed at step 2 of 50, before its first save at step 20, has data, a train config and two
    metrics rows but no checkpoint: ``--resume`` said only "no checkpoint at RUN (expected a model folder
    …)". It now names the step it reached and the first save, and says to start again without
    ``--resume``, which works in the same folder; there a typed context schedule past ``--steps`` is refused
    once the run's steps are read."""
    run = tmp_path / "run"
    flags = ["train", "--data", str(corpus), "--out", str(run), "--context-schedule", "0:16", *SMALL]
    step = Trainer.train_step

    def killed_after_two(self):
        if self.step == 2:
            raise _Killed
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", killed_after_two)
    with pytest.raises(_Killed):
        main([*flags, "--steps", "50", "--save-every", "20"])
    monkeypatch.undo()
    assert not (run / "checkpoints").exists() and (run / "train_config.json").is_file()
    capsys.readouterr()
    line = (
        f"--resume: run folder {run} has no checkpoint yet: it stopped at step 2 (metrics.jsonl), before its "
        "first save at step 20 (--save-every 20); start it again without --resume (the same flags and --out: "
        "its prepared data is re-used) or with a fresh --out"
    )
    assert main(["train", "--out", str(run), "--resume"]) == 2
    assert capsys.readouterr().err == f"openk3: error: {line}\n"
    with pytest.raises(FileNotFoundError) as error:  # the Python API gives the same line
        Trainer(TrainConfig(data=str(corpus), out=str(run), context_schedule=[(0, 16)]), resume=True)
    assert str(error.value) == line
    assert main(["train", "--out", str(tmp_path / "none"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: there is no run at {tmp_path / 'none'} (no such folder): start it without" in err
    (tmp_path / "empty").mkdir()
    assert main(["train", "--out", str(tmp_path / "empty"), "--resume"]) == 2
    assert f"--resume: {tmp_path / 'empty'} holds no run (no checkpoints/" in capsys.readouterr().err
    # the advice works: the same folder, without --resume
    assert main([*flags, "--steps", "1"]) == 0
    assert (run / "checkpoints" / "step-000001" / "trainer_state.pt").is_file()
    capsys.readouterr()
    metrics = (run / "metrics.jsonl").read_text()
    assert (
        main(["train", "--out", str(run), "--resume", "--steps", "3", "--context-schedule", "0:16,3:24"]) == 2
    )
    assert "context schedule '0:16,3:24': 3:24 starts at or after --steps 3" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == metrics  # refused before the run was touched


@pytest.fixture(scope="module")
def dcp_run(ckpt, corpus, tmp_path_factory):
    """A run folder as ``openk3 train --nproc-per-node N`` leaves it before its end: ``data/`` (splits and
    tokenizer) and ``checkpoints/step-000001``, a DCP folder written by :func:`openk3.dist.checkpoint.
    save_checkpoint` itself (in a one-rank gloo group) from a k3-tiny model after one optimizer step, with the
    optimizer state beside the model as the trainer saves it; and the same weights as a Hugging Face folder
    (``save_pretrained``, the single-process way). Returns ``(run, model folder, model)``."""
    import torch.distributed as dist

    from openk3.data import prepare_data
    from openk3.dist.checkpoint import save_checkpoint
    from openk3.train.optim import build_optimizer

    root = tmp_path_factory.mktemp("dcp")
    run = root / "run"
    prepare_data(
        corpus, out_dir=run / "data", vocab_size=8192, tokenizer=ckpt, val_fraction=0.25, progress=False
    )
    model = openk3.build_model(get_preset("k3-tiny"), seed=1)
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    optimizer.step()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        save_checkpoint(run / "checkpoints", 1, model, optimizer, extra={"data_position": 1})
    finally:
        dist.destroy_process_group()
    openk3.save_pretrained(model, root / "hf", tokenizer=str(run / "data" / "tokenizer"))
    return run, root / "hf", model


def test_eval_and_generate_read_a_dcp_step_folder(dcp_run, tmp_path, capsys):
    """``eval``/``generate --ckpt RUN/checkpoints/step-N`` of a distributed run said only "no checkpoint":
    the step folder is now read in one process (``torch.distributed.checkpoint`` without a process group),
    bit for bit the weights saved, so the loss and the greedy text are those of the same weights saved the
    single-process way; ``--ckpt RUN`` of a distributed run without ``RUN/final`` reads its newest step."""
    import shutil

    from openk3.checkpoint import latest_checkpoint

    run, hf, model = dcp_run
    step = run / "checkpoints" / "step-000001"
    windows = ["--seq-len", "16", "--batch-size", "4", "--max-batches", "3"]
    val = str(run / "data" / "val.bin")
    lines = []
    for ckpt in (step, run, hf):
        assert main(["eval", "--ckpt", str(ckpt), *windows, *(["--data", val] if ckpt == hf else [])]) == 0
        lines.append(capsys.readouterr().out)
    assert lines[0] == lines[1] == lines[2] and lines[0].startswith("val loss "), lines
    gen = ["generate", "--prompt", "ROMEO.", "--max-new-tokens", "6", "--temperature", "0"]
    outs = []
    for ckpt in (step, hf):
        assert main([*gen, "--ckpt", str(ckpt)]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].startswith("ROMEO.")
    assert list(step.parent.iterdir()) == [step]  # nothing was written into the run's checkpoints
    from openk3.checkpoint.dcp_step import load_dcp_model

    loaded = load_dcp_model(step).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())

    # what still cannot read one says what it is and what reads it; a step folder outside its run is named
    with pytest.raises(FileNotFoundError, match=r"this is a distributed checkpoint \(DCP\): `openk3 eval`"):
        latest_checkpoint(step)
    shutil.copytree(step, tmp_path / "step-000001")
    assert main(["eval", "--ckpt", str(tmp_path / "step-000001"), "--data", val]) == 2
    assert capsys.readouterr().err == (
        f"openk3: error: {tmp_path / 'step-000001'} is a distributed checkpoint (DCP) outside its run folder, "
        "so its run's tokenizer (RUN/data/tokenizer) is not found: read it in place (RUN/checkpoints/step-N), "
        "or use RUN/final\n"
    )


def test_every_sample_ends_its_line(ckpt, capsys, monkeypatch):
    """``generate --num-samples 2``: a sample that ends inside a multi-byte character lost that text (held
    back for bytes that never came), and one stopped by Ctrl-C left the line open, so the next line (the
    error, the shell prompt) joined it. The held-back bytes are now written (as U+FFFD) and every sample ends
    with a newline, however it ends."""
    import openk3.generate
    from openk3.data import Tokenizer

    tok = Tokenizer.load(ckpt)
    soft = tok.encode(" soft")
    euro = tok.encode("€")  # three byte tokens: the first two are an unfinished character
    assert tok.decode(euro[:2]).endswith("\ufffd") and len(euro) == 3
    samples = [soft + euro[:2], soft]
    calls = []

    def stream(*args, **kwargs):  # the model's tokens, scripted: sample 2 is stopped by Ctrl-C
        calls.append(args)
        for token in samples[len(calls) - 1]:
            yield torch.tensor([[token]])
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(openk3.generate, "stream", stream)
    argv = ["generate", "--ckpt", str(ckpt), "--prompt", "ROMEO.", "--num-samples", "2", "--seed", "1"]
    assert main(argv) == 130
    captured = capsys.readouterr()
    assert captured.out == (
        f"--- sample 1/2 ---\nROMEO.{tok.decode(soft + euro[:2])}\n--- sample 2/2 ---\nROMEO.{tok.decode(soft)}\n"
    )
    assert captured.err == "openk3: interrupted\n"
