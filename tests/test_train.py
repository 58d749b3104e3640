"""Training loop: exact resume, checkpoints, logs, schedules, CLI smoke run (small and fast)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import openk3
from openk3.cli import main
from openk3.train.metrics import read_metrics
from openk3.train.schedule import effective_warmup, lr_factor, parse_context_schedule, seq_len_at
from openk3.train.state import latest_checkpoint
from openk3.train.trainer import TrainConfig, Trainer, train, unigram_entropy

TEXT = [
    "ROMEO. But soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n",
    "HAMLET. To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "MACBETH. Tomorrow, and tomorrow, and tomorrow,\nCreeps in this petty pace from day to day,\n",
    "LEAR. Blow, winds, and crack your cheeks! rage! blow!\nYou cataracts and hurricanoes, spout\n",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(TEXT * 2):
        (folder / f"work{i}.txt").write_text(text * 40)
    return str(folder)


def small(corpus, out, **kw) -> TrainConfig:
    base = dict(
        preset="k3-tiny",
        data=corpus,
        out=str(out),
        steps=6,
        batch_size=2,
        context_schedule=[(0, 32), (3, 48)],
        warmup_steps=2,
        eval_every=3,
        eval_batches=2,
        final_eval_batches=2,
        save_every=3,
        sample_prompt=None,
        val_fraction=0.25,
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.slow  # trains k3-tiny for dozens of steps: minutes on a 2-core CPU
def test_resume_is_exact(corpus, tmp_path):
    straight = train(small(corpus, tmp_path / "a"), progress=False)
    first = train(small(corpus, tmp_path / "b", stop_at_step=3), progress=False)
    assert first["interrupted"] and first["step"] == 3
    resumed = train(small(corpus, tmp_path / "b"), resume=True, progress=False)
    assert resumed["step"] == straight["step"] == 6
    a = read_metrics(tmp_path / "a" / "metrics.jsonl")
    b = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b):
        assert ra["loss"] == rb["loss"], (ra["step"], ra["loss"], rb["loss"])
    assert a[-1]["val_loss"] == b[-1]["val_loss"]
    wa = openk3.from_pretrained(latest_checkpoint(tmp_path / "a")).state_dict()
    wb = openk3.from_pretrained(latest_checkpoint(tmp_path / "b")).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_run_folder_contents(corpus, tmp_path, capsys):
    summary = train(small(corpus, tmp_path / "run", steps=3, context_schedule=[(0, 32)]), progress=True)
    run = tmp_path / "run"
    # the run folder is named before any work starts
    assert (
        capsys.readouterr().out.splitlines()[0]
        == f"training in {run} (metrics.jsonl, loss.png, checkpoints/)"
    )
    rows = read_metrics(run / "metrics.jsonl")
    for row in rows:
        assert {"step", "loss", "lr", "tokens_per_s", "maxvio"} <= row.keys()
        assert math.isfinite(row["loss"]) and row["maxvio"] >= 0
    assert "val_loss" in rows[-1] and "val_loss" in rows[2]
    assert (run / "loss.png").stat().st_size > 1000
    ckpt = latest_checkpoint(run)
    assert ckpt.name == "step-000003" and (ckpt / "tokenizer.json").is_file()
    assert json.loads((run / "train_config.json").read_text())["steps"] == 3
    model = openk3.from_pretrained(ckpt)
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 8192)
    assert summary["val_loss"] == rows[-1]["val_loss"]


@pytest.mark.slow  # trains k3-tiny for dozens of steps: minutes on a 2-core CPU
def test_loss_decreases_and_balancing_moves_bias(corpus, tmp_path):
    t = Trainer(
        small(corpus, tmp_path / "run", steps=12, lr=1e-2, context_schedule=[(0, 32)]), progress=False
    )
    bias0 = t.model.language_model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.clone()
    first = t.train_step()["loss"]
    for _ in range(11):
        last = t.train_step()["loss"]
    assert last < first - 1.0
    bias = t.model.language_model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias
    assert not torch.equal(bias, bias0) and abs(bias.mean().item()) < 1e-5


def test_schedules():
    assert lr_factor(0, 100, 10) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10) == pytest.approx(1.0)
    assert lr_factor(100, 100, 10, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(55, 100, 10, min_lr_ratio=0.0) == pytest.approx(0.5)
    assert lr_factor(50, 100, 10, kind="wsd") == 1.0 and lr_factor(99, 100, 10, kind="wsd") == pytest.approx(
        0.1
    )
    sched = parse_context_schedule("0:64,10:128,20:256")
    assert [seq_len_at(s, sched) for s in (0, 9, 10, 19, 20, 1000)] == [64, 64, 128, 128, 256, 256]
    for bad in ("10:64", "0:64,0:128", "0:x", "0:0"):
        with pytest.raises(ValueError, match=f"context schedule '{bad}': "):  # the text as typed
            parse_context_schedule(bad)
    with pytest.raises(ValueError, match="balance"):
        TrainConfig(balance="magic")


def test_unigram_entropy():
    assert unigram_entropy([0, 1, 2, 3]) == pytest.approx(math.log(4))
    assert unigram_entropy([5, 5, 5]) == 0.0


def test_cli_train_generate_eval(corpus, tmp_path, capsys):
    out = tmp_path / "cli"
    args = [
        "train",
        "--data",
        corpus,
        "--out",
        str(out),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--context-schedule",
        "0:32",
        "--eval-every",
        "2",
        "--no-sample",
    ]
    assert main(args) == 0
    assert "val loss" in capsys.readouterr().out
    assert (
        main(["generate", "--ckpt", str(out), "--prompt", "ROMEO.", "--max-new-tokens", "5", "--seed", "0"])
        == 0
    )
    assert capsys.readouterr().out.startswith("ROMEO.")
    assert main(["eval", "--ckpt", str(out), "--seq-len", "32", "--max-batches", "2"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["generate", "--ckpt", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    with pytest.raises(SystemExit, match="2"):
        main(["generate", "--ckpt", str(out), "--prompt", "x", "--temperature", "-1"])


def test_refuses_to_overwrite_a_run_without_resume(corpus, tmp_path):
    train(small(corpus, tmp_path / "run", steps=1, context_schedule=[(0, 32)]), progress=False)
    with pytest.raises(ValueError, match="--resume"):
        Trainer(small(corpus, tmp_path / "run", steps=2, context_schedule=[(0, 32)]), progress=False)
    assert latest_checkpoint(tmp_path / "run").name == "step-000001"


def _snapshot(folder):
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def test_resume_refuses_another_preset_before_touching_the_run(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    train(small(corpus, run, steps=1, context_schedule=[(0, 32)]), progress=False)
    before = _snapshot(run)
    args = ["train", "--out", str(run), "--resume", "--preset", "k3-small", "--no-sample"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"run {run} was trained with preset 'k3-tiny', not 'k3-small'" in err
    assert "step-000001" in err and "without --preset" in err
    assert _snapshot(run) == before  # no data rebuild, no train_config.json, no metrics truncation
    # same preset name, but the checkpoint's model differs from the preset (e.g. an edited config.json)
    ckpt = latest_checkpoint(run)
    data = json.loads((ckpt / "config.json").read_text())
    data["text_config"]["rms_norm_eps"] = 1e-6
    (ckpt / "config.json").write_text(json.dumps(data))
    before = _snapshot(run)
    with pytest.raises(
        ValueError,
        match=r"not preset 'k3-tiny' as defined now \(fields that differ: "
        r"text_config\.rms_norm_eps;",
    ):
        Trainer(small(corpus, run, steps=2, context_schedule=[(0, 32)]), resume=True, progress=False)
    assert _snapshot(run) == before


def test_final_eval_reads_the_whole_val_set_like_openk3_eval(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    T, B = 64, 4
    cfg = small(
        corpus,
        run,
        steps=2,
        batch_size=B,
        context_schedule=[(0, T)],
        eval_every=1,
        eval_batches=1,
        final_eval_batches=None,
        val_fraction=0.125,
    )
    summary = train(cfg, progress=False)
    rows = read_metrics(run / "metrics.jsonl")
    # periodic evaluation: eval_batches=1 batch, under its own names
    assert rows[0]["val_subset_tokens"] == B * T and "val_loss" not in rows[0]
    assert math.exp(rows[0]["val_loss_subset"]) == pytest.approx(rows[0]["val_ppl_subset"])
    # final evaluation: every window of val.bin, recomputed here from the raw file
    tokens = np.fromfile(run / "data" / "val.bin", dtype=np.uint16).astype(np.int64)
    n_win = (len(tokens) - 1) // T
    assert n_win > 8 and summary["val_tokens"] == rows[-1]["val_tokens"] == n_win * T
    w = torch.from_numpy(tokens[: n_win * T + 1])
    x, y = w[:-1].view(n_win, T), w[1:].view(n_win, T)
    model = openk3.from_pretrained(run)
    with torch.no_grad():
        logits = model(x).logits.double()
    want = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert summary["val_loss"] == rows[-1]["val_loss"] == pytest.approx(want, rel=1e-5)
    assert "val_loss_subset" not in rows[-1]
    # `openk3 eval` with the same windows prints the same number
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(run), "--seq-len", str(T), "--batch-size", str(B)]) == 0
    printed = float(re.search(r"val loss (\S+) nats/token", capsys.readouterr().out).group(1))
    assert printed == round(summary["val_loss"], 4)
    assert TrainConfig().final_eval_batches == 32  # the default run's bound (TrainConfig docstring)


def test_warmup_is_clamped_for_short_runs():
    # a 10-step run with the default 20 warmup steps: warmup W = floor(0.25 * 10) = 2, then cosine over 8
    assert effective_warmup(20, 10) == 2 and effective_warmup(20, 200) == 20 and effective_warmup(5, 1) == 0
    min_ratio = 0.1
    want = [0.5, 1.0] + [
        min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 10)
    ]
    assert [lr_factor(s, 10, 20, min_ratio) for s in range(10)] == pytest.approx(want, rel=1e-12)
    assert lr_factor(0, 200, 20) == pytest.approx(1 / 20)  # the default run is unchanged
    assert lr_factor(0, 1, 20) == 1.0  # a 1-step run has no warmup
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        lr_factor(0, 10, -1)


@pytest.mark.parametrize(
    "field,value",
    [
        ("lr", float("nan")),
        ("lr", float("inf")),
        ("lr", 0.0),
        ("lr", -1e-3),
        ("warmup_steps", -1),
        ("steps", 0),
        ("steps", "10"),
        ("steps", True),
        ("batch_size", 0),
        ("grad_accum", 0),
        ("final_eval_batches", 0),
        ("min_lr_ratio", 1.5),
        ("grad_clip", float("nan")),
        ("val_fraction", 1.0),
    ],
)
def test_train_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field}={re.escape(repr(value))} is invalid"):
        TrainConfig(**{field: value})


@pytest.fixture(scope="module")
def run1(tmp_path_factory):
    """A finished 1-step run on its own copy of the corpus: (run folder, corpus folder). Tests copy it."""
    root = tmp_path_factory.mktemp("run1")
    corpus = root / "corpus"
    corpus.mkdir()
    for i, text in enumerate(TEXT * 2):
        (corpus / f"work{i}.txt").write_text(text * 40)
    train(small(str(corpus), root / "run", steps=1, context_schedule=[(0, 32)]), progress=False)
    return root / "run", corpus


def test_a_fresh_start_into_a_run_is_refused_whichever_kind_of_run_it_holds(run1, tmp_path, capsys):
    """``openk3 train --out RUN`` without ``--resume`` is refused, its metrics and checkpoints untouched,
    when RUN holds a single-process run, or a distributed one (DCP step folders, no ``checkpoints/latest``:
    it was trained over and its checkpoints pruned); a save cut short (``.tmp``) alone is no run."""
    import shutil

    from openk3.train.state import refuse_existing_run

    single, dcp = tmp_path / "single", tmp_path / "dcp"
    shutil.copytree(run1[0], single)
    shutil.copytree(run1[0], dcp)
    shutil.rmtree(dcp / "checkpoints")
    step = dcp / "checkpoints" / "step-000020"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    (step / ".metadata").write_bytes(b"")
    for run, how in [
        (single, "continue it with --resume"),
        (dcp, "continue it with --resume and --nproc-per-node as it was started (a distributed run)"),
    ]:
        metrics = (run / "metrics.jsonl").read_text()
        assert main(["train", "--out", str(run), "--steps", "3", "--no-sample"]) == 2
        err = capsys.readouterr().err
        assert (
            err
            == f"openk3: error: {run} already holds a run with checkpoints: {how}, or choose another --out\n"
        )
        assert (run / "metrics.jsonl").read_text() == metrics
    assert sorted(p.name for p in (dcp / "checkpoints").iterdir()) == ["step-000020"]
    torn = tmp_path / "torn" / "checkpoints" / "step-000010.tmp"
    torn.mkdir(parents=True)
    refuse_existing_run(tmp_path / "torn")  # nothing to resume: a fresh start is what --resume would advise


def test_a_ctrl_c_before_the_first_step_says_the_run_is_as_it_was(run1, tmp_path, capsys, monkeypatch):
    """A Ctrl-C while a ``--resume`` loads (before the trainer's handlers) names the run's checkpoint and the
    resume command, not just "interrupted"; the run is untouched."""
    import shutil

    from openk3.train import trainer

    run = tmp_path / "run"
    shutil.copytree(run1[0], run)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "load_trainer_state", interrupted)
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--no-sample"]) == 130
    ckpt = run / "checkpoints" / "step-000001"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"openk3: interrupted before the first step: nothing was trained, the run's latest checkpoint is "
        f"{ckpt}; continue with: openk3 train --out {run} --resume"
    )
    assert latest_checkpoint(run) == ckpt


def test_resume_refuses_other_data_before_touching_the_run(run1, tmp_path, capsys):
    import os
    import shutil

    src, corpus = run1
    run = tmp_path / "run"
    shutil.copytree(src, run)
    other = tmp_path / "other"
    other.mkdir()
    for i in range(2):  # too small to train on: it must be refused before it is read
        (other / f"tiny{i}.txt").write_text("a b")
    before = _snapshot(run)
    base = ["train", "--out", str(run), "--resume", "--steps", "3", "--no-sample"]
    assert main([*base, "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"run {run} was trained on data={str(corpus)!r} with a byte-level BPE trained on it" in err
    assert "(different data)" in err and "resume without --data" in err
    tok = run / "data" / "tokenizer" / "tokenizer.json"
    assert main([*base, "--tokenizer", str(tok)]) == 2
    assert "(different tokenizer)" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"\(different val_fraction\).*TrainConfig\.val_fraction"):
        Trainer(small(str(corpus), run, steps=3, val_fraction=0.5), resume=True, progress=False)
    # the same flags, but one byte of a corpus file changed since the shards were built (same size, mtime put
    # back as `cp -p` or `touch -d` would): the fingerprint follows the content
    work0 = corpus / "work0.txt"
    stat, original = work0.stat(), work0.read_bytes()
    work0.write_bytes(original.replace(b"R", b"r", 1))
    os.utime(work0, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    try:
        assert main(base) == 2
        err = capsys.readouterr().err
        assert f"the inputs of run {run} changed since its token shards were built" in err
        assert "another fingerprint: modified: work0.txt)" in err
    finally:
        work0.write_bytes(original)
    os.utime(work0)  # restored byte for byte, then touched: the same data, so the steps check answers below
    # a finished run without a larger --steps: nothing to do
    assert main(base[:-3] + ["--no-sample"]) == 2
    assert f"run {run} is already at step 1 and steps=1" in capsys.readouterr().err
    # the same files spelled as a glob pass the data check (and reach the steps check); a glob of a subset not
    assert main(base[:-3] + ["--no-sample", "--data", str(corpus / "*.txt")]) == 2
    assert f"run {run} is already at step 1 and steps=1" in capsys.readouterr().err
    assert main(base[:-3] + ["--no-sample", "--data", str(corpus / "work0*")]) == 2
    assert "(different data)" in capsys.readouterr().err
    assert _snapshot(run) == before  # no data rebuild, no train_config.json, no metrics truncation


def _signals_after_each_step(monkeypatch, *signals) -> None:
    """Make every training step send ``signals`` to this process, in order, once it has run."""
    import os

    one_step = Trainer.train_step

    def step_then_signals(self):
        row = one_step(self)
        for sig in signals:
            os.kill(os.getpid(), sig)
        return row

    monkeypatch.setattr(Trainer, "train_step", step_then_signals)


def test_sigterm_saves_like_ctrl_c(run1, tmp_path, capsys, monkeypatch):
    """SIGTERM (``timeout``, a job scheduler) finishes the step, saves its checkpoint, says how to resume and
    exits 130, as a first Ctrl-C does, also when it comes twice (unlike a second Ctrl-C, which aborts); both
    handlers are put back afterwards."""
    import shutil
    import signal

    run = tmp_path / "run"
    shutil.copytree(run1[0], run)
    _signals_after_each_step(monkeypatch, signal.SIGTERM, signal.SIGTERM)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--no-sample"]) == 130  # as Ctrl-C
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    out, err = capsys.readouterr()
    assert "SIGTERM: finishing this step and saving a checkpoint" in out
    assert f"stopped at step 2; continue with: openk3 train --out {run} --resume" in out
    assert (run / "checkpoints" / "step-000002").is_dir()


def test_extending_a_run_then_a_double_ctrl_c(run1, tmp_path, capsys, monkeypatch):
    import shutil
    import signal

    run = tmp_path / "run"
    shutil.copytree(run1[0], run)
    # the first Ctrl-C: finish this step and save; the second: stop at once
    _signals_after_each_step(monkeypatch, signal.SIGINT, signal.SIGINT)
    handler = signal.getsignal(signal.SIGINT)
    try:
        code = main(["train", "--out", str(run), "--resume", "--steps", "3", "--no-sample"])
    except KeyboardInterrupt:
        pytest.fail("a second Ctrl-C escaped as a KeyboardInterrupt traceback")
    assert code == 130 and signal.getsignal(signal.SIGINT) is handler
    out, err = capsys.readouterr()
    # lr of the peak 3e-3 at step 1 (warmup clamped to 0): cosine floor 0.1 at the end of a 1-step run,
    # 0.1 + 0.9 * (1 + cos(pi / 3)) / 2 = 0.775 of a 3-step run
    assert f"resuming {run} at step 1 with total steps 1 → 3" in out
    assert f"(lr at step 1: {3e-3 * 0.1:.3e} → {3e-3 * 0.775:.3e})" in out
    ckpt = run / "checkpoints" / "step-000001"
    assert "Traceback" not in err and err.endswith("\n")  # above the message: the progress bar only
    assert err.splitlines()[-1] == (
        f"openk3: training aborted by a second Ctrl-C at step 2; the checkpoint was NOT saved, the run's "
        f"latest checkpoint is step 1 ({ckpt}); continue with: openk3 train --out {run} --resume"
    )
    assert latest_checkpoint(run) == ckpt


def test_the_resume_lines_give_the_resume_command(run1, tmp_path, capsys, monkeypatch):
    """``--resume-command`` (``scripts/quickstart.sh`` passes its own, which also samples) replaces ``openk3 train
    --out OUT --resume`` in the line after a stop and in a second Ctrl-C's message."""
    import shutil
    import signal

    run = tmp_path / "run"
    shutil.copytree(run1[0], run)
    command = "bash scripts/quickstart.sh --resume"
    args = ["train", "--out", str(run), "--resume", "--resume-command", command, "--no-sample"]
    _signals_after_each_step(monkeypatch, signal.SIGTERM)
    assert main([*args, "--steps", "3"]) == 130
    assert f"stopped at step 2; continue with: {command}\n" in capsys.readouterr().out
    _signals_after_each_step(monkeypatch, signal.SIGINT, signal.SIGINT)
    assert main([*args, "--steps", "4"]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "openk3: training aborted by a second Ctrl-C at step 3; the checkpoint was NOT saved, the run's latest "
        f"checkpoint is step 2 ({run / 'checkpoints' / 'step-000002'}); continue with: {command}"
    )


def test_divergence_stops_before_the_update_and_keeps_the_last_checkpoint(corpus, tmp_path, capsys):
    """A learning rate of 1e4 blows the model up within a few steps: training stops at the first non-finite
    loss (or gradient norm) with one line naming the latest checkpoint, every saved checkpoint is finite and
    metrics.jsonl stays valid JSON (``json.loads`` rejects nothing: bare NaN is not written)."""
    out = tmp_path / "run"
    args = ["train", "--data", corpus, "--out", str(out), "--steps", "12", "--batch-size", "2"]
    args += ["--context-schedule", "0:32", "--lr", "1e4", "--warmup-steps", "0", "--save-every", "1"]
    assert main([*args, "--no-sample"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bars
    assert err.startswith("openk3: error: training diverged: the ")
    step = int(re.search(r" at step (\d+) ", err).group(1))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step))
    assert all(math.isfinite(r["loss"]) for r in rows)
    if step > 1:  # the message names the checkpoint of the last good step, which holds finite weights
        assert f"step-{step - 1:06d}" in err
        model = openk3.from_pretrained(latest_checkpoint(out))
        assert all(torch.isfinite(p).all() for p in model.parameters())
    else:
        assert "has no checkpoint yet" in err


def test_a_run_that_fails_to_start_leaves_no_folder(tmp_path):
    out = tmp_path / "never" / "a" / "b"  # every folder it creates is removed again
    with pytest.raises((ValueError, FileNotFoundError)):
        Trainer(small(str(tmp_path / "missing-corpus"), out), progress=False)
    assert not (tmp_path / "never").exists()
    stranger = tmp_path / "stranger"  # a non-empty folder that is not a run: refused, untouched
    stranger.mkdir()
    (stranger / "README.md").write_text("mine")
    with pytest.raises(ValueError, match=r"is a non-empty folder that holds no openk3 run \(README.md\)"):
        Trainer(small(str(tmp_path / "missing-corpus"), stranger), progress=False)
    assert [p.name for p in stranger.iterdir()] == ["README.md"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a run folder"):
        Trainer(small(str(tmp_path / "missing-corpus"), tmp_path / "afile"), progress=False)
    assert (tmp_path / "afile").read_text() == "x"


def test_blowup_threshold_and_a_finite_blowup(corpus, tmp_path):
    """``2·ln V + 5`` (23.02 nats at V = 8192): a loss above it stops the run like a NaN, with its value."""
    from openk3.train.trainer import DivergenceError, blowup_loss

    assert blowup_loss(8192) == pytest.approx(2 * 9.010913 + 5, abs=1e-5)
    trainer = Trainer(small(corpus, tmp_path / "run", steps=4), progress=False)
    assert trainer.blowup_loss == blowup_loss(8192)  # the model's ids: an untrained model's loss is ≈ ln 8192
    trainer.blowup_loss = 0.5  # every real loss of this model is above it
    with pytest.raises(
        DivergenceError, match=r"the loss is [\d.]+ \(above 0.5\) at step 1 .* no checkpoint yet"
    ):
        trainer.fit()
    assert trainer.step == 0


def test_metrics_log_writes_non_finite_values_as_null(tmp_path):
    from openk3.train.metrics import MetricsLog

    log = MetricsLog(tmp_path / "m.jsonl")
    log.write({"step": 1, "loss": float("nan"), "val": float("inf"), "per_layer": [1.0, float("-inf")]})
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {
        "step": 1,
        "loss": None,
        "val": None,
        "per_layer": [1.0, None],
    }


def test_impossible_sizes_are_refused_with_their_numbers(corpus, tmp_path):
    """The memory floor counts 16 bytes per parameter (the accounting module's independent count) and 12
    per logit; ``kimi-k3`` on this machine is refused before any folder is written."""
    from openk3.accounting import accounting_report
    from openk3.train.trainer import training_memory_floor

    config = openk3.get_preset("k3-tiny")
    floor = training_memory_floor(config, 2, 32)
    assert floor["state"] == pytest.approx(16 * accounting_report(config)["total_params"], rel=1e-3)
    assert floor["logits"] == 2 * 32 * config.text_config.vocab_size * 12
    out = tmp_path / "big"
    with pytest.raises(
        ValueError, match=r"training kimi-k3 .* needs (at least|about) [\d,.]+ GiB .* more than the"
    ):
        Trainer(small(corpus, out, preset="kimi-k3"), progress=False)
    assert not out.exists()


@pytest.mark.slow  # trains k3-tiny for dozens of steps: minutes on a 2-core CPU
def test_eval_default_window_fits_a_short_val_split(run1, capsys, monkeypatch):
    """Without --seq-len, eval reads windows of the run's longest training context (here 32, the same
    number as ``--seq-len 32``); a val split shorter than the window is read as one window of N − 1 targets
    (the count a window of the whole split has)."""
    import openk3.cli as cli
    from openk3.data import TokenDataset

    run, _ = run1
    assert main(["eval", "--ckpt", str(run)]) == 0
    default = capsys.readouterr().out
    assert main(["eval", "--ckpt", str(run), "--seq-len", "32"]) == 0
    assert capsys.readouterr().out == default
    n = TokenDataset(run / "data" / "val.bin").num_tokens
    monkeypatch.setattr(cli, "_run_eval_shape", lambda folder: (n + 1000, 2))
    assert main(["eval", "--ckpt", str(run)]) == 0
    assert f"({n - 1:,} tokens," in capsys.readouterr().out


@pytest.mark.slow  # trains k3-tiny for dozens of steps: minutes on a 2-core CPU
def test_resume_with_a_lower_lr_uses_it_from_another_folder(corpus, tmp_path, monkeypatch, capsys):
    """``--resume --lr`` (the divergence message's advice) trains at the new peak lr: the optimizer's lr at
    the next step is new_lr × lr_factor (closed form), the run differs from a same-lr resume, and the run
    resumes from another working folder (it recorded absolute input paths)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").symlink_to(corpus)
    first = small("corpus", "run", stop_at_step=3)
    train(first, progress=False)
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert saved["data"] == str(tmp_path / "corpus")  # absolute, as the run recorded it
    import shutil

    shutil.copytree(tmp_path / "run", tmp_path / "same")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    low = small("../corpus", tmp_path / "run", lr=first.lr / 10)  # the same folder by another relative path
    trainer = Trainer(low, resume=True, progress=False)
    assert f"resuming {tmp_path / 'run'} at step 3 with peak lr 0.003 → 0.0003" in capsys.readouterr().out
    assert trainer.config.data == str(tmp_path / "corpus")  # recorded absolute again
    trainer.train_step()
    factor = lr_factor(3, low.steps, low.warmup_steps, low.min_lr_ratio, low.schedule)
    assert {g["lr"] for g in trainer.optimizer.param_groups} == {first.lr / 10 * factor}
    same = Trainer(small(str(tmp_path / "corpus"), tmp_path / "same"), resume=True, progress=False)
    assert same.train_step()["loss"] == trainer.losses[4]  # step 4's loss is from step 3's weights
    assert same.train_step()["loss"] != trainer.train_step()["loss"]  # step 5: weights from different lrs


def test_divergence_after_a_resume_still_gives_the_checkpoint_loss(corpus, tmp_path):
    from openk3.train.trainer import DivergenceError

    train(small(corpus, tmp_path / "run", stop_at_step=3), progress=False)
    loss3 = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["loss"]
    trainer = Trainer(small(corpus, tmp_path / "run"), resume=True, progress=False)
    trainer.blowup_loss = 0.5
    with pytest.raises(
        DivergenceError, match=r"step-000003, train loss [\d.]+ on its weights\); continue from"
    ) as e:
        trainer.fit()
    # the loss measured on the checkpoint's weights is the diverging step's own value, not step 3's
    value = re.search(r"the loss is ([\d.]+)", str(e.value)).group(1)
    assert f"train loss {float(value):.3f} on its weights" in str(e.value) and float(value) != loss3
