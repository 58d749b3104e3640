"""Learning-rate and context-length schedules (pure functions of the step).

* ``cosine``: linear warmup from 0 to the peak over ``warmup_steps``, then cosine decay to
  ``min_lr_ratio · peak`` at ``total_steps``.
* ``wsd`` (warmup–stable–decay): warmup, a flat peak, then a linear decay to ``min_lr_ratio · peak`` over
  the last ``decay_fraction`` of the steps.
* Short runs: the warmup is clamped to at most ``MAX_WARMUP_FRACTION`` (25%) of ``total_steps``
  (:func:`effective_warmup`), so a run shorter than its warmup still reaches the peak and decays.
* Progressive context: a list of ``(start_step, seq_len)`` pairs; the sequence length in force at a step is
  the one of the last pair whose start is ≤ step. The schedule grows the context over training (short
  sequences while the model learns local statistics, longer ones later), so it starts at step 0, its steps
  increase and its lengths never shrink (:func:`check_context_schedule`); the longest length also sizes the
  run's evaluations and its memory plan. A schedule typed for a run is checked against the run's steps
  (:func:`check_schedule_steps`).
"""

from __future__ import annotations

import math

MAX_WARMUP_FRACTION = 0.25
"""The warmup never takes more than this share of the run (``floor(0.25 · total_steps)`` steps)."""


def effective_warmup(warmup_steps: int, total_steps: int) -> int:
    """Warmup steps actually used: ``min(warmup_steps, floor(MAX_WARMUP_FRACTION · total_steps))``.

    E.g. the default 20 warmup steps in a 10-step run become 2. Raises ``ValueError`` for a negative
    ``warmup_steps``."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
    return min(warmup_steps, int(MAX_WARMUP_FRACTION * total_steps))


def lr_factor(
    step: int,
    total_steps: int,
    warmup_steps: int,
    min_lr_ratio: float = 0.1,
    kind: str = "cosine",
    decay_fraction: float = 0.2,
) -> float:
    """Multiplier of the peak learning rate at 0-based ``step`` of a ``total_steps`` run.

    Linear warmup ``(step + 1) / W`` over ``W = effective_warmup(warmup_steps, total_steps)`` steps (the
    requested warmup, clamped to at most 25% of the run), then the ``kind`` decay (module doc). Raises
    ``ValueError`` for an unknown kind or a negative ``warmup_steps``."""
    warmup_steps = effective_warmup(warmup_steps, total_steps)
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "wsd":
        decay_steps = max(1, int(round(decay_fraction * total_steps)))
        start = total_steps - decay_steps
        if step < start:
            return 1.0
        return 1.0 - (1 - min_lr_ratio) * min(1.0, (step - start + 1) / decay_steps)
    raise ValueError(f"unknown lr schedule {kind!r}: use 'cosine' or 'wsd'")


def parse_context_schedule(text: str) -> list[tuple[int, int]]:
    """``"0:128,200:256"`` → ``[(0, 128), (200, 256)]``; raises ``ValueError`` on bad syntax or order."""
    try:
        pairs = [tuple(int(x) for x in item.split(":")) for item in text.split(",") if item.strip()]
    except ValueError as e:
        raise ValueError(f"context schedule {text!r}: expected 'step:seq_len,step:seq_len,...'") from e
    return check_context_schedule(pairs, shown=repr(text))


def _entries(pairs) -> str:
    return ", ".join(f"{s}:{t}" for s, t in pairs)


def check_context_schedule(pairs, shown: str | None = None) -> list[tuple[int, int]]:
    """``pairs`` as a list of int ``(step, seq_len)``; raises ``ValueError`` naming the schedule
    (``shown``, e.g. the text the user typed, else ``repr(pairs)``) unless it starts at step 0, its steps
    increase, every length is >= 1 and no length is shorter than an earlier one.

    A shrinking schedule (``0:32,2:16,3:24``) is refused, naming the entries shorter than an earlier length:
    progressive context only lengthens the sequences, and the trainer evaluates and plans memory at the
    longest length, so a run whose last phase is shorter than an earlier one would be reported on windows it
    stopped training on. A repeated length (``0:32,10:32``) is allowed (it changes nothing)."""
    pairs = [tuple(p) for p in pairs]
    shown = repr(pairs) if shown is None else shown
    if not pairs or any(len(p) != 2 for p in pairs):
        raise ValueError(f"context schedule {shown}: expected a non-empty list of (step, seq_len)")
    if pairs[0][0] != 0:
        raise ValueError(f"context schedule {shown}: the first entry must start at step 0")
    if any(b[0] <= a[0] for a, b in zip(pairs, pairs[1:])) or any(p[1] < 1 for p in pairs):
        raise ValueError(f"context schedule {shown}: steps must increase and lengths be >= 1")
    shorter = [b for i, b in enumerate(pairs[1:], 1) if b[1] < max(t for _, t in pairs[:i])]
    if shorter:
        raise ValueError(
            f"context schedule {shown}: {_entries(shorter)} shorten{'s' if len(shorter) == 1 else ''} the "
            "context, which only grows over training (progressive context): make each length at least the "
            "one before"
        )
    return [(int(s), int(t)) for s, t in pairs]


def check_schedule_steps(
    schedule: list[tuple[int, int]], steps: int, shown: str, default_steps: bool = False
) -> None:
    """Raise ``ValueError`` naming the entries of ``schedule`` (as the user typed it: ``shown``) that start
    at or after ``steps``, the run's step count (``default_steps``: it is ``--steps``'s default, which the
    message then says).

    Refused rather than warned about: such an entry never trains (the run's steps ``0 … steps − 1`` read
    the length in force at each), yet its length, the longest, would still set the evaluations' windows and
    the memory plan, so the run would report a loss on windows it never trained on; it is almost always a
    typo in one of the two numbers, and a warning scrolls away under the progress bar. A run meant to grow
    its context later is continued with ``--resume --steps N`` and the longer schedule then (the schedule
    may change on a resume). The default schedule (sized for the default 200 steps) is not checked."""
    late = [(s, t) for s, t in schedule if s >= steps]
    if late:
        one = len(late) == 1
        raise ValueError(
            f"context schedule {shown}: {_entries(late)} start{'s' if one else ''} at or after --steps {steps}"
            f"{' (the default)' if default_steps else ''}, so the run would never train at "
            f"{'that length' if one else 'those lengths'}, yet its evaluations would use the longest: drop "
            f"{'it' if one else 'them'} or raise --steps"
        )


def seq_len_at(step: int, schedule: list[tuple[int, int]]) -> int:
    """Sequence length in force at ``step``."""
    current = schedule[0][1]
    for start, length in schedule:
        if step >= start:
            current = length
    return current
