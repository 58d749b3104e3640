"""``benchmarks/speculative.py``: its argument checks (before anything loads), and one whole run on the CPU at
tiny sizes, training its own target (the path the one-call GPU measurement takes)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = [
    "ROMEO. But soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n",
    "HAMLET. To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "MACBETH. Tomorrow, and tomorrow, and tomorrow,\nCreeps in this petty pace from day to day,\n",
    "LEAR. Blow, winds, and crack your cheeks! rage! blow!\nYou cataracts and hurricanoes, spout\n",
]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("speculative")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "one of the arguments --target --train-target is required"),
        (["--target", "r", "--train-target", "k3-tiny"], "not allowed with argument"),
        (["--train-target", "k3-huge"], "invalid choice: 'k3-huge'"),
        (["--target", "r", "--ks", "1,17"], "--ks and --engine-ks take k in [1, 16], got 17"),
        (["--target", "r", "--engine-ks", "0,3"], "--ks and --engine-ks take k in [1, 16], got 0"),
        (["--target", "r", "--ks", "a"], "expected comma-separated ints"),
        (["--target", "r", "--streams", "0,64"], "--streams takes numbers of streams >= 1"),
        (["--target", "r", "--budget-s", "0"], "expected a finite number > 0, got '0'"),
        (["--target", "r", "--target-steps", "0"], "expected an int >= 1, got '0'"),
        (["--target", "r", "--data", "corpus"], "--data and --work go with --train-target"),
        (["--target", "r", "--seq-len", "12"], "--seq-len must be at least 18"),
        (["--target", "r", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (["--target", "r", "--train-only"], "--train-only needs --drafts DIR"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(bench, args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(args)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_gpu_command_of_the_docs_parses(bench):
    """The one-call GPU command of docs/speculative.md, as written there, parses."""
    text = (ROOT / "docs" / "speculative.md").read_text()
    command = text[text.index("python benchmarks/speculative.py --train-target") :].split("\n```")[0]
    argv = command.replace("\\\n", " ").split()[2:]
    args = bench.parse_args(argv)
    assert args.train_target == "k3-small" and args.device == "cuda" and args.budget_s == 400.0
    assert args.streams == [1, 64] and args.engine_ks == [1, 2, 3, 4, 5] and args.data == ".corpus"
    two_calls = text[text.index("echo /.spec/") :].split("\n```")[0].replace("\\\n", " ").splitlines()[1:]
    train, measure = (bench.parse_args(line.split()[2:]) for line in two_calls)
    assert train.train_only and train.drafts == measure.drafts == ".spec/drafts" and train.work == ".spec"
    assert measure.target == ".spec/k3-small" and not measure.train_only and measure.streams == [1, 64]


def test_speed_ups_of_outputs_unlike_plain_decoding_are_flagged(bench):
    """A speculative row whose greedy outputs differ from plain decoding's (the graphed step's first H200 run:
    0/1 and 0/64 identical streams, its speed-ups printed as if lossless) gets the note in its speed-up cell
    and a warning line after its table naming it; rows with identical outputs get neither."""
    args = bench.parse_args(["--target", "run", "--prompts", "2"])
    spec = dict(decode_tokens_per_s=300.0, tokens_per_s=290.0, speedup=1.5, acceptance_rate=0.5)
    spec.update(tokens_per_step=2.0, ms_per_step=5.0, decode_steps=10)
    plain = dict(decode_tokens_per_s=200.0, tokens_per_s=199.0, decode_steps=20)
    single = dict(tokens_per_forward=2.0, speedup=1.4)

    def report(same_streams, same_prompts):
        result = dict(
            environment=dict(cpu="cpu", threads=1, torch="t", python="p"), command="c", dtype="torch.float32",
            wall_seconds=1.0, target_val=dict(loss=1.0, tokens=1, unigram_entropy=2.0), target="run",
            draft_training=dict(steps=1, seconds_per_step=0.1, batch_size=8, data="corpus windows of 64 tokens",
                                ttt_steps=3, lr=0.002), skipped=[],
            drafts={loss: dict(alpha_by_depth=[0.5] * 5, expected_tokens_per_forward={3: 1.9},
                               train_seconds=1.0) for loss in ("lk", "kl")},
            engine={"4": dict(plain=plain, speculative={k: dict(spec, identical_streams=n)
                                                        for k, n in zip((1, 3), same_streams)})},
            single_sequence={loss: {3: dict(single, identical_prompts=n)}
                             for loss, n in zip(("lk", "kl"), same_prompts)},
        )  # fmt: skip
        return bench.render(result, args).splitlines()

    lines = report((4, 3), (2, 1))
    rows = {line.split(" | ")[1]: line for line in lines if line.startswith("| 4 |")}
    assert "OUTPUTS DIFFER" not in rows["1"] and "1.50× **OUTPUTS DIFFER (1/4)** |" in rows["3"]
    # 4 streams × (new_tokens - 1) decode tokens over 20 plain steps at 200 tok/s, 10 speculative at 300
    ms = [1e3 * 4 * (args.new_tokens - 1) / tps / steps for tps, steps in ((200, 20), (300, 10))]
    assert f"| 20 / 10 ({ms[0]:.1f} / {ms[1]:.1f}) |" in rows["1"]
    warnings = [line for line in lines if line.startswith("**WARNING: the outputs differ")]
    assert len(warnings) == 2 and "4 streams k = 3:" in warnings[0] and "k = 1" not in warnings[0]
    assert "KL k = 3:" in warnings[1] and "LK" not in warnings[1]
    single_row = next(line for line in lines if line.startswith("| 3 | 2.00 |"))
    assert single_row == "| 3 | 2.00 | 1.40× | 2.00 | 1.40× **OUTPUTS DIFFER (1/2)** | 2/2, 1/2 |"
    assert not any("DIFFER" in line or "WARNING" in line for line in report((4, 4), (2, 2)))


@pytest.mark.slow  # trains a k3-tiny target and two drafts for a few steps: ~1–2 min on 2 busy cores
def test_a_whole_run_trains_its_target_and_writes_the_report(bench, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(TEXT * 2):
        (corpus / f"work{i}.txt").write_text(text * 40)
    out = tmp_path / "out"
    argv = [
        "--train-target", "k3-tiny", "--data", str(corpus), "--work", str(tmp_path / "w"), "--target-steps", "7",
        "--target-batch-size", "2", "--target-seq-len", "32", "--draft-steps", "2", "--gen-windows", "2",
        "--batch-size", "2", "--seq-len", "24", "--eval-batches", "1", "--ks", "1,3", "--prompts", "2",
        "--prompt-len", "8", "--new-tokens", "5", "--streams", "1,2", "--engine-ks", "1,3", "--budget-s", "100000", "--threads", "1",
        "--out", str(out),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["speculative.py"])
    assert bench.main(argv) == 0
    result = json.loads((out / "speculative_cpu.json").read_text())
    assert result["target_training"]["steps"] == 7  # the budget and the one pass leave the planned steps
    train_tokens = bench.TokenDataset(tmp_path / "w" / "k3-tiny" / "data" / "train.bin").num_tokens
    assert result["target_training"]["train_tokens"] == train_tokens > 7 * 2 * 32
    assert result["target_training"]["epochs"] == pytest.approx(7 * 2 * 32 / train_tokens)
    assert (tmp_path / "w" / "k3-tiny" / "checkpoints" / "step-000007").is_dir()
    rows = [json.loads(x) for x in (tmp_path / "w" / "k3-tiny" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r["loss"] for r in rows if "grad_norm" in r}
    assert sorted(steps) == list(range(1, 8))  # the timed steps and the resumed ones, each logged once
    curve = result["target_training"]["train_loss"]
    assert curve["curve"][-1][0] == 7 and curve["last"] == steps[7] and curve["min"] == min(steps.values())
    assert sum(b - a for (a, _), (b, _) in zip([(0, 0), *curve["curve"]], curve["curve"])) == 7
    assert result["draft_training"]["steps"] == 2 and result["skipped"] == []
    for loss in ("lk", "kl"):
        alphas = result["drafts"][loss]["alpha_by_depth"]
        assert len(alphas) == 5 and all(0 < a <= 1 for a in alphas)
        for k in ("1", "3"):  # fp32 on the CPU: greedy speculation gives the plain tokens
            row = result["single_sequence"][loss][k]
            assert row["identical_prompts"] == 2 and 1 <= row["tokens_per_forward"] <= int(k) + 1
    for n in ("1", "2"):
        for k in ("1", "3"):
            row = result["engine"][n]["speculative"][k]
            assert row["identical_streams"] == int(n)
            assert 0 <= row["acceptance_rate"] <= 1 and 1 <= row["tokens_per_step"] <= int(k) + 1
            assert row["decode_tokens_per_s"] > 0 and row["ms_per_step"] > 0
    report = (out / "speculative_cpu.md").read_text()
    assert report.startswith("# Speculative decoding") and "--train-target k3-tiny" in report
    assert "| 2 |" in report and "trained here for 7 steps" in report and "Target train loss" in report
    assert f"passes over its {train_tokens:,} train tokens" in report


def test_the_target_stops_after_its_passes_over_the_corpus(bench, tmp_path):
    """``--target-epochs`` caps the planned steps at that many passes over the train split (a small corpus
    overfits past one), never below the timed steps; the budget's unused target share is reported."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(TEXT * 2):
        (corpus / f"work{i}.txt").write_text(text * 40)
    argv = [
        "--train-target", "k3-tiny", "--data", str(corpus), "--work", str(tmp_path / "w"), "--target-steps", "900",
        "--target-batch-size", "8", "--target-seq-len", "32", "--target-epochs", "0.5", "--budget-s", "100000",
    ]  # fmt: skip
    args = bench.parse_args(argv)
    run, summary = bench.train_target(args, bench.Clock(args.budget_s))
    train_tokens = bench.TokenDataset(run / "data" / "train.bin").num_tokens
    half_pass = int(0.5 * train_tokens / (8 * 32))
    assert summary["steps"] == max(bench.TIMED_STEPS, half_pass) < 900
    assert summary["epochs"] == pytest.approx(summary["steps"] * 8 * 32 / train_tokens)
    assert summary["spare_seconds"] > 0


def test_divergence_tells_a_rounding_flip_from_a_real_difference(bench):
    """Two greedy continuations compared at their first difference by the fp32 target: the logit gap of the
    two tokens there (an independent forward gives the same), a flip counted as rounding only when the gap
    lies within twice the low-precision model's logit error, and never for the fp32 model itself."""
    import copy

    import torch

    import openk3
    from openk3.generate import greedy
    from openk3.presets import k3_shaped

    master = openk3.build_model(k3_shaped(4, vocab_size=64), seed=0).eval()
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        a = greedy(master, torch.tensor([prompt]), 6)[0].tolist()
        logits = master(torch.tensor([prompt + a[:2]])).logits[0, -1]
        b = a[:2] + [int(logits.argsort()[-2])] + a[3:]  # the runner-up at position 2
        assert bench.divergence(master, master, prompt, a, list(a)) is None
        exact = bench.divergence(master, master, prompt, a, b)
        assert exact["position"] == 2 and not exact["rounding"] and exact["error"] == 0.0
        assert exact["gap"] == pytest.approx(float(logits[a[2]] - logits[b[2]]), rel=1e-6)
        assert exact["fp32_best"] == "first"  # a is greedy: its token is the fp32 argmax
        assert bench.divergence(master, master, prompt, b, a)["fp32_best"] == "second"
        low = copy.deepcopy(master).to(torch.bfloat16)
        flip = bench.divergence(master, low, prompt, a, b)
        error = float((low(torch.tensor([prompt + a[:2]])).logits[0, -1].float() - logits).abs().max())
        assert flip["error"] == pytest.approx(error) and flip["rounding"] == (flip["gap"] <= 2 * error)
        worst = a[:2] + [int(logits.argmin())] + a[3:]
        assert not bench.divergence(master, low, prompt, a, worst)["rounding"]
        assert bench.divergence(master, low, prompt, worst, b)["fp32_best"] == "neither"


def test_streams_equal_in_fp32_are_counted_apart(bench):
    """The measured H200 row (64 streams, k = 1: 1 identical, 61 bf16 near-ties, 2 past the near-tie bound):
    flagged while nothing reruns in fp32; not flagged once both engines' fp32 runs of those 2 agree."""
    row = dict(identical_streams=1, rounding_streams=61)
    assert bench.same_text(row, 64) == "1/64 (+61 bf16 near-ties)"
    assert bench.differ(1, 64, 61) == " **OUTPUTS DIFFER (2/64)**"
    row["fp32_equal_streams"] = 2
    assert bench.same_text(row, 64) == "1/64 (+61 bf16 near-ties, +2 equal in fp32)"
    assert bench.differ(1, 64, 61 + 2) == ""


def test_streams_past_the_near_tie_bound_are_rerun_in_fp32(bench, monkeypatch):
    """A bf16 engine round whose streams all count as past the near-tie bound (``divergence`` stubbed so):
    both engines run again in fp32 (the fp32 target and draft), where the lossless speculative engine gives
    plain decoding's tokens, so every such stream is counted equal in fp32 and the row is not flagged."""
    import copy
    import types

    import numpy as np
    import torch

    import openk3
    from openk3.model.draft import DraftConfig, build_draft, feature_layers
    from openk3.presets import k3_shaped

    master = openk3.build_model(k3_shaped(4, vocab_size=64), seed=0).eval()
    cfg = master.language_model.config
    exact = build_draft(cfg, DraftConfig(feature_layers(4), 64, cfg.hidden_size, 4), seed=1).eval()
    model, draft = copy.deepcopy(master).to(torch.bfloat16), copy.deepcopy(exact).to(torch.bfloat16)
    val = types.SimpleNamespace(tokens_N=np.arange(40, dtype=np.uint16) % 64, num_tokens=40)
    args = bench.parse_args(["--target", "r", "--streams", "3", "--engine-ks", "2", "--prompt-len", "4"])
    args.new_tokens = 5
    stub = {"position": 0, "gap": 1.0, "error": 0.0, "rounding": False, "fp32_best": "first"}
    monkeypatch.setattr(bench, "divergence", lambda *a: dict(stub))
    clock = bench.Clock(None)
    with torch.no_grad():
        row = bench.engine_throughput(model, master, draft, exact, val, args, torch.device("cpu"), clock)
    spec = row[3]["speculative"][2]
    assert spec["identical_streams"] == 0 and spec["rounding_streams"] == 0
    assert spec["fp32_equal_streams"] == 3
    assert bench.differ(0, 3, spec["rounding_streams"] + spec["fp32_equal_streams"]) == ""


@pytest.mark.slow  # trains a k3-tiny target and two drafts for a few steps: ~1 min on 2 busy cores
def test_drafts_trained_in_one_call_are_measured_in_the_next(bench, tmp_path, monkeypatch, capsys):
    """``--train-only --drafts DIR`` trains and saves both drafts and stops after their acceptance rates; a
    second run with ``--target RUN --drafts DIR`` loads them (the same weights: the same α to the bit on
    the CPU) and measures the rest. A folder missing a draft, or drafts of another target, are refused."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(TEXT * 2):
        (corpus / f"work{i}.txt").write_text(text * 40)
    drafts = tmp_path / "drafts"
    small = ["--draft-steps", "2", "--gen-windows", "2", "--batch-size", "2", "--seq-len", "24",
             "--eval-batches", "1", "--threads", "1", "--budget-s", "100000"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["speculative.py"])
    first = [
        "--train-target", "k3-tiny", "--data", str(corpus), "--work", str(tmp_path / "w"), "--target-steps", "7",
        "--target-batch-size", "2", "--target-seq-len", "32", "--drafts", str(drafts), "--train-only",
        "--out", str(tmp_path / "a"), *small,
    ]  # fmt: skip
    assert bench.main(first) == 0
    first_log = capsys.readouterr().err
    trained = json.loads((tmp_path / "a" / "speculative_cpu.json").read_text())
    assert {p.name for p in drafts.iterdir()} == {"lk", "kl", bench.DRAFTS_RECORD}
    assert "engine" not in trained and "single_sequence" not in trained
    assert trained["draft_training"]["steps"] == 2 and "loaded_from" not in trained["draft_training"]

    second = ["--target", str(tmp_path / "w" / "k3-tiny"), "--drafts", str(drafts), "--ks", "1",
              "--prompts", "1", "--prompt-len", "8", "--new-tokens", "4", "--out", str(tmp_path / "b"), *small]  # fmt: skip
    assert bench.main(second) == 0
    measured = json.loads((tmp_path / "b" / "speculative_cpu.json").read_text())
    assert measured["draft_training"] == {**trained["draft_training"], "loaded_from": str(drafts)}
    for loss in ("lk", "kl"):
        assert measured["drafts"][loss]["alpha_by_depth"] == trained["drafts"][loss]["alpha_by_depth"]
        assert measured["drafts"][loss]["final_loss"] == trained["drafts"][loss]["final_loss"]
        assert measured["single_sequence"][loss]["1"]["identical_prompts"] == 1
    report = (tmp_path / "b" / "speculative_cpu.md").read_text()
    assert f"trained by an earlier run and loaded from `{drafts}`" in report
    assert (
        "lk draft:" in first_log and "lk draft:" not in capsys.readouterr().err
    )  # no training the second time

    record = json.loads((drafts / bench.DRAFTS_RECORD).read_text())
    (drafts / bench.DRAFTS_RECORD).write_text(json.dumps({**record, "target_fingerprint": 1.0}))
    with pytest.raises(SystemExit, match="trained against another target"):
        bench.main(second)
    with pytest.raises(SystemExit, match="already holds both drafts"):
        bench.main([*second, "--train-only"])
    (drafts / bench.DRAFTS_RECORD).unlink()
    with pytest.raises(SystemExit, match=r"holds lk, kl and no training.json: not the two drafts"):
        bench.main(second)
