"""The demo recipe: K3's post-training pipeline end to end on a CPU.

1. **SFT** a K3-shaped base on both domains (:mod:`openk3.rl.tasks`), each problem written at a random effort
   whose tag is *not* tied to the format (the base cannot follow the tag yet).
2. **RL experts**, one per (domain, effort): the high-effort expert first, on correctness alone; its correct
   lengths on the training problems give ``b0(x)`` (fixed from then on), and the shortest correct length over
   its samples and the SFT base's gives the floor; the medium and low experts start from the SFT base and
   train with the budget reward at the effort's ``τ``.
3. **Sequence-level distillation warm start** (Kim & Rush arXiv 1606.07947; the off-policy stage before
   on-policy distillation in Qwen3 arXiv 2505.09388 and Thinking Machines' "On-Policy Distillation"): each
   expert answers fresh problems of its domain greedily under its effort tag (its mode, the output the table
   scores), every response that stopped is kept, right or wrong, and the student, the SFT base, is
   fine-tuned on them, balanced over (domain, effort), so that it starts MOPD following the tag.
4. **MOPD**: the warm-started student samples every (domain, effort) equally often; each token is rewarded
   by the clipped log-ratio against the teacher of that (domain, effort).

Each stage's history is plotted at the end (``<out>/<stage>.png``: reward, length, over-budget fraction and
held-out accuracy against steps) and ``<out>/results.md`` holds the final table: accuracy and mean length per
domain and effort, student against teacher (greedy decoding), on a second held-out set (``table_problems``,
240 per domain by default, against the stages' 48).

Problem sets, disjoint and drawn in this order from the config's seed: the RL training problems, the
held-out problems of the stages' evaluations, the table's held-out problems, the warm start's problems.
The SFT set holds none of the first three.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import openk3
from openk3.rl.loss import LossConfig
from openk3.rl.rewards.budget import BudgetTable, EffortLevels, budget_limit, budget_reward
from openk3.rl.rewards.mopd import Teacher, TeacherRegistry, mopd_reward, teacher_logprobs
from openk3.rl.rollout import RolloutEngine, RolloutSampling, Trajectory
from openk3.rl.sft import sft
from openk3.rl.step import PolicyTrainer, RLConfig
from openk3.rl.tasks import (
    DOMAINS,
    EFFORTS,
    CharTokenizer,
    Problem,
    is_correct,
    sample_problem,
    solution,
    written_effort,
)
from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig

MUL_PROBLEMS = 900 * 8
"""Distinct mul problems (three-digit number times a digit 2–9): the smaller domain bounds the problem sets."""


@dataclass
class DemoConfig:
    """Sizes of the demo (the defaults are the measured default run, ``docs/LOG.md``). Steps count optimiser
    updates; an RL step samples ``prompts_per_step × group_size`` rollouts of at most ``max_tokens`` tokens;
    ``high_steps`` per high-effort expert, ``effort_steps`` per medium/low expert; the held-out accuracy is
    measured every ``eval_every`` steps on ``eval_problems`` problems per domain (greedy); the final table on
    ``table_problems`` others."""

    depth: int = 4
    """K3-shaped depth (``k3_shaped``; 8 is k3-tiny)."""
    sft_steps: int = 1000
    sft_batch: int = 32
    sft_lr: float = 2e-3
    high_steps: int = 12
    effort_steps: int = 16
    """At 24 steps the medium and low experts' held-out lengths had settled by step 16 and their accuracy
    did not rise after it (``docs/LOG.md``)."""
    distill_problems: int = 384
    """Fresh problems per domain each expert answers (greedily) for the warm start."""
    distill_steps: int = 300
    distill_lr: float = 1e-3
    """At 5e-4 for 300 steps the student wrote the bare answer under the medium tag (mul 0.80 of the time
    against the teacher's 0.14); 1e-3 or 600 steps made it follow the tag (``docs/LOG.md``)."""
    mopd_steps: int = 24
    prompts_per_step: int = 6
    group_size: int = 6
    rl_lr: float = 2e-4
    mopd_lr: float = 5e-5
    """The student's learning rate in MOPD (the experts train at ``rl_lr``)."""
    max_tokens: int = 32
    train_problems: int = 48
    eval_problems: int = 48
    eval_every: int = 8
    table_problems: int = 240
    """Held-out problems per domain of the final table: at 48 one draw moved a cell by up to 8 points."""
    rho: float = 0.9
    """b0's percentile of the high expert's correct lengths: high enough that b0 is its scratchpad's length
    while the expert still writes every format (at 0.5 b0 is the carry format's, and τ·b0 shuts it out)."""
    budget_samples: int = 16
    """Samples per training problem from the high-effort expert for ``b0``."""
    floor_samples: int = 32
    """Samples per training problem from the SFT base for the floor ``min_correct``."""
    r_max: float = 2.0
    efforts: EffortLevels = field(
        default_factory=lambda: EffortLevels((("low", 0.35), ("medium", 0.8), ("high", 2.0)))
    )
    """τ per effort. With b0 at the scratchpad's length, 0.8 admits the medium format and shuts out the
    scratchpad, 0.35 admits the bare answer and shuts out the medium format, on every problem of both
    domains (checked in the tests; 0.4 still admits the carry format on part of them); the high expert
    trains on correctness alone."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "sft_steps",
            "distill_problems",
            "distill_steps",
            "high_steps",
            "effort_steps",
            "mopd_steps",
            "prompts_per_step",
            "train_problems",
            "budget_samples",
            "floor_samples",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("depth", "sft_batch", "group_size", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("sft_lr", "distill_lr", "rl_lr", "mopd_lr", "r_max"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be positive and finite, got {getattr(self, name)}")
        if not 0 < self.rho <= 1:
            raise ValueError(f"rho is a percentile in (0, 1], got {self.rho}")
        drawn = self.train_problems + self.eval_problems + self.table_problems + self.distill_problems
        if drawn > MUL_PROBLEMS // 2:
            raise ValueError(
                f"train_problems + eval_problems + table_problems + distill_problems = {drawn} distinct problems "
                f"per domain; mul has {MUL_PROBLEMS}, and at most half of them may be set aside"
            )
        if self.eval_problems < 1 or self.eval_every < 1 or self.table_problems < 1:
            raise ValueError("eval_problems, eval_every and table_problems must be >= 1")
        if self.prompts_per_step % (len(DOMAINS) * len(EFFORTS)):
            raise ValueError(
                f"prompts_per_step must be a multiple of {len(DOMAINS) * len(EFFORTS)} (MOPD samples every "
                f"(domain, effort) equally), got {self.prompts_per_step}"
            )
        if tuple(self.efforts.names) != ("low", "medium", "high"):
            raise ValueError(f"the demo's efforts are low, medium, high; got {self.efforts.names}")


def quick_config() -> DemoConfig:
    """A few minutes on 2 CPU cores: every stage runs, too short to learn much."""
    return DemoConfig(
        sft_steps=40, sft_batch=16, distill_problems=4, distill_steps=4, high_steps=2, effort_steps=2,
        mopd_steps=3, prompts_per_step=6,
        group_size=4, train_problems=8, eval_problems=4, table_problems=4, eval_every=2,
    )  # fmt: skip


Route = Callable[[str, str], tuple[str, str]]
"""``(domain, effort)`` of a rollout → ``(domain, effort)`` of the teacher that scores it."""


def mopd_dense_reward(
    registry: TeacherRegistry, trajs: list[Trajectory], r_max: float, route: Route | None = None
) -> torch.Tensor:
    """The MOPD reward ``[B, T]`` of finished rollouts (``meta`` holds ``domain`` and ``effort``): each
    rollout's realised tokens scored by the teacher ``registry.get(*route(domain, effort))`` (identity
    routing by default), one prefill per teacher, against the rollout's behaviour log-probs, clipped at
    ``r_max`` (:func:`openk3.rl.rewards.mopd.mopd_reward`); 0 past each rollout's end."""
    T = max(t.num_generated for t in trajs)
    s_BT = torch.zeros(len(trajs), T)
    t_BT = torch.zeros(len(trajs), T)
    m_BT = torch.zeros(len(trajs), T)
    keys = []
    for b, t in enumerate(trajs):
        n = t.num_generated
        s_BT[b, :n] = torch.tensor(t.behaviour_logprobs)
        m_BT[b, :n] = 1
        d, e = t.meta["domain"], t.meta["effort"]
        keys.append(route(d, e) if route is not None else (d, e))
    for key in sorted(set(keys)):
        rows = [b for b, k in enumerate(keys) if k == key]
        lp = teacher_logprobs(
            registry.get(*key), [trajs[b].prompt_ids for b in rows], [trajs[b].response_ids for b in rows]
        )
        for i, b in enumerate(rows):
            t_BT[b, : lp.shape[1]] = lp[i]
    return mopd_reward(t_BT, s_BT, m_BT, r_max)


def engine_config(max_tokens: int) -> EngineConfig:
    """The rollout engine's sizes: 128 sequences decode together. Each running request holds its KDA state
    (55 pages of 2 KiB at depth 4) besides its latent blocks, so the pool is sized in MiB: at 1,024 blocks
    only 16 requests fit and a batch of rollouts ran in waves of 16 (4× slower, ``docs/LOG.md``)."""
    return EngineConfig(
        CacheConfig(block_size=8, pool_mib=48.0, checkpoint_interval=1),
        SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=128, long_prefill_token_threshold=64,
                        max_model_len=64 + max_tokens),
    )  # fmt: skip


class Demo:
    def __init__(self, config: DemoConfig, out_dir: Path) -> None:
        self.cfg, self.out = config, Path(out_dir)
        check_out_dir(self.out)
        self.tok = CharTokenizer()
        rng = random.Random(config.seed)
        self.train = {d: self._unique(d, config.train_problems, rng, set()) for d in DOMAINS}
        seen = {p.id for ps in self.train.values() for p in ps}
        self.eval = {d: self._unique(d, config.eval_problems, rng, seen) for d in DOMAINS}
        self.table_set = {d: self._unique(d, config.table_problems, rng, seen) for d in DOMAINS}
        self.distill = {d: self._unique(d, config.distill_problems, rng, seen) for d in DOMAINS}
        self.budgets = BudgetTable(config.rho)
        self.history: dict[str, list[dict]] = {}
        self.log_lines: list[str] = []
        self.seconds: dict[str, float] = {}
        """Wall time of each stage (:meth:`timed`), in run order."""

    @staticmethod
    def _unique(domain, n, rng, seen) -> list[Problem]:
        out = []
        while len(out) < n:
            p = sample_problem(domain, rng)
            if p.id not in seen:
                seen.add(p.id)
                out.append(p)
        return out

    def outputs(self) -> Path:
        """The output folder, created on the first write (:func:`check_out_dir` checked it)."""
        self.out.mkdir(parents=True, exist_ok=True)
        return self.out

    def log(self, text: str) -> None:
        print(text, flush=True)
        self.log_lines.append(text)

    @contextlib.contextmanager
    def timed(self, name: str):
        """Time the block as stage ``name`` into :attr:`seconds` and log it."""
        t0 = time.monotonic()
        yield
        self.seconds[name] = time.monotonic() - t0
        self.log(f"[time] {name} {self.seconds[name]:.0f} s")

    def engine(self, model, temperature: float) -> RolloutEngine:
        return RolloutEngine(
            model,
            engine_config(self.cfg.max_tokens),
            RolloutSampling(temperature, frozenset({self.tok.stop_id}), self.cfg.seed),
        )

    # ---- evaluation ------------------------------------------------------------------------------------
    def evaluate(self, model, domain: str, effort: str, table: bool = False) -> dict[str, float]:
        """Greedy accuracy, mean length (tokens) and the fraction of responses written in each effort's format
        (:func:`~openk3.rl.tasks.written_effort`) on the held-out problems of ``domain`` at ``effort``: the
        stages' (``eval_problems``), or with ``table`` the final table's (``table_problems``)."""
        eng = self.engine(model, 0.0)
        probs = (self.table_set if table else self.eval)[domain]
        trajs = eng.generate(
            [Trajectory(self.tok.encode(p.prompt(effort)), self.cfg.max_tokens) for p in probs]
        )
        texts = [self.tok.decode(t.response_ids) for t in trajs]
        acc = [is_correct(p, x) for p, x in zip(probs, texts)]
        lengths = [t.num_generated for t in trajs]
        written = [written_effort(p, x) for p, x in zip(probs, texts)]
        return {
            "accuracy": sum(acc) / len(acc),
            "length": sum(lengths) / len(lengths),
            "formats": {f: written.count(f) / len(written) for f in (*EFFORTS, "other")},
        }

    # ---- stages ----------------------------------------------------------------------------------------
    def sft_examples(self) -> list[tuple[list[int], list[int]]]:
        """``sft_steps × sft_batch`` (prompt ids, response ids + stop) pairs, one per problem drawn (domains
        uniform; a mul problem may repeat, there are only 7,200), none of them an RL training or held-out
        problem (of the stages or the table): the experts then meet their problems for the first time in RL and must learn a method
        rather than recall a memorised answer (with the RL problems in the SFT set the medium and low
        experts kept memorised short answers, ``docs/LOG.md``). Each problem is written at a random effort
        under an independently random tag: the base cannot follow the tag yet."""
        cfg = self.cfg
        rng = random.Random(cfg.seed + 1)
        reserved = {
            p.id for ps in (*self.train.values(), *self.eval.values(), *self.table_set.values()) for p in ps
        }
        examples = []
        while len(examples) < cfg.sft_steps * cfg.sft_batch:
            p = sample_problem(rng.choice(DOMAINS), rng)
            if p.id in reserved:
                continue
            examples.append(
                (
                    self.tok.encode(p.prompt(rng.choice(EFFORTS))),
                    self.tok.encode(solution(p, rng.choice(EFFORTS))) + [self.tok.stop_id],
                )
            )
        return examples

    def stage_sft(self) -> torch.nn.Module:
        cfg = self.cfg
        text = openk3.presets.k3_shaped(cfg.depth, vocab_size=self.tok.vocab_size)
        model = openk3.build_model(text, seed=cfg.seed)
        examples = self.sft_examples()
        hist = []
        every = max(1, cfg.sft_steps // 6)

        def on_eval(step: int, losses: list[float]) -> None:
            recent = losses[-every:]
            ev = {f"{d}/acc": self.evaluate(model, d, "high")["accuracy"] for d in DOMAINS}
            hist.append({"step": step, "loss": sum(recent) / len(recent), **ev})
            self.log(
                f"[sft] step {step}/{cfg.sft_steps} loss {hist[-1]['loss']:.3f} "
                + " ".join(f"{k} {v:.2f}" for k, v in ev.items())
            )

        sft(
            model,
            examples,
            cfg.sft_steps,
            cfg.sft_batch,
            cfg.sft_lr,
            cfg.seed,
            on_eval,
            every,
        )
        model.eval()
        self.history["sft"] = hist
        return model

    def _rl(self, name: str, init, domain: str, effort: str, steps: int, tau: float | None):
        """An RL expert from ``init`` on ``domain`` under ``effort``'s tag: correctness (``tau=None``) or the
        budget reward at ``tau``."""
        cfg = self.cfg
        model = copy.deepcopy(init).train()
        engine = self.engine(model, 1.0)
        trainer = PolicyTrainer(
            model, engine, RLConfig(cfg.group_size, cfg.max_tokens, cfg.rl_lr, loss=LossConfig())
        )
        rng = random.Random(100 * cfg.seed + 10 * DOMAINS.index(domain) + EFFORTS.index(effort))
        hist = []
        for step in range(steps):
            problems = rng.sample(self.train[domain], min(cfg.prompts_per_step, len(self.train[domain])))
            over: list[bool] = []
            stats, _ = trainer.step(
                [self.tok.encode(p.prompt(effort)) for p in problems],
                [{"problem": p} for p in problems],
                functools.partial(self.outcome, tau=tau, over=over),
            )
            row = {"step": step + 1, "reward": stats["reward"], "length": stats["length"],
                   "over_budget": sum(over) / len(over) if over else 0.0, "tau": tau}  # fmt: skip
            if (step + 1) % cfg.eval_every == 0 or step + 1 == steps:
                model.eval()
                ev = self.evaluate(model, domain, effort)
                row.update(accuracy=ev["accuracy"], eval_length=ev["length"], formats=ev["formats"])
                model.train()
            hist.append(row)
            self.log(
                f"[{name}] "
                + " ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
            )
        self.history[name] = hist
        return model.eval()

    def outcome(self, t: Trajectory, tau: float | None, over: list[bool]) -> float:
        """Correctness (1/0), or the budget reward at ``tau``; appends whether ``t`` was over budget."""
        p = t.meta["problem"]
        correct = float(is_correct(p, self.tok.decode(t.response_ids)))
        if tau is None:
            return correct
        b = self.budgets.get(p.id)
        over.append(b is not None and t.num_generated > budget_limit(b, tau))
        return budget_reward(correct, t.num_generated, b, tau)

    def _samples(self, model, problems: list[Problem], n: int) -> list[list[tuple[int, str]]]:
        """``n`` samples (temperature 1, tag ``H``) per problem: ``(length, text)`` per sample, per problem."""
        trajs = self.engine(model, 1.0).generate(
            [
                Trajectory(self.tok.encode(p.prompt("high")), self.cfg.max_tokens)
                for p in problems
                for _ in range(n)
            ]
        )
        return [
            [(t.num_generated, self.tok.decode(t.response_ids)) for t in trajs[i * n : (i + 1) * n]]
            for i in range(len(problems))
        ]

    def estimate_budgets(self, expert, base, domain: str) -> None:
        """b0(x) from the high-effort expert: the ρ-percentile of its correct lengths over ``budget_samples``
        samples per training problem (temperature 1). The floor ``min_correct`` is the shortest correct
        length over those and ``floor_samples`` samples of the SFT ``base``: the high expert writes the
        scratchpad, so its own shortest correct length is the scratchpad's and ``max(⌊τ·b0⌋, min_correct)``
        would not bite; the base writes every format. Logs b0 against the length of each effort's format,
        the floor's format and, per effort, the fraction of problems whose limit admits the format of that
        effort and excludes the next longer one."""
        problems = self.train[domain]
        ref = self._samples(expert, problems, self.cfg.budget_samples)
        floor = self._samples(base, problems, self.cfg.floor_samples)
        rows = []
        for p, group, extra in zip(problems, ref, floor):
            got = self.budgets.estimate(
                p.id,
                [n for n, _ in group],
                [is_correct(p, x) for _, x in group],
                [n for n, x in extra if is_correct(p, x)],
            )
            rows.append((p, got, [written_effort(p, x) for _, x in group if is_correct(p, x)]))
        have = [(p, b) for p, b, _ in rows if b is not None]
        written = [f for _, _, fs in rows for f in fs]
        summary = {
            "problems": len(problems),
            "with_b0": len(have),
            "b0_mean": sum(b.b0 for _, b in have) / max(1, len(have)),
            "format_lengths": {
                e: sum(len(solution(p, e)) + 1 for p, _ in have) / max(1, len(have)) for e in EFFORTS
            },
            "correct_formats": {f: written.count(f) / max(1, len(written)) for f in (*EFFORTS, "other")},
            "floor_at_most": {  # fraction of problems whose floor is at most each format's length
                e: sum(b.min_correct <= len(solution(p, e)) + 1 for p, b in have) / max(1, len(have))
                for e in EFFORTS
            },
            "limits": {},
        }
        for e in ("medium", "low"):
            tau = self.cfg.efforts.tau(e)
            longer = EFFORTS[EFFORTS.index(e) - 1]
            lim = [budget_limit(b, tau) for _, b in have]
            fits = [len(solution(p, e)) + 1 <= L for (p, _), L in zip(have, lim)]  # + the stop token
            shut = [len(solution(p, longer)) + 1 > L for (p, _), L in zip(have, lim)]
            summary["limits"][e] = {
                "tau": tau,
                "limit_mean": sum(lim) / max(1, len(lim)),
                "admits_own_format": sum(fits) / max(1, len(fits)),
                "excludes_longer_format": sum(shut) / max(1, len(shut)),
            }
        self.history[f"budget-{domain}"] = [summary]
        self.log(f"[budget] {domain}: " + json.dumps(summary))

    def stage_experts(self, base) -> dict[tuple[str, str], torch.nn.Module]:
        """Per domain: the high expert from ``base`` on correctness; the budgets (:meth:`estimate_budgets`);
        then the medium and low experts, each from ``base`` (which writes every format) at its effort's τ.
        Started from the high expert instead, they sample the shorter formats too rarely once the limit bites,
        and fall to short wrong answers (``docs/LOG.md``)."""
        cfg, experts = self.cfg, {}
        for d in DOMAINS:
            with self.timed(f"rl-{d}-high"):
                high = self._rl(f"rl-{d}-high", base, d, "high", cfg.high_steps, None)
            experts[(d, "high")] = high
            with self.timed(f"budget-{d}"):
                self.estimate_budgets(high, base, d)
            for e in ("medium", "low"):
                with self.timed(f"rl-{d}-{e}"):
                    experts[(d, e)] = self._rl(
                        f"rl-{d}-{e}", base, d, e, cfg.effort_steps, cfg.efforts.tau(e)
                    )
        return experts

    def mopd_prompts(self, rng: random.Random) -> tuple[list[list[int]], list[dict]]:
        """One MOPD step's prompts and metas: every (domain, effort) ``prompts_per_step / 6`` times, each
        on a training problem of its domain drawn by ``rng``, under that effort's tag."""
        per = self.cfg.prompts_per_step // (len(DOMAINS) * len(EFFORTS))
        keys = [(d, e) for d in DOMAINS for e in EFFORTS] * per
        problems = [rng.choice(self.train[d]) for d, _ in keys]
        return (
            [self.tok.encode(p.prompt(e)) for p, (_, e) in zip(problems, keys)],
            [{"domain": d, "effort": e} for d, e in keys],
        )

    def stage_distill(self, base, experts) -> torch.nn.Module:
        """The student's warm start: ``base`` fine-tuned on the experts' greedy answers. Each expert answers
        the ``distill_problems`` warm-start problems of its domain under its effort tag at temperature 0, and
        every response that stopped is kept, right or wrong: the student learns each teacher's mode, which is
        what the table compares it with. Each (domain, effort)'s kept responses are resampled to the largest
        count, so every tag weighs the same; then :func:`~openk3.rl.sft.sft` for ``distill_steps`` batches of
        ``sft_batch`` at ``distill_lr``. An expert with nothing to keep adds nothing (logged); with nothing
        kept at all the student is the SFT base. The temperature-1 samples of the RL problems, filtered by
        correctness (high) or the budget (medium, low), left mul 18–25 points below its high expert and the
        bare answer under the medium tag (``docs/LOG.md``)."""
        cfg = self.cfg
        rng = random.Random(cfg.seed + 5)
        kept: dict[tuple[str, str], list[tuple[list[int], list[int]]]] = {}
        for (d, e), expert in experts.items():
            trajs = self.engine(expert, 0.0).generate(
                [Trajectory(self.tok.encode(p.prompt(e)), cfg.max_tokens) for p in self.distill[d]]
            )
            kept[(d, e)] = [(t.prompt_ids, t.response_ids) for t in trajs if t.finish_reason == "stop"]
        self.log(
            "[distill] kept answers per (domain, effort): "
            + ", ".join(f"{d}-{e} {len(v)}/{len(self.distill[d])}" for (d, e), v in kept.items())
        )
        model = copy.deepcopy(base)
        most = max(len(v) for v in kept.values())
        if most == 0:
            self.log("[distill] no expert sample to keep: the student starts from the SFT base")
            return model.eval()
        examples = [x for v in kept.values() if v for x in v + rng.choices(v, k=most - len(v))]
        hist = []
        every = max(1, cfg.distill_steps // 4)

        def on_eval(step: int, losses: list[float]) -> None:
            recent = losses[-every:]
            evs = {(d, e): self.evaluate(model, d, e) for d in DOMAINS for e in EFFORTS}
            row = {"step": step, "loss": sum(recent) / len(recent)}
            row["accuracy"] = sum(v["accuracy"] for v in evs.values()) / len(evs)
            for e in EFFORTS:
                row[f"eval_length_{e}"] = sum(evs[(d, e)]["length"] for d in DOMAINS) / len(DOMAINS)
            hist.append(row)
            self.log(
                "[distill] "
                + " ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
            )

        sft(model, examples, cfg.distill_steps, cfg.sft_batch, cfg.distill_lr, cfg.seed + 5, on_eval, every)
        self.history["distill"] = hist
        return model.eval()

    def stage_mopd(
        self, base, experts, name: str = "mopd", r_max: float | None = None, route: Route | None = None
    ) -> torch.nn.Module:
        """The student from ``base`` (the warm start of :meth:`stage_distill`), distilled from ``experts`` for
        ``mopd_steps``; each step samples every (domain, effort) ``prompts_per_step / 6`` times, each on a
        random training problem of its domain. ``r_max`` overrides the
        config's clip (``math.inf``: no clip) and ``route`` the teacher routing (both for the ablations of
        ``benchmarks/mopd_ablation.py``); the history is kept under ``name``."""
        cfg = self.cfg
        registry = TeacherRegistry(self.tok.tokenizer_id)
        for (d, e), m in experts.items():
            registry.register(d, e, Teacher(m, self.tok.tokenizer_id, f"{d}-{e}"))
        model = copy.deepcopy(base).train()
        engine = self.engine(model, 1.0)
        trainer = PolicyTrainer(
            model, engine, RLConfig(cfg.group_size, cfg.max_tokens, cfg.mopd_lr, loss=LossConfig())
        )
        rng = random.Random(cfg.seed + 7)
        hist = []

        r_max = cfg.r_max if r_max is None else r_max

        def dense(trajs: list[Trajectory]) -> torch.Tensor:
            return mopd_dense_reward(registry, trajs, r_max, route)

        for step in range(cfg.mopd_steps):
            prompts, metas = self.mopd_prompts(rng)
            stats, _ = trainer.step(
                prompts,
                metas,
                lambda t: 0.0,
                dense,
            )
            row = {
                "step": step + 1,
                "reward": stats["dense_reward"],
                "length": stats["length"],
            }
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.mopd_steps:
                model.eval()
                evs = {(d, e): self.evaluate(model, d, e) for d in DOMAINS for e in EFFORTS}
                row["accuracy"] = sum(v["accuracy"] for v in evs.values()) / len(evs)
                for e in EFFORTS:  # does the length follow the tag?
                    row[f"eval_length_{e}"] = sum(evs[(d, e)]["length"] for d in DOMAINS) / len(DOMAINS)
                model.train()
            hist.append(row)
            self.log(
                f"[{name}] "
                + " ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
            )
        self.history[name] = hist
        return model.eval()

    # ---- outputs ---------------------------------------------------------------------------------------
    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        for name, hist in self.history.items():
            if name.startswith("budget-"):
                continue  # one summary per domain, no steps
            keys = [
                k
                for k in (
                    "loss",
                    "reward",
                    "length",
                    "over_budget",
                    "accuracy",
                    "eval_length",
                    "add/acc",
                    "mul/acc",
                )
                if any(k in r for r in hist)
            ]
            per_effort = any("eval_length_high" in r for r in hist)
            fig, axes = plt.subplots(1, len(keys) + per_effort, figsize=(3.2 * (len(keys) + per_effort), 2.8))
            axes = list(axes) if len(keys) + per_effort > 1 else [axes]
            for ax, k in zip(axes, keys):
                pts = [(r["step"], r[k]) for r in hist if r.get(k) is not None]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3)
                ax.set_title(k)
                ax.set_xlabel("step")
            if per_effort:  # the student's held-out length under each effort tag
                for e in EFFORTS:
                    pts = [(r["step"], r[f"eval_length_{e}"]) for r in hist if f"eval_length_{e}" in r]
                    axes[-1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=e)
                axes[-1].set_title("eval length per tag")
                axes[-1].set_xlabel("step")
                axes[-1].legend(fontsize=7)
            fig.suptitle(name)
            fig.tight_layout()
            fig.savefig(self.outputs() / f"{name}.png", dpi=80)
            plt.close(fig)

    def table(self, teachers: dict[tuple[str, str], dict], student: dict[tuple[str, str], dict]) -> str:
        """Held-out greedy accuracy, mean length and the formats written (fractions high/medium/low), teacher
        of each (domain, effort) against the student under that effort's tag, from their evaluations
        (:meth:`evaluate` results per (domain, effort)); Δ is student − teacher accuracy in points."""
        lines = [
            "| domain | effort | teacher acc | teacher len | teacher formats h/m/l | student acc | student len "
            "| student formats h/m/l | Δ acc (points) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        rows = []

        def formats(ev):
            return "/".join(f"{ev['formats'][e]:.2f}" for e in EFFORTS)

        for d in DOMAINS:
            for e in EFFORTS:
                t, s = teachers[(d, e)], student[(d, e)]
                rows.append({"domain": d, "effort": e, "teacher": t, "student": s})
                lines.append(
                    f"| {d} | {e} | {t['accuracy']:.2f} | {t['length']:.1f} | {formats(t)} | {s['accuracy']:.2f} "
                    f"| {s['length']:.1f} | {formats(s)} | {round(100 * (s['accuracy'] - t['accuracy'])):+d} |"
                )
        (self.outputs() / "table.json").write_text(json.dumps(rows, indent=1))
        return "\n".join(lines)

    def run(self, stages: Path | None = None) -> str:
        """Every stage, then the outputs; ``stages``: also save the warm-started student and the experts
        there (``torch.save`` of ``{"warm", "experts"}``, what ``benchmarks/mopd_ablation.py --stages``
        loads)."""
        if stages is not None:
            check_stages_path(stages)
        t0 = time.monotonic()
        with self.timed("sft"):
            base = self.stage_sft()
        experts = self.stage_experts(base)
        with self.timed("distill"):
            warm = self.stage_distill(base, experts)
        if stages is not None:
            torch.save({"warm": warm, "experts": experts, "config": stages_config(self.cfg)}, stages)
        with self.timed("mopd"):
            student = self.stage_mopd(warm, experts)
        return self.write_outputs(experts, student, time.monotonic() - t0)

    def write_outputs(self, experts, student, seconds: float) -> str:
        """The table (:meth:`table`: each expert and the MOPD ``student`` evaluated on the table's problems),
        plots, ``results.md``, ``history.json`` and ``log.txt`` in the output directory; ``seconds``: the
        pipeline's wall time before the table."""
        with self.timed("table"):
            teachers = {
                (d, e): self.evaluate(experts[(d, e)], d, e, table=True) for d in DOMAINS for e in EFFORTS
            }
            students = {(d, e): self.evaluate(student, d, e, table=True) for d in DOMAINS for e in EFFORTS}
        table = self.table(teachers, students)
        self.plot()
        cfg = asdict(self.cfg)
        cfg["efforts"] = dict(self.cfg.efforts.taus)
        stages = ", ".join(f"{k} {v:.0f}" for k, v in self.seconds.items())
        text = (
            f"# openk3 posttrain --recipe demo\n\nwall time {seconds:.0f} s before the table (stages, s: {stages})\n\n"
            f"config: `{json.dumps(cfg)}`\n\n{table}\n"
        )
        (self.outputs() / "results.md").write_text(text)
        (self.out / "history.json").write_text(json.dumps(self.history, indent=1))
        (self.out / "log.txt").write_text("\n".join(self.log_lines) + "\n")
        self.log(table)
        self.log(f"wall time {seconds:.0f} s; outputs in {self.out}")
        return table


def stages_config(config: DemoConfig) -> dict:
    """What a stages file records of the config that made it: every field but the MOPD stage's own (the
    ablation varies ``mopd_steps``, ``mopd_lr`` and ``r_max`` on the same stages)."""
    out = asdict(config)
    out["efforts"] = dict(config.efforts.taus)
    for name in ("mopd_steps", "mopd_lr", "r_max"):
        out.pop(name)
    return out


def check_out_dir(out: Path) -> None:
    """Refuse an output folder before any work: one that is a file (or below one), or that holds an earlier
    run's ``results.md`` (not overwritten). The folder is created only when the first output is written, so a
    run refused or interrupted before then leaves nothing behind."""
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                raise ValueError(f"--out {out}: {path} is a file, not a folder")
            break
    if (out / "results.md").exists():
        raise FileExistsError(
            f"--out {out} holds an earlier run's results.md; remove it or name a new folder"
        )


def check_stages_path(path: Path) -> None:
    """Refuse a ``--stages`` path before any work: its folder must exist and nothing may be there yet (the
    file is written after the warm start, minutes in; an existing file is not overwritten)."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"--stages {path} already exists; remove it or name a new file")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"--stages {path}: the folder {path.parent} does not exist")


def load_stages(path: Path, config: DemoConfig) -> tuple[torch.nn.Module, dict]:
    """The warm-started student and the experts of a stages file written by :meth:`Demo.run`; raises
    ``ValueError`` naming the problem when ``path`` is not such a file or was made with another config or
    seed than ``config`` (the table's problems would then be ones the experts may have seen in SFT)."""
    path = Path(path)
    try:
        saved = torch.load(path, weights_only=False)  # the user's own file, written by Demo.run
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise ValueError(f"--stages {path} is not a stages file: {e}") from None
    except Exception as e:  # pickle.UnpicklingError and the like
        raise ValueError(f"--stages {path} is not a stages file: {type(e).__name__}: {e}") from None
    if not isinstance(saved, dict) or not {"warm", "experts", "config"} <= saved.keys():
        raise ValueError(
            f"--stages {path} holds no warm start, experts and config; write one with "
            "openk3 posttrain --recipe demo --stages FILE"
        )
    want = stages_config(config)
    diff = sorted(k for k in want.keys() | saved["config"].keys() if want.get(k) != saved["config"].get(k))
    if diff:
        raise ValueError(
            f"--stages {path} was made with another config: "
            + ", ".join(f"{k} {saved['config'].get(k)!r} there, {want.get(k)!r} here" for k in diff)
        )
    return saved["warm"], saved["experts"]
