"""Rollouts from openk3's own serving engine, recording per generated token the behaviour log-prob, the
policy version and the segment.

The engine (:class:`openk3.serve.LLMEngine`: continuous batching over the paged cache, the KDA-aware
prefix cache) samples but does not report log-probs; :class:`LogprobRunner` is a thin adapter that
subclasses its :class:`~openk3.serve.model_runner.ModelRunner` and records
``log softmax(logits / T)[token]`` of every sampled token (``T`` = the request's temperature; 1 for greedy
requests, so a greedy log-prob is the policy's own), without changing what is sampled.

A :class:`Trajectory` is a prompt plus a list of :class:`Segment`: the tokens generated in one engine run
under one policy version. Partial rollout (:mod:`openk3.rl.partial_rollout`) appends segments across weight
updates; each token keeps the version that produced it (AReaL's ``accumulated_versions``).

A rollout engine never sheds load: its scheduler's ``queue_timeout_s`` is infinite (a serving engine
rejects requests that waited too long, which in a rollout batch larger than the running set would silently
lose samples on a slow machine); a request the engine still rejects raises ``RuntimeError``.

Weight sync (:meth:`RolloutEngine.sync_weights`) copies the trainer's parameters into the engine's model and
starts a fresh engine (an empty prefix cache), because cached latents and KDA states were computed with the
old weights; the version counter goes up by one.

Legend: ``B`` requests in a step, ``V`` vocabulary.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from openk3.serve import EngineConfig, LLMEngine, Request, SamplingParams
from openk3.serve.model_runner import ModelRunner, sample_tokens


class LogprobRunner(ModelRunner):
    """The engine's runner, also recording the log-prob of each sampled token in ``self.logprobs``
    (request id → float, overwritten every step)."""

    def __init__(self, base: ModelRunner) -> None:
        self.__dict__.update(base.__dict__)
        self.logprobs: dict[str, float] = {}

    def _sample(self, chunks, logits_BV: torch.Tensor, sampled: dict[str, int]) -> None:
        rows = [i for i, c in enumerate(chunks) if c.samples]
        if len(rows) < len(chunks):
            logits_BV = logits_BV[rows]
        if self.sample_vocab_size is not None:
            logits_BV = logits_BV[:, : self.sample_vocab_size]
        requests = [chunks[i].request for i in rows]
        tokens = sample_tokens(requests, logits_BV)
        temps = torch.tensor(
            [r.sampling_params.temperature or 1.0 for r in requests], device=logits_BV.device
        )
        logp_BV = torch.log_softmax(logits_BV.float() / temps[:, None], -1)
        picked = logp_BV.gather(-1, torch.tensor(tokens, device=logits_BV.device)[:, None])[:, 0].tolist()
        for r, t, lp in zip(requests, tokens, picked):
            sampled[r.request_id] = t
            self.logprobs[r.request_id] = lp


@dataclass
class Segment:
    """Tokens generated in one engine run under one policy version."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Behaviour log-probs (natural log), one per token."""
    version: int = 0
    observation: bool = False
    """Tokens an agent harness inserted (a tool's output, :mod:`openk3.rl.harness`), not sampled by the policy:
    their log-probs are 0 and they never train."""
    trains: bool = True
    """False for policy tokens whose context was rewritten after they were sampled (the harness elided an
    earlier observation): the trainer's forward would score them in a context they were not sampled in."""


@dataclass
class Trajectory:
    """One sample: the prompt, its segments, and whether and why it ended."""

    prompt_ids: list[int]
    max_tokens: int
    meta: dict = field(default_factory=dict)
    """Caller's labels (problem id, domain, effort, ...)."""
    segments: list[Segment] = field(default_factory=list)
    finish_reason: str | None = None
    """``"stop"`` or ``"length"`` once finished (an agentic rollout adds ``"failed"``: its sandbox died);
    ``None`` while unfinished."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def behaviour_logprobs(self) -> list[float]:
        return [lp for s in self.segments for lp in s.logprobs]

    @property
    def versions(self) -> list[int]:
        return [s.version for s in self.segments for _ in s.token_ids]

    @property
    def segment_ids(self) -> list[int]:
        return [i for i, s in enumerate(self.segments) for _ in s.token_ids]

    @property
    def loss_mask(self) -> list[float]:
        """Per response token: 1.0 for policy tokens that train, 0.0 for observations and elided contexts."""
        return [float(s.trains and not s.observation) for s in self.segments for _ in s.token_ids]

    @property
    def num_generated(self) -> int:
        """Response tokens, observation segments included (``max_tokens`` bounds this)."""
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def first_version(self) -> int | None:
        return self.segments[0].version if self.segments else None


@dataclass(frozen=True)
class RolloutSampling:
    temperature: float = 1.0
    stop_token_ids: frozenset[int] = frozenset()
    seed: int | None = None
    """Base seed; request ``i`` of a run gets ``seed + i`` (``None``: the global generator)."""


class RolloutEngine:
    """An :class:`LLMEngine` over a private copy of the policy, with log-prob recording and versions."""

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig | None = None,
        sampling: RolloutSampling | None = None,
        sample_vocab_size: int | None = None,
    ) -> None:
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        config = config or EngineConfig()
        self.config = replace(config, scheduler=replace(config.scheduler, queue_timeout_s=math.inf))
        self.sampling = sampling or RolloutSampling()
        self.sample_vocab_size = sample_vocab_size
        self.version = 0
        self._ids = itertools.count()
        self.pending: list[Request] = []
        """Requests beyond the engine's waiting-queue bound, admitted as the queue drains."""
        self._build()

    def _build(self) -> None:
        self.engine = LLMEngine(self.model, self.config, self.sample_vocab_size)
        self.runner = LogprobRunner(self.engine.runner)
        self.engine.runner = self.runner

    @torch.no_grad()
    def sync_weights(self, source: nn.Module | dict[str, torch.Tensor]) -> int:
        """Copy the trainer's parameters and buffers (a module or its ``state_dict``) into the engine's
        model; returns the new version.

        Raises ``RuntimeError`` while requests are running or queued (pause them first)."""
        if self.engine.has_unfinished_requests() or self.pending:
            raise RuntimeError("sync_weights: the engine still has requests; pause or finish them first")
        self.model.load_state_dict(source if isinstance(source, dict) else source.state_dict())
        self.version += 1
        self._build()
        return self.version

    def submit(self, trajectory: Trajectory) -> str:
        """Queue ``trajectory``: the prompt plus everything generated so far, for the tokens left. Requests
        beyond the engine's waiting-queue bound wait in :attr:`pending` and enter as the queue drains."""
        left = trajectory.max_tokens - trajectory.num_generated
        if left < 1:
            raise ValueError("submit: the trajectory has no tokens left")
        i = next(self._ids)
        seed = None if self.sampling.seed is None else self.sampling.seed + i
        params = SamplingParams(
            max_tokens=left,
            temperature=self.sampling.temperature,
            seed=seed,
            stop_token_ids=self.sampling.stop_token_ids,
        )
        rid = f"rl-{i}"
        self.pending.append(Request(rid, trajectory.prompt_ids + trajectory.response_ids, params))
        self._admit_pending()
        trajectory.segments.append(Segment(version=self.version))
        return rid

    def _admit_pending(self) -> None:
        room = self.config.scheduler.max_waiting - len(self.engine.scheduler.waiting)
        if room > 0 and self.pending:
            for request in self.pending[:room]:
                self.engine.add_request(request)
            del self.pending[:room]

    def step(self, active: dict[str, Trajectory]) -> list[Trajectory]:
        """One engine step; appends the new tokens to their trajectories; returns those that finished."""
        done = []
        self._admit_pending()
        for out in self.engine.step():
            traj = active.get(out.request_id)
            if traj is None:
                continue
            seg = traj.segments[-1]
            for t in out.new_token_ids:
                seg.token_ids.append(t)
                seg.logprobs.append(self.runner.logprobs[out.request_id])
            if out.finish_reason == "rejected":
                raise RuntimeError(f"rollout request {out.request_id} was rejected by the engine's scheduler")
            if out.finished and out.finish_reason in ("stop", "length"):
                traj.finish_reason = out.finish_reason
                done.append(active.pop(out.request_id))
            elif out.finished:
                active.pop(out.request_id)  # aborted: stays unfinished with what it has
        return done

    def generate(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """Run every trajectory to completion (synchronous rollout)."""
        active = {self.submit(t): t for t in trajectories}
        while active:
            self.step(active)
        return trajectories

    def abort(self, active: dict[str, Trajectory]) -> None:
        """Stop every active request; their trajectories keep the tokens generated so far."""
        queued = {r.request_id for r in self.pending}
        self.pending.clear()
        for rid in list(active):
            if rid in queued:
                del active[rid]
            else:
                self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests() or active:
            self.step(active)
            if not self.engine.has_unfinished_requests():
                active.clear()
