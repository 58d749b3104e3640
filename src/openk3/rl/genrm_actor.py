"""The GenRM judge as a Ray actor, so that judging runs beside the rollout workers (the reward-model worker of
OpenRLHF's and verl's Ray trainers): :class:`JudgeWorker` holds a judge and runs
:func:`~openk3.rl.rewards.genrm.tournament_rewards` for whole groups; :class:`RayGenRM` is the driver's handle
that deals groups to judge actors and returns their rewards in order.

``submit`` returns at once (object refs); the trainer can keep generating while the judges work and
``collect`` later. Every ``ray.get`` has a timeout, so a dead or hung judge raises ``GetTimeoutError``
instead of hanging. The rewards equal the in-process tournament's exactly (same code, same judge), and are
invariant to the order of the candidates (both orders of every pair are judged).

:class:`EngineJudge` is a judge backed by an openk3 model: greedy generation from openk3's serving engine,
``str → str``, so the judge actor can hold a model (on a GPU when the actor is given one).

Ray is an optional dependency (``pip install openk3[ray]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from openk3.rl.rewards.genrm import GenRMConfig, Judge, Scorepad, tournament_rewards
from openk3.serve import EngineConfig, LLMEngine, Request, SamplingParams


@dataclass(frozen=True)
class GenRMGroup:
    """One task's group of candidates and what the gates need (see :func:`tournament_rewards`)."""

    task: str
    candidates: list[str]
    lengths: list[int]
    reference_length: float
    format_ok: list[bool]


def judge_group(judge: Judge, group: GenRMGroup, config: GenRMConfig) -> tuple[list[float], Scorepad]:
    return tournament_rewards(
        judge, group.task, group.candidates, group.lengths, group.reference_length, group.format_ok, config
    )


class JudgeWorker:
    """A judge inside an actor: ``ray.remote(JudgeWorker).remote(judge, GenRMConfig())``. ``judge`` must be
    picklable (a class instance, not a lambda)."""

    def __init__(self, judge: Judge, config: GenRMConfig, num_threads: int = 1) -> None:
        torch.set_num_threads(num_threads)
        self.judge, self.config = judge, config

    def rewards(self, groups: list[GenRMGroup]) -> list[tuple[list[float], Scorepad]]:
        return [judge_group(self.judge, g, self.config) for g in groups]


class RayGenRM:
    """Judge actors behind one handle: groups are dealt round-robin, results come back in the groups' order."""

    def __init__(self, actors: list, timeout_s: float = 600.0) -> None:
        if not actors:
            raise ValueError("RayGenRM needs at least one judge actor")
        if not timeout_s > 0:
            raise ValueError(f"RayGenRM timeout_s must be > 0, got {timeout_s}")
        self.actors, self.timeout_s = actors, timeout_s

    def submit(self, groups: list[GenRMGroup]) -> list:
        """Start judging ``groups``; returns at once with one ref per actor used (pass them to :meth:`collect`)."""
        n = len(self.actors)
        return [a.rewards.remote(groups[i::n]) for i, a in enumerate(self.actors) if groups[i::n]]

    def collect(self, refs: list) -> list[tuple[list[float], Scorepad]]:
        """The results of :meth:`submit`, one ``(rewards, scorepad)`` per group in order."""
        import ray

        parts = ray.get(refs, timeout=self.timeout_s)
        n = len(self.actors)
        out: list = [None] * sum(len(p) for p in parts)
        for i, part in enumerate(parts):
            out[i::n] = part
        return out

    def rewards(self, groups: list[GenRMGroup]) -> list[tuple[list[float], Scorepad]]:
        return self.collect(self.submit(groups))


class TextTokenizer(Protocol):
    stop_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class EngineJudge:
    """A ``str → str`` judge: greedy generation of at most ``max_tokens`` tokens from ``model`` through openk3's
    serving engine, stopping at the tokenizer's stop token."""

    def __init__(self, model: nn.Module, tokenizer: TextTokenizer, max_tokens: int = 64,
                 config: EngineConfig | None = None) -> None:  # fmt: skip
        if max_tokens < 1:
            raise ValueError(f"EngineJudge max_tokens must be >= 1, got {max_tokens}")
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self.engine = LLMEngine(model.eval(), config or EngineConfig())
        self._n = 0

    @torch.no_grad()
    def __call__(self, prompt: str) -> str:
        self._n += 1
        params = SamplingParams(
            max_tokens=self.max_tokens, temperature=0.0, stop_token_ids=frozenset({self.tokenizer.stop_id})
        )
        rid = f"judge-{self._n}"
        out = self.engine.generate([Request(rid, self.tokenizer.encode(prompt), params)])
        return self.tokenizer.decode(out[rid])
