"""The ``openk3`` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from openk3 import cli_types
from openk3.config import load_config
from openk3.presets import PRESETS, get_preset

DEFAULT_EVAL_SEQ_LEN = 256
"""``openk3 eval``'s window length when ``--seq-len`` is not given and the checkpoint is outside a run."""
DEFAULT_EVAL_BATCH_SIZE = 16
"""``openk3 eval``'s windows per batch when ``--batch-size`` is not given and the checkpoint is outside a run."""


def _length_list(text: str) -> list[int]:
    """``256,512`` → ``[256, 512]`` (each at least 32: a needle, its cue and a haystack)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 32:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths >= 32, got {text!r}")
    return values


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _print_info(report: dict) -> None:
    print(f"model_type: {report['model_type']}")
    print("parameters:")
    for name, value in report["components"].items():
        print(f"  {name:<28} {value:>22,}")
    print(f"  {'total':<28} {report['total_params']:>22,}")
    print(f"  {'active (no input embedding)':<28} {report['active_params']:>22,}")
    if report["total_with_vision_params"] != report["total_params"]:
        print(f"  {'total with vision':<28} {report['total_with_vision_params']:>22,}")
    print("cache per request:")
    print(f"  KDA layers / MLA layers      {report['kda_layers']} / {report['mla_layers']}")
    print(
        f"  KDA state, bf16 (with conv)  {report['kda_state_bytes_bf16']:,} B ({_mib(report['kda_state_bytes_bf16'])})"
    )
    print(
        f"  KDA state, fp32 state        {report['kda_state_bytes_fp32']:,} B ({_mib(report['kda_state_bytes_fp32'])})"
    )
    print(
        f"  MLA latent, bf16             {report['mla_bytes_per_token_bf16']:,} B/token "
        f"({report['mla_numbers_per_token_per_layer']} numbers/token/layer)"
    )
    print(f"  crossover vs all-MLA         {report['crossover_tokens_vs_all_mla']:,} tokens")
    print("checkpoint size:")
    print(f"  bf16                         {_bytes(report['checkpoint_bytes_bf16'])}")
    print(f"  MXFP4 routed experts         {_bytes(report['checkpoint_bytes_mxfp4'])}")


def _bytes(n: int) -> str:
    """``1,559,965,606,912 B (1.56 TB, 1.42 TiB)``: decimal and binary units of the largest fitting size."""
    for dec, binary, unit in ((10**12, 2**40, "T"), (10**9, 2**30, "G"), (10**6, 2**20, "M")):
        if n >= dec:
            return f"{n:,} B ({n / dec:.2f} {unit}B, {n / binary:.2f} {unit}iB)"
    return f"{n:,} B"


def cmd_info(args: argparse.Namespace) -> int:
    from openk3.accounting import accounting_report

    config = load_config(args.config) if args.config else get_preset(args.preset)
    report = accounting_report(config)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_info(report)
    return 0


def _load_for_inference(ckpt: str, device: str):
    """(model, tokenizer, folder) of checkpoint or run folder ``ckpt``; the tokenizer is read first (cheap).
    Damaged files raise ``ValueError`` naming the file (printed by :func:`main`)."""
    from openk3.checkpoint import checkpoint_with_tokenizer, from_pretrained
    from openk3.data import Tokenizer
    from openk3.devices import check_device

    check_device(device)
    folder = checkpoint_with_tokenizer(ckpt)
    tokenizer = Tokenizer.load(folder)
    return from_pretrained(folder, device=device), tokenizer, folder


def cmd_plan(args: argparse.Namespace) -> int:
    from openk3.dist.mesh import ParallelDims
    from openk3.dist.plan import GIB, plan

    dims = ParallelDims(
        world_size=args.gpus, dp_shard=args.dp_shard, dp_replicate=args.dp_replicate, ep=args.ep
    )
    b = plan(get_preset(args.preset), dims, args.tokens)
    print(
        f"{args.preset} on {args.gpus} GPUs: dp_replicate {dims.dp_replicate} × dp_shard {dims.dp_shard}, "
        f"ep {dims.ep} (efsdp {dims.efsdp}, {b.experts_per_rank} experts per EP rank), {args.tokens} tokens/GPU"
    )
    rows = [
        ("parameters (fp32)", b.params_bytes),
        ("gradients (fp32)", b.grads_bytes),
        ("optimizer state (fp32)", b.optimizer_bytes),
        ("unsharded layers (bf16, 2 in flight)", b.unsharded_bytes),
        ("EP receive buffer per MoE layer (bf16, S·K rows)", b.ep_buffer_bytes),
        ("FSDP/HSDP traffic per step", b.fsdp_comm_bytes),
        ("EP traffic per step", b.ep_comm_bytes),
        ("activations per micro-batch (bf16, no checkpointing)", b.activations_bytes),
        ("activations per micro-batch (full checkpointing)", b.activations_checkpointed_bytes),
    ]
    for name, value in rows:
        print(f"  {name:54s} {value / GIB:10.2f} GiB")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from openk3.train.console import pipe_safe_output

    # a closed pipe (`| tee log` killed by the same Ctrl-C, `| head`) must not stop the save or the resume line
    with pipe_safe_output():
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    import dataclasses

    if args.nproc_per_node:  # this process only starts the ranks (openk3.dist.launch)
        if "TORCHELASTIC_RUN_ID" in os.environ:
            raise ValueError("--nproc-per-node starts the ranks itself: run it without torchrun")
        _typed_schedule(args, check_steps=True)  # one line here rather than from every rank
        from openk3.dist.launch import launch, resume_command
        from openk3.train.trainer import TrainConfig

        argv = _without_flag(args.argv, "--nproc-per-node")
        out = args.out or TrainConfig.out
        return launch(args.nproc_per_node, argv, out, resume_command(args.argv, args.resume_command))

    from openk3.train.run_lock import check_run_free
    from openk3.train.schedule import check_schedule_steps
    from openk3.train.state import load_trainer_state, resume_checkpoint
    from openk3.train.trainer import TrainConfig, resume_command, train

    given = {
        k: v
        for k, v in vars(args).items()
        if v is not None and k in {f.name for f in dataclasses.fields(TrainConfig)}
    }
    if args.tensorboard:  # before any slow work
        from openk3.train.metrics import check_tensorboard

        check_tensorboard()
    distributed = bool(args.dp_shard or args.ep or args.dp_replicate or args.cp or "LOCAL_RANK" in os.environ)
    if args.context_schedule is not None:  # a resume's steps are the run's: checked once they are read
        given["context_schedule"] = _typed_schedule(args, check_steps=distributed or not args.resume)
    if args.no_sample:
        given["sample_prompt"] = None
    from openk3.data.image_text import is_image_text_jsonl

    if is_image_text_jsonl(given.get("data")):  # image-text pairs: openk3.train.image_text
        from openk3.train.image_text import train_image_text

        if args.resume or args.dp_shard or args.ep or args.dp_replicate or args.cp or args.qat:
            raise ValueError(
                "image-text training (a JSONL of image and text) does not resume, run distributed or take --qat"
            )
        summary = train_image_text(TrainConfig(**given))
        print(
            f"checkpoint: {summary['checkpoint']}\nheld-out caption accuracy {summary['caption_accuracy']:.3f} "
            f"(words {summary['word_accuracy']:.3f}; chance {summary['majority_accuracy']:.3f}) on "
            f"{summary['heldout_rows']} images not trained on"
        )
        return 0
    if args.ep_dispatcher != "alltoall" and not (args.ep or 1) > 1:
        raise ValueError(
            f"--ep-dispatcher {args.ep_dispatcher} needs expert parallelism: --ep B > 1 under torchrun "
            "(docs/distributed.md)"
        )
    if distributed:  # under torchrun
        from openk3.dist.train import train_distributed

        summary = train_distributed(
            TrainConfig(**given), args.dp_shard or -1, args.dp_replicate or 1, args.ep or 1, args.resume,
            args.ep_dispatcher, cp=args.cp or 1, cp_layout=args.cp_layout,
        )  # fmt: skip
        if summary["rank"] == 0:
            print(f"step {summary['step']}: loss {summary['loss']:.4f}, checkpoint {summary['checkpoint']}")
            if "val_loss" in summary:
                print(
                    f"val loss {summary['val_loss']:.4f} nats/token on {summary['val_tokens']:,} val tokens"
                )
            if "export" in summary and not args.no_sample:
                _print_sample(args, TrainConfig(**given), summary["export"])
        return 0
    if args.resume:
        out = given.get("out", TrainConfig.out)
        check_run_free(Path(out))  # a run in progress is named before its checkpoints are looked for
        _refuse_distributed_resume(Path(out))
        saved = load_trainer_state(resume_checkpoint(Path(out)))["train_config"]
        config = TrainConfig.from_dict({**saved, **given})
        if args.context_schedule is not None:
            check_schedule_steps(config.context_schedule, config.steps, repr(args.context_schedule))
    else:
        config = TrainConfig(**given)
    from openk3.train.trainer import TrainingAborted

    try:
        summary = train(config, resume=args.resume, resume_with=args.resume_command)
    except TrainingAborted:
        raise
    except (
        KeyboardInterrupt
    ):  # before the trainer's own handlers (data preparation, model build, a resume's load)
        raise KeyboardInterrupt(_interrupted_before_training(config, args)) from None
    print(f"checkpoint: {summary['checkpoint']}")
    if "val_loss" in summary:
        print(
            f"val loss {summary['val_loss']:.4f} nats/token, perplexity {summary['val_ppl']:.2f} "
            f"on {summary['val_tokens']:,} val tokens "
            f"(unigram entropy of the val set: {summary['val_unigram_entropy']:.4f} nats/token)"
        )
    elif "val_loss_subset" in summary:
        print(
            f"last periodic val loss {summary['val_loss_subset']:.4f} nats/token on "
            f"{summary['val_subset_tokens']:,} val tokens (the run is not finished)"
        )
    if summary["interrupted"]:
        print(
            f"stopped at step {summary['step']}; continue with: {resume_command(config.out, args.resume_command)}"
        )
        return 130 if not config.stop_at_step else 0
    if config.sample_prompt:
        _print_sample(args, config, summary["checkpoint"])
    return 0


def _interrupted_before_training(config, args: argparse.Namespace) -> str:
    """The line of a Ctrl-C that came before the first step: nothing was trained, the run's checkpoints are
    as they were, and how to go on (the resume command when the run has a checkpoint)."""
    from openk3.train.state import latest_checkpoint
    from openk3.train.trainer import resume_command

    head = "interrupted before the first step: nothing was trained"
    try:
        ckpt = latest_checkpoint(config.out)
    except (FileNotFoundError, ValueError):
        return f"{head}; run the command again"
    return (
        f"{head}, the run's latest checkpoint is {ckpt}; continue with: "
        f"{resume_command(config.out, args.resume_command)}"
    )


def _typed_schedule(args: argparse.Namespace, check_steps: bool) -> list[tuple[int, int]] | None:
    """``--context-schedule`` parsed and checked (:func:`openk3.train.schedule.check_context_schedule`: from
    step 0, growing), and with ``check_steps`` refused when an entry starts at or after ``--steps`` (or its
    default; :func:`~openk3.train.schedule.check_schedule_steps`); ``None`` when the flag is not given.
    ``check_steps`` is off for a single-process resume, whose steps are the run's unless given: checked
    once the run's train config is read. Cheap: it runs before the ranks start or any data is read."""
    from openk3.train.schedule import check_schedule_steps, parse_context_schedule

    if args.context_schedule is None:
        return None
    schedule = parse_context_schedule(args.context_schedule)
    if check_steps:
        if args.steps is None:
            from openk3.train.trainer import TrainConfig

            steps = TrainConfig.steps
        else:
            steps = args.steps
        check_schedule_steps(schedule, steps, repr(args.context_schedule), default_steps=args.steps is None)
    return schedule


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag VALUE`` / ``flag=VALUE``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def _print_sample(args: argparse.Namespace, config, checkpoint: str) -> None:
    """The end-of-run sample of ``openk3 train``: 200 tokens from ``checkpoint`` after the run's prompt."""
    from openk3.train.trainer import TrainConfig

    model, tokenizer, _ = _load_for_inference(checkpoint, config.device)
    prompt = config.sample_prompt
    if args.sample_prompt is None and config.data is not None and prompt == TrainConfig.sample_prompt:
        prompt = _corpus_prompt(Path(config.out), tokenizer) or prompt  # not Shakespeare: its own text
    print(f"--- sample (temperature 0.8, top-p 0.95, seed {config.seed}) ---")
    _stream_text(model, tokenizer, prompt, 200, 0.8, 0.95, config.seed, config.device)


CORPUS_PROMPT_TOKENS = 8
"""Tokens of the val split that start the end-of-run sample of a run on a corpus of one's own."""


def _corpus_prompt(run: Path, tokenizer) -> str:
    """The text of the first :data:`CORPUS_PROMPT_TOKENS` tokens of ``run``'s val split, up to its first line
    end; ``""`` when the split cannot be read."""
    from openk3.data import TokenDataset

    try:
        ids = TokenDataset(run / "data" / "val.bin").tokens_N[:CORPUS_PROMPT_TOKENS]
    except (OSError, ValueError):
        return ""
    text = tokenizer.decode([int(i) for i in ids if int(i) != tokenizer.eos_id]).rstrip("\ufffd")
    return text.split("\n")[0] if text.split("\n")[0].strip() else text.strip()


def _check_prompt(prompt: str) -> None:
    """Raise ``ValueError`` when ``prompt`` holds bytes that are not UTF-8 (undecodable argv bytes arrive as
    lone surrogates)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = prompt[e.start].encode("utf-8", "surrogateescape")
        raise ValueError(
            f"--prompt is not valid UTF-8 text (byte 0x{bad.hex()} at character {e.start}); pass UTF-8 text"
        ) from None


def _stream_text(
    model,
    tokenizer,
    prompt,
    max_new_tokens,
    temperature,
    top_p,
    seed,
    device,
    ids=None,
    stop=None,
    draft=None,
    media=None,
) -> None:
    """Write ``prompt`` then its continuation to stdout as it is generated, and end it with a newline.

    A character is written once its bytes are complete; what the last tokens leave unfinished (the token
    budget ran out inside a multi-byte character, or the model wrote an invalid byte) is written at the end
    as U+FFFD, so no produced text is dropped. The newline is written however the sample ends (its budget,
    a stop token, Ctrl-C), so each of ``--num-samples`` ends its own line. ``ids``: the prompt's token ids
    when they are not ``tokenizer.encode(prompt)`` (a chat prompt; then ``prompt`` is what is echoed, possibly
    ""); ``stop``: ids that end the text (default: the eos id); ``draft``: ``(draft model, k)`` for
    speculative decoding (:func:`openk3.speculative.speculative_stream`, the same distribution); ``media``:
    the images of ``ids``'s placeholder tokens (not with ``draft``)."""
    import torch

    from openk3.generate import stream

    ids = tokenizer.encode(prompt) if ids is None else ids
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    sys.stdout.write(prompt)
    sys.stdout.flush()  # shown before the prompt's prefill
    produced: list[int] = []
    shown = ""
    x = torch.tensor([ids], device=device)
    stop = {tokenizer.eos_id} if stop is None else stop
    if draft is None:
        tokens = stream(
            model, x, max_new_tokens, temperature, top_p, seed, stop, tokenizer.vocab_size, media=media
        )
    else:
        from openk3.speculative import speculative_stream

        tokens = speculative_stream(
            model, draft[0], x, max_new_tokens, draft[1], temperature, top_p, seed, stop, tokenizer.vocab_size
        )
    try:
        for tok in tokens:
            token = int(tok[0, 0])
            if token in stop:
                break
            produced.append(token)
            text = tokenizer.decode(produced)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(shown) :])
                sys.stdout.flush()
                shown = text
    finally:  # also on Ctrl-C: the next line (a sample's header, the error, the shell prompt) starts anew
        sys.stdout.write(tokenizer.decode(produced)[len(shown) :] + "\n")
        sys.stdout.flush()


def _refuse_distributed_resume(out: Path) -> None:
    """Raise ``ValueError`` when ``out`` is a distributed run (DCP checkpoints, no single-process ``latest``):
    a single process cannot resume it; its own launch can, on any world size."""
    from openk3.checkpoint.io import LATEST
    from openk3.dist.checkpoint import finished_checkpoints

    if finished_checkpoints(out / "checkpoints") and not (out / "checkpoints" / LATEST).exists():
        raise ValueError(
            f"--resume: {out} is a distributed run (DCP checkpoints): resume it as it was started, with "
            "--resume (`openk3 train --nproc-per-node N ...` or torchrun, any world size; docs/distributed.md)"
        )


def check_context(prompt_tokens: int, max_new_tokens: int, limit: int, where: str) -> None:
    """Raise ``ValueError`` when a prompt of ``prompt_tokens`` tokens and ``max_new_tokens`` new ones do not
    fit the model's context of ``limit`` tokens (its ``max_position_embeddings``, read from ``where``), as
    the server refuses such a request with a 400."""
    if prompt_tokens + max_new_tokens <= limit:
        return
    fix = (
        f"use --max-new-tokens {limit - prompt_tokens} or less"
        if prompt_tokens < limit
        else "use a shorter prompt"
    )
    raise ValueError(
        f"the model's maximum context length is {limit:,} tokens ({where}); the prompt ({prompt_tokens:,} "
        f"tokens) and --max-new-tokens {max_new_tokens:,} ask for {prompt_tokens + max_new_tokens:,}: {fix}"
    )


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt text: ``--prompt TEXT``, ``--prompt -`` (stdin) or ``--prompt-file PATH`` (UTF-8)."""
    if args.prompt_file is not None:
        try:
            raw = Path(args.prompt_file).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror or e}") from None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"--prompt-file {args.prompt_file} is not UTF-8 text (byte 0x{raw[e.start]:02x} at {e.start})"
            ) from None
    if args.prompt == "-":
        return sys.stdin.read()
    _check_prompt(args.prompt)
    return args.prompt


def cmd_generate(args: argparse.Namespace) -> int:
    from openk3.checkpoint import checkpoint_with_tokenizer
    from openk3.checkpoint.dcp_step import checkpoint_of, model_folder
    from openk3.serve.cli import speculative_tokens_of

    # the sampling flags were checked by their argparse types; the prompt and its length are checked before
    # the (slow) model load (a DCP step folder's model is read once before, to write the folder they read)
    num_speculative_tokens = speculative_tokens_of(args)
    prompt = _read_prompt(args)
    if not prompt and not args.image:
        raise ValueError("the prompt is empty (give --prompt, or --image for a prompt of an image alone)")
    if args.draft and args.image:
        raise ValueError("--draft does not take --image (the draft reads text features only)")
    source = checkpoint_of(args.ckpt)
    with model_folder(source) as folder:
        return _generate(args, prompt, source, checkpoint_with_tokenizer(folder), num_speculative_tokens)


def _generate(args: argparse.Namespace, prompt: str, source: Path, folder: Path, speculative: int) -> int:
    """``openk3 generate`` of ``prompt`` from model folder ``folder`` (checkpoint ``source`` as named in
    messages; the two differ for a DCP step folder, :func:`~openk3.checkpoint.dcp_step.model_folder`); ``speculative``: drafted
    tokens per target forward with ``--draft``."""
    from openk3.config import text_config_of
    from openk3.data import Tokenizer
    from openk3.serve.chat_template import ChatTemplate

    tokenizer = Tokenizer.load(folder)
    stop = None
    media, image_ids = _images_for(args.image, load_config(folder)) if args.image else (None, [])
    if args.chat:  # one user turn in the checkpoint's chat template; only the reply is printed
        template = ChatTemplate.from_folder(tokenizer, folder)
        content = [image_ids, prompt] if media is not None else prompt
        ids, stop, echo = template.encode([{"role": "user", "content": content}]), template.stop_token_ids, ""
    else:
        ids, echo = image_ids + tokenizer.encode(prompt), prompt
    limit = text_config_of(load_config(folder)).max_position_embeddings
    check_context(len(ids), args.max_new_tokens, limit, f"max_position_embeddings in {source}")
    model, tokenizer, _ = _load_for_inference(str(folder), args.device)
    draft = None
    if args.draft:
        from openk3.model.draft import load_draft

        draft = (load_draft(args.draft, model), speculative)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1}/{args.num_samples} ---")
        seed = None if args.seed is None else (args.seed + i) % 2**63
        _stream_text(
            model,
            tokenizer,
            echo,
            args.max_new_tokens,
            args.temperature,
            args.top_p,
            seed,
            args.device,
            ids=ids,
            stop=stop,
            draft=draft,
            media=media,
        )
    return 0


def _images_for(paths: list[str], config):
    """``(MediaInputs, placeholder ids)`` of ``--image`` files for ``config``'s vision tower; the images go
    before the prompt's text. Raises ``ValueError`` for a model without a vision tower or an unreadable or
    too large image."""
    from openk3.data.images import load_image, pack_images

    vision = getattr(config, "vision_config", None)
    if vision is None:
        raise ValueError("--image needs a model with a vision tower (its config.json has no vision_config)")
    media = pack_images([load_image(p) for p in paths], vision)
    return media, [config.media_placeholder_token_id] * media.num_tokens


def _eval_split(folder: Path, data: str | None) -> Path:
    """The data ``openk3 eval`` reads: ``--data`` (a ``.bin`` split, a folder holding ``val.bin``, or text
    to tokenize: any other file, folder or glob), else the ``data/val.bin`` of the run that holds checkpoint
    ``folder``. Raises ``FileNotFoundError`` saying what to pass instead."""
    from openk3.checkpoint.io import run_folder

    hint = (
        "pass --data path/to/val.bin (a token split written by `openk3 train` into RUN/data/), or an image-text "
        "JSONL for a vision model"
    )
    if data is None:
        run = run_folder(folder)
        if run is None:
            raise FileNotFoundError(
                f"checkpoint {folder} is not inside a run folder (RUN/checkpoints/step-* or RUN/final), so there "
                f"is no run val split to default to: {hint}"
            )
        path = run / "data" / "val.bin"
        if not path.is_file():
            raise FileNotFoundError(f"the run of checkpoint {folder} has no {path} (deleted?): {hint}")
        return path
    path = Path(data)
    if path.is_dir() and (path / "val.bin").is_file():
        return path / "val.bin"
    return path


def _run_eval_shape(folder: Path) -> tuple[int | None, int | None]:
    """(longest context, batch size) of the training run that holds checkpoint ``folder`` (a step folder or
    a distributed run's ``RUN/final``; the run's train_config.json): the windows its evaluations read;
    ``(None, None)`` outside a run or when the file is unreadable."""
    from openk3.checkpoint.io import run_folder

    run = run_folder(folder)
    if run is None:
        return None, None
    try:
        config = json.loads((run / "train_config.json").read_text())
        return max(int(t) for _, t in config["context_schedule"]), int(config["batch_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def _image_text_split(folder: Path, data: str | None) -> Path | None:
    """The image-text JSONL ``openk3 eval`` reads, or ``None`` for token data: ``--data`` when it is one (or a
    folder holding ``val.jsonl`` and no ``val.bin``), else the ``data/val.jsonl`` a vision run wrote."""
    from openk3.checkpoint.io import run_folder
    from openk3.data.image_text import is_image_text_jsonl

    if data is None:
        run = run_folder(folder)
        if run is None:
            return None
        path = run / "data"
    else:
        path = Path(data)
    if path.is_dir() and (path / "val.jsonl").is_file() and not (path / "val.bin").is_file():
        path = path / "val.jsonl"
        if not path.read_text(encoding="utf-8").strip():
            raise ValueError(f"the val split {path} is empty (no image-text rows): pass --data PAIRS.jsonl")
    return path if is_image_text_jsonl(str(path)) else None


def _refuse_flags(args: argparse.Namespace, flags: list[str], why: str) -> None:
    """Raise ``ValueError`` naming those of ``flags`` given on the command line: they are ``why``."""
    given = [flag for flag in flags if getattr(args, flag[2:].replace("-", "_"))]
    if given:
        one = len(given) == 1
        raise ValueError(
            f"{', '.join(given)} {'is' if one else 'are'} {why}: leave {'it' if one else 'them'} out"
        )


def _evaluate_image_text(args: argparse.Namespace, folder: Path, pairs: Path) -> int:
    from openk3.train.image_text import evaluate_image_text

    if not json.loads((folder / "config.json").read_text()).get("vision_config"):
        raise ValueError(
            f"{pairs} is image-text pairs, which need a model with a vision tower; {folder} has none (its "
            "config.json has no vision_config): pass --data a token split or text for it"
        )
    _refuse_flags(args, ["--needle", "--draft", "--seq-len", "--max-batches"],
                  f"for token data only; {pairs} is image-text pairs, evaluated whole")  # fmt: skip
    model, tokenizer, _ = _load_for_inference(str(folder), args.device)
    r = evaluate_image_text(model, tokenizer, pairs, args.batch_size or DEFAULT_EVAL_BATCH_SIZE)
    print(
        f"held-out loss {r['loss']:.4f} nats/token ({r['tokens']:,} text tokens), caption accuracy "
        f"{r['caption_accuracy']:.3f} (words {r['word_accuracy']:.3f}; chance {r['majority_accuracy']:.3f}, the "
        f"most common text of {r['chance_from']}) on {r['rows']} images ({pairs})"
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from openk3.checkpoint.dcp_step import checkpoint_of, model_folder
    from openk3.data import TokenDataset

    if args.needle:
        _refuse_flags(args, ["--seq-len", "--max-batches", "--batch-size", "--draft"],
                      "not used by --needle (its rows have the --needle lengths, a fixed count each)")  # fmt: skip
    source = checkpoint_of(args.ckpt)  # the run's files are found from it, before any model is read
    pairs = _image_text_split(source, args.data)
    if pairs is not None:  # a vision run's held-out pairs
        with model_folder(source) as folder:
            return _evaluate_image_text(args, folder, pairs)
    val_path = _eval_split(source, args.data)
    with tempfile.TemporaryDirectory(prefix="openk3-eval-") as tmp, model_folder(source) as folder:
        if val_path.suffix != ".bin":  # raw text: tokenized with the checkpoint's tokenizer, all of it
            from openk3.checkpoint import checkpoint_with_tokenizer
            from openk3.data import Tokenizer
            from openk3.data.text_split import write_text_split

            tokenizer = Tokenizer.load(checkpoint_with_tokenizer(str(folder)))
            dataset = TokenDataset(write_text_split(args.data, tokenizer, Path(tmp) / "text.bin"))
        else:
            dataset = TokenDataset(val_path)
        return _evaluate(args, source, folder, val_path, dataset)


def _evaluate(args: argparse.Namespace, source: Path, folder: Path, val_path: Path, dataset) -> int:
    """Evaluate the model of folder ``folder`` on ``dataset``; ``source``: the checkpoint as named (its run
    gives the default windows), :func:`~openk3.checkpoint.dcp_step.model_folder`."""
    from openk3.train.trainer import validation_loss

    model, tokenizer, _ = _load_for_inference(str(folder), args.device)
    dataset.check_tokenizer(tokenizer, f"checkpoint {source}")
    if args.needle:
        from openk3.synthetic.long_context import needle_eval

        for row in needle_eval(model, dataset, args.needle, device=args.device):
            print(f"needle at {row['length']:>6} tokens, depth {row['depth']:.2f}: accuracy "
                  f"{row['accuracy']:.3f}, token accuracy {row['token_accuracy']:.3f}")  # fmt: skip
        return 0
    run_seq_len, run_batch = _run_eval_shape(source)  # defaults: the windows the run's evaluations read
    seq_len = args.seq_len
    if seq_len is None:  # at most N - 1 (a val split shorter than one window)
        seq_len = max(1, min(run_seq_len or DEFAULT_EVAL_SEQ_LEN, dataset.num_tokens - 1))
    batch_size = args.batch_size or run_batch or DEFAULT_EVAL_BATCH_SIZE
    if args.draft:
        from openk3.train.draft_cli import print_acceptance

        print_acceptance(model, args.draft, dataset, batch_size, seq_len, args.max_batches, args.device)
        return 0
    loss, count = validation_loss(
        model, dataset, batch_size, seq_len, args.max_batches, device=args.device, progress=True
    )
    print(f"val loss {loss:.4f} nats/token, perplexity {math.exp(loss):.2f} ({count:,} tokens, {val_path})")
    return 0


DASH_VALUE_FLAGS = ("--context-schedule",)
"""Flags whose value may start with ``-`` and a digit (``--context-schedule -1:64``): argparse takes such a
word for a flag (it is no plain number) and fails with "expected one argument"."""


def _attach_dash_values(argv: list[str]) -> list[str]:
    """``argv`` with ``FLAG -VALUE`` written ``FLAG=-VALUE`` for the :data:`DASH_VALUE_FLAGS` (a value that
    starts with ``-`` and a digit), so the value reaches the flag's own check, which names what is wrong
    with it (``context schedule '-1:64': the first entry must start at step 0``)."""
    out, i = [], 0
    while i < len(argv):
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if argv[i] in DASH_VALUE_FLAGS and len(value) > 1 and value[0] == "-" and value[1].isdigit():
            out.append(f"{argv[i]}={value}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help when it has a default and its help does not say it already
    (``None`` and ``False`` defaults are not shown: those flags say what happens without them)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``openk3 train: error: … (see openk3 train --help)``)
    instead of the usage block and the error; subcommand parsers inherit it."""

    commands: dict[str, argparse.ArgumentParser] | None = None
    """Subcommand parsers by name (set on the top-level parser), so an unknown option is reported by the
    subcommand it was given to (``openk3 train: error: unrecognized arguments: --bogus``)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(
            2, f"{self.prog}: error: {message} (see {self.prog} --help)\n" if _reports_errors() else None
        )

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        if self.commands and argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
            self.error(
                f"unrecognized arguments: {argv[0]} (the command comes first: {', '.join(self.commands)})"
            )
        parsed, extras = self.parse_known_args(argv, namespace)
        if extras:
            owner = (self.commands or {}).get(getattr(parsed, "command", None), self)
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="openk3", description="Kimi K3 family: models, accounting, tools")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices
    info = sub.add_parser("info", help="parameter counts and cache sizes of a preset or config.json")
    src = info.add_mutually_exclusive_group()
    src.add_argument(
        "--preset", default="kimi-k3", choices=sorted(PRESETS), help="preset name (default kimi-k3)"
    )
    src.add_argument("--config", help="path to a config.json or a model folder")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=cmd_info)

    tr = sub.add_parser(
        "train", help="train a model (default: k3-tiny on Shakespeare, CPU, under 10 minutes)"
    )
    tr.add_argument("--preset", choices=sorted(PRESETS), help="model preset (default k3-tiny)")
    tr.add_argument("--data", help="text/JSONL file, folder or glob (default: Shakespeare's complete works)")
    tr.add_argument("--tokenizer", help="tokenizer.json or .tiktoken file (default: train a byte-level BPE)")
    tr.add_argument("--out", help="run folder (default runs/k3-tiny)")
    tr.add_argument("--steps", type=cli_types.steps, help="optimizer steps, at most 10^9 (default 200)")
    tr.add_argument(
        "--batch-size",
        dest="batch_size",
        type=cli_types.positive_int,
        help="sequences per micro-batch, also the eval batch size (default 16)",
    )
    tr.add_argument(
        "--grad-accum",
        dest="grad_accum",
        type=cli_types.positive_int,
        help="micro-batches per step (default 1)",
    )
    tr.add_argument(
        "--micro-batch-size",
        dest="micro_batch_size",
        type=cli_types.positive_int,
        help="sequences per forward/backward (default: --batch-size on CPU, the memory planner's pick on CUDA)",
    )
    tr.add_argument(
        "--activation-checkpointing",
        dest="activation_checkpointing",
        choices=["auto", "none", "selective", "full"],
        help="per decoder layer (default auto: none on CPU, the memory planner's pick on CUDA)",
    )
    tr.add_argument(
        "--compile",
        dest="compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each decoder layer (default: on for CUDA, off on CPU)",
    )
    tr.add_argument(
        "--context-schedule",
        dest="context_schedule",
        help="progressive context, step:seq_len,... from step 0, lengths growing, steps below --steps "
        "(default '0:64,60:128')",
    )
    tr.add_argument(
        "--lr", type=cli_types.positive_float, help="peak learning rate of Muon and AdamW (default 0.003)"
    )
    tr.add_argument(
        "--grad-clip",
        dest="grad_clip",
        type=cli_types.positive_float,
        help="max global gradient norm (default 1.0)",
    )
    tr.add_argument(
        "--warmup-steps",
        dest="warmup_steps",
        type=cli_types.non_negative_int,
        help="linear warmup steps (default 20), clamped to at most 25%% of --steps",
    )
    tr.add_argument(
        "--schedule",
        choices=["cosine", "wsd"],
        help="learning-rate schedule after the warmup (default cosine)",
    )
    tr.add_argument(
        "--balance", choices=["quantile", "sign", "none"], help="MoE balancing (default quantile)"
    )
    tr.add_argument(
        "--eval-every",
        dest="eval_every",
        type=cli_types.positive_int,
        help="steps between evaluations on a fixed val subset, each redrawing loss.png (default 50)",
    )
    tr.add_argument(
        "--save-every",
        dest="save_every",
        type=cli_types.positive_int,
        help="steps between checkpoints (default 100)",
    )
    tr.add_argument(
        "--seed", type=cli_types.seed, help="seed of the weights, the data split and the batches (default 0)"
    )
    tr.add_argument(
        "--device", choices=["cpu", "cuda"], help="cpu (fp32) or cuda (bf16 autocast) (default cpu)"
    )
    tr.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its latest checkpoint"
    )
    tr.add_argument(
        "--resume-command",
        metavar="CMD",
        help="the command that the lines after a Ctrl-C give for continuing the run (default: openk3 train "
        "--out OUT --resume; scripts/quickstart.sh passes its own, which also samples)",
    )
    tr.add_argument(
        "--sample-prompt",
        dest="sample_prompt",
        help="prompt of the sample printed at the end (default: 'ROMEO:' on the default corpus, else the "
        "first tokens of the val split)",
    )
    tr.add_argument("--no-sample", action="store_true", help="do not print a sample at the end")
    tr.add_argument(
        "--qat",
        choices=["mxfp4"],
        help="quantization-aware training of the routed experts: MXFP4 weights, MXFP8 inputs, export with "
        "`openk3 quantize` (default None: full precision)",
    )
    tr.add_argument(
        "--tensorboard",
        action="store_true",
        default=None,
        help="also log the metrics as TensorBoard events in OUT/tensorboard (tensorboard --logdir OUT); "
        'needs pip install -e ".[tensorboard]"',
    )
    tr.add_argument(
        "--nproc-per-node",
        dest="nproc_per_node",
        type=cli_types.positive_int,
        help="start this many local ranks (as torchrun --standalone --nproc_per_node does); a failed world "
        "is reported in one line",
    )
    tr.add_argument(
        "--dp-shard", dest="dp_shard", type=cli_types.positive_int, help="FSDP2 shard degree (under torchrun)"
    )
    tr.add_argument(
        "--dp-replicate", dest="dp_replicate", type=cli_types.positive_int, help="HSDP replicas (torchrun)"
    )
    tr.add_argument(
        "--ep",
        type=cli_types.positive_int,
        help="expert-parallel degree (under torchrun; divides --dp-shard)",
    )
    tr.add_argument(
        "--cp",
        type=cli_types.positive_int,
        help="context-parallel degree: each sequence split over this many ranks (under torchrun)",
    )
    tr.add_argument(
        "--cp-layout",
        dest="cp_layout",
        choices=("contiguous", "zigzag"),
        default="contiguous",
        help="how --cp C splits a sequence: contiguous (rank r: part r of C) or zigzag (parts r and 2C-1-r of 2C)",
    )
    tr.add_argument(
        "--ep-dispatcher",
        dest="ep_dispatcher",
        choices=("alltoall", "moonep"),
        default="alltoall",
        help="token exchange under --ep: dropless all-to-all (default) or the MoonEP contract "
        "(S·K rows per rank; docs/distributed.md)",
    )
    tr.add_argument(
        "--long-context",
        dest="long_context",
        action="store_const",
        const=True,
        help="rows of permuted corpus pieces ending in a recall of their first passage (docs/synthetic.md)",
    )
    tr.set_defaults(func=cmd_train)

    pl = sub.add_parser("plan", help="per-GPU memory and traffic of a distributed layout (no GPU needed)")
    pl.add_argument("--preset", choices=sorted(PRESETS), default="kimi-k3", help="model to plan for")
    pl.add_argument("--gpus", type=cli_types.positive_int, required=True, help="world size (number of GPUs)")
    pl.add_argument(
        "--dp-shard", dest="dp_shard", type=int, default=-1, help="FSDP2 shard degree (-1: what is left)"
    )
    pl.add_argument(
        "--dp-replicate", dest="dp_replicate", type=cli_types.positive_int, default=1, help="HSDP replicas"
    )
    pl.add_argument("--ep", type=cli_types.positive_int, default=1, help="expert-parallel degree")
    pl.add_argument(
        "--tokens", type=cli_types.positive_int, default=4096, help="tokens per GPU per micro-batch"
    )
    pl.set_defaults(func=cmd_plan)

    gen = sub.add_parser("generate", help="stream text from a checkpoint")
    gen.add_argument(
        "--ckpt", required=True, help="checkpoint folder or run folder (uses its latest checkpoint)"
    )
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text to continue; - reads it from stdin")
    what.add_argument("--prompt-file", dest="prompt_file", help="a UTF-8 text file holding the prompt")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message in the checkpoint's chat template; print only the reply",
    )
    gen.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="an image file (or data: URL) the prompt is about; repeat for several (they come first)",
    )
    gen.add_argument(
        "--num-samples",
        dest="num_samples",
        type=cli_types.positive_int,
        default=1,
        help="samples of the same prompt (sample i uses --seed + i)",
    )
    gen.add_argument(
        "--max-new-tokens",
        dest="max_new_tokens",
        type=cli_types.positive_int,
        default=200,
        help="tokens to generate at most (prompt + these within the model's context)",
    )
    gen.add_argument(
        "--temperature", type=cli_types.temperature, default=0.8, help="sampling temperature, 0 = greedy"
    )
    gen.add_argument(
        "--top-p",
        dest="top_p",
        type=cli_types.top_p,
        default=1.0,
        help="nucleus sampling: keep this probability mass",
    )
    gen.add_argument(
        "--seed", type=cli_types.seed, default=None, help="sampling seed (default: a random one)"
    )
    gen.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs")
    from openk3.serve.cli import DEFAULT_SPECULATIVE_TOKENS, speculative_tokens_arg

    gen.add_argument("--draft", help="speculative decoding with this draft folder (openk3 train-draft)")
    gen.add_argument(
        "--speculative-tokens", dest="speculative_tokens", type=speculative_tokens_arg,
        help=f"drafted tokens per target forward with --draft (at most 16; default {DEFAULT_SPECULATIVE_TOKENS})",
    )  # fmt: skip
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="validation loss and perplexity of a checkpoint")
    ev.add_argument("--ckpt", required=True, help="checkpoint folder or run folder")
    ev.add_argument(
        "--data",
        help="a token split (.bin), text (a file, folder or glob) tokenized with the checkpoint's tokenizer, "
        "or image-text pairs (.jsonl) for a vision model (default: the run's data/val.bin, or a vision run's "
        "held-out data/val.jsonl)",
    )
    ev.add_argument(
        "--seq-len",
        dest="seq_len",
        type=cli_types.positive_int,
        default=None,
        help=f"tokens per window (default: the run's longest training context, else {DEFAULT_EVAL_SEQ_LEN}; "
        "at most the val split's length - 1)",
    )
    ev.add_argument(
        "--batch-size",
        dest="batch_size",
        type=cli_types.positive_int,
        default=None,
        help=f"windows per batch (default: the run's batch size, else {DEFAULT_EVAL_BATCH_SIZE})",
    )
    ev.add_argument(
        "--max-batches",
        dest="max_batches",
        type=cli_types.positive_int,
        default=None,
        help="read only the first N batches (default: every window of the split)",
    )
    ev.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs")
    ev.add_argument(
        "--needle",
        type=_length_list,
        help="needle-in-a-haystack accuracy at these context lengths instead, e.g. 256,512,1024",
    )
    ev.add_argument(
        "--draft", help="a draft folder (openk3 train-draft): report its acceptance rate on the data instead"
    )
    ev.set_defaults(func=cmd_eval)

    # each subcommand module is light: its heavy imports happen when it runs
    from openk3.quant.cli import add_quantize_parser
    from openk3.rl.cli import add_posttrain_parser
    from openk3.rl.sft_cli import add_sft_parser
    from openk3.sandbox.cli import add_sandbox_parser
    from openk3.serve.cli import add_route_parser, add_serve_parser
    from openk3.synthetic.cli import add_parser as add_synthetic_parser
    from openk3.train.draft_cli import add_draft_parser

    add_serve_parser(sub)
    add_draft_parser(sub)
    add_route_parser(sub)
    add_posttrain_parser(sub)
    add_sft_parser(sub)
    add_sandbox_parser(sub)
    add_synthetic_parser(sub)
    add_quantize_parser(sub)
    return parser


def _silence_stdout() -> None:
    """Point file descriptor 1 at /dev/null, so the interpreter's final flush of a closed pipe is silent."""
    try:
        sys.stdout.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a descriptor
        pass


OOM_ADVICE = {
    "train": "use a smaller --micro-batch-size (the step keeps its batch) or --batch-size, "
    "--activation-checkpointing selective or full, a shorter --context-schedule, or a smaller --preset",
    "generate": "use a shorter --prompt (prefill memory grows with its length) or fewer --max-new-tokens",
    "eval": "use a smaller --batch-size or --seq-len",
    "serve": "use a smaller --pool-mib / --num-blocks or --max-model-len",
}
"""What to change when a command runs out of memory, by command (only flags that command has)."""


def _failure_line(e: BaseException, command: str | None = None) -> str | None:
    """The one-line report of a failure that is not a bug: training diverged, or memory ran out (host or
    GPU; the advice is :data:`OOM_ADVICE`'s for ``command``); ``None`` for any other error (its traceback is
    shown)."""
    from openk3.train.trainer import DivergenceError

    if isinstance(e, DivergenceError):
        return str(e)
    first = (str(e).strip().splitlines() or [""])[0]
    oom = isinstance(e, MemoryError) or "out of memory" in first.lower() or "DefaultCPUAllocator" in first
    if not oom:
        return None
    return (
        f"out of memory ({first[:200]}): {OOM_ADVICE.get(command, 'free memory or use a smaller --preset')}"
    )


def _reports_errors() -> bool:
    """Whether this process prints a bad input or a Ctrl-C. Under torch's elastic agent (torchrun) every rank
    meets the same bad input, so the first rank of a node to fail prints it: the ranks of one attempt keep
    their error files in sibling folders (``attempt_N/<local rank>/error.json``), and the one that creates
    the marker beside those folders (an ``O_EXCL`` create) prints. The first rank, not rank 0: torchrun stops
    the others when one exits, which can be before rank 0 has printed. Without an error file, rank 0 prints.
    No rank prints under ``openk3 train --nproc-per-node``, whose launcher prints the line
    (:mod:`openk3.dist.launch`)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return True
    if os.environ.get("OPENK3_LAUNCHER") == "1":
        return False
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return os.environ.get("RANK", "0") == "0"
    # named by the agent's pid (the ranks' parent), so a log folder reused by a later run holds no stale one
    marker = Path(error_file).parent.parent / f"openk3-error-printed-{os.getppid()}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # an unwritable log folder: fall back to rank 0
        return os.environ.get("RANK", "0") == "0"
    return True


def _user_error(e: BaseException) -> None:
    """Print bad input ``e`` as one ``openk3: error:`` line (one rank under the elastic agent) and, under
    the agent, record it in this rank's error file, where torchrun's report and :mod:`openk3.dist.launch`
    read it."""
    if _reports_errors():
        print(f"openk3: error: {e}", file=sys.stderr)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e.with_traceback(None))  # bad input: its line, not a traceback


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit codes: its own (0 on success), 2 for a bad input (one ``openk3: error:`` line on
    stderr; argparse's own errors raise ``SystemExit(2)`` with one ``openk3 <command>: error:`` line; under
    torch's elastic agent one rank prints it, :func:`_reports_errors`), 1 for diverged training or memory
    exhausted (one such line), 130 for Ctrl-C (one line saying what was saved), 141 when stdout was closed
    early (``openk3 info --json | head``; nothing printed)."""
    args = None
    try:
        argv = _attach_dash_values(list(sys.argv[1:] if argv is None else argv))
        args = build_parser().parse_args(argv)
        args.argv = argv
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe raises here, inside the handler, not at interpreter exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        _user_error(e)
        return 2
    except (MemoryError, RuntimeError) as e:
        why = _failure_line(e, getattr(args, "command", None))
        if why is None:
            raise
        print(f"openk3: error: {why}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        with contextlib.suppress(OSError):  # stderr may be a closed pipe too
            if _reports_errors():  # every rank of a world gets the Ctrl-C: one says it
                print(f"openk3: {e}" if str(e) else "openk3: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
