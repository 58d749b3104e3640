"""Partial rollout: generation pauses once a fraction λ of the groups in flight has finished; the unfinished
groups wait with their trajectories' tokens, behaviour log-probs and versions and resume in the next iteration.

Kimi K1.5 (arXiv 2501.12599 sec. 2.6.2) caps the tokens of one iteration and continues unfinished trajectories
later; slime/APRIL (arXiv 2509.18521) stop once enough groups are done and recycle the rest. Here the stop
condition is the finished fraction of *groups*: the ``G`` samples of one prompt share a group-normalised
advantage (:func:`openk3.rl.loss.group_advantages`), so they train together or not at all. Pause when
``⌈λ·N⌉`` of the ``N`` groups in flight have every member finished; a group with some members finished and
some not goes back to the buffer whole (its finished members wait, its unfinished ones resume). A group of
one is a plain trajectory.

Resume re-submits prompt + response so far with the tokens left (slime's ``generate``), a prefill of that
sequence; the engine's prefix cache serves whatever prefix it still holds from the current weights (after a
weight sync the cache starts empty, :meth:`openk3.rl.rollout.RolloutEngine.sync_weights`). With unchanged
weights at temperature 0, a paused and resumed trajectory equals an uninterrupted one token for token
(tested).

Off-policy segments: each token's version is recorded. The staleness of a group is the current version
minus the oldest version of its first segments; a group above ``max_staleness`` is dropped and its prompt
starts over with fresh members (AReaL's ``max_head_offpolicyness``, per group). Older tokens of a kept group
are either **masked** out of the loss (slime's ``--mask-offpolicy-in-partial-rollout``) or **corrected** in
the loss by the truncated importance weight and the squared log-ratio regulariser against their recorded
behaviour log-probs (:mod:`openk3.rl.loss`).
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
    """Groups returned complete."""
    paused: int = 0
    """Groups back in the buffer."""
    dropped_stale: int = 0
    """Groups restarted for staleness."""
    generated_tokens: int = 0


def _restart(group: list[Trajectory]) -> list[Trajectory]:
    return [Trajectory(t.prompt_ids, t.max_tokens, t.meta) for t in group]


@dataclass
class PartialRollout:
    """The buffer of unfinished groups and the pause rule."""

    config: PartialRolloutConfig
    buffer: list[list[Trajectory]] = field(default_factory=list)

    def run(
        self, engine: RolloutEngine, new: list[list[Trajectory]]
    ) -> tuple[list[list[Trajectory]], PartialRolloutStats]:
        """Resume the buffered groups and start the ``new`` ones; return the complete groups (in the order
        they completed, each in its own member order) once ``⌈λ·N⌉`` of the ``N`` groups in flight are
        complete; the others go back to the buffer whole.

        Raises ``ValueError`` for an empty group."""
        if any(not g for g in new):
            raise ValueError("partial rollout: a group needs at least one trajectory")
        stats = PartialRolloutStats()
        flight = []
        for group in self.buffer:
            started = [t.first_version for t in group if t.first_version is not None]
            if started and engine.version - min(started) > self.config.max_staleness:
                stats.dropped_stale += 1
                group = _restart(group)
            flight.append(group)
        self.buffer = []
        flight += [list(g) for g in new]
        if not flight:
            return [], stats
        before = sum(t.num_generated for g in flight for t in g)
        owner = {id(t): k for k, g in enumerate(flight) for t in g}
        left = [sum(not t.finished for t in g) for g in flight]
        complete = [k for k, n in enumerate(left) if n == 0]  # all members finished while in the buffer
        target = math.ceil(self.config.finish_fraction * len(flight))
        active = {engine.submit(t): t for g in flight for t in g if not t.finished}
        while active and len(complete) < target:
            for t in engine.step(active):
                k = owner[id(t)]
                left[k] -= 1
                if left[k] == 0:
                    complete.append(k)
        engine.abort(active)
        for k, group in enumerate(flight):
            for t in group:
                if t.segments and not t.segments[-1].token_ids:
                    t.segments.pop()  # a resume that produced nothing before the pause
            if left[k]:
                self.buffer.append(group)
        stats.finished, stats.paused = len(complete), len(self.buffer)
        stats.generated_tokens = sum(t.num_generated for g in flight for t in g) - before
        return [flight[k] for k in complete], stats


def train_mask(trajectory: Trajectory, current_version: int, old_segments: str) -> list[float]:
    """Per response token: 1.0 if it trains. ``"mask"`` zeroes tokens from versions before
    ``current_version``; ``"correct"`` keeps every token (the loss weights them)."""
    if old_segments == "mask":
        return [1.0 if v >= current_version else 0.0 for v in trajectory.versions]
    if old_segments == "correct":
        return [1.0] * trajectory.num_generated
    raise ValueError(f"old_segments must be 'mask' or 'correct', got {old_segments!r}")
