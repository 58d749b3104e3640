"""Training on image-text pairs: ``openk3 train --preset k3-vision-tiny --data pairs.jsonl``.

The run teaches a K3 model with a vision tower to write an image's text after the image's placeholder
tokens (:mod:`openk3.data.image_text`). It shares the text trainer's optimizer (Per-Head Muon + AdamW, the
position table on AdamW), learning-rate schedule, gradient clipping and Quantile Balancing, and its
``TrainConfig`` fields (``preset``, ``steps``, ``batch_size``, ``lr``, ``warmup_steps``, ``min_lr_ratio``,
``schedule``, ``weight_decay``, ``grad_clip``, ``balance``, ``eval_every``, ``val_fraction``, ``seed``,
``device``, ``out``, ``tokenizer``). It does not resume, accumulate micro-batches or run distributed; those
raise ``ValueError``.

The rows are split into train and held-out rows by ``val_fraction`` (a seeded permutation); the held-out
images are never trained on. Evaluation writes each held-out image's text greedily (up to eos) and reports
``caption_accuracy`` (exact text), ``word_accuracy`` (words equal at the same place) and the chance level
``majority_accuracy`` (the share of held-out rows whose text is the most common training text), and the
held-out loss (nats per text token, eos included). The model and the tokenizer are saved as
``<out>/checkpoints/step-NNNNNN`` with ``latest`` naming it, and the split as ``<out>/data/train.jsonl`` and
``<out>/data/val.jsonl`` (image-text JSONL, absolute image paths), so ``openk3 generate --ckpt <out> --image
PATH`` and ``openk3 eval --ckpt <out>`` (:func:`evaluate_image_text`) read the run.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from openk3.checkpoint import save_pretrained
from openk3.data import Tokenizer
from openk3.data.image_text import (
    IGNORE_INDEX,
    ImageTextPair,
    ImageTextSet,
    RandomPairBatches,
    read_image_text,
)
from openk3.generate import generate
from openk3.model import build_model
from openk3.presets import get_preset
from openk3.train.balance import QuantileBalancer
from openk3.train.optim import build_optimizer
from openk3.train.schedule import lr_factor


def _check(config) -> None:
    if config.grad_accum != 1 or config.micro_batch_size not in (None, config.batch_size):
        raise ValueError(
            "image-text training runs whole batches: leave --grad-accum and --micro-batch-size unset"
        )
    if not 0 < config.val_fraction < 1:
        raise ValueError(f"val_fraction={config.val_fraction} must be in (0, 1) for image-text data")


def caption_metrics(model, data: ImageTextSet, rows: list[int], max_new_tokens: int, batch: int = 64) -> dict:
    """Greedy texts of the ``rows``' images (batched by prompt length): ``caption_accuracy``,
    ``word_accuracy`` and the ``texts`` (in ``rows`` order)."""
    tok = data.tokenizer
    device = next(model.parameters()).device
    by_len: dict[int, list[int]] = {}
    for i in rows:
        by_len.setdefault(data.counts[i], []).append(i)
    texts: dict[int, str] = {}
    model.eval()
    with torch.no_grad():
        for group in by_len.values():
            for k in range(0, len(group), batch):
                picked = group[k : k + batch]
                ids_BT, _, media = data.batch(picked)
                prompt_BT = ids_BT[:, : data.counts[picked[0]]].to(device)
                out = generate(model, prompt_BT, max_new_tokens, media=media).tolist()
                for i, seq in zip(picked, out):
                    texts[i] = tok.decode(seq[: seq.index(tok.eos_id)] if tok.eos_id in seq else seq)
    exact = words = total_words = 0
    for i in rows:
        want = data.pairs[i].text
        exact += texts[i] == want
        words += sum(a == b for a, b in zip(texts[i].split(), want.split()))
        total_words += len(want.split())
    return {
        "caption_accuracy": exact / len(rows),
        "word_accuracy": words / total_words,
        "texts": [texts[i] for i in rows],
    }


def heldout_loss(model, data: ImageTextSet, rows: list[int], batch: int = 64) -> tuple[float, int]:
    """(mean cross-entropy in nats per target token, target tokens) of the ``rows``' texts and eos after
    their images (the training loss's tokens), in batches of ``batch`` rows."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for k in range(0, len(rows), batch):
            ids_BT, targets_BT, media = data.batch(rows[k : k + batch])
            logits = model(
                ids_BT.to(device), pixel_values=media.pixel_values.to(device), grid_thws=media.grid_thws
            ).logits
            total += F.cross_entropy(
                logits.float().flatten(0, 1),
                targets_BT.to(device).flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            ).item()
            count += int((targets_BT != IGNORE_INDEX).sum())
    return total / count, count


def majority_accuracy(train_texts: list[str], heldout_texts: list[str]) -> float:
    """Chance level: the share of ``heldout_texts`` equal to the most common of ``train_texts`` (what a model
    that ignores the image and writes the commonest text scores)."""
    majority = Counter(train_texts).most_common(1)[0][0]
    return sum(t == majority for t in heldout_texts) / len(heldout_texts)


def write_split(folder: Path, pairs: list[ImageTextPair], train_rows: list[int], val_rows: list[int]) -> None:
    """Write ``train.jsonl`` and ``val.jsonl`` (rows ``{"image": absolute path, "text": …}``) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train_rows), ("val.jsonl", val_rows)):
        lines = [json.dumps({"image": str(pairs[i].image.resolve()), "text": pairs[i].text}) for i in rows]
        (folder / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def evaluate_image_text(model, tokenizer, pairs_path: Path, batch: int = 64) -> dict:
    """Held-out numbers of a vision ``model`` on the image-text JSONL ``pairs_path``: ``loss`` (nats per text
    token, eos included) over ``tokens``, ``caption_accuracy`` (exact text, greedy), ``word_accuracy``,
    ``majority_accuracy`` (chance: the commonest text of the ``train.jsonl`` beside ``pairs_path`` — a run's
    split — else of the evaluated rows themselves, ``chance_from`` says which) and ``rows``.

    Raises ``ValueError`` for a model without a vision tower or a tokenizer whose ids reach the placeholder."""
    config = model.config
    vision = getattr(config, "vision_config", None)
    if vision is None:
        raise ValueError(
            "image-text evaluation needs a model with a vision tower (config.json has no vision_config)"
        )
    placeholder = config.media_placeholder_token_id
    if tokenizer.vocab_size > placeholder:
        raise ValueError(
            f"the tokenizer's ids reach {tokenizer.vocab_size - 1}, past the media placeholder id {placeholder}"
        )
    pairs = read_image_text(pairs_path)
    data = ImageTextSet(pairs, tokenizer, vision, placeholder)
    rows = list(range(len(pairs)))
    train_path = Path(pairs_path).parent / "train.jsonl"
    if train_path.is_file() and train_path != Path(pairs_path):
        train_texts, chance_from = [p.text for p in read_image_text(train_path)], str(train_path)
    else:
        train_texts, chance_from = [p.text for p in pairs], "the evaluated rows"
    loss, tokens = heldout_loss(model, data, rows, batch)
    longest = max(len(t) for t in data.text_ids) + 1
    metrics = caption_metrics(model, data, rows, longest, batch)
    return {
        "loss": loss,
        "tokens": tokens,
        "rows": len(rows),
        "caption_accuracy": metrics["caption_accuracy"],
        "word_accuracy": metrics["word_accuracy"],
        "majority_accuracy": majority_accuracy(train_texts, [p.text for p in pairs]),
        "chance_from": chance_from,
    }


def train_image_text(config, progress: bool = True) -> dict:
    """Train ``config.preset`` on the image-text JSONL ``config.data``; returns the summary (also written to
    ``<out>/summary.json``). Raises ``ValueError`` for a preset without a vision tower or settings this
    trainer does not take."""
    _check(config)
    model_config = get_preset(config.preset)
    vision = getattr(model_config, "vision_config", None)
    if vision is None:
        raise ValueError(
            f"preset {config.preset!r} has no vision tower; use one with a vision_config (k3-vision-tiny)"
        )
    placeholder = model_config.media_placeholder_token_id
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = read_image_text(config.data)
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(config.seed)).tolist()
    n_val = max(1, round(config.val_fraction * len(pairs)))
    val_rows, train_rows = order[:n_val], order[n_val:]
    if config.tokenizer:
        tokenizer = Tokenizer.load(config.tokenizer)
    else:  # ids below the placeholder, so text never produces it
        tokenizer = Tokenizer.train([pairs[i].text for i in train_rows], vocab_size=min(placeholder, 8192))
    if tokenizer.vocab_size > placeholder:
        raise ValueError(
            f"the tokenizer's ids reach {tokenizer.vocab_size - 1}, past the media placeholder id {placeholder}"
        )
    data = ImageTextSet(pairs, tokenizer, vision, placeholder)
    batches = RandomPairBatches(data, train_rows, config.batch_size, config.seed)
    device = torch.device(config.device)
    model = build_model(model_config, device=device, seed=config.seed)
    optimizer = build_optimizer(model, lr=config.lr, weight_decay=config.weight_decay)
    for group in optimizer.param_groups:
        group["peak_lr"] = group["lr"]
    balancer = (
        QuantileBalancer(model, method=config.balance)
        if config.balance != "none" and model_config.text_config.num_experts
        else None
    )
    chance = majority_accuracy([pairs[i].text for i in train_rows], [pairs[i].text for i in val_rows])
    write_split(out / "data", pairs, train_rows, val_rows)
    longest = max(len(t) for t in data.text_ids) + 1
    log = (out / "metrics.jsonl").open("w")
    start = time.perf_counter()
    loss, final = math.nan, {}
    for step in range(config.steps):
        factor = lr_factor(step, config.steps, config.warmup_steps, config.min_lr_ratio, config.schedule)
        for group in optimizer.param_groups:
            group["lr"] = group["peak_lr"] * factor
        model.train()
        optimizer.zero_grad(set_to_none=True)
        ids_BT, targets_BT, media = next(batches)
        logits = model(
            ids_BT.to(device), pixel_values=media.pixel_values.to(device), grid_thws=media.grid_thws
        ).logits
        loss_ = F.cross_entropy(
            logits.float().flatten(0, 1), targets_BT.to(device).flatten(), ignore_index=IGNORE_INDEX
        )
        loss_.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        if balancer is not None:
            balancer.step()
        optimizer.step()
        loss = loss_.detach().item()
        if not math.isfinite(loss):
            raise ValueError(f"the loss is {loss} at step {step + 1}: lower --lr")
        row = {
            "step": step + 1,
            "loss": loss,
            "lr": config.lr * factor,
            "elapsed_s": time.perf_counter() - start,
        }
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            final = caption_metrics(model, data, val_rows, longest)
            final["heldout_loss"] = heldout_loss(model, data, val_rows)[0]
            row.update({k: v for k, v in final.items() if k != "texts"})
            if progress:
                print(
                    f"step {step + 1}: loss {loss:.4f}, held-out loss {row['heldout_loss']:.4f}, caption "
                    f"accuracy {row['caption_accuracy']:.3f} "
                    f"(words {row['word_accuracy']:.3f}; chance {chance:.3f})",
                    flush=True,
                )
        log.write(json.dumps(row) + "\n")
        log.flush()
    log.close()
    ckpt = out / "checkpoints" / f"step-{config.steps:06d}"
    save_pretrained(model, ckpt, tokenizer=tokenizer)
    (out / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    summary = {
        "step": config.steps,
        "loss": loss,
        "train_rows": len(train_rows),
        "heldout_rows": len(val_rows),
        "heldout_loss": final["heldout_loss"],
        "caption_accuracy": final["caption_accuracy"],
        "word_accuracy": final["word_accuracy"],
        "majority_accuracy": chance,
        "examples": [{"want": pairs[i].text, "got": t} for i, t in zip(val_rows[:5], final["texts"][:5])],
        "checkpoint": str(ckpt),
        "train_seconds": time.perf_counter() - start,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
