"""The distributed training loop behind ``torchrun --nproc_per_node N -m openk3 train --dp-shard A --ep B --cp C``.

Each rank: the process group from torchrun's environment (gloo on the CPU, NCCL on CUDA, bounded collective
timeout), the meshes, the sharded model (:func:`~openk3.dist.fsdp.build_sharded_model`), the sharded
optimizer and the balancer over the data group. The data are the single-process run's: rank 0 prepares the
shards first, then every rank draws the same global batch (``batch_size × grad_accum`` sequences, where
``batch_size`` is the *global* micro-batch, :class:`~openk3.data.RandomBatches`, one seed) and takes its
slice, so the data position is one integer and resuming on another world size reads the same tokens. Loss, learning rate and gradient norm are the
single-process trainer's (:mod:`openk3.train.schedule`); gradients are clipped with one total norm over
every mesh (dense and expert parameters together). Checkpoints are DCP folders
(:mod:`openk3.dist.checkpoint`) under ``<out>/checkpoints/``; ``--resume`` takes the newest finished one.
Rank 0 writes the run's ``train_config.json`` (as the single-process trainer does; ``openk3 eval`` reads
its windows from it), prints ``resuming RUN at step N from CHECKPOINT`` on a resume, then one line per step,
and writes ``metrics.jsonl`` (and ``loss.png`` at the end). Evaluation is the
single-process trainer's (:func:`evaluate_distributed`): ``val_loss_subset`` every ``eval_every`` steps, and
after the last step ``val_loss`` on the row of that step and in the summary;
the final weights are exported as a Hugging Face folder ``<out>/final`` (with the run's tokenizer: what
``openk3 generate``/``eval``/``serve`` read), from which ``openk3 train`` prints the end-of-run sample on rank 0.

With ``--cp C`` each group of ``C`` consecutive ranks shares its data rank's sequences: a micro-batch's rows
are packed into one row (a document each) and split over the group by the layout
(:mod:`openk3.dist.context_parallel`), so a context length of the progressive schedule may be ``C`` times what
one rank holds. The loss on a rank is the mean over its tokens (all ranks hold as many), and FSDP averages
the gradients over ``dp_shard·cp``, so the step is the single-process one.

The loop's setup (:func:`build_training`) and step (:func:`train_step`) are functions of their own, so
``benchmarks/dist_scaling.py`` times exactly the step this loop takes.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from openk3.config import text_config_of
from openk3.data import RandomBatches, TokenDataset, prepare_data
from openk3.dist.balance import data_process_group
from openk3.dist.checkpoint import export_hf, finished_checkpoints, load_checkpoint, save_checkpoint
from openk3.dist.context_parallel import ContextParallel, apply_context_parallel
from openk3.dist.cp_plan import LAYOUTS
from openk3.dist.fsdp import build_sharded_model
from openk3.dist.launch import stop_with_launcher
from openk3.dist.lost_peer import exit_lost_peer, lost_peer_line, lost_peer_reason
from openk3.dist.mesh import ParallelDims, build_meshes
from openk3.dist.muon import build_sharded_optimizer
from openk3.dist.rank_zero import on_rank_zero
from openk3.presets import get_preset
from openk3.quant.qat import enable_qat
from openk3.train.balance import QuantileBalancer
from openk3.train.metrics import MetricsLog, plot_metrics
from openk3.train.run_lock import RunLock, acquire_run_lock
from openk3.train.schedule import lr_factor, seq_len_at
from openk3.train.state import refuse_existing_run
from openk3.train.trainer import validation_loss, write_train_config

COLLECTIVE_TIMEOUT_S = 300
"""A collective that waits longer (a rank died or hangs) fails on every other rank with an error."""


def init_from_env(device: str) -> None:
    """Initialise the default process group from torchrun's variables (a world of one without them)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def clip_grad_norm_(params, max_norm: float) -> float:
    """Clip every gradient with one total L2 norm over all meshes (dense and expert DTensors, plain tensors).

    Each mesh's parameters give a partial norm (a DTensor reduced with ``full_tensor``); the total is
    ``sqrt(Σ partial²)``. Returns the norm before clipping (one host sync).
    """
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p.grad)
    squares = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = float(torch.stack(squares).sum().sqrt()) if squares else 0.0
    if total > max_norm and math.isfinite(total):
        scale = max_norm / (total + 1e-6)
        for grads in by_mesh.values():
            torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], scale)
    return total


def evaluate_distributed(
    model,
    val_set: TokenDataset,
    config,
    device,
    max_batches: int | None,
    context: ContextParallel | None = None,
) -> dict:
    """``val_loss`` (nats/token), ``val_ppl``, ``val_tokens`` of the sharded ``model`` on the windows the
    single-process trainer evaluates (the schedule's longest context, ``batch_size`` rows per batch, the
    first ``max_batches`` batches; ``None``: all). Every rank evaluates every window (the FSDP and EP
    forwards are collectives all ranks run), so all ranks return the same numbers. In eval mode, so the
    MoE blocks do not count the routing (Quantile Balancing never sees evaluation).

    Under context parallelism (``context``) a batch's rows are packed into one row (a document each) and split
    over the CP group as in training, and the summed losses and token counts are all-reduced over the group;
    the window is rounded down to a length the layout can split."""
    seq_len = min(max(t for _, t in config.context_schedule), val_set.num_tokens - 1)
    amp = torch.bfloat16 if device.type == "cuda" else None
    model.eval()
    try:
        if context is None:
            loss, tokens = validation_loss(
                model, val_set, config.batch_size, seq_len, max_batches, device, amp
            )
        else:
            loss, tokens = _validation_loss_cp(
                model, val_set, config, seq_len, max_batches, device, amp, context
            )
    finally:
        model.train()
    return {"val_loss": loss, "val_ppl": math.exp(loss), "val_tokens": tokens}


def _validation_loss_cp(
    model, val_set, config, seq_len, max_batches, device, amp, context
) -> tuple[float, int]:
    """:func:`~openk3.train.trainer.validation_loss` with every window split over the CP group."""
    parts = dist.get_world_size(context.group) * (2 if context.layout == "zigzag" else 1)
    seq_len -= seq_len % parts
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, target tokens]
    with torch.no_grad():
        for x_BT, y_BT in val_set.iter_sequential(config.batch_size, seq_len, max_batches):
            b, T = x_BT.shape
            plan = context.begin(list(range(0, b * T + 1, T)))
            x_mine, y_mine = plan.shard(x_BT.reshape(1, b * T)), plan.shard(y_BT.reshape(1, b * T))
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                logits = model(x_mine.to(device)).logits
            sums[0] += F.cross_entropy(
                logits.float().flatten(0, 1), y_mine.to(device).flatten(), reduction="sum"
            )
            sums[1] += y_mine.numel()
    dist.all_reduce(sums, group=context.group)
    if sums[1] == 0:
        raise ValueError(
            f"no validation windows were evaluated (max_batches={max_batches}, seq_len={seq_len})"
        )
    return (sums[0] / sums[1]).item(), int(sums[1].item())


def latest_distributed_checkpoint(run_dir: Path) -> Path | None:
    """The newest finished DCP checkpoint under ``run_dir/checkpoints`` (not a ``.tmp`` folder), or ``None``."""
    folders = finished_checkpoints(run_dir / "checkpoints")
    return folders[-1] if folders else None


def check_context_lengths(context_schedule, cp: int, layout: str) -> None:
    """Raise ``ValueError`` (before any process group) when a context length of the schedule cannot be split
    by ``layout`` over ``cp`` ranks (a multiple of ``cp``, of ``2·cp`` for zig-zag)."""
    if layout not in LAYOUTS:
        raise ValueError(f"--cp-layout {layout!r} is not one of {LAYOUTS}")
    parts = cp if layout == "contiguous" else 2 * cp
    bad = [t for _, t in context_schedule if t % parts]
    if cp > 1 and bad:
        raise ValueError(
            f"--cp {cp} with the {layout} layout needs every context length to be a multiple of {parts}; "
            f"the schedule has {bad}"
        )


class StopRequest:
    """SIGINT/SIGTERM handlers for one rank while it trains: the first signal sets a flag (finish the step,
    save, stop); a SIGINT after it (a second Ctrl-C) raises ``KeyboardInterrupt`` (stop at once). A repeated
    SIGTERM is the same request again, never an abort, since one request can reach a rank as several: a
    launcher killed with ``kill -9`` sends each rank one or more (the parent-death signal comes at each
    hand-over between the dying launcher's threads, :func:`~openk3.dist.launch.stop_with_launcher`), and a
    service manager's stop signals every process of the job besides the agent's forward. Handlers are
    installed only in the main thread (``signal.signal`` allows no other) and restored by :meth:`restore`.

    The ranks agree on whether any of them got a signal without a collective or a host read of their own:
    :func:`train_step` all-reduces its loss in a tensor ``[loss, flag]`` (:meth:`mark` sets this rank's
    flag, a fill on the device) and reads both numbers in the one host read it makes for the loss
    (:meth:`settle` keeps the sum). The loss is read every step (every step prints a line and writes a
    metrics row), so the answer is fresh after each step at no cost. Were the loss read only every ``N``
    steps (a log interval), the check should not wait for that read: the elastic agent kills the ranks
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (30) seconds after the signal, so a save up to ``N`` steps later is
    lost whenever ``N`` steps outlast that. The flag would move to the reduction the step reads every step
    regardless, the gradient norm's (clipping needs it on the host). A signal that arrives after a step's
    all-reduce (during its evaluation, log line or save) is counted by the next step's: the world then
    stops one step later, and saves that step."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.any_rank = False
        self.previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def mark(self, flag: torch.Tensor) -> None:
        """Set ``flag`` (one element of the tensor the step sums over the world; 0 before) to 1 when this
        rank got a signal: a fill on the device, no host read."""
        if self.signum is not None:
            flag.fill_(1.0)

    def settle(self, flags: float) -> None:
        """Record the world's sum of the :meth:`mark` flags (read on the host with the loss)."""
        self.any_rank = self.any_rank or flags > 0

    def agreed(self) -> str | None:
        """The name of the signal when any rank got one by the last :meth:`settle` (``"SIGINT"``;
        ``"SIGINT or SIGTERM"`` on a rank that got none yet), else ``None``: the same answer on every rank."""
        if not self.any_rank:
            return None
        return signal.Signals(self.signum).name if self.signum is not None else "SIGINT or SIGTERM"

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


@dataclass
class DistributedTraining:
    """What one rank trains with: the sharded model, its optimizer, the balancer over the data group
    (``None`` without experts or with ``balance="none"``) and the CP seam (``None`` at ``cp = 1``)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    balancer: QuantileBalancer | None
    context: ContextParallel | None
    device: torch.device


def build_training(
    config,
    model_config,
    dims: ParallelDims,
    device: torch.device,
    ep_dispatcher: str = "alltoall",
    cp_layout: str = "contiguous",
) -> DistributedTraining:
    """Meshes, sharded ``model_config`` (bf16 parameters on CUDA, fp32 on the CPU; QAT when ``config.qat``),
    context parallelism, sharded optimizer and balancer with ``config``'s seed, learning rate, weight decay
    and balancing, on the initialised world; every rank calls it."""
    meshes = build_meshes(dims, device.type)
    param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_sharded_model(
        model_config, meshes, device, seed=config.seed, param_dtype=param_dtype, ep_dispatcher=ep_dispatcher
    )
    if config.qat:  # every routed-experts module, expert-parallel ones included
        enable_qat(model, config.qat)
    context = apply_context_parallel(model, meshes.cp_group, cp_layout) if dims.cp > 1 else None
    optimizer = build_sharded_optimizer(model, lr=config.lr, weight_decay=config.weight_decay)
    balancer = None
    if config.balance != "none" and text_config_of(model_config).num_experts:
        balancer = QuantileBalancer(model, method=config.balance, process_group=data_process_group(meshes))
    return DistributedTraining(model, optimizer, balancer, context, device)


def train_step(
    run: DistributedTraining,
    x_BT: torch.Tensor,
    y_BT: torch.Tensor,
    grad_accum: int,
    grad_clip: float,
    stop: StopRequest | None = None,
) -> tuple[float, float, dict]:
    """One optimizer step on this rank's rows ``x_BT, y_BT [B, T]`` (int64, on any device) in ``grad_accum``
    micro-batches; returns ``(loss, grad_norm, balancer stats)``, the loss averaged over the world (two host
    syncs: the gradient norm and the loss). The loss is all-reduced with ``stop``'s flag beside it, so the
    ranks learn whether any of them got a stop signal in the same collective and host read
    (:class:`StopRequest`). Under CP a micro-batch's rows are packed into one row (a document each) and split
    over the group; every rank of a CP group passes the same rows."""
    model, device, context = run.model, run.device, run.context
    run.optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(2, device=device)  # [this rank's loss, 1 if this rank got a stop signal], summed
    for x_mb, y_mb in zip(x_BT.chunk(grad_accum), y_BT.chunk(grad_accum), strict=True):
        if context is not None:  # the rows packed into one, a document each, split over the group
            b, T = x_mb.shape
            plan = context.begin(list(range(0, b * T + 1, T)))
            x_mb, y_mb = plan.shard(x_mb.reshape(1, b * T)), plan.shard(y_mb.reshape(1, b * T))
        logits = model(x_mb.to(device)).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y_mb.to(device).flatten()) / grad_accum
        loss.backward()
        sums[0] += loss.detach()  # each MoE block counted its routing in the forward
    grad_norm = clip_grad_norm_(model.parameters(), grad_clip)
    stats = run.balancer.step() if run.balancer else {}
    run.optimizer.step()
    if stop is not None:
        stop.mark(sums[1])
    dist.all_reduce(sums)
    loss_sum, flags = sums.tolist()
    if stop is not None:
        stop.settle(flags)
    return loss_sum / dist.get_world_size(), grad_norm, stats


def train_distributed(
    config,
    dp_shard: int = -1,
    dp_replicate: int = 1,
    ep: int = 1,
    resume: bool = False,
    ep_dispatcher: str = "alltoall",
    cp: int = 1,
    cp_layout: str = "contiguous",
) -> dict:
    """Train ``config`` (a :class:`~openk3.train.trainer.TrainConfig`) on the torchrun world (experts
    exchanged by ``ep_dispatcher`` when ``ep > 1``); returns the last step's ``{"step", "loss",
    "checkpoint", "rank"}``. Raises ``ValueError`` (on every rank, before any allocation or data preparation)
    when the mesh does not divide the world or the model, ``--batch-size`` does not divide over the data
    ranks, or a context length cannot be split over ``cp`` ranks by ``cp_layout``.

    A collective that fails because another rank is gone (its connection dropped, or it did not answer
    within :data:`COLLECTIVE_TIMEOUT_S`) ends this rank with one line and
    :data:`~openk3.dist.launch.PEER_LOST_EXIT` instead of a traceback (:mod:`openk3.dist.lost_peer`): the
    rank that died is the one to report, and the launcher names it.

    Rank 0 holds the run folder's lock (:mod:`openk3.train.run_lock`) for the whole run, so a second world
    or a single-process run started into the same folder is refused (``ValueError`` naming the holder), and
    a rank started by an agent asks to be stopped (SIGTERM: finish the step, save) when the agent dies
    (:func:`~openk3.dist.launch.stop_with_launcher`): a launcher killed with ``kill -9`` left its ranks
    training on, unseen, into the folder a new run would then share. The lock is given back on every way
    out, the lost peer's ``os._exit`` included (released before it)."""
    if "LOCAL_RANK" in os.environ:  # started by an agent (openk3's launcher, torchrun): end with it
        stop_with_launcher()
    held: list[RunLock] = []  # rank 0's lock on the run folder, taken before it writes there
    try:
        return _train_distributed(
            config, dp_shard, dp_replicate, ep, resume, ep_dispatcher, cp, cp_layout, held
        )
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        reason = lost_peer_reason(e) if dist.is_initialized() else None
        if reason is None:
            raise
        line = lost_peer_line(dist.get_rank(), *reason)
    finally:
        for lock in held:
            lock.release()
    exit_lost_peer(line)  # os._exit, after the lock is given back: a finally around it would never run


def _train_distributed(
    config, dp_shard, dp_replicate, ep, resume, ep_dispatcher, cp, cp_layout, held
) -> dict:
    """:func:`train_distributed` without its handling of a lost peer; rank 0 appends its run lock to
    ``held`` (released by the caller)."""
    check_context_lengths(config.context_schedule, cp, cp_layout)
    init_from_env(config.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims(world_size=world, dp_shard=dp_shard, dp_replicate=dp_replicate, ep=ep, cp=cp)
    model_config = get_preset(config.preset)
    dims.check_model(text_config_of(model_config))
    if config.batch_size % (world // cp):  # before the data is prepared or the model built
        raise ValueError(
            f"--batch-size {config.batch_size} (global sequences per micro-batch) is not divisible by the "
            f"{world // cp} data ranks (world_size={world} / cp={cp})"
        )
    device = (
        torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")
    )
    run_dir = Path(config.out)
    prepare = dict(
        out_dir=run_dir / "data", vocab_size=text_config_of(model_config).vocab_size, seed=config.seed
    )

    def prepare_on_rank_zero() -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        held.append(acquire_run_lock(run_dir))  # one world (or process) per run folder
        if not resume:
            refuse_existing_run(run_dir)  # a fresh start would prune the old run's checkpoints
        prepare_data(config.data, val_fraction=config.val_fraction, progress=True, **prepare)

    on_rank_zero(prepare_on_rank_zero)  # a bad --data is raised on every rank, not left to a collective
    data = prepare_data(config.data, val_fraction=config.val_fraction, progress=False, **prepare)
    run = build_training(config, model_config, dims, device, ep_dispatcher, cp_layout)
    model, optimizer, balancer, context = run.model, run.optimizer, run.balancer, run.context
    peak = [g["lr"] for g in optimizer.param_groups]
    data_ranks, data_rank = world // cp, rank // cp  # the cp ranks of one group are consecutive
    per_rank = config.batch_size // data_ranks * config.grad_accum
    batches = RandomBatches(
        TokenDataset(data.train_path), per_rank * data_ranks, config.context_schedule[0][1], config.seed
    )
    step, checkpoint = 0, None
    if resume:
        checkpoint = latest_distributed_checkpoint(run_dir)
        if checkpoint is None:
            raise ValueError(f"--resume: {run_dir}/checkpoints holds no finished distributed checkpoint")
        extra = load_checkpoint(checkpoint, model, optimizer, balancer)
        step, batches.step = extra["step"], extra["data_position"]
        if rank == 0:
            print(f"resuming {run_dir} at step {step} from {checkpoint}", flush=True)
    if rank == 0:  # what `openk3 eval` of the run's checkpoints reads its windows from, as on one process
        write_train_config(run_dir, config)
    # rank 0 logs; a resume drops the rows past its checkpoint (steps a lost rank's world logged and will redo)
    metrics = (
        MetricsLog(run_dir / "metrics.jsonl", resume_step=step if resume else None) if rank == 0 else None
    )
    loss_value, final, stopped = float("nan"), {}, None
    val_set = TokenDataset(data.val_path)
    last = config.stop_at_step or config.steps
    stop = StopRequest()
    try:
        while step < last:
            start = time.perf_counter()
            batches.seq_len = seq_len_at(step, config.context_schedule)
            factor = lr_factor(step, config.steps, config.warmup_steps, config.min_lr_ratio, config.schedule)
            for group, lr in zip(optimizer.param_groups, peak, strict=True):
                group["lr"] = lr * factor
            x_BT, y_BT = next(batches)
            mine = slice(data_rank * per_rank, (data_rank + 1) * per_rank)
            loss_value, grad_norm, stats = train_step(
                run, x_BT[mine], y_BT[mine], config.grad_accum, config.grad_clip, stop
            )
            step += 1
            elapsed = time.perf_counter() - start
            ev = {}
            if step == config.steps:  # the reported result, as the single-process trainer's
                ev = final = evaluate_distributed(
                    model, val_set, config, device, config.final_eval_batches, context
                )
            elif step % config.eval_every == 0:  # progress: the first eval_batches batches
                sub = evaluate_distributed(model, val_set, config, device, config.eval_batches, context)
                ev = {"val_loss_subset": sub["val_loss"], "val_ppl_subset": sub["val_ppl"]}
                ev["val_subset_tokens"] = sub["val_tokens"]
            if rank == 0:
                row = {
                    "step": step,
                    "loss": loss_value,
                    "lr": config.lr * factor,
                    "grad_norm": grad_norm,
                    "maxvio": stats.get("maxvio"),
                    "tokens_per_s": x_BT.numel() / elapsed,
                    "world_size": world,
                    **ev,
                }
                metrics.write(row)
                print(
                    f"step {step} loss {loss_value:.4f} grad_norm {grad_norm:.3f} lr {row['lr']:.2e}",
                    flush=True,
                )
            stopped = stop.agreed()  # settled by the step's loss all-reduce: the same on every rank
            if step % config.save_every == 0 or step == last or stopped:
                checkpoint = save_checkpoint(
                    run_dir / "checkpoints",
                    step,
                    model,
                    optimizer,
                    balancer,
                    extra={"data_position": batches.step},
                )
            if stopped:
                if rank == 0:
                    print(
                        f"openk3: {stopped} received: stopped after step {step}, checkpoint saved ({checkpoint}); continue "
                        "with the same command and --resume",
                        flush=True,
                    )
                break
    finally:
        stop.restore()
        if metrics:
            metrics.close()
    if rank == 0:
        plot_metrics(run_dir / "metrics.jsonl", run_dir / "loss.png")
    if final:  # collective: every rank gathers, rank 0 writes (the folder generate, eval and serve read)
        export_hf(model, run_dir / "final", tokenizer=data.tokenizer_dir)
        final["export"] = str(run_dir / "final")
    return {
        "step": step,
        "loss": loss_value,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "rank": rank,
        "interrupted": stopped is not None,
        **final,
    }
