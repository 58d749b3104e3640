"""The ``openk3`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from openk3.accounting import accounting_report
from openk3.config import load_config
from openk3.presets import PRESETS, get_preset


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (the error names the flag and the value)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _print_info(report: dict) -> None:
    print(f"model_type: {report['model_type']}")
    print("parameters:")
    for name, value in report["components"].items():
        print(f"  {name:<28} {value:>22,}")
    print(f"  {'total':<28} {report['total_params']:>22,}")
    print(f"  {'active (no input embedding)':<28} {report['active_params']:>22,}")
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


def cmd_info(args: argparse.Namespace) -> int:
    config = load_config(args.config) if args.config else get_preset(args.preset)
    report = accounting_report(config)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_info(report)
    return 0


def _load_for_inference(ckpt: str, device: str):
    from openk3.checkpoint import from_pretrained
    from openk3.data import Tokenizer
    from openk3.train.state import latest_checkpoint

    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    folder = latest_checkpoint(ckpt)
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json (checkpoints written by `openk3 train` do)")
    return from_pretrained(folder, device=device), Tokenizer.load(folder), folder


def cmd_train(args: argparse.Namespace) -> int:
    import dataclasses

    from openk3.train.schedule import parse_context_schedule
    from openk3.train.state import latest_checkpoint, load_trainer_state
    from openk3.train.trainer import TrainConfig, train

    given = {
        k: v
        for k, v in vars(args).items()
        if v is not None and k in {f.name for f in dataclasses.fields(TrainConfig)}
    }
    if args.context_schedule is not None:
        given["context_schedule"] = parse_context_schedule(args.context_schedule)
    if args.no_sample:
        given["sample_prompt"] = None
    if args.resume:
        out = given.get("out", TrainConfig.out)
        saved = load_trainer_state(latest_checkpoint(Path(out)))["train_config"]
        config = TrainConfig.from_dict({**saved, **given})
    else:
        config = TrainConfig(**given)
    summary = train(config, resume=args.resume)
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
        print(f"stopped at step {summary['step']}; continue with: openk3 train --out {config.out} --resume")
        return 130 if not config.stop_at_step else 0
    if config.sample_prompt:
        model, tokenizer, _ = _load_for_inference(summary["checkpoint"], config.device)
        print(f"--- sample (temperature 0.8, top-p 0.95, seed {config.seed}) ---")
        _stream_text(model, tokenizer, config.sample_prompt, 200, 0.8, 0.95, config.seed, config.device)
    return 0


def _stream_text(model, tokenizer, prompt, max_new_tokens, temperature, top_p, seed, device) -> None:
    import torch

    from openk3.generate import stream

    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    sys.stdout.write(prompt)
    produced: list[int] = []
    shown = ""
    x = torch.tensor([ids], device=device)
    for tok in stream(model, x, max_new_tokens, temperature, top_p, seed, stop_ids={tokenizer.eos_id}):
        token = int(tok[0, 0])
        if token == tokenizer.eos_id:
            break
        produced.append(token)
        text = tokenizer.decode(produced)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")


def cmd_generate(args: argparse.Namespace) -> int:
    from openk3.generate import check_sampling

    check_sampling(args.temperature, args.top_p, args.max_new_tokens)  # before the (slow) model load
    model, tokenizer, _ = _load_for_inference(args.ckpt, args.device)
    _stream_text(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_p,
        args.seed,
        args.device,
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import math

    from openk3.data import TokenDataset
    from openk3.train.state import latest_checkpoint
    from openk3.train.trainer import validation_loss

    folder = latest_checkpoint(args.ckpt)
    model, _, _ = _load_for_inference(str(folder), args.device)
    val_path = Path(args.data) if args.data else folder.parent.parent / "data" / "val.bin"
    dataset = TokenDataset(val_path)
    loss, count = validation_loss(
        model, dataset, args.batch_size, args.seq_len, args.max_batches, device=args.device
    )
    print(f"val loss {loss:.4f} nats/token, perplexity {math.exp(loss):.2f} ({count:,} tokens, {val_path})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openk3", description="Kimi K3 family: models, accounting, tools")
    sub = parser.add_subparsers(dest="command", required=True)
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
    tr.add_argument("--steps", type=int, help="optimizer steps")
    tr.add_argument("--batch-size", dest="batch_size", type=int, help="sequences per step")
    tr.add_argument("--grad-accum", dest="grad_accum", type=int, help="micro-batches per step")
    tr.add_argument(
        "--context-schedule",
        dest="context_schedule",
        help="progressive context, e.g. '0:128,150:256' (step:seq_len,...)",
    )
    tr.add_argument("--lr", type=float, help="peak learning rate")
    tr.add_argument(
        "--warmup-steps",
        dest="warmup_steps",
        type=int,
        help="linear warmup steps (default 20), clamped to at most 25%% of --steps",
    )
    tr.add_argument("--schedule", choices=["cosine", "wsd"])
    tr.add_argument(
        "--balance", choices=["quantile", "sign", "none"], help="MoE balancing (default quantile)"
    )
    tr.add_argument("--eval-every", dest="eval_every", type=int)
    tr.add_argument("--save-every", dest="save_every", type=int)
    tr.add_argument("--seed", type=int)
    tr.add_argument("--device", choices=["cpu", "cuda"])
    tr.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its latest checkpoint"
    )
    tr.add_argument("--no-sample", action="store_true", help="do not print a sample at the end")
    tr.set_defaults(func=cmd_train)

    gen = sub.add_parser("generate", help="stream text from a checkpoint")
    gen.add_argument(
        "--ckpt", required=True, help="checkpoint folder or run folder (uses its latest checkpoint)"
    )
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-p", dest="top_p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="validation loss and perplexity of a checkpoint")
    ev.add_argument("--ckpt", required=True, help="checkpoint folder or run folder")
    ev.add_argument("--data", help="a token split (.bin); default: the run's data/val.bin")
    ev.add_argument("--seq-len", dest="seq_len", type=_positive_int, default=256, help="tokens per window")
    ev.add_argument(
        "--batch-size", dest="batch_size", type=_positive_int, default=16, help="windows per batch"
    )
    ev.add_argument(
        "--max-batches",
        dest="max_batches",
        type=_positive_int,
        default=None,
        help="read only the first N batches (default: every window of the split)",
    )
    ev.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ev.set_defaults(func=cmd_eval)

    from openk3.serve.cli import add_serve_parser  # light: heavy imports happen when `serve` runs

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"openk3: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
