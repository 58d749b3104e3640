"""Speculative decoding benchmark: LK- vs KL-trained drafts of one target, trained for the same steps on the
same batches, side by side: the acceptance rate by draft depth on held-out text, the serving engine's decode
throughput with and without the draft at 1 and 64 streams, and for k = 1…5 the measured tokens per target
forward and the single-sequence speed-up over plain decoding.

* The target is a trained run (``--target RUN``, an ``openk3 train`` folder) or is trained here first
  (``--train-target PRESET`` on ``--data``, default Shakespeare, into ``--work``), uncompiled so that no
  ``torch.compile`` warm-up is paid. The run's val split gives the held-out windows and the prompts.
* Both drafts start from the same initialisation (``--seed``) and read the same batches: the target's own
  samples (``--draft-data generations``: ``--gen-windows`` windows of 16 corpus tokens and the target's
  continuation at temperature 1, drawn once and shared) or random windows of the training split
  (``corpus``). They differ only in the loss.
* Engine (``--streams``): ``N`` greedy requests of ``--prompt-len`` val tokens and ``--new-tokens`` new
  tokens each, all submitted at once, tokens / wall time (prefills included), best of ``--repeats`` after a
  warm-up round, without a draft and with the LK draft at each k of ``--engine-ks``; every engine takes its
  default path (on CUDA: plain decode steps and greedy speculative steps replayed from CUDA graphs). Greedy
  outputs are compared stream by stream; a stream that differs is checked by the fp32 target at its first
  difference (:func:`divergence`): a bf16 near-tie is counted apart, anything else flags the row.
* Single sequence (``--ks``): ``--prompts`` prompts, greedy (or ``--temperature``), :func:`openk3.generate
  .generate` against :func:`openk3.speculative.speculative_generate`, best of ``--repeats``, plain and the
  two drafts alternating so a shared machine slows all alike; their greedy outputs are compared in fp32
  (the loops run again, untimed, on the fp32 target and drafts), where a lossless decoder is exact.
* A trained-here target stops after ``--target-epochs`` passes over its train split (default 1): a
  model of k3-small's size memorises a small corpus, and a worse target makes every draft accept less
  (docs/LOG.md: Shakespeare's 1.24M train tokens gave val loss 4.51 after one pass, 5.10 after 3.4, 5.63
  after 5.3).
* ``--budget-s``: the run's wall-clock budget. The target's steps get 40 % of it and each draft's 10 % plus
  half of what the target left unused; the rest is for setup, kernel compilation, sampling, evaluation and
  the measurements: their step counts (``--target-steps``, ``--draft-steps``) are cut to what fits once a
  few steps are timed. The engine
  measurement and the first single-sequence k always run; a later k that would start past the budget is
  skipped and listed. Each phase logs a timestamped line on stderr and rewrites the (partial) report.
* Two calls (a device call is limited to minutes): ``--drafts DIR --train-only`` trains the target (into
  ``--work``) and both drafts, each draft with :data:`TRAIN_ONLY_DRAFT_SHARE` of the budget, saves the drafts
  into ``DIR`` (``lk/``, ``kl/`` and :data:`DRAFTS_RECORD`, written last) and stops after their acceptance
  rates; a second run with ``--target WORK/PRESET --drafts DIR`` loads them (refused when they were trained
  against another target) and measures the rest. A ``--drafts`` folder without drafts is trained into.

    python benchmarks/speculative.py --target runs/k3-tiny --out benchmarks/results/   # CPU
    python benchmarks/speculative.py --train-target k3-small --device cuda --data CORPUS --work /tmp/spec \\
        --budget-s 400 --target-steps 3000 --target-batch-size 32 --target-seq-len 256 --draft-steps 2000 \\
        --batch-size 32 --seq-len 128 --gen-windows 2048 --eval-batches 16 --streams 1,64 --new-tokens 128 \\
        --engine-ks 1,2,3,4,5 --ks 3 --prompts 1 --out OUT_DIR                     # one H200, ~8 min

Prints a Markdown report; ``--out`` is a ``.md`` file or a folder (which receives ``speculative_<device>.md``
and ``.json``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from openk3.checkpoint import from_pretrained
from openk3.cli_types import positive_float, positive_int
from openk3.data import TokenDataset
from openk3.data.shards import RandomBatches
from openk3.generate import generate
from openk3.model.draft import DraftConfig, build_draft, feature_layers, load_draft, save_draft
from openk3.presets import PRESETS
from openk3.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeStats, speculative_generate
from openk3.train.draft_cli import GEN_PROMPT_TOKENS, generated_windows, pool_batches
from openk3.train.draft_trainer import acceptance_by_step, expected_accepted_length, train_draft
from openk3.train.state import latest_checkpoint
from openk3.train.trainer import unigram_entropy, validation_loss

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TARGET_SHARE = 0.4
"""Share of ``--budget-s`` for the target's training steps (at the rate of its steady steps: the data
preparation and the first step's kernel compilation come on top)."""
DRAFT_SHARE = 0.1
"""Share of ``--budget-s`` for each draft's training steps."""
TRAIN_ONLY_DRAFT_SHARE = 0.25
"""Each draft's share with ``--train-only`` (no measurements after the acceptance rates)."""
LOSSES = ("lk", "kl")
DRAFTS_RECORD = "training.json"
"""The ``--drafts`` folder's record: the target's fingerprint, how the drafts were trained, their losses."""
TIMED_STEPS = 6
"""Target steps run before the step count is fitted to the budget (the first one, with kernel compilation,
is left out of the per-step time)."""
DEPTH = 5
"""Draft depths of the acceptance table."""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one int, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--target", help="run folder of a trained target (openk3 train --out)")
    which.add_argument("--train-target", choices=sorted(PRESETS), help="train a target of this preset first")
    p.add_argument("--data", help="corpus of --train-target (openk3 train --data; default Shakespeare)")
    p.add_argument("--work", help="folder for the --train-target run (default: a new temporary folder)")
    p.add_argument("--target-steps", type=positive_int, default=300, help="most steps of --train-target")
    p.add_argument("--target-batch-size", type=positive_int, default=16)
    p.add_argument("--target-seq-len", type=positive_int, default=128)
    p.add_argument("--target-lr", type=positive_float, default=3e-3)
    p.add_argument(
        "--target-epochs", type=positive_float, default=1.0,
        help="most passes of --train-target over its train split (default 1: more overfits a small corpus)",
    )  # fmt: skip
    p.add_argument("--budget-s", type=positive_float, help="wall-clock budget of the whole run, seconds")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bfloat16 on CUDA, else float32")
    p.add_argument("--draft-steps", type=positive_int, default=150, help="training steps of each draft")
    p.add_argument("--draft-data", choices=["generations", "corpus"], default="generations")
    p.add_argument("--gen-windows", type=positive_int, default=64, help="target samples for the drafts")
    p.add_argument("--batch-size", type=positive_int, default=8, help="draft training windows per step")
    p.add_argument("--seq-len", type=positive_int, default=64, help="draft training window length")
    p.add_argument("--ttt-steps", type=positive_int, default=3)
    p.add_argument("--lr", type=positive_float, default=2e-3)
    p.add_argument(
        "--eval-batches", type=positive_int, default=8, help="val batches for the acceptance rates"
    )
    p.add_argument("--ks", type=_int_list, default=[1, 2, 3, 4, 5], help="k of the single-sequence table")
    p.add_argument("--prompts", type=positive_int, default=2)
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--new-tokens", type=positive_int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=positive_int, default=1)
    p.add_argument(
        "--streams",
        type=_int_list,
        default=[],
        help="engine throughput at these concurrent streams, e.g. 1,64",
    )
    p.add_argument(
        "--engine-ks", type=_int_list, default=[3], help="k of the engine throughput test, e.g. 1,2,3,4,5"
    )
    p.add_argument(
        "--drafts",
        help="folder of the two drafts: loaded when it holds them (an earlier run's), else trained and saved there",
    )
    p.add_argument(
        "--train-only", action="store_true",
        help="stop after training and saving the drafts into --drafts (the first of two calls)",
    )  # fmt: skip
    p.add_argument("--threads", type=positive_int, help="torch threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help=".md file or folder for the report")
    args = p.parse_args(argv)
    for k in [*args.ks, *args.engine_ks]:
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            p.error(f"--ks and --engine-ks take k in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
    if any(n < 1 for n in args.streams):
        p.error(f"--streams takes numbers of streams >= 1, got {args.streams}")
    if args.train_only and not args.drafts:
        p.error("--train-only needs --drafts DIR: the folder the trained drafts are saved to")
    if args.target and (args.data or args.work):
        p.error("--data and --work go with --train-target (a --target run has its own data)")
    if args.seq_len < max(GEN_PROMPT_TOKENS, args.ttt_steps, DEPTH) + 2:
        p.error(f"--seq-len must be at least {max(GEN_PROMPT_TOKENS, args.ttt_steps, DEPTH) + 2}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    return args


class Clock:
    """Wall time since the start and the deadlines of ``--budget-s`` (none without it)."""

    def __init__(self, budget_s: float | None) -> None:
        self.t0, self.budget_s = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return math.inf if self.budget_s is None else self.budget_s - self.elapsed()

    def share(self, fraction: float) -> float:
        return math.inf if self.budget_s is None else fraction * self.budget_s

    def log(self, message: str) -> None:
        """``[elapsed s] message`` on stderr, flushed at once, so a run killed at its time limit still shows
        where its time went."""
        print(f"[{self.elapsed():6.1f} s] {message}", file=sys.stderr, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, *args):
    sync()
    t0 = time.perf_counter()
    out = fn(*args)
    sync()
    return out, time.perf_counter() - t0


def train_target(args, clock: Clock) -> tuple[Path, dict]:
    """Train ``--train-target`` into ``--work``: :data:`TIMED_STEPS` steps, then (with a budget) the step
    count cut to what fits in :data:`TARGET_SHARE` of it, resumed to the end. Returns the run folder and a
    summary for the report."""
    from openk3.train.trainer import TrainConfig, train

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="openk3-speculative-"))
    config = TrainConfig(
        preset=args.train_target, data=args.data, out=str(work / args.train_target),
        steps=args.target_steps, batch_size=args.target_batch_size,
        context_schedule=[(0, args.target_seq_len)], lr=args.target_lr,
        warmup_steps=max(1, min(20, args.target_steps // 10)), eval_every=args.target_steps, save_every=args.target_steps,
        final_eval_batches=8, device=args.device, compile=False, sample_prompt=None, seed=args.seed,
    )  # fmt: skip
    first = min(TIMED_STEPS, args.target_steps)
    clock.log(f"target {args.train_target}: data preparation and {first} timed steps")
    train(dataclasses.replace(config, stop_at_step=first), progress=False)
    run = Path(config.out)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(
        args.target_batch_size * r["seq_len"] / r["tokens_per_s"] for r in rows[1:] or rows
    )
    tokens_per_step = args.target_batch_size * args.target_seq_len
    train_tokens = TokenDataset(run / "data" / "train.bin").num_tokens
    steps = min(args.target_steps, max(first, int(args.target_epochs * train_tokens / tokens_per_step)))
    room = clock.share(TARGET_SHARE)  # stepping time: data preparation and compilation come on top
    if room < math.inf:
        steps = max(first, min(steps, int(0.9 * room / step_s)))
    summary = {
        "preset": args.train_target, "planned_steps": args.target_steps, "seconds_per_step": step_s,
        "train_tokens": train_tokens, "epochs": steps * tokens_per_step / train_tokens,
        "spare_seconds": max(0.0, room - steps * step_s) if room < math.inf else 0.0,
    }  # fmt: skip
    clock.log(
        f"target: {step_s:.3f} s per step; training to step {steps} "
        f"({summary['epochs']:.2f} passes over {train_tokens:,} train tokens)"
    )
    if steps > first:
        train(dataclasses.replace(config, steps=steps), resume=True, progress=False)
    summary.update(steps=steps, tokens=steps * args.target_batch_size * args.target_seq_len)
    summary["seconds"] = clock.elapsed()
    summary["train_loss"] = loss_curve(run / "metrics.jsonl")
    clock.log(f"target {args.train_target}: {steps} steps done")
    return run, summary


def loss_curve(metrics: Path, points: int = 8) -> dict:
    """The target run's training loss from its ``metrics.jsonl``: ``points`` (step, mean loss of the steps since
    the previous point) pairs, the lowest single-step loss and the last; the report shows them beside the val
    loss, so a weak target says whether it stopped early, plateaued or spiked."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r and "grad_norm" in r]
    if not losses:
        return {}
    edges = [round(i * len(losses) / points) for i in range(points + 1)]
    curve = [
        (losses[b - 1][0], statistics.fmean(v for _, v in losses[a:b]))
        for a, b in zip(edges, edges[1:])
        if b > a
    ]
    return {"curve": curve, "min": min(v for _, v in losses), "last": losses[-1][1]}


def draft_batches(args, lm, train_set, device):
    """A fresh iterator over the drafts' training batches (the same for every call) and the seconds it took
    to make them (sampling the target, for ``generations``)."""
    if args.draft_data == "corpus":
        return lambda: (
            x.to(device) for x, _ in RandomBatches(train_set, args.batch_size, args.seq_len, args.seed)
        ), 0.0
    rows = (
        args.gen_windows if device.type == "cuda" else 32
    )  # one batch on a GPU: decode steps are launch-bound
    pool, seconds = timed(
        generated_windows, lm, train_set, args.gen_windows, args.seq_len, args.seed, device.type, rows
    )
    return lambda: pool_batches(pool, args.batch_size, args.seed, 0), seconds


def fitted_draft_steps(
    draft, lm, batches, args, clock: Clock, amp_dtype, extra_s: float = 0.0
) -> tuple[int, float]:
    """``--draft-steps``, cut to :data:`DRAFT_SHARE` of the budget (:data:`TRAIN_ONLY_DRAFT_SHARE` with
    ``--train-only``) plus ``extra_s`` seconds after timing 3 steps of a copy of the draft (one warm-up step
    first); returns the steps and the seconds per step."""
    probe = copy.deepcopy(draft)
    train_draft(probe, lm, batches(), 1, lr=args.lr, amp_dtype=amp_dtype)
    step_s = train_draft(probe, lm, batches(), 3, lr=args.lr, amp_dtype=amp_dtype).seconds / 3
    room = clock.share(TRAIN_ONLY_DRAFT_SHARE if args.train_only else DRAFT_SHARE) + extra_s
    steps = args.draft_steps if room == math.inf else max(1, min(args.draft_steps, int(room / step_s)))
    return steps, step_s


def target_fingerprint(lm) -> float:
    """The sum of the target's token embeddings in fp64: tells a draft folder's target from another one."""
    return float(lm.model.embed_tokens.weight.detach().double().sum())


def stored_drafts(folder: Path) -> dict | None:
    """The record of the drafts saved in ``folder`` (``--drafts``), or None when it holds none; exits with a
    message for a folder that holds only part of them (a run stopped while saving)."""
    present = [loss for loss in LOSSES if (folder / loss).is_dir()]
    record = folder / DRAFTS_RECORD
    if not present and not record.exists():
        return None
    if len(present) < len(LOSSES) or not record.is_file():
        raise SystemExit(
            f"--drafts {folder}: holds {', '.join(present) or 'no draft'}"
            f"{'' if record.is_file() else f' and no {DRAFTS_RECORD}'}: not the two drafts and the record a "
            "finished --train-only run leaves (remove the folder to train them anew)"
        )
    return json.loads(record.read_text())


def trained_drafts(
    args, model, master, lm, train_set, val, device, clock: Clock, amp_dtype, result: dict
) -> dict:
    """Both drafts, trained here for the same steps on the same batches (and saved into ``--drafts``), or
    loaded from ``--drafts``; fills ``result["draft_training"]`` and ``result["drafts"]``. Returns ``{loss:
    fp32 draft}``."""
    cfg = lm.config
    folder = Path(args.drafts) if args.drafts else None
    record = stored_drafts(folder) if folder else None
    fingerprint = target_fingerprint(lm)
    drafts = {}
    if record is not None:
        if args.train_only:
            raise SystemExit(f"--train-only: {folder} already holds both drafts (remove it to train anew)")
        if not math.isclose(record["target_fingerprint"], fingerprint, rel_tol=1e-9):
            raise SystemExit(
                f"--drafts {folder}: trained against another target ({record['target']}), not {result['target']}"
            )
        result["draft_training"] = {**record["draft_training"], "loaded_from": str(folder)}
        for loss in LOSSES:
            drafts[loss] = load_draft(folder / loss, master)
            result["drafts"][loss] = dict(record["drafts"][loss])
        clock.log(f"drafts loaded from {folder} ({record['draft_training']['steps']} steps each)")
    else:
        batches, gen_s = draft_batches(args, getattr(model, "language_model", model), train_set, device)
        data = (
            f"windows from {args.gen_windows} target samples of {args.seq_len} tokens (temperature 1, drawn "
            f"in {gen_s:.0f} s)"
            if args.draft_data == "generations"
            else f"corpus windows of {args.seq_len} tokens"
        )
        steps = None
        for loss in LOSSES:
            dc = DraftConfig(
                feature_layers(cfg.num_hidden_layers), cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers,
                loss=loss, ttt_steps=args.ttt_steps,
            )  # fmt: skip
            draft = build_draft(cfg, dc, device=device, dtype=torch.float32, seed=args.seed)
            if steps is None:  # fitted once, so both drafts train for the same steps
                spare = result.get("target_training", {}).get(
                    "spare_seconds", 0.0
                )  # the target's unused share
                steps, step_s = fitted_draft_steps(draft, lm, batches, args, clock, amp_dtype, spare / 2)
                result["draft_training"] = {
                    "steps": steps, "seconds_per_step": step_s, "batch_size": args.batch_size, "data": data,
                    "ttt_steps": args.ttt_steps, "lr": args.lr,
                }  # fmt: skip
            clock.log(f"{loss} draft: {steps} steps ({step_s:.3f} s each)")
            fit = train_draft(
                draft, lm, batches(), steps, lr=args.lr, log_every=max(1, steps // 5), amp_dtype=amp_dtype,
                log=clock.log,
            )  # fmt: skip
            drafts[loss] = draft
            result["drafts"][loss] = {"train_seconds": fit.seconds, "final_loss": fit.losses[-1]}
            if folder is not None:
                save_draft(draft, folder / loss)
            clock.log(
                f"{loss}: trained {steps} steps in {fit.seconds:.0f} s, final loss {fit.losses[-1]:.3f}"
            )
        if folder is not None:  # written last: a folder with it holds both drafts
            record = {
                "target": result["target"], "target_fingerprint": fingerprint, "command": result["command"],
                "draft_training": result["draft_training"], "drafts": result["drafts"],
            }  # fmt: skip
            tmp = folder / (DRAFTS_RECORD + ".tmp")
            tmp.write_text(json.dumps(record, indent=2) + "\n")
            tmp.replace(folder / DRAFTS_RECORD)
            clock.log(f"drafts saved to {folder}")
    for loss, draft in drafts.items():
        windows = (
            x.to(device) for x, _ in val.iter_sequential(args.batch_size, args.seq_len, args.eval_batches)
        )
        alphas = acceptance_by_step(draft, lm, windows, DEPTH, amp_dtype=amp_dtype)
        result["drafts"][loss].update(
            alpha_by_depth=alphas,
            expected_tokens_per_forward={k: expected_accepted_length(alphas, k) for k in range(1, DEPTH + 1)},
        )
        clock.log(f"{loss}: alpha by depth {[round(a, 3) for a in alphas]}")
    return drafts


def val_prompts(val: TokenDataset, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` val tokens, spread evenly over the split (they may overlap when it is short)."""
    if val.num_tokens < length:
        raise SystemExit(f"the val split holds {val.num_tokens} tokens, fewer than --prompt-len {length}")
    step = (val.num_tokens - length) // n
    return [val.tokens_N[i * step : i * step + length].astype("int64").tolist() for i in range(n)]


def divergence(master, model, prompt: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where two greedy continuations of ``prompt`` part: ``None`` when equal, else the first differing
    position, the fp32 target's logit gap between the two tokens there (given ``prompt`` and the common
    prefix) and the largest difference between ``model``'s logits and the fp32 target's at that position.
    ``rounding`` is true when the gap is within twice that difference (a near-tie that ``model``'s dtype
    may flip either way); ``fp32_best``: which token is the fp32 target's argmax there (``"first"``,
    ``"second"`` or ``"neither"``); with ``model`` the fp32 target itself it is always false, since fp32 runs of the
    two decoders agree (the fp32 tests of the engine and of ``speculative_generate``)."""
    if a == b:
        return None
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if i == min(len(a), len(b)):  # one stopped early: not a rounding flip
        return {"position": i, "gap": math.inf, "error": 0.0, "rounding": False}
    ids = torch.tensor([prompt + a[:i]], device=next(master.parameters()).device)
    exact = master(ids).logits[0, -1].float()
    error = 0.0 if model is master else float((model(ids).logits[0, -1].float() - exact).abs().max())
    gap = float((exact[a[i]] - exact[b[i]]).abs())
    best = int(exact.argmax())
    side = "first" if best == a[i] else "second" if best == b[i] else "neither"
    return {
        "position": i, "gap": gap, "error": error, "rounding": model is not master and gap <= 2 * error,
        "fp32_best": side,
    }  # fmt: skip


def engine_throughput(model, master, draft, exact_draft, val, args, device, clock: Clock) -> dict:
    """Decode tokens per second of the serving engine without the draft and with the LK draft at each k of
    ``--engine-ks`` (greedy, every request ``--new-tokens`` long, all submitted at once; prefills included).
    Each engine takes its default path: on CUDA plain decode steps and speculative steps replayed from CUDA
    graphs, in ``model``'s dtype. Streams whose output differs from plain decoding's are checked against
    the fp32 target ``master`` (:func:`divergence`): a bf16 near-tie is counted apart from a real
    difference. The near-tie test bounds the engine's rounding by the eager bf16 forward's, which the
    engine's own kernels (graphed decode and verification steps) may exceed; so when streams differ past
    it, both engines run once more in fp32 (``master`` and ``exact_draft``, the fp32 LK draft): a stream
    whose fp32 outputs agree parted by bf16 arithmetic alone and is counted apart too (``fp32_equal``)."""
    from openk3.serve import Request, SamplingParams

    out = {}
    for n in args.streams:
        prompts = val_prompts(val, n, args.prompt_len)
        clock.log(f"engine, {n} streams: plain")
        _, plain, plain_outputs = engine_round(model, None, 1, prompts, "plain", args, device)
        row = {"plain": plain, "speculative": {}}
        fp32_plain = None
        for k in args.engine_ks:
            clock.log(f"engine, {n} streams: k = {k}")
            eng, spec_row, outputs = engine_round(model, draft, k, prompts, f"k{k}-", args, device)
            spec = eng.runner.speculative
            parts = [divergence(master, model, p, a, b) for p, a, b in zip(prompts, plain_outputs, outputs)]
            spec_row.update(
                acceptance_rate=spec.num_accepted / max(spec.num_drafted, 1),
                tokens_per_step=1 + spec.num_accepted / max(spec.num_verified, 1),
                speedup=spec_row["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
                identical_streams=sum(d is None for d in parts),
                rounding_streams=sum(d is not None and d["rounding"] for d in parts),
                divergences=[d for d in parts if d is not None],
            )
            flagged = [i for i, d in enumerate(parts) if d is not None and not d["rounding"]]
            if flagged and model is not master:
                clock.log(f"engine, {n} streams, k = {k}: {len(flagged)} streams differ; fp32 runs")
                if fp32_plain is None:
                    fp32_plain = engine_round(master, None, 1, prompts, "fp32-plain", args, device, 1)[2]
                fp32_spec = engine_round(master, exact_draft, k, prompts, f"fp32-k{k}-", args, device, 1)[2]
                spec_row["fp32_equal_streams"] = sum(fp32_plain[i] == fp32_spec[i] for i in flagged)
            reqs = [
                Request(f"timed-{i}", p, SamplingParams(max_tokens=args.new_tokens))
                for i, p in enumerate(prompts)
            ]
            spec_row["ms_per_step"] = speculative_step_ms(eng, reqs)
            row["speculative"][k] = spec_row
            clock.log(f"engine {n} streams, k={k}: decode {plain['decode_tokens_per_s']:.1f} → "
                      f"{spec_row['decode_tokens_per_s']:.1f} tok/s ({spec_row['speedup']:.2f}x), "
                      f"{spec_row['tokens_per_step']:.2f} tokens/step, {spec_row['ms_per_step']:.2f} ms/step, "
                      f"{same_text(spec_row, n)}")  # fmt: skip
        out[n] = row
    return out


def engine_round(model, draft, k, prompts, name, args, device, rounds: int | None = None):
    """An engine for ``prompts`` (with ``draft`` at ``k``, or none): ``(engine, row, outputs)``, the row's
    ``tokens_per_s`` over the whole round (prefills included) and ``decode_tokens_per_s`` over the steps
    after every stream has its first token (``decode_steps`` of them: their wall time over this count is
    the engine's ms per step, host work included), each the best of ``--repeats`` rounds after a warm-up round
    (which captures the graphs); ``rounds``: that many rounds in all instead (for the outputs only)."""
    from openk3.serve import CacheConfig, EngineConfig, LLMEngine, Request, SamplingParams, SchedulerConfig

    n = len(prompts)
    config = EngineConfig(
        CacheConfig(block_size=16, pool_mib=256 if device.type == "cpu" else 8192),
        SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=max(2048, n * args.prompt_len)),
    )
    eng = LLMEngine(model, config, draft=draft, num_speculative_tokens=k)
    best, best_decode, decode_steps = math.inf, math.inf, 0
    for r in range(args.repeats + 1 if rounds is None else rounds):
        reqs = [
            Request(f"{name}{r}-{i}", p, SamplingParams(max_tokens=args.new_tokens))
            for i, p in enumerate(prompts)
        ]
        for q in reqs:
            eng.add_request(q)
        sync()
        t0 = time.perf_counter()
        first, steps = None, 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += first is not None
            if first is None and all(q.output_token_ids for q in reqs):
                sync()
                first = time.perf_counter()
        sync()
        if r or rounds is not None:
            best = min(best, time.perf_counter() - t0)
            if time.perf_counter() - first < best_decode:
                best_decode, decode_steps = time.perf_counter() - first, steps
    row = {
        "tokens_per_s": n * args.new_tokens / best,
        "decode_tokens_per_s": n * (args.new_tokens - 1) / max(best_decode, 1e-9),
        "seconds": best,
        "decode_steps": decode_steps,
    }
    return eng, row, [list(q.output_token_ids) for q in reqs]


def speculative_step_ms(eng, requests) -> float:
    """One more (untimed) round of the speculative engine with a device sync around each speculative step
    (a graph replay for greedy requests on CUDA): the mean ms per step."""
    spec = eng.runner.speculative
    total, calls = [0.0], [0]

    def synced(fn):
        def run(*a, **kw):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                sync()
                total[0] += time.perf_counter() - t0
                calls[0] += 1

        return run

    spec._verify, spec._verify_static = synced(spec._verify), synced(spec._verify_static)
    eng.generate(requests)
    return 1e3 * total[0] / max(calls[0], 1)


def single_sequence(
    model, master, drafts, exact, val, args, device, clock: Clock, skipped: list[str]
) -> dict:
    """Per k: plain and speculative decoding of the prompts in ``model``'s dtype, best of ``--repeats``, plain
    and the drafts alternating. Returns ``{loss: {k: row}}``.

    Greedy outputs are compared with plain decoding's in fp32: ``master`` (the fp32 target) with ``exact``
    (the fp32 drafts), once per k, untimed. A lossless decoder gives plain decoding's tokens there, so any
    difference is a bug. In bf16 it would not be a test: the verification runs ``k + 1`` tokens through
    kernels that round unlike one-token decoding, and a near-tie of the greedy choice may flip either way
    (on an fp32 run the timed outputs are compared themselves)."""
    prompts = val_prompts(val, args.prompts, args.prompt_len)
    sample = dict(temperature=args.temperature, seed=args.seed)
    greedy = args.temperature == 0

    def plain(m):
        return [generate(m, torch.tensor([p], device=device), args.new_tokens, **sample) for p in prompts]

    def spec(m, draft, k, stats):
        return [
            speculative_generate(
                m,
                draft,
                torch.tensor([p], device=device),
                args.new_tokens,
                num_speculative_tokens=k,
                stats=stats,
                **sample,
            )  # fmt: skip
            for p in prompts
        ]

    clock.log("single sequence: warm-up")
    reference, _ = timed(plain, model)  # warm-up
    for draft in drafts.values():
        spec(model, draft, args.ks[0], SpeculativeStats())
    if greedy and master is not model:
        reference = plain(master)
    out = {loss: {} for loss in drafts}
    last = 0.0
    for k in args.ks:
        if last and clock.left() < last:  # the first k always runs
            skipped.append(f"single sequence at k = {k}: the budget was spent")
            continue
        clock.log(f"single sequence: k = {k}")
        t0 = time.perf_counter()
        best_plain, rows = math.inf, {loss: {"spec_s": math.inf} for loss in drafts}
        outputs = {}
        for _ in range(args.repeats):
            best_plain = min(best_plain, timed(plain, model)[1])
            for loss, draft in drafts.items():
                stats = SpeculativeStats()
                outputs[loss], seconds = timed(spec, model, draft, k, stats)
                row = rows[loss]
                row["spec_s"] = min(row["spec_s"], seconds)
                row["tokens_per_forward"], row["acceptance_rate"] = (
                    stats.acceptance_length,
                    stats.acceptance_rate,
                )
        for loss, row in rows.items():
            row["identical_prompts"] = None
            if greedy:
                got = outputs[loss] if master is model else spec(master, exact[loss], k, SpeculativeStats())
                row["identical_prompts"] = sum(torch.equal(a, b) for a, b in zip(got, reference))
            row.update(plain_s=best_plain, speedup=best_plain / row["spec_s"])
            out[loss][k] = row
            same = row["identical_prompts"]
            clock.log(f"{loss} k={k}: {row['tokens_per_forward']:.2f} tokens/forward, speed-up {row['speedup']:.2f}x"
                      f"{'' if same is None else differ(same, args.prompts)}")  # fmt: skip
        last = time.perf_counter() - t0
    return out


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        import triton

        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, triton=triton.__version__)
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def write(result: dict, args, device: torch.device, clock: Clock, final: bool = False) -> str:
    """Render the report of what ``result`` holds so far and, with ``--out``, write it (and the JSON) there:
    called after every phase, so a run stopped at its time limit leaves its results up to the last phase
    (``"complete": false`` in the JSON, a line at the top of the report)."""
    result["wall_seconds"], result["complete"] = clock.elapsed(), final
    report = render(result, args)
    if args.out:
        out = Path(args.out)
        name = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device).split()[-1].lower()
        if out.suffix != ".md":
            out.mkdir(parents=True, exist_ok=True)
            (out / f"speculative_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
            out = out / f"speculative_{name}.md"
        out.write_text(report)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clock = Clock(args.budget_s)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    result = {
        "command": "python benchmarks/speculative.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": environment(device), "dtype": str(dtype), "args": vars(args), "drafts": {},
        "skipped": [],
    }  # fmt: skip
    clock.log(f"start: {result['environment']}")
    if args.train_target:
        run, result["target_training"] = train_target(args, clock)
    else:
        run = Path(args.target)
    folder = latest_checkpoint(run)
    run = folder.parent.parent
    result["target"] = str(folder)
    # the drafts train (and α is measured) against the fp32 target, their forwards under autocast to
    # ``dtype`` as `openk3 train` runs on CUDA; decoding runs ``dtype`` copies of the target and the drafts
    master = from_pretrained(folder, device=device, dtype=torch.float32).eval()
    model = master if dtype == torch.float32 else copy.deepcopy(master).to(dtype)
    amp_dtype = None if dtype == torch.float32 else dtype
    lm = getattr(master, "language_model", master)
    train_set, val = TokenDataset(run / "data" / "train.bin"), TokenDataset(run / "data" / "val.bin")
    val_loss, tokens = validation_loss(
        master, val, args.batch_size, args.seq_len, args.eval_batches, device, amp_dtype
    )
    result["target_val"] = {
        "loss": val_loss, "tokens": tokens, "unigram_entropy": unigram_entropy(val.tokens_N)
    }  # fmt: skip
    clock.log(f"target val loss {val_loss:.3f}")
    write(result, args, device, clock)

    exact = trained_drafts(args, model, master, lm, train_set, val, device, clock, amp_dtype, result)
    drafts = {loss: d if dtype == torch.float32 else copy.deepcopy(d).to(dtype) for loss, d in exact.items()}
    write(result, args, device, clock)
    if args.train_only:
        clock.log(
            f"done: the drafts are in {args.drafts}; measure them with --target {run} --drafts {args.drafts}"
        )
        print(write(result, args, device, clock, final=True))
        return 0

    with torch.no_grad():
        if args.streams:
            result["engine"] = engine_throughput(
                model, master, drafts["lk"], exact["lk"], val, args, device, clock
            )
            write(result, args, device, clock)
        result["single_sequence"] = single_sequence(
            model, master, drafts, exact, val, args, device, clock, result["skipped"]
        )
    clock.log("done")
    print(write(result, args, device, clock, final=True))
    return 0


def differ(identical: int, total: int, rounding: int = 0) -> str:
    """``""`` when every one of ``total`` greedy outputs equals plain decoding's or parts from it by bf16
    rounding (``rounding``: near-ties of :func:`divergence` and streams whose fp32 runs agree), else a loud
    note for a speed-up cell."""
    bad = total - identical - rounding
    return "" if bad == 0 else f" **OUTPUTS DIFFER ({bad}/{total})**"


def step_ms(row: dict, streams: int, args) -> float:
    """Wall ms per engine step of a row's decode window (its tokens over its tok/s, over its steps)."""
    return 1e3 * streams * (args.new_tokens - 1) / row["decode_tokens_per_s"] / max(row["decode_steps"], 1)


def same_text(row: dict, total: int) -> str:
    """The engine table's identity cell: ``identical/total``, plus the bf16 near-ties and the streams that
    differ in bf16 only (their fp32 runs agree)."""
    ties, fp32 = row.get("rounding_streams", 0), row.get("fp32_equal_streams", 0)
    notes = [f"+{ties} bf16 near-tie{'s' * (ties > 1)}"] * bool(ties) + [f"+{fp32} equal in fp32"] * bool(
        fp32
    )
    return f"{row['identical_streams']}/{total}" + (f" ({', '.join(notes)})" if notes else "")


def differing_rows_warning(bad: list[str], what: str) -> list[str]:
    """Lines after a table with speed-ups whose greedy outputs are not plain decoding's (none if all are)."""
    if not bad:
        return []
    return [
        "",
        f"**WARNING: the outputs differ from plain greedy decoding** in {what} {', '.join(bad)}: a lossless "
        "speculative decoder gives the same tokens (up to near-ties its dtype may flip, which are counted "
        "apart), so these rows' speed-ups are not of one and must not be quoted.",
    ]


def render(result: dict, args) -> str:
    env = result["environment"]
    where = (
        f"{env['gpu']}, CUDA {env['cuda']}, triton {env['triton']}"
        if "gpu" in env
        else f"{env['cpu']}, {env['threads']} threads"
    )
    lines = [
        "# Speculative decoding: LK- vs KL-trained drafts",
        "",
    ]
    if not result.get("complete", True):
        lines += ["**Partial: the run has not finished** (the report of what it had measured so far).", ""]
    lines += [
        f"Command: `{result['command']}`",
        "",
        f"Machine: {where}; torch {env['torch']}, Python {env['python']}; {result['dtype']}"
        + (
            ""
            if result["dtype"] == "torch.float32"
            else " decoding; the drafts trained and α measured against the fp32 target, the forwards under "
            "autocast to it"
        )
        + ". "
        f"Wall time of the whole run: {result['wall_seconds']:.0f} s.",
        "",
    ]
    if "target_val" not in result:
        return "\n".join(lines) + "\n"
    v = result["target_val"]
    val = (
        f"val loss {v['loss']:.3f} nats/token on {v['tokens']:,} tokens (unigram entropy of the val split "
        f"{v['unigram_entropy']:.3f})"
    )
    if "target_training" in result:
        t = result["target_training"]
        lines += [
            f"Target: `{t['preset']}` trained here for {t['steps']} steps of {args.target_batch_size} × "
            f"{args.target_seq_len} tokens ({t['tokens']:,} tokens"
            + (
                f", {t['epochs']:.2f} passes over its {t['train_tokens']:,} train tokens"
                if "epochs" in t
                else ""
            )
            + f", {t['seconds_per_step']:.3f} s/step, uncompiled; {t['seconds']:.0f} s with data preparation), "
            f"{val}.",
            "",
        ]
        if t.get("train_loss"):
            tl = t["train_loss"]
            lines += [
                "Target train loss (mean per stretch of steps, up to the step shown): "
                + ", ".join(f"{v:.2f} (step {s})" for s, v in tl["curve"])
                + f"; lowest step {tl['min']:.2f}, last {tl['last']:.2f}.",
                "",
            ]
    else:
        lines += [f"Target: `{result['target']}`, {val}.", ""]
    if result["drafts"] and "draft_training" in result:
        t = result["draft_training"]
        lines += [
            f"Drafts: {t['steps']} steps each ({t['seconds_per_step']:.3f} s/step) on the same batches of "
            f"{t['batch_size']} {t['data']}, unroll {t['ttt_steps']}, lr {t['lr']}"
            + (
                f"; trained by an earlier run and loaded from `{t['loaded_from']}`"
                if "loaded_from" in t
                else ""
            )
            + ".",
            "",
            "Acceptance rate α by draft depth on held-out windows (`openk3 eval --draft`'s numbers, temperature 1):",
            "",
            "| loss | depth 1 | 2 | 3 | 4 | 5 | expected tokens/forward at k = 3 | final train loss | train s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for loss, d in result["drafts"].items():
            lines.append(
                f"| {loss} | " + " | ".join(f"{x:.3f}" for x in d["alpha_by_depth"])
                + f" | {d['expected_tokens_per_forward'][3]:.2f} | {d.get('final_loss', math.nan):.3f} | "
                f"{d['train_seconds']:.0f} |"
            )  # fmt: skip
    if result.get("engine"):
        lines += [
            "",
            f"Serving engine, greedy, {args.prompt_len}-token prompts, {args.new_tokens} new tokens per stream, "
            "each engine on its default path (on a GPU: plain decode steps and speculative steps replayed from "
            "CUDA graphs); speculative = the LK draft. Decode tok/s counts the tokens after each stream's first "
            "over the steps after the last stream got it (the speed-up compares these); all tok/s includes the "
            "prefills; tokens per step = tokens emitted per speculative step of a stream; ms per step from an "
            "extra round with a device sync around each speculative step; engine steps: the decode window's "
            "engine steps and its wall time per step (the step plus the host's scheduling and bookkeeping). "
            "Identical streams: outputs equal to "
            "the plain engine's; a stream that parts from it where the fp32 target's two candidates lie within "
            "twice the bf16 logits' error is a near-tie that rounding flips, counted apart, and so is one whose "
            "outputs agree when both engines run again in fp32 (any other difference "
            "flags the row):",
            "",
            "| streams | k | plain decode tok/s | speculative decode tok/s | speed-up | plain / speculative all tok/s "
            "| drafts accepted | tokens per step | ms per speculative step | plain ms per step "
            "| engine steps plain / speculative (ms each) | identical streams |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        bad = []
        for n, row in result["engine"].items():
            p = row["plain"]
            plain_ms = 1e3 * int(n) / p["decode_tokens_per_s"]
            for k, s in row["speculative"].items():
                note = differ(
                    s["identical_streams"],
                    int(n),
                    s.get("rounding_streams", 0) + s.get("fp32_equal_streams", 0),
                )
                bad += [f"{n} streams k = {k}"] if note else []
                lines.append(
                    f"| {n} | {k} | {p['decode_tokens_per_s']:.1f} | {s['decode_tokens_per_s']:.1f} | "
                    f"{s['speedup']:.2f}×{note} | {p['tokens_per_s']:.1f} / {s['tokens_per_s']:.1f} | "
                    f"{s['acceptance_rate']:.2f} | {s['tokens_per_step']:.2f} | {s['ms_per_step']:.1f} | "
                    f"{plain_ms:.1f} | {p['decode_steps']} / {s['decode_steps']} "
                    f"({step_ms(p, int(n), args):.1f} / {step_ms(s, int(n), args):.1f}) | "
                    f"{same_text(s, int(n))} |"
                )
        lines += differing_rows_warning(bad, "rows")
    single = result.get("single_sequence", {})
    if single.get("lk"):
        lines += [
            "",
            f"Single sequence: {args.prompts} prompts × {args.new_tokens} new tokens, temperature "
            f"{args.temperature}, `generate` against `speculative_generate` (both eager, {result['dtype']}): "
            "tokens per target forward (measured) and speed-up; identical to plain: the greedy outputs of both "
            "loops run again in fp32 (fp32 target and drafts), where a lossless decoder gives plain decoding's "
            "tokens exactly:",
            "",
            "| k | LK tokens/forward | LK speed-up | KL tokens/forward | KL speed-up | identical to plain (LK, KL) |",
            "|---|---|---|---|---|---|",
        ]
        bad = []
        for k in single["lk"]:
            lk, kl = single["lk"][k], single["kl"][k]
            sampled = lk["identical_prompts"] is None
            same = (
                "n/a (sampled)"
                if sampled
                else f"{lk['identical_prompts']}/{args.prompts}, {kl['identical_prompts']}/{args.prompts}"
            )
            notes = ["" if sampled else differ(r["identical_prompts"], args.prompts) for r in (lk, kl)]
            bad += [f"{loss.upper()} k = {k}" for loss, note in zip(("lk", "kl"), notes) if note]
            lines.append(
                f"| {k} | {lk['tokens_per_forward']:.2f} | {lk['speedup']:.2f}×{notes[0]} | "
                f"{kl['tokens_per_forward']:.2f} | {kl['speedup']:.2f}×{notes[1]} | {same} |"
            )
        lines += differing_rows_warning(bad, "rows")
    if result["skipped"]:
        lines += ["", "Skipped:", ""] + [f"- {s}" for s in result["skipped"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
