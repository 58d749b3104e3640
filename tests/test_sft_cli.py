"""``openk3 sft``: a run on a few chat pairs learns them (loss, greedy reply, a model folder the loaders read);
bad data is one line naming the file, the line and the problem, and nothing is written; an ``--out`` that
holds a model, or is the checkpoint, is refused."""

from __future__ import annotations

import json

import pytest
import torch

import openk3
from openk3.cli import main
from openk3.config import text_config_of
from openk3.data import Tokenizer
from openk3.presets import k3_shaped
from openk3.rl.logprobs import response_logprobs
from openk3.rl.sft_cli import SFT_RECORD, batch_note, split_held_out
from openk3.serve.chat_template import ChatTemplate

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 128
"""The fixture's max_position_embeddings: small, so an over-long example is cheap to write."""

PAIRS = [
    {"prompt": "Who killed Duncan?", "response": "Macbeth."},
    {"prompt": "Who loves Juliet?", "response": "Romeo."},
    {
        "messages": [
            {"role": "system", "content": "Answer with one name."},
            {"role": "user", "content": "Who is the Prince of Denmark?"},
            {"role": "assistant", "content": "Hamlet."},
        ]
    },
]
TEXT = "Who loves Juliet? Romeo. Who is the Prince of Denmark? Hamlet. Who killed Duncan? Macbeth. "


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 4-layer K3-shaped model (random weights, context 128) with a small BPE tokenizer."""
    folder = tmp_path_factory.mktemp("base") / "k3-4"
    config = k3_shaped(4, vocab_size=320)
    text_config_of(config).max_position_embeddings = CONTEXT
    openk3.save_pretrained(openk3.build_model(config, seed=0), folder, tokenizer=None)
    Tokenizer.train([TEXT * 20], 300).save(folder)
    return folder


def _write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _examples(folder, records):
    tok = Tokenizer.load(folder)
    chat = ChatTemplate.from_folder(tok, folder)
    out = []
    for r in records:
        messages = r.get("messages") or [
            {"role": "user", "content": r["prompt"]},
            {"role": "assistant", "content": r["response"]},
        ]
        out.append((chat.encode(messages[:-1]), tok.encode(messages[-1]["content"]) + [tok.eos_id]))
    return out


def _loss(model, example) -> float:
    with torch.no_grad():
        logp_BT, mask_BT = response_logprobs(model, [example[0]], [example[1]])
    return -(logp_BT * mask_BT).sum().item() / mask_BT.sum().item()


def test_sft_learns_the_pairs_and_writes_a_model_folder(ckpt, tmp_path, capsys):
    data = _write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    out = tmp_path / "sft"
    args = ["sft", "--ckpt", str(ckpt), "--data", data, "--out", str(out), "--steps", "40"]
    assert main([*args, "--batch-size", "2", "--lr", "3e-3", "--val-fraction", "0.3"]) == 0
    printed = capsys.readouterr().out
    assert "step 40/40: loss" in printed and "held-out loss before" in printed and f"wrote {out}" in printed
    record = json.loads((out / SFT_RECORD).read_text())
    assert record["command"].startswith("openk3 sft --ckpt") and record["steps"] == 40
    assert (record["train_examples"], record["held_out_examples"]) == (2, 1)
    losses = record["train_loss"]
    assert len(losses) == 40 and losses[-1] < 0.3 * losses[0], losses
    held = record["held_out_loss"]
    assert held["before"] > 0 and held["after"] > 0
    assert not list(tmp_path.glob(".tmp-*")), "the temporary folder was left behind"

    # the folder loads with the usual loader; each trained answer is far likelier than under the base model
    examples = _examples(ckpt, PAIRS)
    train, held_out = split_held_out(examples, 0.3, seed=0)
    assert held_out == [examples[0]]  # the seed holds out Duncan: Juliet and Denmark are trained
    base, tuned = openk3.from_pretrained(ckpt), openk3.from_pretrained(out)
    for example in train:
        assert _loss(tuned, example) < 0.3 * _loss(base, example)
    assert Tokenizer.load(out).encode(TEXT) == Tokenizer.load(ckpt).encode(TEXT)
    # and `openk3 generate --chat` replies with the trained answer
    gen = ["generate", "--ckpt", str(out), "--chat", "--temperature", "0", "--max-new-tokens", "8"]
    assert main([*gen, "--prompt", "Who loves Juliet?"]) == 0
    assert capsys.readouterr().out == "Romeo.\n"


LONG = {"prompt": " ".join(str(i) for i in range(100)), "response": "Romeo."}


@pytest.mark.parametrize(
    ("records", "line", "problem"),
    [
        ([PAIRS[0], '{"prompt": "Who loves', PAIRS[2]], 2, "not JSON"),
        ([{"messages": [{"role": "user", "content": "Who?"}]}], 1, "not the assistant's"),
        ([PAIRS[0], {"prompt": "Who loves Juliet?", "response": " "}], 2, '"response" is empty'),
        (
            [{"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "Romeo."}]}],
            1,
            "message 1 (user) has empty content",
        ),
        (
            [{"messages": [{"role": "narrator", "content": "Hi"}, {"role": "assistant", "content": "Hi"}]}],
            1,
            "unknown role 'narrator'",
        ),
        ([{"question": "Who?", "answer": "Romeo."}], 1, 'expected {"messages"'),
        ([PAIRS[0], PAIRS[2], LONG], 3, f"longer than the model's context of {CONTEXT}"),
        (["", "  "], None, "holds no examples"),
    ],
)
def test_bad_data_names_the_line_and_writes_nothing(ckpt, tmp_path, capsys, records, line, problem):
    data = _write_jsonl(tmp_path / "bad.jsonl", records)
    out = tmp_path / "sft"
    assert main(["sft", "--ckpt", str(ckpt), "--data", data, "--out", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("openk3: error: "), err
    assert (f"{data}:{line}: " if line else f"{data} ") in err and problem in err, err
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


def test_an_out_holding_a_model_or_the_checkpoint_is_refused(ckpt, tmp_path, capsys):
    data = _write_jsonl(tmp_path / "pairs.jsonl", PAIRS[:1])
    other = tmp_path / "other"
    openk3.save_pretrained(openk3.from_pretrained(ckpt), other)
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    base = ["sft", "--ckpt", str(ckpt), "--data", data, "--steps", "1", "--out"]
    assert main([*base, str(other)]) == 2
    assert (
        "already exists and holds a checkpoint (config.json); refusing to overwrite"
        in capsys.readouterr().err
    )
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    assert main([*base, str(ckpt)]) == 2
    assert f"--out {ckpt} is the --ckpt checkpoint" in capsys.readouterr().err
    # inside the checkpoint, or inside a run's checkpoints/step-N (a resumed run prunes old steps whole)
    for inside in (ckpt / "sft", tmp_path / "run" / "checkpoints" / "step-000002" / "sft"):
        assert main([*base, str(inside)]) == 2
        assert "lies inside a checkpoint folder" in capsys.readouterr().err
        assert not inside.exists()
    # a folder of one's own that happens to be called checkpoints is fine
    assert main([*base, str(tmp_path / "checkpoints" / "mine")]) == 0


def test_the_checkpoints_jinja_chat_template_is_kept(ckpt, tmp_path):
    import shutil

    jinja = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    base = tmp_path / "jinja"
    shutil.copytree(ckpt, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": jinja}))
    data = _write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    out = tmp_path / "sft"
    assert main(["sft", "--ckpt", str(base), "--data", data, "--out", str(out), "--steps", "1"]) == 0
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == jinja
    tok = Tokenizer.load(out)
    messages = [{"role": "user", "content": "Who loves Juliet?"}]
    assert ChatTemplate.from_folder(tok, out).encode(messages) == tok.encode(
        "user: Who loves Juliet?\nassistant:"
    )


def test_an_interrupted_write_leaves_no_model_folder(ckpt, tmp_path, monkeypatch, capsys):
    """A Ctrl-C while the folder is written, or during the steps, leaves no folder and says so in one line
    (it printed only "interrupted")."""
    import openk3.checkpoint
    import openk3.rl.sft

    real = openk3.checkpoint.save_pretrained

    def save_then_interrupt(*args, **kwargs):
        real(*args, **kwargs)  # the weights are written, sft.json is not yet: Ctrl-C now
        raise KeyboardInterrupt

    monkeypatch.setattr(openk3.checkpoint, "save_pretrained", save_then_interrupt)
    data = _write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    out = tmp_path / "sft"
    line = (
        f"openk3: sft interrupted: nothing was written to {out} (the model is written once, after the last "
        "step); run the command again\n"
    )
    assert main(["sft", "--ckpt", str(ckpt), "--data", data, "--out", str(out), "--steps", "1"]) == 130
    assert capsys.readouterr().err == line
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))
    monkeypatch.undo()

    def interrupted_training(*args, **kwargs):  # Ctrl-C during the steps
        raise KeyboardInterrupt

    monkeypatch.setattr(openk3.rl.sft, "sft", interrupted_training)
    assert main(["sft", "--ckpt", str(ckpt), "--data", data, "--out", str(out), "--steps", "1"]) == 130
    assert capsys.readouterr().err == line
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


def test_a_batch_above_the_examples_is_named_and_the_record_holds_absolute_paths(
    ckpt, tmp_path, capsys, monkeypatch
):
    """``--batch-size 5`` on 2 training examples printed only "1 steps of 5": every batch draws its examples
    at random with replacement (a batch above the example count is allowed, it repeats them), and the line
    now says so; ``sft.json`` recorded ``--data`` as typed (relative), now the absolute path."""
    monkeypatch.chdir(tmp_path)
    _write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    args = ["sft", "--ckpt", str(ckpt), "--data", "pairs.jsonl", "--out", "sft", "--steps", "1"]
    assert main([*args, "--batch-size", "5", "--val-fraction", "0.3"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"sft: 2 training examples, 1 held out; 1 step of 5 from {ckpt}"
    assert printed[1] == (
        "sft: --batch-size 5 is more than the 2 training examples: each step draws them at random with "
        "replacement, each about 2.5 times; --batch-size 2 draws each about once"
    )
    record = json.loads((tmp_path / "sft" / SFT_RECORD).read_text())
    assert (record["data"], record["ckpt"]) == (str(tmp_path / "pairs.jsonl"), str(ckpt))
    assert batch_note(2, 2) is None and batch_note(3, 2).startswith("sft: --batch-size 3 is more than")


def test_a_distributed_runs_dcp_step_folder_is_fine_tuned_as_its_weights(ckpt, tmp_path, capsys):
    """``--ckpt RUN/checkpoints/step-N`` of a distributed run said there is no checkpoint; it is read as
    ``openk3 eval`` reads it (the run's tokenizer, the step's model), and two steps on it give the losses
    and weights of two steps on the same weights saved as a model folder."""
    import torch.distributed as dist

    from openk3.dist.checkpoint import save_checkpoint
    from openk3.train.optim import build_optimizer

    run = tmp_path / "run"
    Tokenizer.load(ckpt).save(run / "data" / "tokenizer")
    model = openk3.from_pretrained(ckpt)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        step = save_checkpoint(run / "checkpoints", 3, model, build_optimizer(model, lr=1e-2))
    finally:
        dist.destroy_process_group()
    data = _write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    records = []
    for source, out in ((step, tmp_path / "from-dcp"), (ckpt, tmp_path / "from-folder")):
        assert main(["sft", "--ckpt", str(source), "--data", data, "--out", str(out), "--steps", "2"]) == 0
        assert f"from {source}" in capsys.readouterr().out
        records.append(json.loads((out / SFT_RECORD).read_text()))
    assert records[0]["ckpt"] == str(step) and records[0]["train_loss"] == records[1]["train_loss"]
    dcp, folder = (
        openk3.from_pretrained(tmp_path / name).state_dict() for name in ("from-dcp", "from-folder")
    )
    assert all(torch.equal(dcp[k], v) for k, v in folder.items())
    assert list(step.parent.iterdir()) == [step]  # nothing was written into the run's checkpoints
