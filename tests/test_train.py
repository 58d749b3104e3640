"""Training loop: exact resume, checkpoints, logs, schedules, CLI smoke run (small and fast)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import openk3
from openk3.cli import main
from openk3.train.metrics import read_metrics
from openk3.train.schedule import lr_factor, parse_context_schedule, seq_len_at
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
        save_every=3,
        sample_prompt=None,
        val_fraction=0.25,
    )
    base.update(kw)
    return TrainConfig(**base)


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


def test_run_folder_contents(corpus, tmp_path):
    summary = train(small(corpus, tmp_path / "run", steps=3, context_schedule=[(0, 32)]), progress=False)
    run = tmp_path / "run"
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
    for bad in ("10:64", "0:64,0:128", "0:x"):
        with pytest.raises(ValueError):
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
    assert main(["generate", "--ckpt", str(out), "--prompt", "x", "--temperature", "-1"]) == 2


def test_refuses_to_overwrite_a_run_without_resume(corpus, tmp_path):
    train(small(corpus, tmp_path / "run", steps=1, context_schedule=[(0, 32)]), progress=False)
    with pytest.raises(ValueError, match="--resume"):
        Trainer(small(corpus, tmp_path / "run", steps=2, context_schedule=[(0, 32)]), progress=False)
    assert latest_checkpoint(tmp_path / "run").name == "step-000001"
