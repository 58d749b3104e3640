"""What ``openk3 train`` prints about its data before the first step and about the run after the last.

:func:`data_lines`: the corpus (files, documents, bytes), the train/val split (documents, tokens), the
tokenizer's vocabulary against the model's (a BPE trained on a small corpus stops merging long before the
model's ``vocab_size``: ids above it are never seen), and how many passes over the train split the run
reads (:func:`tokens_read`). :func:`end_lines`: wall-clock time, tokens read, the final train loss.
"""

from __future__ import annotations

import time

from openk3.train.schedule import seq_len_at


def tokens_read(first_step: int, last_step: int, schedule: list[tuple[int, int]], sequences: int) -> int:
    """Train tokens read by steps ``first_step … last_step − 1`` (0-based) when each step reads ``sequences``
    windows of the context :func:`seq_len_at` gives: the sum over the schedule's segments of (steps in the
    segment) × ``sequences`` × its length. Exact, in O(len(schedule)) for any number of steps."""
    starts = sorted({first_step} | {s for s, _ in schedule if first_step < s < last_step} | {last_step})
    return sum(
        (b - a) * sequences * seq_len_at(a, schedule) for a, b in zip(starts, starts[1:], strict=False)
    )


def data_lines(data, config, first_step: int = 0) -> list[str]:
    """Lines about ``data`` (:class:`openk3.data.DataInfo`) and what run ``config`` (:class:`TrainConfig`)
    reads of it from ``first_step`` on."""
    train, val = data.splits["train"], data.splits["val"]
    lines = [f"data: {line}" for line in data.lines()]
    if data.tokenizer.vocab_size < data.model_vocab_size:
        lines.append(
            f"data: the tokenizer has {data.tokenizer.vocab_size:,} ids, the model {data.model_vocab_size:,}: "
            "a byte-level BPE stops merging when the corpus has no more pairs to merge; the other ids are "
            "never seen (a larger corpus, or --tokenizer FILE, fills them)"
        )
    total = val.num_tokens + train.num_tokens
    lines.append(
        f"data: split {train.num_tokens:,} train / {val.num_tokens:,} val tokens "
        f"({val.num_tokens / max(total, 1):.1%} val; val_fraction {config.val_fraction})"
    )
    sequences = config.batch_size * config.grad_accum
    read = tokens_read(first_step, config.steps, config.context_schedule, sequences)
    lines.append(
        f"data: steps {first_step}-{config.steps} read {read:,} train tokens = "
        f"{read / max(train.num_tokens, 1):.2f} epoch(s) of the train split"
    )
    return lines


def end_lines(step: int, seconds: float, tokens: int, train_loss: float | None) -> list[str]:
    """The end-of-run line: the step reached, ``seconds`` of wall-clock time, ``tokens`` train tokens read
    in them and the last logged train loss (the val loss is printed beside it by the CLI)."""
    line = (
        f"run: at step {step} after {time.strftime('%H:%M:%S', time.gmtime(seconds))} "
        f"({tokens:,} train tokens read, {tokens / max(seconds, 1e-9):,.0f} tokens/s)"
    )
    if train_loss is not None:
        line += f"; final train loss {train_loss:.4f} nats/token"
    return [line]


RESUME_FIELDS = ("batch_size", "grad_accum", "context_schedule", "eval_every", "eval_batches", "save_every")
"""TrainConfig fields a resume may change (besides ``steps`` and ``lr``, announced with the schedule)."""


def resume_changes(step: int, saved: dict, config) -> list[str]:
    """One line per field of :data:`RESUME_FIELDS` whose value in ``config`` differs from the run's saved
    train config ``saved`` (JSON: the context schedule as lists): what changes from ``step`` on."""
    lines = []
    for name in RESUME_FIELDS:
        old, new = saved.get(name), getattr(config, name)
        if name == "context_schedule" and old is not None:
            old = [tuple(pair) for pair in old]
        if old is not None and old != new:
            lines.append(f"resuming at step {step} with {name} {old} → {new} (the run's value until now)")
    return lines
