"""Partial rollout: generation pauses once a fraction λ of the batch has finished; the unfinished
trajectories wait with their tokens, behaviour log-probs and versions and resume in the next iteration.

Kimi K1.5 (arXiv 2501.12599 sec. 2.6.2) caps the tokens of one iteration and continues unfinished trajectories
later; slime/APRIL (arXiv 2509.18521) stop once enough groups are done and recycle the rest. Here the stop
condition is the finished fraction: pause when ``finished ≥ ⌈λ·N⌉`` of the ``N`` trajectories in flight.

Resume re-submits prompt + response so far with the tokens left (slime's ``generate``), a prefill of that
sequence; the engine's prefix cache serves whatever prefix it still holds from the current weights (after a
weight sync the cache starts empty, :meth:`openk3.rl.rollout.RolloutEngine.sync_weights`). With unchanged
weights at temperature 0, a paused and resumed trajectory equals an uninterrupted one token for token
(tested).

Off-policy segments: each token's version is recorded. The staleness of a trajectory is the current version
minus the version of its first segment; one above ``max_staleness`` is dropped and its prompt starts over
(AReaL's ``max_head_offpolicyness``). Its older tokens are then either **masked** out of the loss (slime's
``--mask-offpolicy-in-partial-rollout``) or **corrected** in the loss by the truncated importance weight and
the squared log-ratio regulariser against their recorded behaviour log-probs (:mod:`openk3.rl.loss`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from openk3.rl.rollout import RolloutEngine, Trajectory


@dataclass(frozen=True)
class PartialRolloutConfig:
    finish_fraction: float = 0.5
    """λ: pause once this fraction of the trajectories in flight has finished (1.0: synchronous)."""
    max_staleness: int = 2
    """Most policy versions a trajectory may lag behind before it is dropped and restarted."""
    old_segments: str = "correct"
    """``"mask"``: tokens from older versions do not train; ``"correct"``: they train, importance-weighted."""

    def __post_init__(self) -> None:
        if not 0 < self.finish_fraction <= 1:
            raise ValueError(f"finish_fraction must be in (0, 1], got {self.finish_fraction}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.old_segments not in ("mask", "correct"):
            raise ValueError(f"old_segments must be 'mask' or 'correct', got {self.old_segments!r}")


@dataclass
class PartialRolloutStats:
    finished: int = 0
    paused: int = 0
    dropped_stale: int = 0
    generated_tokens: int = 0


@dataclass
class PartialRollout:
    """The buffer of unfinished trajectories and the pause rule."""

    config: PartialRolloutConfig
    buffer: list[Trajectory] = field(default_factory=list)

    def run(
        self, engine: RolloutEngine, new: list[Trajectory]
    ) -> tuple[list[Trajectory], PartialRolloutStats]:
        """Resume the buffered trajectories and start ``new``; return the finished ones once ``⌈λ·N⌉`` of
        the ``N`` in flight are done (the others go back to the buffer)."""
        stats = PartialRolloutStats()
        flight = []
        for traj in self.buffer:
            if engine.version - traj.first_version > self.config.max_staleness:
                stats.dropped_stale += 1
                flight.append(Trajectory(traj.prompt_ids, traj.max_tokens, traj.meta))
            else:
                flight.append(traj)
        self.buffer = []
        flight += new
        if not flight:
            return [], stats
        before = sum(t.num_generated for t in flight)
        target = math.ceil(self.config.finish_fraction * len(flight))
        active = {engine.submit(t): t for t in flight}
        done: list[Trajectory] = []
        while active and len(done) < target:
            done += engine.step(active)
        engine.abort(active)
        for traj in flight:
            if traj.segments and not traj.segments[-1].token_ids:
                traj.segments.pop()  # a resume that produced nothing before the pause
            if not traj.finished:
                self.buffer.append(traj)
        stats.finished, stats.paused = len(done), len(self.buffer)
        stats.generated_tokens = sum(t.num_generated for t in flight) - before
        return done, stats


def train_mask(trajectory: Trajectory, current_version: int, old_segments: str) -> list[float]:
    """Per response token: 1.0 if it trains. ``"mask"`` zeroes tokens from versions before
    ``current_version``; ``"correct"`` keeps every token (the loss weights them)."""
    if old_segments == "mask":
        return [1.0 if v >= current_version else 0.0 for v in trajectory.versions]
    if old_segments == "correct":
        return [1.0] * trajectory.num_generated
    raise ValueError(f"old_segments must be 'mask' or 'correct', got {old_segments!r}")
