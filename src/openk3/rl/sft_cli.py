"""``openk3 sft``: supervised fine-tuning of a checkpoint on one's own chat pairs (JSONL), written as a model
folder that ``openk3 generate --chat`` and ``openk3 serve`` read.

Each line of ``--data`` is one example, either OpenAI chat messages or a prompt/response pair::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}
    {"prompt": "...", "response": "..."}          # one user turn and the assistant's answer

The loss is on the last assistant message only: the messages before it are the prompt, rendered by the
checkpoint's chat template (:class:`openk3.serve.chat_template.ChatTemplate`, as ``openk3 generate --chat``
and the server render a conversation), and the answer is its tokens followed by the eos token. Training is
:func:`openk3.rl.sft.sft`. Bad input raises ``ValueError`` naming the file, the line and the problem before
the model is loaded; the output folder appears whole or not at all. ``--ckpt`` may be a distributed run's DCP
step folder (:mod:`openk3.checkpoint.dcp_step`), as for ``openk3 eval`` and ``generate``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import time
from pathlib import Path

ROLES = ("system", "user", "assistant")
"""The roles a message may have."""

SFT_RECORD = "sft.json"
"""The file in ``--out`` recording the command, the data sizes and the losses."""

Example = tuple[list[int], list[int]]
"""(prompt ids, response ids) of one training example."""


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def add_sft_parser(sub) -> None:
    from openk3 import cli_types

    p = sub.add_parser(
        "sft",
        help="fine-tune a checkpoint on chat pairs (JSONL); the loss is on the last assistant message",
    )
    p.add_argument(
        "--ckpt",
        required=True,
        help="model folder, run folder (uses its latest checkpoint) or a distributed run's "
        "RUN/checkpoints/step-N",
    )
    p.add_argument(
        "--data",
        required=True,
        help='JSONL, one example a line: {"messages": [{"role": ..., "content": ...}, ...]} or '
        '{"prompt": ..., "response": ...}',
    )
    p.add_argument("--out", required=True, help="new model folder to write (refused when it holds anything)")
    p.add_argument("--steps", type=cli_types.steps, default=200, help="optimizer steps")
    p.add_argument(
        "--batch-size", dest="batch_size", type=cli_types.positive_int, default=8, help="examples per step"
    )
    p.add_argument("--lr", type=cli_types.positive_float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument(
        "--seed",
        type=cli_types.seed,
        default=0,
        help="seed of the held-out split and the batches (default 0)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model trains")
    p.add_argument(
        "--val-fraction",
        dest="val_fraction",
        type=_fraction,
        default=0.1,
        help="share of the examples held out (at least one when > 0 and there are 2 or more); "
        "their loss is reported before and after training",
    )
    p.set_defaults(func=cmd_sft)


def _message_problem(i: int, m) -> str | None:
    """Why message ``i`` (1-based) is not a chat message, or ``None``."""
    if not isinstance(m, dict):
        return f"message {i} is not an object with role and content"
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        return f"message {i} has unknown role {role!r} (use one of {', '.join(ROLES)})"
    if not isinstance(content, str):
        return f"message {i} ({role}) has no string content"
    if not content.strip():
        return f"message {i} ({role}) has empty content"
    return None


def parse_example(record) -> tuple[list[dict], str]:
    """(prompt messages, answer) of one decoded JSONL record; raises ``ValueError`` saying what is wrong
    (without the file and line, which :func:`read_examples` adds)."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError('"messages" is not a non-empty list')
        for i, m in enumerate(messages, 1):
            if problem := _message_problem(i, m):
                raise ValueError(problem)
        if messages[-1]["role"] != "assistant":
            raise ValueError(
                f"the last message is the {messages[-1]['role']}'s, not the assistant's: nothing to train on"
            )
        return messages[:-1], messages[-1]["content"]
    if isinstance(record, dict) and "prompt" in record and "response" in record:
        for key in ("prompt", "response"):
            if not isinstance(record[key], str) or not record[key].strip():
                raise ValueError(f'"{key}" is empty or not a string')
        return [{"role": "user", "content": record["prompt"]}], record["response"]
    raise ValueError('expected {"messages": [...]} or {"prompt": "...", "response": "..."}')


def read_examples(path: str | os.PathLike, template, tokenizer, max_len: int) -> list[Example]:
    """The (prompt ids, response ids) of each non-blank line of JSONL file ``path``: prompt ids are
    ``template.encode(messages before the last assistant message)``, response ids the answer's tokens and
    ``tokenizer.eos_id``. Raises ``ValueError`` ``"PATH:LINE: problem"`` for a line that is not JSON, not an
    example (:func:`parse_example`) or longer than ``max_len`` tokens (prompt + response, the model's
    ``max_position_embeddings``), and naming ``path`` when it cannot be read or holds no example."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read --data {path}: {e.strerror or e}") from None
    examples = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"{path}:{n}: not UTF-8 text") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno})") from None
        try:
            prompt, answer = parse_example(record)
            prompt_ids = template.encode(prompt)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        response_ids = tokenizer.encode(answer) + [tokenizer.eos_id]
        if len(prompt_ids) + len(response_ids) > max_len:
            raise ValueError(
                f"{path}:{n}: the example is {len(prompt_ids) + len(response_ids):,} tokens (prompt "
                f"{len(prompt_ids):,} + response {len(response_ids):,}), longer than the model's context of "
                f"{max_len:,} (max_position_embeddings)"
            )
        examples.append((prompt_ids, response_ids))
    if not examples:
        raise ValueError(f"{path} holds no examples (one JSON object a line)")
    return examples


def split_held_out(
    examples: list[Example], fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """(train, held out): a seeded shuffle, ``round(fraction · n)`` held out, at least one and at most
    ``n − 1``; nothing held out when ``fraction`` is 0 or there is a single example."""
    if fraction <= 0 or len(examples) < 2:
        return list(examples), []
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    k = min(len(examples) - 1, max(1, round(fraction * len(examples))))
    return [examples[i] for i in order[k:]], [examples[i] for i in order[:k]]


def response_loss(model, examples: list[Example], batch_size: int = 8) -> float:
    """Mean negative log-likelihood of the response tokens of ``examples`` under ``model`` (nats per
    response token, all examples' tokens weighted alike), without gradients."""
    import torch

    from openk3.rl.logprobs import response_logprobs

    total, count = 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            batch = examples[i : i + batch_size]
            logp_BT, mask_BT = response_logprobs(model, [p for p, _ in batch], [r for _, r in batch])
            total -= (logp_BT * mask_BT).sum().item()
            count += mask_BT.sum().item()
    return total / count


def check_out(ckpt: Path, out: str | os.PathLike) -> None:
    """Raise ``ValueError`` when ``out`` is the checkpoint folder ``ckpt`` (or the ``--ckpt`` run folder
    holding it) or lies inside it or inside a run's ``checkpoints/step-N`` (a run keeps only its newest
    checkpoints and deletes the others whole), ``FileExistsError`` when ``out`` holds anything (a model, a run, files), and ``ValueError``
    when no folder can be made there (:func:`openk3.checkpoint.out_folder.check_new_folder`)."""
    from openk3.checkpoint.out_folder import check_new_folder

    target, source = Path(os.path.realpath(out)), Path(os.path.realpath(ckpt))
    if target == source or target in source.parents:
        raise ValueError(
            f"--out {out} is the --ckpt checkpoint (or its run); write the fine-tuned model elsewhere"
        )
    pruned = any(p.parent.name == "checkpoints" and p.name.startswith("step-") for p in target.parents)
    if source in target.parents or pruned:
        raise ValueError(
            f"--out {out} lies inside a checkpoint folder (the --ckpt one, or a run's checkpoints/step-N, which "
            "a resumed run deletes whole); write the fine-tuned model elsewhere"
        )
    check_new_folder(out)


def _write_model(model, tokenizer, source: Path, out: str, record: dict) -> None:
    """Write ``model`` with ``tokenizer``, the ``chat_template`` of ``source``'s tokenizer_config.json (when
    it has one) and ``record`` as :data:`SFT_RECORD` into a temporary folder renamed to ``out`` at the end."""
    from openk3.checkpoint import save_pretrained
    from openk3.checkpoint.out_folder import folder_written_whole
    from openk3.data.tokenizer import TOKENIZER_CONFIG

    with folder_written_whole(out) as tmp:
        save_pretrained(model, tmp, tokenizer=tokenizer)
        src_config = source / TOKENIZER_CONFIG
        template = json.loads(src_config.read_text()).get("chat_template") if src_config.is_file() else None
        if template is not None:  # Tokenizer.save writes no chat template: carry the checkpoint's over
            config = json.loads((tmp / TOKENIZER_CONFIG).read_text())
            config["chat_template"] = template
            (tmp / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / SFT_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def batch_note(batch_size: int, train_examples: int) -> str | None:
    """The line printed when a batch of ``batch_size`` is drawn from fewer ``train_examples``: every batch
    draws its examples at random with replacement (:func:`openk3.rl.sft.sft`), so such a batch repeats each
    example about ``batch_size / train_examples`` times; ``None`` otherwise."""
    if batch_size <= train_examples:
        return None
    return (
        f"sft: --batch-size {batch_size} is more than the {train_examples} training examples: each step draws "
        f"them at random with replacement, each about {batch_size / train_examples:.3g} times; "
        f"--batch-size {train_examples} draws each about once"
    )


def cmd_sft(args: argparse.Namespace) -> int:
    """Check ``--out``, read ``--data`` (both before the model loads), fine-tune with
    :func:`openk3.rl.sft.sft`, print the loss about ten times and the held-out loss before and after, then
    write the model folder with :data:`SFT_RECORD`. ``--ckpt`` may be a distributed run's DCP step folder (or
    a run folder whose newest checkpoint is one), read as ``openk3 eval`` reads it (its model written with
    the run's tokenizer into a temporary model folder, once ``--data`` is read). A Ctrl-C ends with one line
    saying that ``--out`` was not written (it is written whole, once, after the last step)."""
    from openk3.checkpoint.dcp_step import checkpoint_of, model_folder
    from openk3.devices import check_device

    check_device(args.device)
    source = checkpoint_of(args.ckpt)  # a model folder, a run's latest checkpoint or a DCP step folder
    check_out(source, args.out)
    try:
        tokenizer, template, max_len = _encoding_of(source)
        examples = read_examples(args.data, template, tokenizer, max_len)
        train, held_out = split_held_out(examples, args.val_fraction, args.seed)
        steps = f"{args.steps} step{'s' if args.steps != 1 else ''}"
        print(
            f"sft: {len(train)} training examples, {len(held_out)} held out; {steps} of {args.batch_size} "
            f"from {source}",
            flush=True,
        )
        if note := batch_note(args.batch_size, len(train)):
            print(note, flush=True)
        with model_folder(source) as folder:
            seconds, losses = _fine_tune(args, source, folder, tokenizer, train, held_out)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"sft interrupted: nothing was written to {args.out} (the model is written once, after the last "
            "step); run the command again"
        ) from None
    print(f"wrote {args.out} (loss {losses[0]:.4f} → {losses[-1]:.4f} in {seconds:.0f} s)")
    return 0


def _encoding_of(source: Path):
    """(tokenizer, chat template, ``max_position_embeddings``) of checkpoint ``source`` (a model folder or a
    DCP step folder, whose run's tokenizer and ``meta.json`` are read), without reading its weights."""
    from openk3.checkpoint import checkpoint_with_tokenizer
    from openk3.checkpoint.dcp_step import dcp_step_config, is_dcp_step, run_tokenizer_of
    from openk3.config import load_config, text_config_of
    from openk3.data import Tokenizer
    from openk3.serve.chat_template import ChatTemplate

    if is_dcp_step(source):
        folder, config = run_tokenizer_of(source), dcp_step_config(source)
    else:
        folder = checkpoint_with_tokenizer(source)
        config = load_config(folder)
    tokenizer = Tokenizer.load(folder)
    template = ChatTemplate.from_folder(tokenizer, folder)
    return tokenizer, template, text_config_of(config).max_position_embeddings


def _fine_tune(
    args: argparse.Namespace, source: Path, folder: Path, tokenizer, train, held_out
) -> tuple[float, list[float]]:
    """Fine-tune the model of model folder ``folder`` (``source`` itself, or the temporary export of DCP
    step ``source``) on ``train`` and write ``--out``; returns (seconds of training, loss per step)."""
    import torch

    from openk3.checkpoint import from_pretrained
    from openk3.rl.sft import sft

    torch.manual_seed(args.seed)
    model = from_pretrained(folder, device=args.device)
    before = response_loss(model, held_out, args.batch_size) if held_out else None
    if before is not None:
        print(f"held-out loss before: {before:.4f} nats per response token", flush=True)
    start = time.perf_counter()

    def progress(step: int, losses: list[float]) -> None:
        print(f"step {step}/{args.steps}: loss {losses[-1]:.4f}", flush=True)

    losses = sft(
        model,
        train,
        args.steps,
        args.batch_size,
        args.lr,
        seed=args.seed,
        on_eval=progress,
        eval_every=max(1, args.steps // 10),
    )
    seconds = time.perf_counter() - start
    model.eval()
    after = response_loss(model, held_out, args.batch_size) if held_out else None
    if after is not None:
        print(f"held-out loss after: {after:.4f} nats per response token (before {before:.4f})", flush=True)
    record = {
        "command": "openk3 " + shlex.join(getattr(args, "argv", [])),
        "ckpt": os.path.abspath(source),
        "data": os.path.abspath(args.data),
        "train_examples": len(train),
        "held_out_examples": len(held_out),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "seconds": round(seconds, 1),
        "train_loss": losses,
        "held_out_loss": {"before": before, "after": after} if held_out else None,
    }
    _write_model(model, tokenizer, folder, args.out, record)
    return seconds, losses
