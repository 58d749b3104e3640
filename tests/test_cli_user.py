"""What a new user hits on the command line: a closed output pipe, two runs in one folder, the server's
optional dependencies and port, prompts past the context, the data summary, help texts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from openk3.cli import main
from openk3.train.state import latest_checkpoint

TEXT = [
    "ROMEO. But soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n",
    "HAMLET. To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "MACBETH. Tomorrow, and tomorrow, and tomorrow,\nCreeps in this petty pace from day to day,\n",
    "LEAR. Blow, winds, and crack your cheeks! rage! blow!\nYou cataracts and hurricanoes, spout\n",
]

SMALL = ["--batch-size", "2", "--context-schedule", "0:32", "--warmup-steps", "0", "--no-sample"]
"""Flags of a small, fast run (2 × 32 tokens per step)."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(TEXT * 2):
        (folder / f"work{i}.txt").write_text(text * 40)
    return folder


def _env() -> dict:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {
        **os.environ,
        "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }


def _spawn(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "openk3.cli", *args], env=_env(), **kw)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the trainer exited ({proc.returncode}) or timed out before the condition held")
        time.sleep(0.1)


def _steps_logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_ctrl_c_with_a_closed_output_pipe_still_saves_and_resumes(corpus, tmp_path):
    """`openk3 train ... | tee log` and Ctrl-C: the group's SIGINT kills the reader first, so every later write
    to stdout fails; the trainer still finishes the step, saves, and prints the resume line on stderr."""
    run = tmp_path / "run"
    args = ["train", "--data", str(corpus), "--out", str(run), "--steps", "100000", "--save-every", "100000"]
    with open(tmp_path / "stderr", "w") as err:
        proc = _spawn([*args, "--eval-every", "100000", *SMALL], stdout=subprocess.PIPE, stderr=err)
        _wait_for(lambda: _steps_logged(run) >= 1, proc)
        proc.stdout.close()  # the reader exits, as tee does on the same Ctrl-C
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    err = (tmp_path / "stderr").read_text()
    assert code == 130, err
    assert "Traceback" not in err and "BrokenPipeError" not in err
    ckpt = latest_checkpoint(run)
    saved = int(ckpt.name.split("-")[1])
    assert "Ctrl-C: finishing this step and saving a checkpoint" in err
    assert f"stopped at step {saved}; continue with: openk3 train --out {run} --resume" in err
    assert not (run / "train.lock").exists()
    assert main(["train", "--out", str(run), "--resume", "--steps", str(saved + 1), "--no-sample"]) == 0
    assert (run / "checkpoints" / f"step-{saved + 1:06d}").is_dir()


@pytest.mark.slow
def test_a_second_training_in_the_same_folder_is_refused_naming_the_first(corpus, tmp_path, capsys):
    import socket

    run = tmp_path / "run"
    args = ["train", "--data", str(corpus), "--out", str(run), "--steps", "100000", "--save-every", "100000"]
    proc = _spawn(
        [*args, "--eval-every", "100000", *SMALL], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        _wait_for(lambda: (run / "train.lock").exists() and (run / "train.lock").read_text().strip(), proc)
        before = _steps_logged(run)
        holder = f"pid {proc.pid} on host {socket.gethostname()} since "
        for extra in ([], ["--resume"]):  # a new run and a resume of the same folder, both refused at once
            assert main([*args, *SMALL, *extra]) == 2
            err = capsys.readouterr().err
            assert f"openk3: error: run folder {run} is in use by another training ({holder}" in err
            assert "wait for it to end or stop it, or choose another --out" in err
        _wait_for(lambda: _steps_logged(run) > before, proc)  # the first run goes on, its log intact
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130
    finally:
        proc.kill()
        proc.wait()
    assert not (run / "train.lock").exists()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # one run's rows, none interleaved
    # a lock left by a run killed with -9 (no process holds it any more) is taken over with a line saying so
    saved = int(latest_checkpoint(run).name.split("-")[1])
    stale = {"pid": 4194999, "host": socket.gethostname(), "started": "2026-12-01 00:00:00 +0000"}
    (run / "train.lock").write_text(json.dumps(stale))
    assert main(["train", "--out", str(run), "--resume", "--steps", str(saved + 1), "--no-sample"]) == 0
    out = capsys.readouterr().out
    assert (
        f"recovered a stale run lock in {run}: pid 4194999 on host {stale['host']} since "
        "2026-12-01 00:00:00 +0000 no longer holds it"
    ) in out
    assert not (run / "train.lock").exists()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A k3-tiny checkpoint (random weights) with a small BPE tokenizer, outside any run folder."""
    import openk3
    from openk3.data import Tokenizer
    from openk3.presets import get_preset

    folder = tmp_path_factory.mktemp("ckpt") / "k3-tiny"
    openk3.save_pretrained(openk3.build_model(get_preset("k3-tiny"), seed=0), folder)
    Tokenizer.train([t * 20 for t in TEXT], 300).save(folder)
    return folder


def test_serve_without_its_packages_names_the_install(ckpt, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed: import raises
    assert main(["serve", "--ckpt", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert err == (
        'openk3: error: openk3 serve needs uvicorn, not installed here: pip install -e ".[serve]" '
        "(or pip install uvicorn)\n"
    )


@pytest.mark.slow
def test_serve_port_0_prints_the_bound_port(ckpt):
    import urllib.request

    proc = _spawn(["serve", "--ckpt", str(ckpt), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("openk3 serve: model 'k3-tiny' on http://127.0.0.1:"), line
        base = line.split(" on ")[1].split()[0]
        port = int(base.rsplit(":", 1)[1].split("/")[0])
        assert port > 0
        deadline = time.monotonic() + 60
        while True:  # uvicorn starts accepting right after the line
            try:
                with urllib.request.urlopen(f"{base}/models", timeout=5) as r:
                    models = json.loads(r.read())
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        assert [m["id"] for m in models["data"]] == ["k3-tiny"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def test_generate_refuses_tokens_past_the_context(ckpt, capsys):
    from openk3.config import load_config, text_config_of
    from openk3.data import Tokenizer

    limit = text_config_of(load_config(ckpt)).max_position_embeddings  # 65536 for k3-tiny
    n = len(Tokenizer.load(ckpt).encode("ROMEO:"))
    args = ["generate", "--ckpt", str(ckpt), "--prompt", "ROMEO:", "--max-new-tokens"]
    assert main([*args, "100000000"]) == 2
    assert capsys.readouterr().err == (
        f"openk3: error: the model's maximum context length is {limit:,} tokens (max_position_embeddings in "
        f"{ckpt}); the prompt ({n:,} tokens) and --max-new-tokens 100,000,000 ask for {n + 100000000:,}: "
        f"use --max-new-tokens {limit - n} or less\n"
    )
    assert main([*args, "2", "--temperature", "0"]) == 0  # within the context: generated
    assert capsys.readouterr().out.startswith("ROMEO:")


def test_tokens_read_sums_the_context_schedule():
    from openk3.train.run_summary import tokens_read
    from openk3.train.schedule import seq_len_at

    schedule = [(0, 32), (3, 48), (7, 64)]
    for first, last in [(0, 10), (0, 3), (2, 8), (5, 6), (7, 20), (4, 4)]:
        brute = sum(5 * seq_len_at(s, schedule) for s in range(first, last))
        assert tokens_read(first, last, schedule, 5) == brute
    assert tokens_read(0, 10**9, [(0, 128)], 16) == 10**9 * 16 * 128  # O(schedule), not O(steps)


@pytest.mark.slow
def test_train_prints_the_data_the_run_and_redraws_the_plot(corpus, tmp_path, capsys, monkeypatch):
    import openk3.train.trainer as trainer
    from openk3.train.schedule import seq_len_at

    drawn = []  # metrics rows present at each redraw of loss.png
    plot = trainer.plot_metrics

    def recording_plot(metrics, png):
        drawn.append(len(Path(metrics).read_text().splitlines()))
        plot(metrics, png)

    monkeypatch.setattr(trainer, "plot_metrics", recording_plot)
    run = tmp_path / "run"
    args = ["train", "--data", str(corpus), "--out", str(run), "--steps", "6", "--eval-every", "2"]
    args += ["--batch-size", "2", "--context-schedule", "0:32,3:48", "--warmup-steps", "0", "--no-sample"]
    assert main(args) == 0
    out = capsys.readouterr().out
    manifest = json.loads((run / "data" / "data.json").read_text())
    n_train, n_val = manifest["splits"]["train"]["num_tokens"], manifest["splits"]["val"]["num_tokens"]
    vocab = json.loads((run / "data" / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    assert "data: read 8 file(s) (8 text, 0 JSONL), " in out
    assert f"data: the tokenizer has {len(vocab):,} ids, the model 8,192" in out
    assert f"data: split {n_train:,} train / {n_val:,} val tokens ({n_val / (n_train + n_val):.1%} val" in out
    read = sum(2 * seq_len_at(s, [(0, 32), (3, 48)]) for s in range(6))  # 3 × 64 + 3 × 96 = 480
    assert f"data: steps 0-6 read {read:,} train tokens = {read / n_train:.2f} epoch(s)" in out
    assert out.index(f"training in {run}") < out.index("data: read")
    assert drawn == [2, 4, 6]  # at the evaluations of steps 2 and 4, and at the end
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert re.search(r"run: at step 6 after \d\d:\d\d:\d\d \(", out)
    assert f"({read:,} train tokens read, " in out
    assert f"; final train loss {rows[-1]['loss']:.4f} nats/token" in out
    # openk3 eval shows its progress: the val split in the run's windows (48 tokens, 2 per batch)
    assert main(["eval", "--ckpt", str(run)]) == 0
    batches = -(-((n_val - 1) // 48) // 2)
    assert f"{batches}/{batches}" in capsys.readouterr().err


@pytest.mark.slow
def test_one_input_txt_a_corpus_prompt_and_a_resume_with_another_batch(tmp_path, capsys):
    """nanoGPT habits: one ``input.txt`` as the corpus; the end-of-run sample starts from that corpus's text
    (not ``ROMEO:``), ``--sample-prompt`` sets it; a resume with another ``--batch-size`` says so."""
    from openk3.data import TokenDataset, Tokenizer

    text = "".join(TEXT) * 40
    (tmp_path / "input.txt").write_text(text)
    run = tmp_path / "run"
    args = ["train", "--data", str(tmp_path / "input.txt"), "--out", str(run), "--steps", "1"]
    args += ["--batch-size", "2", "--context-schedule", "0:32", "--warmup-steps", "0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    manifest = json.loads((run / "data" / "data.json").read_text())
    cut = text.index("\n", round(0.9 * len(text))) + 1
    assert manifest["splits"]["val"]["documents"] == [f"input.txt[{cut}:]"]
    tokenizer = Tokenizer.load(run / "data" / "tokenizer")
    ids = TokenDataset(run / "data" / "val.bin").tokens_N[:8]
    prompt = tokenizer.decode([int(i) for i in ids]).split("\n")[0]
    assert prompt and text[cut:].startswith(prompt)
    assert out.split("--- sample (temperature 0.8, top-p 0.95, seed 0) ---\n")[1].startswith(prompt)
    resume = ["train", "--out", str(run), "--resume", "--steps", "2", "--batch-size", "4"]
    assert main([*resume, "--sample-prompt", "HAMLET."]) == 0
    out = capsys.readouterr().out
    assert "resuming at step 1 with batch_size 2 → 4 (the run's value until now)" in out
    assert out.split("seed 0) ---\n")[1].startswith("HAMLET.")


def test_a_missing_corpus_is_named_before_the_run_is_announced(tmp_path, capsys):
    args = ["train", "--data", str(tmp_path / "nothing.txt"), "--out", str(tmp_path / "run"), "--no-sample"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and str(tmp_path / "nothing.txt") in err
    assert not (tmp_path / "run").exists()


def _flags(parser):
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_every_flag_has_help_and_its_default():
    import dataclasses

    from openk3.cli import build_parser
    from openk3.train.trainer import TrainConfig

    parser = build_parser()
    for name, sub in parser.commands.items():
        for action in _flags(sub):
            text = sub.formatter_class(sub.prog)._get_help_string(action) or ""
            assert text.strip(), f"openk3 {name} {action.option_strings[0]} has no help text"
            if action.default not in (None, False) and action.nargs != 0:  # a switch has no default
                assert "default" in text, (
                    f"openk3 {name} {action.option_strings[0]} does not show its default"
                )
    # the train flags (argparse default None: a resume keeps the run's values) state TrainConfig's defaults
    defaults = {
        f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING
    }
    train = parser.commands["train"]
    for action in _flags(train):
        skip = (
            "sample_prompt",
            "data",
            "tokenizer",
            "tensorboard",
            "micro_batch_size",
            "long_context",
            "compile",
        )  # described, or a switch
        if action.dest in defaults and action.dest not in skip:
            assert f"default {defaults[action.dest]}" in action.help, action.option_strings[0]
    schedule = ",".join(f"{s}:{t}" for s, t in TrainConfig().context_schedule)
    assert f"(default '{schedule}')" in next(a.help for a in _flags(train) if a.dest == "context_schedule")


def test_help_does_not_import_torch():
    code = (
        "import sys; from openk3.cli import main\n"
        "try: main(['--help'])\nexcept SystemExit: pass\n"
        "try: main(['serve', '--help'])\nexcept SystemExit: pass\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert done.stderr.strip().splitlines()[-1] == "False"
    assert "openk3 serve" not in done.stdout or "--ckpt" in done.stdout


@pytest.mark.slow
def test_tensorboard_events_mirror_the_metrics(corpus, tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    args = ["train", "--data", str(corpus), "--out", str(run), "--steps", "4", "--eval-every", "2"]
    assert main([*args, *SMALL, "--tensorboard"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    val = [(e.step, e.value) for e in events.Scalars("val/loss_subset")]
    assert val == [(2, pytest.approx(rows[1]["val_loss_subset"], rel=1e-6))]
    assert [e.step for e in events.Scalars("val/loss")] == [4]
    # without the package: one line naming the install, before any work
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert main([*args[:-4], "--out", str(tmp_path / "other"), "--tensorboard", *SMALL]) == 2
    assert 'needs the tensorboard package: pip install -e ".[tensorboard]"' in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_eval_on_raw_text_uses_the_checkpoints_tokenizer(ckpt, tmp_path, capsys):
    import torch
    import torch.nn.functional as F

    import openk3
    from openk3.data import Tokenizer

    text = tmp_path / "input.txt"
    text.write_text(TEXT[2] * 3)
    assert (
        main(["eval", "--ckpt", str(ckpt), "--data", str(text), "--seq-len", "16", "--batch-size", "2"]) == 0
    )
    printed = capsys.readouterr().out
    tok = Tokenizer.load(ckpt)
    ids = tok.encode(text.read_text()) + [tok.eos_id]
    n = (len(ids) - 1) // 16
    w = torch.tensor(ids[: n * 16 + 1])
    with torch.no_grad():
        logits = openk3.from_pretrained(ckpt)(w[:-1].view(n, 16)).logits.double()
    want = F.cross_entropy(logits.flatten(0, 1), w[1:]).item()
    found = re.search(r"val loss (\S+) nats/token, perplexity \S+ \(([\d,]+) tokens, (.*)\)", printed)
    assert float(found[1]) == pytest.approx(want, abs=6e-5)  # printed to 4 decimals
    assert found[2] == f"{n * 16:,}" and found[3] == str(text)


def test_generate_chat_prompt_file_stdin_and_samples(ckpt, tmp_path, capsys, monkeypatch):
    import io

    import torch

    import openk3
    from openk3.data import Tokenizer
    from openk3.serve.chat_template import ChatTemplate

    tok = Tokenizer.load(ckpt)
    model = openk3.from_pretrained(ckpt)
    base = ["generate", "--ckpt", str(ckpt), "--max-new-tokens", "6", "--temperature", "0"]

    def greedy_text(ids, stop):
        out = openk3.generate.generate(model, torch.tensor([ids]), 6, vocab_size=tok.vocab_size)[0].tolist()
        cut = next((i for i, t in enumerate(out) if t in stop), len(out))
        return tok.decode(out[:cut])

    # --chat: the prompt is a user turn of the chat template; the reply alone is printed
    template = ChatTemplate.from_folder(tok, ckpt)
    ids = template.encode([{"role": "user", "content": "To be"}])
    assert main([*base, "--chat", "--prompt", "To be"]) == 0
    assert capsys.readouterr().out == greedy_text(ids, template.stop_token_ids) + "\n"
    # --prompt-file and --prompt - (stdin) give the same continuation as --prompt
    plain = "ROMEO. But soft"
    want = plain + greedy_text(tok.encode(plain), {tok.eos_id}) + "\n"
    (tmp_path / "p.txt").write_text(plain)
    assert main([*base, "--prompt-file", str(tmp_path / "p.txt")]) == 0
    assert capsys.readouterr().out == want
    monkeypatch.setattr(sys, "stdin", io.StringIO(plain))
    assert main([*base, "--prompt", "-"]) == 0
    assert capsys.readouterr().out == want
    # --num-samples: seeds --seed + i, each one the sample of that seed
    sampled = ["--temperature", "1.0", "--max-new-tokens", "4", "--prompt", plain]
    assert main([*base, *sampled, "--num-samples", "2", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    singles = []
    for seed in (5, 6):
        assert main([*base, *sampled, "--seed", str(seed)]) == 0
        singles.append(capsys.readouterr().out)
    assert out == f"--- sample 1/2 ---\n{singles[0]}--- sample 2/2 ---\n{singles[1]}"
    assert main([*base, "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert f"cannot read --prompt-file {tmp_path / 'missing.txt'}" in capsys.readouterr().err


def test_serve_on_cuda_without_a_gpu_is_one_line(ckpt, capsys, monkeypatch):
    """As ``openk3 generate --device cuda``: one line before the model is loaded, not a traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["serve", "--ckpt", str(ckpt), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == "openk3: error: device 'cuda' requested but torch.cuda.is_available() is False\n"


def test_check_device_names_the_device(monkeypatch):
    from openk3.devices import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_device("cpu")
    check_device(torch.device("cpu"))
    for device in ("cuda", "cuda:1", torch.device("cuda", 1)):
        with pytest.raises(
            ValueError, match=r"device 'cuda(:1)?' requested but torch.cuda.is_available\(\) is False"
        ):
            check_device(device)
