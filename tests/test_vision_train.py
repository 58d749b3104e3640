"""Image-text training data and the image-text trainer (``openk3 train --data pairs.jsonl``)."""

from __future__ import annotations

import json

import pytest
import torch

import openk3
from openk3.cli import main
from openk3.data import Tokenizer
from openk3.data.image_text import (
    IGNORE_INDEX,
    ImageTextPair,
    ImageTextSet,
    is_image_text_jsonl,
    read_image_text,
)
from openk3.data.shapes import COLORS, SHAPES, SIDES, write_shapes
from openk3.presets import get_preset


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_shapes(tmp_path_factory.mktemp("shapes"), 48, seed=3)


def test_shapes_are_described_by_colour_shape_and_side(shapes):
    rows = [json.loads(line) for line in shapes.read_text().splitlines()]
    assert len(rows) == 48
    texts = {f"a {c} {s} on the {d}" for c in COLORS for s in SHAPES for d in SIDES}
    assert len(texts) == 36 and all(r["text"] in texts for r in rows)
    again = write_shapes(shapes.parent / "again", 48, seed=3)
    assert (again.parent / rows[5]["image"]).read_bytes() == (shapes.parent / rows[5]["image"]).read_bytes()
    assert is_image_text_jsonl(str(shapes)) and not is_image_text_jsonl(str(shapes.parent / "nope.jsonl"))


def test_batches_train_on_the_text_after_the_image(shapes):
    config = get_preset("k3-vision-tiny")
    pairs = read_image_text(shapes)[:3]
    tok = Tokenizer.train([p.text for p in pairs] * 4, vocab_size=400)
    data = ImageTextSet(pairs, tok, config.vision_config, config.media_placeholder_token_id)
    P = config.media_placeholder_token_id
    ids_BT, targets_BT, media = data.batch([2, 0])
    text = [tok.encode(pairs[i].text) for i in (2, 0)]
    assert data.counts == [4, 4, 4] and media.grid_thws.tolist() == [[1, 4, 4], [1, 4, 4]]
    for b, t in enumerate(text):
        row = [P] * 4 + t + [tok.eos_id]
        n = len(row) - 1
        assert ids_BT[b, :n].tolist() == row[:-1]
        assert targets_BT[b, :n].tolist() == [IGNORE_INDEX] * 3 + t + [tok.eos_id]
        assert (targets_BT[b, n:] == IGNORE_INDEX).all()
    assert torch.equal(media.pixel_values[:16], data.patches[2][0])


@pytest.mark.parametrize(
    "line, error, match",
    [
        ("{not json", ValueError, r"pairs.jsonl:2 is not valid JSON"),
        ('{"image": "a.png"}', ValueError, r'pairs.jsonl:2: expected \{"image"'),
        ('{"image": "a.png", "text": ""}', ValueError, "pairs.jsonl:2: the text is empty"),
        ('{"image": "gone.png", "text": "x"}', FileNotFoundError, "pairs.jsonl:2: no image file"),
    ],
)
def test_bad_rows_name_the_line(tmp_path, line, error, match):
    from PIL import Image

    Image.new("RGB", (28, 28)).save(tmp_path / "a.png")
    (tmp_path / "pairs.jsonl").write_text('{"image": "a.png", "text": "ok"}\n' + line + "\n")
    with pytest.raises(error, match=match):
        read_image_text(tmp_path / "pairs.jsonl")
    assert ImageTextPair(tmp_path / "a.png", "ok") == read_image_text_first(tmp_path)


def read_image_text_first(folder):
    (folder / "one.jsonl").write_text('{"image": "a.png", "text": "ok"}\n')
    return read_image_text(folder / "one.jsonl")[0]


@pytest.mark.slow  # a 12-step run, evaluation and a save: ~20 s alone on 2 cores, a minute when they are busy
def test_train_cli_learns_from_image_text_pairs(shapes, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--preset", "k3-vision-tiny", "--data", str(shapes), "--out", str(out)]
    assert main([*args, "--steps", "12", "--batch-size", "8", "--eval-every", "100"]) == 0
    printed = capsys.readouterr().out
    assert "held-out caption accuracy" in printed and "on 5 images not trained on" in printed
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 12 and losses[-1] < 0.6 * losses[0]  # from ≈ ln 8192 = 9.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_rows"] == 43 and summary["heldout_rows"] == 5
    model = openk3.from_pretrained(out)  # the run folder resolves to its checkpoint
    assert model.config.vision_config is not None
    image = shapes.parent / json.loads(shapes.read_text().splitlines()[0])["image"]
    gen = ["generate", "--ckpt", str(out), "--prompt", "a", "--image", str(image), "--max-new-tokens", "3"]
    assert main([*gen, "--temperature", "0"]) == 0
    assert main([*args, "--resume"]) == 2
    assert "does not resume" in capsys.readouterr().err
    # `openk3 eval` on the run reads its held-out pairs and gives the run's final evaluation back
    assert main(["eval", "--ckpt", str(out)]) == 0
    printed = capsys.readouterr().out
    want = (
        f"caption accuracy {summary['caption_accuracy']:.3f} (words {summary['word_accuracy']:.3f}; chance "
        f"{summary['majority_accuracy']:.3f}, the most common text of {out / 'data' / 'train.jsonl'}) on 5 images"
    )
    assert want in printed and f"held-out loss {summary['heldout_loss']:.4f}" in printed


def _nll_row_by_row(model, data, rows):
    """Mean fp64 negative log-likelihood of each row's text and eos after its image, one row per forward."""
    total, count = 0.0, 0
    for i in rows:
        prompt, media = data.prompt(i)
        target = data.text_ids[i] + [data.tokenizer.eos_id]
        ids = torch.tensor([prompt + target[:-1]])
        with torch.no_grad():
            logits = model(ids, pixel_values=media.pixel_values, grid_thws=media.grid_thws).logits[0]
        logp = torch.log_softmax(logits.double(), -1)[len(prompt) - 1 :]
        total -= sum(logp[t, tok].item() for t, tok in enumerate(target))
        count += len(target)
    return total / count, count


def test_eval_reads_a_vision_runs_heldout_pairs(shapes, tmp_path, capsys):
    """``openk3 eval --ckpt RUN`` on a vision run (no val.bin): the loss of its ``data/val.jsonl`` pairs equals
    a row-by-row fp64 computation, chance is the commonest ``train.jsonl`` text's share; flags that read token
    data are refused."""
    from openk3.train.image_text import write_split

    config = get_preset("k3-vision-tiny")
    pairs = read_image_text(shapes)
    train_rows, val_rows = list(range(8, 48)), list(range(8))
    tok = Tokenizer.train([pairs[i].text for i in train_rows], vocab_size=400)
    model = openk3.build_model(config, seed=1)
    run = tmp_path / "run"
    openk3.save_pretrained(model, run / "checkpoints" / "step-000001", tokenizer=tok)
    (run / "checkpoints" / "latest").write_text("step-000001\n")
    write_split(run / "data", pairs, train_rows, val_rows)
    assert main(["eval", "--ckpt", str(run)]) == 0
    printed = capsys.readouterr().out
    data = ImageTextSet(
        [pairs[i] for i in val_rows], tok, config.vision_config, config.media_placeholder_token_id
    )
    loss, count = _nll_row_by_row(model, data, range(len(val_rows)))
    train_texts = [pairs[i].text for i in train_rows]
    majority = max(train_texts, key=train_texts.count)  # the first of the commonest, in training order
    chance = sum(pairs[i].text == majority for i in val_rows) / len(val_rows)
    assert f"held-out loss {loss:.4f} nats/token ({count:,} text tokens)" in printed, printed
    assert (
        f"chance {chance:.3f}, the most common text of {run / 'data' / 'train.jsonl'}) on 8 images" in printed
    )
    # any image-text JSONL with --data; without a train.jsonl beside it, chance is the rows' own commonest text
    assert main(["eval", "--ckpt", str(run), "--data", str(shapes), "--batch-size", "7"]) == 0
    assert "on 48 images" in capsys.readouterr().out
    assert main(["eval", "--ckpt", str(run), "--seq-len", "64"]) == 2
    assert "--seq-len is for token data only; " in capsys.readouterr().err


def test_a_text_preset_cannot_train_on_images(shapes, tmp_path, capsys):
    args = [
        "train",
        "--preset",
        "k3-tiny",
        "--data",
        str(shapes),
        "--out",
        str(tmp_path / "r"),
        "--steps",
        "1",
    ]
    assert main(args) != 0
    assert "has no vision tower" in capsys.readouterr().err


def test_eval_of_pairs_names_the_real_problem(shapes, tmp_path, capsys):
    """Image-text pairs on a model without a vision tower: the error says so (not that a flag is wrong);
    flags for token data on a vision model are named in plain English; an empty ``data/val.jsonl`` of a vision
    run is called empty (not a deleted val.bin)."""
    text_ckpt = tmp_path / "k3-tiny"
    openk3.save_pretrained(openk3.build_model(get_preset("k3-tiny"), seed=0), text_ckpt)
    assert main(["eval", "--ckpt", str(text_ckpt), "--data", str(shapes), "--max-batches", "1"]) == 2
    err = capsys.readouterr().err
    assert (
        f"{shapes} is image-text pairs, which need a model with a vision tower; {text_ckpt} has none" in err
    )
    assert "--max-batches" not in err
    run = tmp_path / "run"
    openk3.save_pretrained(
        openk3.build_model(get_preset("k3-vision-tiny"), seed=0), run / "checkpoints" / "step-000001"
    )
    (run / "checkpoints" / "latest").write_text("step-000001\n")
    argv = ["eval", "--ckpt", str(run), "--data", str(shapes), "--seq-len", "64", "--max-batches", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "--seq-len, --max-batches are for token data only; " in err
        and "evaluated whole: leave them out" in err
    )
    (run / "data").mkdir()
    (run / "data" / "val.jsonl").write_text("")
    assert main(["eval", "--ckpt", str(run)]) == 2
    err = capsys.readouterr().err
    assert (
        f"the val split {run / 'data' / 'val.jsonl'} is empty (no image-text rows)" in err
        and "deleted" not in err
    )
