"""Generators of the three synthetic recall tasks of Kimi Linear (palindrome, MQAR, stack).

Each task needs the model to store items and drop or retrieve them at points the input decides. A batch is
``tokens_NL`` (int64) with ``answer_NL`` (bool): ``answer[n, t]`` marks a token the model must predict from
``tokens[n, :t]``; every other position is context (no loss, not scored). Every sequence is exactly ``L``
tokens: the items first or spread out, the rest *noise* tokens drawn uniformly from their own alphabet, so a
longer ``L`` means longer distances to bridge with the same number of items.

Vocabulary (:data:`VOCAB_SIZE` = 256, shared by the tasks)::

    0 BOS   1 SEP   2 PUSH   3 POP   4..7 unused
    8..135    DATA  (128 symbols: palindrome payload, stack values; MQAR keys = DATA[:64], values = DATA[64:])
    136..255  NOISE (120 symbols, never an item)

Layouts (``n`` items; :func:`default_items` gives ``n = L // 32``)::

    palindrome  BOS x₁ … xₙ  noise…  SEP xₙ … x₁                      answers: the reversed xᵢ
    mqar        BOS k₁ v₁ … kₙ vₙ  noise… kσ₁ vσ₁ noise… kσₙ vσₙ noise…  answers: the v after each query key
    stack       BOS noise… (PUSH x | POP y) noise… …                    answers: y = the value popped

MQAR follows Zoology (Arora et al. 2023, "Zoology: measuring and improving recall in efficient language
models"): distinct keys, each queried once in random order at uniformly random 2-token slots after the
pairs. The stack runs ``n`` pushes and ``n`` pops in a random valid order (a pop never meets an empty
stack). Generation is deterministic given the ``numpy.random.Generator``.

Legend: ``N`` sequences, ``L`` tokens per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BOS, SEP, PUSH, POP = 0, 1, 2, 3
DATA_START, NUM_DATA = 8, 128
NOISE_START, NUM_NOISE = 136, 120
VOCAB_SIZE = 256
NUM_KEYS = 64
"""MQAR keys are ``DATA[:64]``, values ``DATA[64:]``: at most 64 pairs per sequence."""
TASKS = ("palindrome", "mqar", "stack")


@dataclass
class Batch:
    tokens_NL: np.ndarray
    """int64 token ids."""
    answer_NL: np.ndarray
    """bool: the positions scored (the token must be predicted from the tokens before it)."""


def default_items(task: str, seq_len: int) -> int:
    """Items per sequence for a length: ``L // 32`` (at least 2; MQAR at most :data:`NUM_KEYS`)."""
    check_task(task)
    n = max(2, seq_len // 32)
    return min(n, NUM_KEYS) if task == "mqar" else n


def min_length(task: str, items: int) -> int:
    """Shortest ``L`` that holds ``items`` items of ``task``."""
    check_task(task)
    return {"palindrome": 2 * items + 2, "mqar": 4 * items + 1, "stack": 8 * items + 1}[task]


def check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose one of {', '.join(TASKS)}")


def make_batch(
    task: str, num: int, seq_len: int, items: int, rng: np.random.Generator, noise: int = NUM_NOISE
) -> Batch:
    """``num`` sequences of ``task``, each ``seq_len`` tokens with ``items`` items (layouts above), the gaps
    filled with the first ``noise`` noise symbols.

    Raises ``ValueError`` for an unknown task, ``num < 1``, ``items < 1``, more MQAR pairs than keys, a
    ``seq_len`` below :func:`min_length`, or ``noise`` outside ``[1, NUM_NOISE]``."""
    check_task(task)
    if num < 1 or items < 1:
        raise ValueError(f"num={num} and items={items} must be at least 1")
    if not 1 <= noise <= NUM_NOISE:
        raise ValueError(f"noise={noise} symbols is invalid: expected 1..{NUM_NOISE}")
    if task == "mqar" and items > NUM_KEYS:
        raise ValueError(f"mqar holds at most {NUM_KEYS} key-value pairs per sequence; got items={items}")
    if seq_len < min_length(task, items):
        raise ValueError(
            f"seq_len={seq_len} is too short for {items} {task} items (needs at least "
            f"{min_length(task, items)}); lower --items or raise --seq-len"
        )
    tokens_NL = rng.integers(NOISE_START, NOISE_START + noise, size=(num, seq_len), dtype=np.int64)
    tokens_NL[:, 0] = BOS
    answer_NL = np.zeros((num, seq_len), dtype=bool)
    fill = {"palindrome": _palindrome, "mqar": _mqar, "stack": _stack}[task]
    for row_L, answer_L in zip(tokens_NL, answer_NL):
        fill(row_L, answer_L, items, rng)
    return Batch(tokens_NL, answer_NL)


def _palindrome(row_L: np.ndarray, answer_L: np.ndarray, n: int, rng: np.random.Generator) -> None:
    payload = rng.integers(DATA_START, DATA_START + NUM_DATA, size=n)
    row_L[1 : 1 + n] = payload
    row_L[-n - 1] = SEP
    row_L[-n:] = payload[::-1]
    answer_L[-n:] = True


def _slots(region: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted starts of ``count`` disjoint 2-token slots in ``[0, region)``."""
    return 2 * np.sort(rng.choice(region // 2, size=count, replace=False))


def _mqar(row_L: np.ndarray, answer_L: np.ndarray, n: int, rng: np.random.Generator) -> None:
    keys = DATA_START + rng.choice(NUM_KEYS, size=n, replace=False)
    values = rng.integers(DATA_START + NUM_KEYS, DATA_START + NUM_DATA, size=n)
    row_L[1 : 1 + 2 * n : 2], row_L[2 : 2 + 2 * n : 2] = keys, values
    start = 1 + 2 * n
    order = rng.permutation(n)
    at = start + _slots(len(row_L) - start, n, rng)
    row_L[at], row_L[at + 1] = keys[order], values[order]
    answer_L[at + 1] = True


def _stack(row_L: np.ndarray, answer_L: np.ndarray, n: int, rng: np.random.Generator) -> None:
    at = 1 + _slots(len(row_L) - 1, 2 * n, rng)
    stack: list[int] = []
    pushes = 0
    for a in at:
        push = pushes < n and (not stack or rng.random() < 0.5)
        if push:
            value = int(rng.integers(DATA_START, DATA_START + NUM_DATA))
            row_L[a], row_L[a + 1] = PUSH, value
            stack.append(value)
            pushes += 1
        else:
            row_L[a], row_L[a + 1] = POP, stack.pop()
            answer_L[a + 1] = True
