"""Partial against synchronous rollout on heavy-tailed lengths: completed tokens per second, and the reward
curves of the same RL run with each.

Each iteration hands ``--prompts`` new trajectories to the rollout engine (a random K3-shaped model, greedy,
through :class:`openk3.rl.rollout.RolloutEngine`). Lengths are heavy-tailed: ``max_tokens =
min(cap, ⌈min_len · U^(−1/α)⌉)`` (a Pareto tail), and the model never stops early, so a trajectory's length
is its ``max_tokens``. After each iteration the engine's weights are synced (the same weights: the cost of a
trainer's update without training), so tokens carry versions.

* ``sync`` — every trajectory of the iteration runs to completion (``finish_fraction = 1``);
* ``partial`` — the iteration pauses once ``λ`` of the trajectories in flight have finished; the rest
  resume in the next iteration.

Reported per mode: completed tokens (in trajectories that finished) per wall second, all generated tokens
(finished or still in the buffer) per wall second, engine steps, the
fraction of completed tokens generated under an older version than the one their trajectory finished under,
and the largest version lag.

**Reward curves** (``--rl-steps``): the same model trains with :class:`openk3.rl.step.PolicyTrainer` on a
synthetic reward (the fraction of response tokens with an even id), ``--rl-prompts`` new prompts of
``--group`` samples per step (temperature 1), each prompt's length cap drawn from the same Pareto tail;
synchronous rollout against group-aware partial rollout (:class:`openk3.rl.partial_rollout.PartialRollout`,
``λ`` of the groups in flight, tokens of older versions importance-corrected). Plotted against step and
against wall seconds (``--png``). Run::

    python benchmarks/partial_rollout.py --rl-steps 16 --md benchmarks/results/partial_rollout.md \\
        --png benchmarks/results/partial_rollout_rewards.png
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import time
from pathlib import Path

import torch

import openk3
from openk3.rl.partial_rollout import PartialRollout, PartialRolloutConfig
from openk3.rl.rollout import RolloutEngine, RolloutSampling, Trajectory
from openk3.rl.step import PolicyTrainer, RLConfig
from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig


def lengths(n: int, rng: random.Random, min_len: int, alpha: float, cap: int) -> list[int]:
    return [min(cap, math.ceil(min_len * (1 - rng.random()) ** (-1 / alpha))) for _ in range(n)]


def run(mode: str, model, args) -> dict:
    config = EngineConfig(
        CacheConfig(block_size=16, num_blocks=4096, checkpoint_interval=1),
        SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=256, long_prefill_token_threshold=256),
    )
    engine = RolloutEngine(model, config, RolloutSampling(temperature=0.0))
    lam = 1.0 if mode == "sync" else args.finish_fraction
    partial = PartialRollout(PartialRolloutConfig(finish_fraction=lam, max_staleness=args.iterations))
    rng, prompt_rng = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    completed_tokens = stale_tokens = max_lag = steps = generated = 0
    count_steps = engine.step

    def counted(active):
        nonlocal steps
        steps += 1
        return count_steps(active)

    engine.step = counted
    t0 = time.perf_counter()
    for _ in range(args.iterations):
        new = [
            Trajectory(torch.randint(2, 96, (args.prompt_len,), generator=prompt_rng).tolist(), n)
            for n in lengths(args.prompts, rng, args.min_len, args.alpha, args.cap)
        ]
        done, stats = partial.run(engine, [[t] for t in new])  # groups of one
        generated += stats.generated_tokens
        for (t,) in done:
            completed_tokens += t.num_generated
            last = t.segments[-1].version
            stale_tokens += sum(v < last for v in t.versions)
            max_lag = max(max_lag, last - t.first_version)
        engine.sync_weights(engine.model)
    wall = time.perf_counter() - t0
    return {
        "mode": mode,
        "finish_fraction": lam,
        "completed_tokens": completed_tokens,
        "wall_s": wall,
        "tokens_per_s": completed_tokens / wall,
        "generated_per_s": generated / wall,
        "engine_steps": steps,
        "stale_token_fraction": stale_tokens / max(1, completed_tokens),
        "max_version_lag": max_lag,
        "left_in_buffer": len(partial.buffer),
    }


def even_fraction(t: Trajectory) -> float:
    """The synthetic reward: the fraction of response tokens with an even id."""
    return sum(x % 2 == 0 for x in t.response_ids) / max(1, t.num_generated)


def rl_curve(mode: str, args) -> list[dict]:
    """One RL run (``args.rl_steps`` updates) from a fresh copy of the random model; per step the mean reward of
    the groups trained, the cumulative wall seconds, tokens trained and groups trained."""
    model = openk3.build_model(openk3.presets.k3_shaped(args.depth, vocab_size=128), seed=0)
    config = EngineConfig(
        CacheConfig(block_size=16, num_blocks=4096, checkpoint_interval=1),
        SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=256, long_prefill_token_threshold=256),
    )
    engine = RolloutEngine(model, config, RolloutSampling(temperature=1.0, seed=args.seed))
    partial = None if mode == "sync" else PartialRolloutConfig(args.finish_fraction, args.rl_steps, "correct")
    trainer = PolicyTrainer(model, engine, RLConfig(args.group, args.cap, args.rl_lr, partial=partial))
    rng, prompt_rng = random.Random(args.seed + 1), torch.Generator().manual_seed(args.seed + 1)
    rows, t0 = [], time.perf_counter()
    for step in range(args.rl_steps):
        prompts = [
            torch.randint(2, 96, (args.prompt_len,), generator=prompt_rng).tolist()
            for _ in range(args.rl_prompts)
        ]
        caps = lengths(args.rl_prompts, rng, args.min_len, args.alpha, args.cap)
        stats, trajs = trainer.step(prompts, [{} for _ in prompts], even_fraction, max_tokens=caps)
        rows.append(
            {
                "step": step + 1,
                "reward": stats["reward"],
                "wall_s": time.perf_counter() - t0,
                "tokens": sum(t.num_generated for t in trajs),
                "groups": len(trajs) // args.group,
                "stale": stats.get("stale_token_fraction", 0.0),
            }
        )
    return rows


def plot_curves(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for mode, rows in curves.items():
        for ax, x in zip(axes, ("step", "wall_s")):
            ax.plot([r[x] for r in rows], [r["reward"] for r in rows], marker="o", ms=3, label=mode)
            ax.set_xlabel("RL step" if x == "step" else "wall seconds")
            ax.set_ylabel("reward of the groups trained")
    axes[0].legend()
    fig.suptitle("synchronous vs group-aware partial rollout")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--alpha", type=float, default=1.1)
    p.add_argument("--cap", type=int, default=96)
    p.add_argument("--finish-fraction", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rl-steps", type=int, default=0, help="RL updates per mode for the reward curves (0: skip)"
    )
    p.add_argument("--rl-prompts", type=int, default=6)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--rl-lr", type=float, default=1e-2)
    p.add_argument("--png", type=Path, help="the reward curves' plot")
    p.add_argument("--md", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = openk3.build_model(openk3.presets.k3_shaped(args.depth, vocab_size=128), seed=0).eval()
    rows = [run(mode, model, args) for mode in ("sync", "partial")]
    head = "| mode | λ | completed tokens | wall s | completed tokens/s | all generated tokens/s | engine steps | stale tokens | max lag | unfinished |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['finish_fraction']} | {r['completed_tokens']} | {r['wall_s']:.1f} | "
            f"{r['tokens_per_s']:.1f} | {r['generated_per_s']:.1f} | {r['engine_steps']} | {r['stale_token_fraction']:.2f} | "
            f"{r['max_version_lag']} | {r['left_in_buffer']} |"
        )
    table = "\n".join(lines)
    curves = {mode: rl_curve(mode, args) for mode in ("sync", "partial")} if args.rl_steps else {}
    if curves:
        lines = [
            "| mode | step | reward | wall s | tokens trained | groups trained | stale tokens |",
            "|---|---|---|---|---|---|---|",
        ]
        for mode, rows in curves.items():
            for r in rows:
                lines.append(
                    f"| {mode} | {r['step']} | {r['reward']:.3f} | {r['wall_s']:.1f} | {r['tokens']} | {r['groups']} "
                    f"| {r['stale']:.2f} |"
                )
        table += "\n\nReward curves (the same RL run, each mode):\n\n" + "\n".join(lines)
        if args.png:
            plot_curves(curves, args.png)
            table += f"\n\n![reward curves]({args.png.name})"
    print(table)
    if args.md:
        cmd = "python benchmarks/partial_rollout.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None
        )
        load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
        args.md.write_text(
            f"# Partial vs synchronous rollout (heavy-tailed lengths)\n\n`{cmd}`\n\n"
            f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread, "
            f"load average at the end {' '.join(load)} (a shared machine: wall times are upper bounds).\n\n"
            f"{table}\n"
        )


if __name__ == "__main__":
    main()
