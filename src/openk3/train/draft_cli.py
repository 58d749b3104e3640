"""``openk3 train-draft``: fit a speculative draft to a trained target (``docs/speculative.md``), and the
acceptance report that ``openk3 eval --draft`` prints.

Data: ``corpus`` reads random windows of the target run's ``data/train.bin``; ``generations`` first samples
``--gen-windows`` continuations from the target itself (temperature 1, prompts of 16 corpus tokens) and
trains on those, so the draft learns the distribution it will be verified against.

Ctrl-C or SIGTERM stops after the current step, saves the draft and :data:`RESUME_STATE` beside it, and prints
the command that continues (the same options plus ``--resume``); a second Ctrl-C aborts at once. While the
target is being sampled (``--data generations``, before the first step) Ctrl-C stops at once: nothing has been
written yet, and the line says so. The draft folder is written whole or not at all
(:func:`~openk3.checkpoint.out_folder.folder_written_whole`), and a fresh run refuses an ``--out`` that holds
anything (:func:`~openk3.checkpoint.out_folder.check_new_folder`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

from openk3 import cli_types

DEFAULT_DRAFT_STEPS = 200
GEN_PROMPT_TOKENS = 16
RESUME_STATE = "train_state.pt"
"""Written into the draft folder when a run stops early (Ctrl-C, SIGTERM): step, AdamW state, settings and
the generated windows, for ``--resume``; removed when the run finishes. It also records the target the draft
trains against (:func:`target_identity`), and a resume against another target is refused."""
SETTINGS = ("loss", "data", "steps", "batch_size", "seq_len", "ttt_steps", "lr", "gen_windows", "seed")
"""The options a resume must repeat (``--steps`` may grow)."""


def add_draft_parser(sub) -> None:
    p = sub.add_parser(
        "train-draft", help="train a speculative draft (EAGLE-3 head, LK or KL loss) for a run"
    )
    p.add_argument("--target", required=True, help="run or checkpoint folder of the target model")
    p.add_argument("--out", help="new draft folder to write (default: RUN/draft-LOSS)")
    p.add_argument(
        "--loss", choices=["lk", "kl"], default="lk", help="lk: -log sum min(p, q); kl: KL(p || q)"
    )
    p.add_argument(
        "--data", choices=["corpus", "generations"], default="corpus",
        help="train on the run's corpus split, or on the target's own samples",
    )  # fmt: skip
    p.add_argument(
        "--steps", type=cli_types.positive_int, default=DEFAULT_DRAFT_STEPS, help="optimizer steps"
    )
    p.add_argument(
        "--batch-size", dest="batch_size", type=cli_types.positive_int, default=8, help="windows per step"
    )
    p.add_argument(
        "--seq-len", dest="seq_len", type=cli_types.positive_int, default=128, help="tokens per window"
    )
    p.add_argument(
        "--ttt-steps",
        dest="ttt_steps",
        type=cli_types.positive_int,
        default=3,
        help="training-time-test unroll",
    )
    p.add_argument("--lr", type=cli_types.positive_float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument(
        "--gen-windows", dest="gen_windows", type=cli_types.positive_int, default=64,
        help="target samples drawn up front with --data generations",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="draft init and batch order")
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the target and the draft run"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue the draft in --out that Ctrl-C stopped (same options)"
    )
    p.set_defaults(func=cmd_train_draft)


def _run_split(folder: Path, name: str) -> Path:
    from openk3.checkpoint.io import run_folder

    run = run_folder(folder)
    path = (folder.parent.parent if run is None else run) / "data" / f"{name}.bin"
    if run is not None and path.is_file():
        return path
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("vision_config"):
        raise ValueError(
            f"{folder} is a vision model from an image-text run, which has no text split {path}: train-draft "
            "trains on a text run's corpus (`openk3 train --data TEXT`), and speculative decoding drafts text only"
        )
    raise FileNotFoundError(
        f"checkpoint {folder} has no run split {path}: pass the folder of an `openk3 train` run"
    )


def target_identity(target: str, folder: Path, lm) -> dict:
    """What identifies the target a draft trains against, recorded in :data:`RESUME_STATE`: ``--target`` as
    given, the checkpoint folder it resolved to, and a fingerprint of the weights (the fp64 sum of the token
    embeddings, summed on the CPU). The fingerprint, not the path, decides whether a resume reads the same
    target: a run moved elsewhere is the same target, a run trained further (its latest checkpoint now another)
    or another run at the same path is not."""
    import torch

    weight = lm.model.embed_tokens.weight.detach()
    embed_sum = weight.to(device="cpu", dtype=torch.float64).sum().item()
    return {"target": str(target), "checkpoint": str(folder), "embed_sum": embed_sum}


def check_same_target(state: dict, identity: dict, out: Path) -> None:
    """Raise ``ValueError`` when the interrupted run saved in ``state`` trained against another target than
    ``identity`` (:func:`target_identity`): its draft and AdamW moments fit that target's features, so going on
    would train a mix of two. States written before the target was recorded are not checked. The fingerprints
    are compared to 1e-9 relative, against a summation order that may differ between machines."""
    saved = state.get("target")
    if saved is None or math.isclose(saved["embed_sum"], identity["embed_sum"], rel_tol=1e-9, abs_tol=1e-12):
        return
    raise ValueError(
        f"--resume: {out} was trained against --target {saved['target']} (checkpoint {saved['checkpoint']}), "
        f"but --target {identity['target']} loads {identity['checkpoint']}, whose weights differ: resume with "
        f"--target {saved['target']}, or train a new draft with another --out"
    )


def generated_windows(lm, dataset, n: int, seq_len: int, seed: int, device: str, per_call: int = 32):
    """``n`` windows ``[n, seq_len]``: 16 corpus tokens, then the target's own continuation at temperature 1,
    sampled ``per_call`` windows at a time."""
    import torch

    from openk3.generate import generate

    g = torch.Generator().manual_seed(seed)
    prompts, _ = dataset.get_batch(n, GEN_PROMPT_TOKENS, g)
    prompts = prompts.to(device)
    rows = []
    for chunk in prompts.split(per_call):
        rows.append(
            torch.cat(
                [chunk, generate(lm, chunk, seq_len - GEN_PROMPT_TOKENS, temperature=1.0, seed=seed)], 1
            )
        )
    return torch.cat(rows)


def pool_batches(pool, batch_size: int, seed: int, step: int):
    """Endless batches of ``batch_size`` rows of ``pool``; batch ``s`` depends only on ``(seed, s)``, so a
    resume at ``step`` draws what the uninterrupted run would have."""
    import torch

    while True:
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**63)
        yield pool[torch.randint(0, pool.shape[0], (batch_size,), generator=g)]
        step += 1


class _StopRequest:
    """SIGINT / SIGTERM handler of ``train-draft``: the first asks the loop to stop after its step (the draft
    is then saved with its optimizer state), the second raises ``KeyboardInterrupt`` at once. Inside
    :meth:`aborting` the first raises ``KeyboardInterrupt`` at once, with the block's text."""

    def __init__(self) -> None:
        self.requested = False
        self.abort_text: str | None = None
        """Set inside :meth:`aborting`: what the interrupted work leaves behind, for the one-line report."""

    def __call__(self, signum, frame) -> None:
        import signal

        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.abort_text is not None:
            raise KeyboardInterrupt(f"{what}: {self.abort_text}")
        if self.requested:
            raise KeyboardInterrupt("train-draft aborted by a second Ctrl-C; nothing of this step was saved")
        self.requested = True
        print(f"{what}: finishing this step and saving the draft (Ctrl-C again to abort)", flush=True)

    @contextlib.contextmanager
    def aborting(self, text: str):
        """Within the block a signal stops the work at once (``KeyboardInterrupt("Ctrl-C: " + text)``): for
        work that keeps nothing worth saving, such as sampling the target before the first step."""
        self.abort_text = text
        try:
            yield
        finally:
            self.abort_text = None

    @contextlib.contextmanager
    def installed(self):
        import signal

        previous = {sig: signal.signal(sig, self) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _resume_line(args: argparse.Namespace, out: Path) -> str:
    flags = [f"--target {args.target}", f"--out {out}"]
    for name in SETTINGS:
        flags.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    return "openk3 train-draft " + " ".join(flags) + f" --device {args.device} --resume"


def cmd_train_draft(args: argparse.Namespace) -> int:
    from openk3.train.console import pipe_safe_output

    with pipe_safe_output():  # a closed pipe must not stop the save or the resume line
        return _train_draft(args)


def _train_draft(args: argparse.Namespace) -> int:
    import torch

    from openk3.checkpoint import from_pretrained
    from openk3.checkpoint.out_folder import folder_written_whole
    from openk3.data import TokenDataset
    from openk3.data.shards import RandomBatches
    from openk3.devices import check_device
    from openk3.model.draft import DraftConfig, build_draft, feature_layers, load_draft, save_draft
    from openk3.train.draft_trainer import train_draft
    from openk3.train.state import latest_checkpoint

    check_device(args.device)
    if args.seq_len < GEN_PROMPT_TOKENS + args.ttt_steps + 2:
        raise ValueError(
            f"--seq-len must be at least {GEN_PROMPT_TOKENS + args.ttt_steps + 2}, got {args.seq_len}"
        )
    folder = latest_checkpoint(args.target)
    split = _run_split(folder, "train")  # RUN/data/train.bin
    dataset = TokenDataset(split)
    out = Path(args.out) if args.out else split.parents[1] / f"draft-{args.loss}"
    state = _load_resume_state(out, args) if args.resume else _check_out_free(out, args)
    model = from_pretrained(folder, device=args.device).eval()
    lm = getattr(model, "language_model", model)
    cfg = lm.config
    identity = target_identity(args.target, folder, lm)
    if state is not None:
        check_same_target(state, identity, out)
        draft = load_draft(out, model)
        print(f"resuming {out} at step {state['step']}/{args.steps}")
    else:
        dc = DraftConfig(
            feature_layers(cfg.num_hidden_layers), cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers,
            loss=args.loss, ttt_steps=args.ttt_steps,
        )  # fmt: skip
        dtype = lm.model.embed_tokens.weight.dtype
        draft = build_draft(cfg, dc, device=args.device, dtype=dtype, seed=args.seed)
    dc = draft.draft_config
    start = 0 if state is None else state["step"]
    stop = _StopRequest()
    with stop.installed():  # from here on, Ctrl-C saves the draft
        print(f"target {folder}: {cfg.num_hidden_layers} layers, width {cfg.hidden_size}; draft taps layers "
              f"{list(dc.feature_layers)}, {sum(p.numel() for p in draft.parameters()):,} parameters",
              flush=True)  # fmt: skip
        pool = None
        if args.data == "corpus":
            source = RandomBatches(dataset, args.batch_size, args.seq_len, args.seed)
            source.step = start
            batches = (x.to(args.device) for x, _ in source)
        else:
            if state is not None:
                pool = state["pool"].to(args.device)
            else:
                t0 = time.perf_counter()
                print(f"sampling {args.gen_windows} target windows of {args.seq_len} tokens", flush=True)
                with stop.aborting(f"stopped while sampling the target; nothing was written ({out} was not "
                                   "created): run the same command again to start over"):  # fmt: skip
                    pool = generated_windows(
                        lm, dataset, args.gen_windows, args.seq_len, args.seed, args.device
                    )
                print(f"sampled {pool.shape[0]} target windows of {args.seq_len} tokens in "
                      f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
            batches = pool_batches(pool, args.batch_size, args.seed, start)
        # on CUDA the forwards under bf16 autocast with fp32 weights and AdamW state, as `openk3 train` runs there
        result = train_draft(
            draft, lm, batches, args.steps, lr=args.lr, log_every=max(1, args.steps // 10),
            start_step=start, optimizer_state=None if state is None else state["optimizer"],
            stop=lambda: stop.requested, amp_dtype=torch.bfloat16 if args.device == "cuda" else None,
        )  # fmt: skip
        with folder_written_whole(out) as tmp:  # the draft and its resume state appear together, or neither
            save_draft(draft, tmp)
            if result.step < args.steps:
                settings = {name: getattr(args, name) for name in SETTINGS}
                saved = {"step": result.step, "optimizer": result.optimizer_state, "settings": settings,
                         "target": identity}  # fmt: skip
                if pool is not None:
                    saved["pool"] = pool.cpu()
                torch.save(saved, tmp / RESUME_STATE)
        if result.step < args.steps:
            print(f"stopped at step {result.step}/{args.steps}; draft saved to {out}; continue with: "
                  f"{_resume_line(args, out)}")  # fmt: skip
            return 130
    print(f"trained {args.steps} steps in {result.seconds:.0f} s; draft saved to {out}")
    print(f"acceptance: openk3 eval --ckpt {args.target} --draft {out}")
    return 0


def _check_out_free(out: Path, args: argparse.Namespace) -> None:
    """Raise ``ValueError`` when ``out`` already holds a draft (stopped or finished) and ``--resume`` is not
    given: a fresh run would overwrite it; ``FileExistsError`` when it holds anything else (a checkpoint, a
    run, files: :func:`~openk3.checkpoint.out_folder.check_new_folder`). Returns ``None`` (no resume state)."""
    import torch

    from openk3.checkpoint.out_folder import check_new_folder

    if (out / RESUME_STATE).is_file():
        state = torch.load(out / RESUME_STATE, map_location="cpu", weights_only=True)
        ran = argparse.Namespace(**{**vars(args), **state["settings"]})  # the options it ran with
        if "target" in state:
            ran.target = state["target"]["target"]
        raise ValueError(
            f"--out {out} holds a train-draft stopped at step {state['step']}: continue it with "
            f"`{_resume_line(ran, out)}`, or pick another --out"
        )
    if (out / "model.safetensors").is_file():
        raise ValueError(f"--out {out} already holds a trained draft: pick another --out (or delete {out})")
    check_new_folder(out)


def _load_resume_state(out: Path, args: argparse.Namespace) -> dict:
    """The saved state of an interrupted ``train-draft`` in ``out``; ``ValueError`` when there is none, when a
    setting differs from the interrupted run's, or when it already reached ``--steps`` (the target is compared
    once loaded, :func:`check_same_target`)."""
    import torch

    path = out / RESUME_STATE
    if not path.is_file():
        raise ValueError(f"--resume: {out} holds no interrupted train-draft ({RESUME_STATE} is missing)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    for name, saved in state["settings"].items():
        if name != "steps" and getattr(args, name) != saved:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"--resume: {flag} {getattr(args, name)} differs from the interrupted run's {flag} {saved}"
            )
    if state["step"] >= args.steps:
        raise ValueError(f"--resume: {out} is already at step {state['step']}; pass --steps above it")
    return state


def print_acceptance(
    model, draft_folder: str, dataset, batch_size: int, seq_len: int, max_batches: int | None, device
) -> None:
    """``openk3 eval --draft``: mean acceptance rate per draft depth on the held-out windows, and the
    expected tokens per target forward at k = 1…5."""
    from openk3.model.draft import load_draft
    from openk3.train.draft_trainer import acceptance_by_step, expected_accepted_length

    draft = load_draft(draft_folder, model)
    lm = getattr(model, "language_model", model)
    depth = 5
    seq_len = max(seq_len, depth + 2)
    batches = (x.to(device) for x, _ in dataset.iter_sequential(batch_size, seq_len, max_batches))
    alphas = acceptance_by_step(draft, lm, batches, depth)
    print(f"draft {draft_folder} (trained with the {draft.draft_config.loss} loss), {seq_len}-token windows:")
    print("acceptance rate by draft depth: " + ", ".join(f"{i + 1}: {a:.3f}" for i, a in enumerate(alphas)))
    print("expected tokens per target forward: " + ", ".join(
        f"k={k}: {expected_accepted_length(alphas, k):.2f}" for k in range(1, depth + 1)))  # fmt: skip
