"""Agentic rollouts: multi-turn trajectories whose tool calls run in sandboxes, behind the same interface as
one :class:`~openk3.rl.rollout.RolloutEngine` (``generate``, ``sync_weights``, ``version``, ``sampling``,
``sample_vocab_size``), so :class:`~openk3.rl.step.PolicyTrainer` trains on them unchanged.

One trajectory's life (the multi-turn loop of AReaL's and verl's tool agent loops, with the sandbox lifecycle
of AgentENV, docs/sandbox.md):

1. the policy starts generating at once; meanwhile a worker thread creates the trajectory's sandbox from its
   task group's template, runs the group's ``setup``, and **pauses** it;
2. generation stops at ``</tool_call>`` (a stop token): the call is parsed, and a worker **resumes** the
   sandbox, runs the command, **pauses** it again; the other trajectories keep generating meanwhile;
3. the observation is appended (loss mask 0, :mod:`openk3.rl.harness`) and the trajectory is re-submitted
   as prompt + response so far (the engine's prefix cache serves the prefix);
4. it ends at the stop token or when ``max_tokens`` (response tokens, observations included) is spent;
5. :meth:`AgenticRollout.outcome` judges it: a task group with ``judge_in_fork`` gets a **fork** of the
   trajectory's sandbox (killed afterwards), so the judge never touches the trajectory's own sandbox.

A sandbox that dies (:class:`~openk3.rl.tool_sandbox.SandboxDiedError`: creation, setup, a tool call, a pause or
resume fails) ends its trajectory at once with ``finish_reason="failed"``; it is never retried, its
``outcome`` raises, so the trainer drops the rollout and counts it (``dropped_rollouts``); ``stats`` counts
the failures. Sandboxes live until the next :meth:`AgenticRollout.generate` (or :meth:`release`), so the
rewards of the batch can fork them.

Legend: none (token lists, no tensors).
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import contextlib
from dataclasses import dataclass

from openk3.rl.harness import AgentTokenizer, Harness, HarnessConfig, ToolCall, last_turn_ids
from openk3.rl.rollout import Trajectory
from openk3.rl.tool_sandbox import SandboxDiedError, SandboxFactory, ToolSandbox


class AgenticTaskGroup(abc.ABC):
    """A family of agentic tasks: its harness, its sandbox template, how a task is put into a fresh sandbox and
    how a finished trajectory is judged. ``meta`` is the trajectory's label dict (``meta["group"]`` names the
    group; the rest is the group's own, e.g. the task's data)."""

    name: str
    harness: HarnessConfig
    template: str = "base"
    judge_in_fork: bool = False
    """Whether :meth:`reward` gets a running fork of the trajectory's sandbox (else ``None``)."""

    @abc.abstractmethod
    def task(self, meta: dict) -> str:
        """The task text that follows the system prompt."""

    @abc.abstractmethod
    def setup(self, sandbox: ToolSandbox, meta: dict) -> None:
        """Put the task into a fresh running sandbox."""

    @abc.abstractmethod
    def reward(self, final_text: str, meta: dict, judge: ToolSandbox | None) -> float:
        """The trajectory's reward from the text of its last turn and, with ``judge_in_fork``, a fork of its
        sandbox to run checks in."""


@dataclass(frozen=True)
class AgenticConfig:
    sandbox_workers: int = 2
    """Threads that create, set up, resume, run and pause sandboxes while the engine generates."""
    sandbox_timeout_s: float = 600.0
    """Running life of each sandbox (the server kills a running sandbox past it)."""

    def __post_init__(self) -> None:
        if self.sandbox_workers < 1:
            raise ValueError(f"AgenticConfig.sandbox_workers must be >= 1, got {self.sandbox_workers}")
        if not self.sandbox_timeout_s > 0:
            raise ValueError(f"AgenticConfig.sandbox_timeout_s must be > 0, got {self.sandbox_timeout_s}")


def final_text(tokenizer: AgentTokenizer, trajectory: Trajectory) -> str:
    """The text of the policy's tokens after the last observation (the answer turn)."""
    return tokenizer.decode(last_turn_ids(trajectory))


class AgenticRollout:
    """Agentic rollouts over ``engine`` (a :class:`~openk3.rl.rollout.RolloutEngine` whose sampling stops at
    the tokenizer's stop token and ``</tool_call>``). Raises ``ValueError`` when a stop token is missing or
    two groups share a name, and :class:`~openk3.rl.tool_sandbox.SandboxServerError` when the sandbox server
    cannot be reached (``sandboxes.check()``)."""

    def __init__(self, engine, tokenizer: AgentTokenizer, groups: list[AgenticTaskGroup],
                 sandboxes: SandboxFactory, config: AgenticConfig | None = None) -> None:  # fmt: skip
        self.engine, self.tokenizer, self.sandboxes = engine, tokenizer, sandboxes
        self.config = config or AgenticConfig()
        self.groups = {g.name: g for g in groups}
        if len(self.groups) != len(groups):
            raise ValueError(f"task group names must be unique, got {[g.name for g in groups]}")
        self.harnesses = {g.name: Harness(g.harness, tokenizer) for g in groups}
        need = {tokenizer.stop_id, next(iter(self.harnesses.values())).call_end_id}
        if not need <= set(engine.sampling.stop_token_ids):
            raise ValueError(
                f"the engine's sampling must stop at the stop token and </tool_call> (ids {sorted(need)}), got "
                f"stop_token_ids={sorted(engine.sampling.stop_token_ids)}"
            )
        sandboxes.check()
        self._live: dict[str, ToolSandbox] = {}
        self.stats = {"tool_calls": 0, "failed_trajectories": 0}

    # -- the engine interface the trainer uses ---------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def sampling(self):
        return self.engine.sampling

    @property
    def sample_vocab_size(self) -> int | None:
        return self.engine.sample_vocab_size

    def sync_weights(self, source) -> int:
        return self.engine.sync_weights(source)

    # -- prompts and rollouts --------------------------------------------------------------------------------

    def _group(self, meta: dict) -> AgenticTaskGroup:
        name = meta.get("group")
        if name not in self.groups:
            raise ValueError(f"meta['group'] must name a task group {sorted(self.groups)}, got {name!r}")
        return self.groups[name]

    def prompt_ids(self, meta: dict) -> list[int]:
        """System prompt (the group's tools) + the task of ``meta``, tokenized."""
        group = self._group(meta)
        return self.harnesses[group.name].prompt_ids(group.task(meta))

    def _start(self, group: AgenticTaskGroup, meta: dict) -> ToolSandbox:
        sb = self.sandboxes.create(group.template, self.config.sandbox_timeout_s)
        meta["agent"]["sandbox_id"] = sb.sandbox_id
        try:
            group.setup(sb, meta)
            sb.pause()
        except BaseException:
            with contextlib.suppress(SandboxDiedError):
                sb.kill()
            raise
        return sb

    def _call(self, created: cf.Future, harness: Harness, call: ToolCall | str) -> str:
        sb = created.result()  # raises SandboxDiedError when creation or setup failed
        if isinstance(call, str):  # a malformed call: answered without touching the sandbox
            return call
        sb.resume()
        text = harness.execute(call, sb)
        sb.pause()
        return text

    def generate(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """Run every trajectory to its end (stop token, ``max_tokens`` or a dead sandbox). Releases the
        sandboxes of the previous batch first."""
        self.release()
        groups = [self._group(t.meta) for t in trajectories]
        pool = cf.ThreadPoolExecutor(self.config.sandbox_workers, thread_name_prefix="sandbox")
        sandbox: dict[int, cf.Future] = {}
        try:
            # creation jobs are queued before any tool job, so a tool job only waits on a started creation
            for t in trajectories:
                t.meta["agent"] = {"tool_calls": 0, "sandbox_id": None, "failed": None}
            sandbox = {
                i: pool.submit(self._start, g, t.meta) for i, (g, t) in enumerate(zip(groups, trajectories))
            }
            index = {id(t): i for i, t in enumerate(trajectories)}
            active = {self.engine.submit(t): t for t in trajectories}
            calls: dict[int, cf.Future] = {}
            while active or calls:
                if active:
                    for t in self.engine.step(active):
                        i = index[id(t)]
                        harness = self.harnesses[groups[i].name]
                        if t.finish_reason == "stop" and harness.pending_call(t):
                            call = harness.parse_call(t)
                            if t.meta["agent"]["tool_calls"] >= harness.config.context.max_turns:
                                call = (
                                    f"error: no tool calls left (at most {harness.config.context.max_turns})"
                                )
                            elif isinstance(call, ToolCall):
                                t.meta["agent"]["tool_calls"] += 1
                                self.stats["tool_calls"] += 1
                            # one call in flight per trajectory: it waits only for the sandbox's creation
                            calls[i] = pool.submit(self._call, sandbox[i], harness, call)
                else:
                    cf.wait(list(calls.values()), return_when=cf.FIRST_COMPLETED)
                for i in [i for i, f in calls.items() if f.done()]:
                    self._observe(trajectories[i], groups[i], calls.pop(i), active)
        finally:
            pool.shutdown(wait=True)
            for i, created in sandbox.items():  # every sandbox made is held (to judge and to release)
                self._settle(trajectories[i], created)
        return trajectories

    def _fail(self, t: Trajectory, reason: str) -> None:
        t.finish_reason = "failed"
        t.meta["agent"]["failed"] = reason
        self.stats["failed_trajectories"] += 1

    def _observe(self, t: Trajectory, group: AgenticTaskGroup, call: cf.Future, active: dict) -> None:
        try:
            text = call.result()
        except SandboxDiedError as e:
            self._fail(t, str(e))
            return
        self.harnesses[group.name].append_observation(t, text, self.engine.version)
        if t.num_generated >= t.max_tokens:
            t.finish_reason = "length"
            return
        t.finish_reason = None
        active[self.engine.submit(t)] = t

    def _settle(self, t: Trajectory, sandbox: cf.Future) -> None:
        try:
            sb = sandbox.result()
        except SandboxDiedError as e:
            if t.finish_reason != "failed":
                self._fail(t, str(e))
            return
        self._live[sb.sandbox_id] = sb
        if t.finish_reason == "failed":  # died in a call, or came back but is of no use: free it now
            self.release([t])

    # -- rewards and cleanup ---------------------------------------------------------------------------------

    def outcome(self, trajectory: Trajectory) -> float:
        """The group's reward of a finished trajectory, judged in a fork of its sandbox where the group asks
        for one. Raises :class:`SandboxDiedError` for a failed trajectory or a fork that fails (the trainer drops
        the rollout and counts it)."""
        info = trajectory.meta.get("agent")
        if info is None:
            raise ValueError("outcome: the trajectory did not come from AgenticRollout.generate")
        if trajectory.finish_reason == "failed":
            raise SandboxDiedError(f"trajectory failed: {info['failed']}")
        group = self._group(trajectory.meta)
        text = final_text(self.tokenizer, trajectory)
        if not group.judge_in_fork:
            return float(group.reward(text, trajectory.meta, None))
        judge = self._live[info["sandbox_id"]].fork()
        try:
            return float(group.reward(text, trajectory.meta, judge))
        finally:
            with contextlib.suppress(SandboxDiedError):
                judge.kill()

    def release(self, trajectories: list[Trajectory] | None = None) -> None:
        """Kill the sandboxes of ``trajectories`` (all held ones when ``None``)."""
        ids = (
            list(self._live)
            if trajectories is None
            else [t.meta.get("agent", {}).get("sandbox_id") for t in trajectories]
        )
        for sid in ids:
            sb = self._live.pop(sid, None)
            if sb is not None:
                with contextlib.suppress(SandboxDiedError):
                    sb.kill()
