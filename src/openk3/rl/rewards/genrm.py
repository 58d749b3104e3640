"""Agentic GenRM: a judge compares a group's candidates pairwise under a fixed protocol; a round-robin
tournament turns the match outcomes into group rewards.

Protocol of one match (the judge is any ``str → str`` callable, e.g. an LLM at temperature 0):

1. **read** — the judge reads the task and both candidates and states what the task asks;
2. **rubric** — it writes the rubric the answers are held to;
3. **score** — it scores both candidates against that rubric, answering JSON ``{"first": s1, "second": s2}``;
4. **scorepad** — the scores are recorded in the :class:`Scorepad` (the running per-candidate tally); the
   higher score wins the match, equal scores tie.

Both candidate orders are judged (A|B and B|A) and a match counts as a win only when both orders agree,
else a tie: a judge that always prefers the first position yields ties (position-bias cancellation).
Group reward ``r_i = (wins_i + ½·ties_i)/(G − 1)`` over all pairs (Tournament-GRPO arXiv 2605.26958: ties
0.5, outcomes normalised), invariant to the order of the candidates.

Gates before any judge call: a candidate failing the **format gate** loses every match (reward 0); a
candidate longer than the **length guillotine** ``σ·ℓ0`` (``ℓ0`` a reference length, in the caller's unit:
tokens or characters) loses every match against one within it (Kimi K3's verbosity guillotine; length bias
of reward models, FiMi-RM arXiv 2505.12843). Two gated candidates tie.

A score answer that does not parse is asked again up to ``max_retries`` times; after that the match is a tie
and is counted in ``Scorepad.parse_failures``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

Judge = Callable[[str], str]


@dataclass(frozen=True)
class GenRMConfig:
    sigma: float = 1.5
    """Guillotine factor σ: a candidate longer than ``σ·ℓ0`` loses."""
    max_retries: int = 2

    def __post_init__(self) -> None:
        if not self.sigma > 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")


@dataclass
class ScorepadEntry:
    first: int
    second: int
    read: str
    rubric: str
    scores: tuple[float, float] | None
    """``None`` when the score never parsed (a tie)."""


@dataclass
class Scorepad:
    """Every judged match, in order, and the running tally per candidate."""

    entries: list[ScorepadEntry] = field(default_factory=list)
    tally: dict[int, float] = field(default_factory=dict)
    judge_calls: int = 0
    parse_failures: int = 0


def read_prompt(task: str, first: str, second: str) -> str:
    return f"[READ]\nTask:\n{task}\n\nFirst answer:\n{first}\n\nSecond answer:\n{second}\n\nState what the task asks."


def rubric_prompt(task: str, reading: str) -> str:
    return f"[RUBRIC]\nTask:\n{task}\n\nWhat it asks:\n{reading}\n\nWrite the rubric, one criterion per line."


def score_prompt(task: str, rubric: str, first: str, second: str) -> str:
    return (
        f"[SCORE]\nTask:\n{task}\n\nRubric:\n{rubric}\n\nFirst answer:\n{first}\n\nSecond answer:\n{second}\n\n"
        'Score both against the rubric. Answer only JSON {"first": <number>, "second": <number>}.'
    )


def parse_scores(text: str) -> tuple[float, float] | None:
    """The two scores of a JSON answer (the first ``{...}`` in ``text``), or ``None``."""
    start, stop = text.find("{"), text.rfind("}")
    if start < 0 or stop < start:
        return None
    try:
        obj = json.loads(text[start : stop + 1])
        return float(obj["first"]), float(obj["second"])
    except (ValueError, KeyError, TypeError):
        return None


def judge_once(judge: Judge, task: str, first: str, second: str, config: GenRMConfig, pad: Scorepad, ids):
    """One ordered match through the four steps; returns +1 (first wins), −1 (second wins) or 0."""
    reading = judge(read_prompt(task, first, second))
    rubric = judge(rubric_prompt(task, reading))
    pad.judge_calls += 2
    scores = None
    for _ in range(config.max_retries + 1):
        pad.judge_calls += 1
        scores = parse_scores(judge(score_prompt(task, rubric, first, second)))
        if scores is not None:
            break
    if scores is None:
        pad.parse_failures += 1
    pad.entries.append(ScorepadEntry(ids[0], ids[1], reading, rubric, scores))
    if scores is None:
        return 0
    for i, s in zip(ids, scores):
        pad.tally[i] = pad.tally.get(i, 0.0) + s
    return (scores[0] > scores[1]) - (scores[0] < scores[1])


def match(judge: Judge, task: str, a: str, b: str, config: GenRMConfig, pad: Scorepad, ids=(0, 1)) -> float:
    """Outcome for ``a`` against ``b`` judged in both orders: 1 (win), 0 (loss), 0.5 (tie or disagreement)."""
    ab = judge_once(judge, task, a, b, config, pad, ids)
    ba = judge_once(judge, task, b, a, config, pad, ids[::-1])
    if ab > 0 and ba < 0:
        return 1.0
    if ab < 0 and ba > 0:
        return 0.0
    return 0.5


def tournament_rewards(
    judge: Judge,
    task: str,
    candidates: list[str],
    lengths: list[int],
    reference_length: float,
    format_ok: list[bool],
    config: GenRMConfig,
) -> tuple[list[float], Scorepad]:
    """Group rewards in [0, 1] for ``G ≥ 2`` candidates of one task, and the scorepad.

    ``lengths``: each candidate's length (same unit as ``reference_length`` = ℓ0). ``format_ok``: the
    format gate's verdict per candidate. Raises ``ValueError`` for fewer than 2 candidates, lists of other
    lengths, or ``reference_length`` ≤ 0."""
    G = len(candidates)
    if G < 2:
        raise ValueError(f"a tournament needs at least 2 candidates, got {G}")
    if len(lengths) != G or len(format_ok) != G:
        raise ValueError(f"{G} candidates but {len(lengths)} lengths and {len(format_ok)} format verdicts")
    if not reference_length > 0:
        raise ValueError(f"reference_length must be > 0, got {reference_length}")
    cap = config.sigma * reference_length
    gated = [not ok or n > cap for ok, n in zip(format_ok, lengths)]
    pad = Scorepad()
    points = [0.0] * G
    for i in range(G):
        for j in range(i + 1, G):
            if gated[i] or gated[j]:
                s = 0.5 if gated[i] == gated[j] else float(gated[j])
            else:
                s = match(judge, task, candidates[i], candidates[j], config, pad, (i, j))
            points[i] += s
            points[j] += 1 - s
    rewards = [0.0 if not format_ok[i] else p / (G - 1) for i, p in enumerate(points)]
    return rewards, pad
