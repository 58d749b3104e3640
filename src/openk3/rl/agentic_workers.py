"""Agentic rollouts as Ray actors: each :class:`AgenticRolloutWorker` holds a rollout engine and the sandboxes
of the trajectories it generated; :class:`RayAgenticRollouts` gives the trainer the interface of one
:class:`~openk3.rl.agentic.AgenticRollout` (``generate``, ``sync_weights``, ``version``, ``sampling``,
``sample_vocab_size``, ``prompt_ids``, ``outcome``, ``release``).

Trajectories are dealt round-robin (:class:`~openk3.rl.ray_workers.RayRollouts`); each remembers its worker
(``meta["agent"]["worker"]``), so ``outcome`` runs on the actor that holds its sandbox and forks it there.
An error in the actor's reward (a dead sandbox, a raising judge) reaches the driver as an exception, which the
trainer counts as a dropped rollout. Ray is an optional dependency (``pip install openk3[ray]``).
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.rl.agentic import AgenticConfig, AgenticRollout, AgenticTaskGroup
from openk3.rl.harness import AgentTokenizer, Harness
from openk3.rl.ray_workers import RayRollouts
from openk3.rl.rollout import RolloutEngine, RolloutSampling, Trajectory
from openk3.rl.tool_sandbox import SandboxFactory
from openk3.serve import EngineConfig


class AgenticRolloutWorker:
    """An :class:`AgenticRollout` inside an actor (its engine, its sandbox workers, its sandboxes)."""

    def __init__(self, model: nn.Module, config: EngineConfig | None, sampling: RolloutSampling,
                 tokenizer: AgentTokenizer, groups: list[AgenticTaskGroup], sandboxes: SandboxFactory,
                 agentic: AgenticConfig | None = None, sample_vocab_size: int | None = None,
                 device: str = "cpu", num_threads: int = 1) -> None:  # fmt: skip
        torch.set_num_threads(num_threads)
        engine = RolloutEngine(model.to(device), config, sampling, sample_vocab_size)
        self.rollout = AgenticRollout(engine, tokenizer, groups, sandboxes, agentic)

    def generate(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        return self.rollout.generate(trajectories)

    def outcome(self, trajectory: Trajectory) -> float:
        return self.rollout.outcome(trajectory)

    def sync_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        return self.rollout.sync_weights(state_dict)

    def release(self) -> None:
        self.rollout.release()

    def stats(self) -> dict[str, int]:
        return dict(self.rollout.stats)


class RayAgenticRollouts(RayRollouts):
    """Agentic rollout actors behind the interface of one :class:`AgenticRollout`. ``tokenizer`` and
    ``groups`` must be the ones the actors were given (the driver renders the prompts)."""

    def __init__(self, actors: list, tokenizer: AgentTokenizer, groups: list[AgenticTaskGroup],
                 sampling: RolloutSampling, sample_vocab_size: int | None = None,
                 timeout_s: float = 600.0) -> None:  # fmt: skip
        super().__init__(actors, sampling, sample_vocab_size, timeout_s)
        self.groups = {g.name: g for g in groups}
        self.harnesses = {g.name: Harness(g.harness, tokenizer) for g in groups}

    def prompt_ids(self, meta: dict) -> list[int]:
        name = meta.get("group")
        if name not in self.groups:
            raise ValueError(f"meta['group'] must name a task group {sorted(self.groups)}, got {name!r}")
        return self.harnesses[name].prompt_ids(self.groups[name].task(meta))

    def generate(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        out = super().generate(trajectories)
        for j, t in enumerate(out):  # RayRollouts deals trajectory j to actor j mod n
            t.meta["agent"]["worker"] = j % len(self.actors)
        return out

    def outcome(self, trajectory: Trajectory) -> float:
        import ray

        actor = self.actors[trajectory.meta["agent"]["worker"]]
        return ray.get(actor.outcome.remote(trajectory), timeout=self.timeout_s)

    def release(self) -> None:
        import ray

        ray.get([a.release.remote() for a in self.actors], timeout=self.timeout_s)

    def stats(self) -> dict[str, int]:
        import ray

        total: dict[str, int] = {}
        for s in ray.get([a.stats.remote() for a in self.actors], timeout=self.timeout_s):
            for k, v in s.items():
                total[k] = total.get(k, 0) + v
        return total
