"""The ``openk3`` command line: bad flags and inputs are refused with a message naming the flag/field, the
value and the file, before any slow work (data preparation, model loading) starts."""

from __future__ import annotations

import json
import math

import pytest
import torch

import openk3
from openk3.cli import main
from openk3.presets import get_preset


@pytest.mark.parametrize(
    "flag,value,expected",
    [
        ("--lr", "nan", "a finite number > 0"),
        ("--lr", "inf", "a finite number > 0"),
        ("--lr", "0", "a finite number > 0"),
        ("--lr", "-0.1", "a finite number > 0"),
        ("--grad-clip", "0", "a finite number > 0"),
        ("--warmup-steps", "-1", "an int >= 0"),
        ("--steps", "0", "an int in [1, 10^9]"),
        ("--steps", "1.5", "an int in [1, 10^9]"),
        ("--steps", "99999999999999999999", "an int in [1, 10^9]"),
        ("--batch-size", "0", "an int >= 1"),
        ("--save-every", "0", "an int >= 1"),
    ],
)
def test_train_rejects_bad_numbers_before_any_work(tmp_path, capsys, flag, value, expected):
    out = tmp_path / "run"
    # a missing --data path would fail later, in data preparation: the flag must be refused first
    args = ["train", "--out", str(out), "--data", str(tmp_path / "no-corpus"), "--no-sample", flag, value]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        f"openk3 train: error: argument {flag}: expected {expected}, got {value!r} "
        "(see openk3 train --help)\n"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "flag,value,expected",
    [
        ("--temperature", "nan", "a finite number >= 0 (0 = greedy)"),
        ("--temperature", "inf", "a finite number >= 0 (0 = greedy)"),
        ("--temperature", "-1", "a finite number >= 0 (0 = greedy)"),
        ("--top-p", "0", "a number in (0, 1]"),
        ("--top-p", "1.5", "a number in (0, 1]"),
        ("--top-p", "nan", "a number in (0, 1]"),
        ("--max-new-tokens", "0", "an int >= 1"),
        ("--speculative-tokens", "17", "an int in [1, 16]"),
    ],
)
def test_generate_rejects_bad_sampling_before_loading(tmp_path, capsys, flag, value, expected):
    # the checkpoint does not exist: the sampling flags are checked before it is looked for
    args = ["generate", "--ckpt", str(tmp_path / "no-ckpt"), "--prompt", "x", flag, value]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert (
        f"openk3 generate: error: argument {flag}: expected {expected}, got {value!r}"
        in capsys.readouterr().err
    )


def test_generate_refuses_speculative_tokens_without_a_draft(tmp_path, capsys):
    """The flag would be ignored (the server refuses the same request with a 400): one line names both flags,
    before the checkpoint is looked for."""
    args = ["generate", "--ckpt", str(tmp_path / "no-ckpt"), "--prompt", "x", "--speculative-tokens", "3"]
    assert main(args) == 2
    assert capsys.readouterr().err == (
        "openk3: error: --speculative-tokens needs --draft (the draft folder that proposes the tokens)\n"
    )


@pytest.mark.parametrize("kwargs", [{"temperature": math.inf}, {"temperature": math.nan}, {"top_p": 0.0}])
def test_generate_library_rejects_bad_sampling(kwargs):
    ids = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature|top_p"):
        openk3.generate.generate(None, ids, 4, **kwargs)  # refused before the model is called


@pytest.mark.parametrize("flag", ["--batch-size", "--seq-len", "--max-batches"])
def test_eval_rejects_non_positive_counts(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--ckpt", str(tmp_path), flag, "0"])
    assert exit_.value.code == 2
    assert f"argument {flag}: expected an int >= 1, got '0'" in capsys.readouterr().err


def test_info_refuses_a_config_without_model_type(tmp_path, capsys):
    data = get_preset("k3-tiny").text_config.to_dict()
    del data["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert main(["info", "--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'config.json'}: the config has no model_type field" in err
    assert "known model types: 'kimi_k3', 'kimi_linear'" in err


def test_train_help_states_the_warmup_clamp(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "clamped to at most 25% of --steps" in " ".join(capsys.readouterr().out.split())


TEXTS = [
    "ROMEO. But soft, what light through yonder window breaks? It is the east. " * 20,
    "HAMLET. To be, or not to be, that is the question: whether 'tis nobler. " * 20,
    "MACBETH. Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace. " * 20,
    "LEAR. Blow, winds, and crack your cheeks! rage! blow! You cataracts. " * 20,
]


@pytest.fixture(scope="module")
def lone(tmp_path_factory):
    """A k3-tiny checkpoint with a tokenizer, outside any run folder, and a corpus folder."""
    from openk3.data import Tokenizer

    root = tmp_path_factory.mktemp("lone")
    openk3.save_pretrained(openk3.build_model(get_preset("k3-tiny"), seed=0), root / "ckpt")
    Tokenizer.train(TEXTS, 300).save(root / "ckpt")
    for i, text in enumerate(TEXTS):
        (root / "corpus").mkdir(exist_ok=True)
        (root / "corpus" / f"doc{i}.txt").write_text(text)
    return root


def test_eval_outside_a_run_asks_for_a_token_split(lone, capsys):
    ckpt = lone / "ckpt"
    assert main(["eval", "--ckpt", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {ckpt} is not inside a run folder" in err
    assert "pass --data path/to/val.bin (a token split written by `openk3 train`" in err
    assert "/data/val.bin'" not in err and "run prepare_data first" not in err
    missing = (
        lone / "corpus" / "nothing.txt"
    )  # text is tokenized now (tests/test_cli_user.py); a missing file:
    assert main(["eval", "--ckpt", str(ckpt), "--data", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_eval_refuses_a_split_of_another_tokenizer(lone, tmp_path, capsys):
    from openk3.data import Tokenizer, prepare_data

    ckpt = lone / "ckpt"
    own = prepare_data(
        lone / "corpus",
        out_dir=tmp_path / "own",
        vocab_size=8192,
        tokenizer=ckpt,
        val_fraction=0.5,
        progress=False,
    )
    args = ["eval", "--ckpt", str(ckpt), "--seq-len", "8", "--batch-size", "1", "--max-batches", "1"]
    assert main([*args, "--data", str(own.val_path)]) == 0  # the checkpoint's own tokenizer: accepted
    assert "perplexity" in capsys.readouterr().out
    other_tok = Tokenizer.train(["completely different text about other things " * 30], 290)
    other = prepare_data(
        lone / "corpus",
        out_dir=tmp_path / "other",
        vocab_size=8192,
        tokenizer=other_tok,
        val_fraction=0.5,
        progress=False,
    )
    recorded = json.loads((tmp_path / "other" / "val.json").read_text())["tokenizer_sha256"]
    assert recorded == other_tok.sha256 != Tokenizer.load(ckpt).sha256
    assert main([*args, "--data", str(other.val_path)]) == 2
    err = capsys.readouterr().err
    assert f"{other.val_path} was tokenized with another tokenizer than checkpoint {ckpt}'s" in err
    assert recorded[:12] in err


@pytest.mark.slow  # a subprocess or a trained tokenizer: ~1 min on a loaded 2-core machine
def test_a_closed_stdout_exits_quietly(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (e.g. `head`) is gone before anything is written
    src = str(Path(openk3.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "openk3.cli", "info", "--preset", "kimi-k3", "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=env,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert proc.stderr.decode() == ""
    assert proc.returncode == 141  # 128 + SIGPIPE


def test_train_refuses_an_out_that_is_a_file_and_a_seed_out_of_range(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    assert main(["train", "--out", str(afile), "--data", str(tmp_path), "--no-sample"]) == 2
    assert "is a file, not a run folder" in capsys.readouterr().err
    assert afile.read_text() == "keep me"
    with pytest.raises(SystemExit) as exc:
        main(["train", "--out", str(tmp_path / "r"), "--seed", str(2**70)])
    assert exc.value.code == 2
    assert "argument --seed: expected an int in [0, 2^63)" in capsys.readouterr().err


def test_generate_refuses_a_prompt_that_is_not_utf8(tmp_path, capsys):
    prompt = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # how Python hands undecodable argv bytes
    assert main(["generate", "--ckpt", str(tmp_path / "no-ckpt"), "--prompt", prompt]) == 2
    assert "--prompt is not valid UTF-8 text (byte 0xe9 at character 3)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "handler", "advice"),
    [
        (["info"], "cmd_info", "a smaller --preset"),
        (["train"], "cmd_train", "--batch-size"),
        (["generate", "--ckpt", "x", "--prompt", "hi"], "cmd_generate", "a shorter --prompt"),
        (["eval", "--ckpt", "x"], "cmd_eval", "--seq-len"),
    ],
)
def test_out_of_memory_is_one_line_with_the_commands_own_advice(monkeypatch, capsys, argv, handler, advice):
    import openk3.cli as cli

    def boom(args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(cli, handler, boom)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("openk3: error: out of memory (") and advice in err and err.count("\n") == 1


def test_a_runtime_bug_keeps_its_traceback(monkeypatch):
    import openk3.cli as cli

    def bug(args):
        raise RuntimeError("a genuine bug")

    monkeypatch.setattr(cli, "cmd_info", bug)
    with pytest.raises(RuntimeError, match="a genuine bug"):  # other errors keep their traceback
        main(["info"])


@pytest.mark.slow  # a subprocess or a trained tokenizer: ~1 min on a loaded 2-core machine
def test_sampling_stays_inside_the_tokenizer_vocabulary():
    """A model whose vocabulary is larger than its tokenizer's never emits ids the tokenizer lacks; with the
    full size the tokens are the unrestricted ones (same seed)."""
    from openk3.generate import stream

    config = get_preset("k3-tiny")
    model = openk3.build_model(config, seed=0).eval()
    V = config.text_config.vocab_size if hasattr(config, "text_config") else config.vocab_size
    ids = torch.tensor([[5, 6, 7]])

    def tokens(**kw):
        return torch.cat(list(stream(model, ids, 40, temperature=1.5, seed=3, **kw)), 1)[0].tolist()

    assert max(tokens()) >= 50  # an untrained model spreads over the whole vocabulary
    assert max(tokens(vocab_size=50)) < 50
    assert tokens(vocab_size=V) == tokens()


def test_python_generate_checks_seed_and_stays_inside_vocab_size():
    model = openk3.build_model(get_preset("k3-tiny"), seed=0).eval()
    ids = torch.tensor([[5, 6, 7]])
    for seed in (2**70, -1, True):
        with pytest.raises(ValueError, match="seed must be None or an int in"):
            openk3.generate.generate(model, ids, 2, temperature=1.0, seed=seed)
    new = openk3.generate.generate(model, ids, 30, temperature=1.5, seed=1, vocab_size=40)
    assert new.shape == (1, 30) and int(new.max()) < 40


@pytest.mark.parametrize(
    "argv", [["train"], ["info"], ["generate", "--ckpt", "m", "--prompt", "p"], ["eval", "--ckpt", "m"]]
)
def test_unknown_option_is_named_by_its_subcommand(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--bogus", "1"])
    assert exit_.value.code == 2
    command = argv[0]
    assert capsys.readouterr().err == (
        f"openk3 {command}: error: unrecognized arguments: --bogus 1 (see openk3 {command} --help)\n"
    )


def test_an_option_before_the_command_is_named(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "openk3: error: unrecognized arguments: --bogus (the command comes first: info, train"
    )


def test_info_names_a_config_that_is_not_utf8(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_bytes(b"\xff\xfe{}")
    assert main(["info", "--config", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"openk3: error: {bad} is not UTF-8 text (JSON): ")


@pytest.mark.parametrize("temperature,top_p", [(1e-44, 1.0), (1e-300, 1.0), (0.8, 1e-300), (0.8, 5e-324)])
def test_extreme_sampling_values_pick_the_most_likely_token(temperature, top_p):
    # a tiny temperature used to overflow logits/T to inf (softmax NaN); a top_p below fp32's range masked
    # every token; both limits are greedy decoding
    from openk3.generate import sample_next

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [10.0, -5.0, 9.5, 0.0]])
    gen = torch.Generator().manual_seed(0)
    assert sample_next(logits, temperature, top_p, gen).flatten().tolist() == [1, 0]


def test_train_refuses_more_tokens_per_step_than_it_can_draw(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--no-sample", "--batch-size", "2", "--grad-accum", str(10**20)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "batch_size × grad_accum × the longest context = 2 × 100000000000000000000 × 128" in err
    assert "above 2,147,483,647" in err
    assert not out.exists()


def test_generate_with_an_image_takes_an_empty_prompt_and_names_the_real_problem(lone, tmp_path, capsys):
    """``--image`` with ``--prompt ""`` is a prompt of an image alone: the empty-prompt check does not fire, and
    a text-only checkpoint is refused for what it is (no vision tower)."""
    image = tmp_path / "x.png"
    image.write_bytes(b"not an image")
    assert main(["generate", "--ckpt", str(lone / "ckpt"), "--image", str(image), "--prompt", ""]) == 2
    err = capsys.readouterr().err
    assert "vision tower" in err and "prompt is empty" not in err
    assert main(["generate", "--ckpt", str(lone / "ckpt"), "--prompt", ""]) == 2
    assert "the prompt is empty" in capsys.readouterr().err


def test_train_refuses_options_its_path_would_ignore(tmp_path, capsys):
    """``--ep-dispatcher moonep`` without expert parallelism, and ``--qat`` on image-text pairs, are refused
    before any work instead of being silently ignored."""
    assert main(["train", "--out", str(tmp_path / "a"), "--steps", "1", "--ep-dispatcher", "moonep"]) == 2
    assert "--ep-dispatcher moonep needs expert parallelism" in capsys.readouterr().err
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"image": "x.png", "text": "a red square"}) + "\n")
    argv = [
        "train",
        "--preset",
        "k3-vision-tiny",
        "--data",
        str(pairs),
        "--out",
        str(tmp_path / "b"),
        "--qat",
        "mxfp4",
    ]
    assert main(argv) == 2
    assert "take --qat" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_distributed_run_folder_is_read_through_its_final_export(lone, tmp_path):
    """``--ckpt RUN`` of a distributed run resolves to ``RUN/final``; without one, the error says the folder
    holds DCP checkpoints and how to use them."""
    from openk3.checkpoint.io import latest_checkpoint

    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "checkpoints" / "step-000002" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="distributed \\(DCP\\) checkpoints"):
        latest_checkpoint(run)
    (run / "final").symlink_to(lone / "ckpt")
    assert latest_checkpoint(run) == run / "final"


def test_a_distributed_run_prints_its_sample_unless_no_sample(monkeypatch, tmp_path, capsys):
    """Rank 0 of a finished torchrun run samples from ``OUT/final`` after the summary, and ``--no-sample``
    skips that (it crashed on a ``None`` prompt after the run had succeeded)."""
    import openk3.cli as cli
    import openk3.dist.train

    out = tmp_path / "cp2"
    summary = {"rank": 0, "step": 5, "loss": 5.0, "checkpoint": str(out / "checkpoints" / "step-000005"),
               "val_loss": 5.1, "val_tokens": 1024, "export": str(out / "final")}  # fmt: skip
    monkeypatch.setattr(openk3.dist.train, "train_distributed", lambda *a, **k: summary)
    samples = []
    monkeypatch.setattr(
        cli, "_print_sample", lambda args, config, ckpt: samples.append((config.sample_prompt, ckpt))
    )
    argv = ["train", "--cp", "2", "--steps", "5", "--eval-every", "5", "--batch-size", "4", "--out", str(out)]
    assert main([*argv, "--no-sample"]) == 0
    assert samples == [] and "val loss 5.1000 nats/token" in capsys.readouterr().out
    assert main(argv) == 0
    assert len(samples) == 1 and samples[0][0] and samples[0][1] == str(out / "final")


def test_eval_of_a_window_longer_than_the_split_is_refused_before_any_progress_bar(lone, tmp_path, capsys):
    from openk3.data import prepare_data

    ckpt = lone / "ckpt"
    split = prepare_data(
        lone / "corpus",
        out_dir=tmp_path / "s",
        vocab_size=8192,
        tokenizer=ckpt,
        val_fraction=0.5,
        progress=False,
    )
    assert main(["eval", "--ckpt", str(ckpt), "--data", str(split.val_path), "--seq-len", "10000000"]) == 2
    err = capsys.readouterr().err
    assert "no validation windows were evaluated" in err and "seq_len=10000000" in err
    assert "eval:" not in err and "batch/s" not in err, err  # no (empty) progress bar before the error


def test_a_distributed_run_is_not_resumed_by_one_process(tmp_path, capsys):
    """A run folder of DCP checkpoints (``step-N/meta.json``, no ``latest``) names how to resume it, instead
    of pointing at a ``latest`` file a distributed run never writes."""
    step = tmp_path / "run" / "checkpoints" / "step-000009"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    assert main(["train", "--out", str(tmp_path / "run"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "is a distributed run (DCP checkpoints): resume it as it was started" in err
    assert "--nproc-per-node" in err and "latest" not in err, err
