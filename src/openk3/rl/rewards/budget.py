"""The effort-budget reward: a trajectory longer than ``τ·b0(x)`` tokens gets −1.

* ``b0(x)`` — the ρ-percentile of the lengths of *correct* responses to problem ``x`` sampled from the
  reference policy (the max-effort model), estimated once and then fixed (Kimi K2.5 arXiv 2602.02276
  sec. 4.4.2: ``B(x) = Percentile_ρ({|y| : y ∈ Y_correct(x)})``, "estimated once at the beginning of training").
  A problem with no correct sample has no budget (the reward is correctness only).
* ``τ`` — the budget multiplier, annealed linearly from ``tau_start`` to ``tau_end`` (ThinkPrune
  arXiv 2504.01296 tightens the limit round by round), never letting ``τ·b0`` drop below the shortest
  correct length seen for ``x`` (the floor: below it no correct answer fits and accuracy collapses; the
  samples of other policies, e.g. the SFT base, may lower it, :meth:`BudgetTable.estimate`).
* Reward (K2 arXiv 2507.20534 sec. 3.2.3, per-sample token budget with a penalty):
  ``r = −1`` if ``|y| > L(x)`` with ``L(x) = max(⌊τ·b0(x)⌋, min_correct(x))``, else the task reward.
  ``|y| = L(x)`` is within budget.
* Effort levels are τ values (:class:`EffortLevels`): the low-effort expert trains at a small τ.
* Optional K2.5 gate: the budget term applies only when the group's accuracy exceeds ``gate_accuracy``.

Lengths are in tokens (response only, stop token included when generated).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def percentile_length(lengths: list[int], rho: float) -> int:
    """Nearest-rank ρ-percentile (``rho`` in (0, 1]) of ``lengths``: the smallest length ℓ with at least
    ``⌈ρ·n⌉`` lengths ≤ ℓ. Raises ``ValueError`` for no lengths or ρ outside (0, 1]."""
    if not lengths:
        raise ValueError("percentile_length: no lengths given")
    if not 0 < rho <= 1:
        raise ValueError(f"rho must be in (0, 1], got {rho}")
    ordered = sorted(lengths)
    return ordered[max(1, math.ceil(rho * len(ordered))) - 1]


@dataclass(frozen=True)
class ProblemBudget:
    b0: int
    """ρ-percentile of correct lengths under the reference policy (tokens)."""
    min_correct: int
    """Shortest correct length seen (tokens): the floor of the limit."""


@dataclass
class BudgetTable:
    """``b0(x)`` per problem id, filled once by :meth:`estimate` and read-only afterwards."""

    rho: float = 0.5
    budgets: dict[str, ProblemBudget] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.rho <= 1:
            raise ValueError(f"rho must be in (0, 1], got {self.rho}")

    def estimate(
        self, problem_id: str, lengths: list[int], correct: list[bool], floor_lengths: Sequence[int] = ()
    ) -> ProblemBudget | None:
        """Set ``b0`` of ``problem_id`` from reference samples (lengths and correctness, one per sample).

        ``floor_lengths`` are correct lengths from other policies (e.g. the SFT base, which writes shorter
        formats than the max-effort reference): they can lower the floor ``min_correct`` but do not enter
        ``b0``. Returns the budget, or ``None`` when no reference sample was correct (no budget). Raises
        ``ValueError`` when the problem already has a budget (it is fixed once estimated), the lists differ in
        length, or a floor length is below 1."""
        if problem_id in self.budgets:
            raise ValueError(
                f"problem {problem_id!r} already has b0={self.budgets[problem_id].b0}; it is fixed"
            )
        if len(lengths) != len(correct):
            raise ValueError(f"{len(lengths)} lengths but {len(correct)} correctness flags")
        if any(n < 1 for n in floor_lengths):
            raise ValueError(f"floor lengths must be >= 1 token, got {sorted(floor_lengths)[:3]}")
        good = [n for n, c in zip(lengths, correct) if c]
        if not good:
            return None
        budget = ProblemBudget(percentile_length(good, self.rho), min([*good, *floor_lengths]))
        self.budgets[problem_id] = budget
        return budget

    def get(self, problem_id: str) -> ProblemBudget | None:
        return self.budgets.get(problem_id)


@dataclass(frozen=True)
class TauSchedule:
    """``τ(step)``: linear from ``tau_start`` to ``tau_end`` over ``anneal_steps``, then constant."""

    tau_start: float = 1.5
    tau_end: float = 1.0
    anneal_steps: int = 0

    def __post_init__(self) -> None:
        if not (self.tau_start > 0 and self.tau_end > 0):
            raise ValueError(f"tau_start and tau_end must be > 0, got {self.tau_start}, {self.tau_end}")
        if self.tau_end > self.tau_start:
            raise ValueError(
                f"tau_end={self.tau_end} must not exceed tau_start={self.tau_start} (τ anneals down)"
            )
        if self.anneal_steps < 0:
            raise ValueError(f"anneal_steps must be >= 0, got {self.anneal_steps}")

    def __call__(self, step: int) -> float:
        if self.anneal_steps == 0 or step >= self.anneal_steps:
            return self.tau_end
        frac = max(step, 0) / self.anneal_steps
        return self.tau_start + (self.tau_end - self.tau_start) * frac


def budget_limit(budget: ProblemBudget, tau: float) -> int:
    """``L = max(⌊τ·b0⌋, min_correct)`` tokens."""
    return max(math.floor(tau * budget.b0), budget.min_correct)


def budget_reward(
    task_reward: float, length: int, budget: ProblemBudget | None, tau: float, apply: bool = True
) -> float:
    """−1 if ``apply`` and ``length > budget_limit(budget, tau)``; else ``task_reward``.

    ``budget=None`` (no correct reference sample) or ``apply=False`` (the K2.5 gate is closed) returns the
    task reward."""
    if apply and budget is not None and length > budget_limit(budget, tau):
        return -1.0
    return task_reward


def gate_open(group_accuracy: float, gate_accuracy: float) -> bool:
    """K2.5's gate: the budget term applies once the group's mean accuracy exceeds ``gate_accuracy``."""
    return group_accuracy > gate_accuracy


@dataclass(frozen=True)
class EffortLevels:
    """Effort names → τ: an effort tag in the prompt selects the budget multiplier the model trained at."""

    taus: tuple[tuple[str, float], ...] = (("low", 0.6), ("medium", 1.0), ("high", 2.0))

    def __post_init__(self) -> None:
        values = [t for _, t in self.taus]
        if any(not t > 0 for t in values) or values != sorted(values) or len(set(values)) != len(values):
            raise ValueError(
                f"taus must be positive and strictly increasing from low to high effort, got {self.taus}"
            )

    def tau(self, effort: str) -> float:
        for name, t in self.taus:
            if name == effort:
                return t
        raise ValueError(f"unknown effort {effort!r}; choose one of {[n for n, _ in self.taus]}")

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.taus]
