"""The RL loop's workers as Ray actors: rollout engines and teachers in their own processes, the trainer in
the driver (Ray, ``ray.io``; the same split as OpenRLHF's and verl's Ray trainers).

* :class:`RolloutWorker` — one :class:`~openk3.rl.rollout.RolloutEngine` per actor (on a GPU when the actor
  is given one: ``ray.remote(num_gpus=1)(RolloutWorker)`` and ``device="cuda"``).
* :class:`TeacherWorker` — one MOPD teacher per actor; ``score`` is
  :func:`~openk3.rl.rewards.mopd.teacher_logprobs` run there.
* :class:`RayRollouts` — the driver's handle on a list of rollout actors with the interface
  :class:`~openk3.rl.step.PolicyTrainer` needs (``generate``, ``sync_weights``, ``version``, ``sampling``,
  ``sample_vocab_size``): trajectories are dealt round-robin to the actors and come back in order; a weight
  sync puts the state dict in the object store once and every actor loads it.

Every ``ray.get`` has a timeout, so a dead or hung actor raises ``GetTimeoutError`` instead of hanging.
Ray is an optional dependency (``pip install openk3[ray]``).
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.rl.rewards.mopd import Teacher, teacher_logprobs
from openk3.rl.rollout import RolloutEngine, RolloutSampling, Trajectory
from openk3.serve import EngineConfig


class RolloutWorker:
    """A rollout engine inside an actor."""

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig | None,
        sampling: RolloutSampling,
        sample_vocab_size: int | None = None,
        device: str = "cpu",
        num_threads: int = 1,
    ) -> None:
        torch.set_num_threads(num_threads)
        self.engine = RolloutEngine(model.to(device), config, sampling, sample_vocab_size)

    def generate(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        return self.engine.generate(trajectories)

    def sync_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Load ``state_dict`` into the engine's model; returns the engine's new version."""
        return self.engine.sync_weights(state_dict)

    def state_checksum(self) -> float:
        """Sum of every parameter (float64): equal weights give equal sums (a test hook)."""
        return float(sum(p.double().sum() for p in self.engine.model.parameters()))


class TeacherWorker:
    """A MOPD teacher inside an actor."""

    def __init__(self, model: nn.Module, tokenizer_id: str, name: str = "", num_threads: int = 1) -> None:
        torch.set_num_threads(num_threads)
        self.teacher = Teacher(model.eval(), tokenizer_id, name)

    def score(self, prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
        return teacher_logprobs(self.teacher, prompts, responses)


class RayRollouts:
    """Rollout actors behind the interface of one :class:`RolloutEngine`."""

    def __init__(
        self,
        actors: list,
        sampling: RolloutSampling,
        sample_vocab_size: int | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if not actors:
            raise ValueError("RayRollouts needs at least one rollout actor")
        self.actors, self.sampling, self.sample_vocab_size = actors, sampling, sample_vocab_size
        self.timeout_s = timeout_s
        self.version = 0

    def generate(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        import ray

        n = len(self.actors)
        parts = [trajectories[i::n] for i in range(n)]
        refs = [a.generate.remote(p) for a, p in zip(self.actors, parts) if p]
        results = ray.get(refs, timeout=self.timeout_s)
        out: list[Trajectory | None] = [None] * len(trajectories)
        for i, part in enumerate(results):
            out[i::n] = part
        return out  # type: ignore[return-value]

    def sync_weights(self, trainer_model: nn.Module) -> int:
        import ray

        state = ray.put({k: v.detach().cpu() for k, v in trainer_model.state_dict().items()})
        versions = ray.get([a.sync_weights.remote(state) for a in self.actors], timeout=self.timeout_s)
        if len(set(versions)) != 1:
            raise RuntimeError(f"rollout actors disagree on the policy version after a sync: {versions}")
        self.version = versions[0]
        return self.version
