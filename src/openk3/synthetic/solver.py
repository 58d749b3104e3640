"""An independent solver of the synthetic tasks: reads one sequence token by token, by the vocabulary's
meaning alone (:mod:`openk3.synthetic.tasks`), and says where the answers are and what they must be.

It shares no code with the generators, so agreeing with them (the tests) checks both.
"""

from __future__ import annotations

from collections.abc import Sequence

from openk3.synthetic import tasks as v


def _is_data(t: int) -> bool:
    return v.DATA_START <= t < v.DATA_START + v.NUM_DATA


def _is_key(t: int) -> bool:
    return v.DATA_START <= t < v.DATA_START + v.NUM_KEYS


def solve(task: str, tokens: Sequence[int]) -> dict[int, int]:
    """``{position: token}`` of every answer of one sequence of ``task``.

    * palindrome: the data tokens after BOS up to the first other token, reversed, right after SEP;
    * mqar: the first time a key appears it is written with the token after it; each later time the token
      after it must be the value written;
    * stack: PUSH x pushes x; POP y must pop y.

    Raises ``ValueError`` for an unknown task or a sequence that breaks the task's grammar."""
    v.check_task(task)
    seq = [int(t) for t in tokens]
    if not seq or seq[0] != v.BOS:
        raise ValueError("a synthetic sequence starts with BOS")
    answers: dict[int, int] = {}
    if task == "palindrome":
        end = 1
        while end < len(seq) and _is_data(seq[end]):
            end += 1
        sep = seq.index(v.SEP)
        for j, t in enumerate(reversed(seq[1:end])):
            answers[sep + 1 + j] = t
        return answers
    memory: dict[int, int] = {}
    stack: list[int] = []
    i = 1
    while i < len(seq):
        t = seq[i]
        if task == "mqar" and _is_key(t):
            if t in memory:
                answers[i + 1] = memory[t]
            else:
                memory[t] = seq[i + 1]
            i += 2
        elif task == "stack" and t == v.PUSH:
            stack.append(seq[i + 1])
            i += 2
        elif task == "stack" and t == v.POP:
            if not stack:
                raise ValueError(f"POP at position {i} meets an empty stack")
            answers[i + 1] = stack.pop()
            i += 2
        else:
            i += 1
    return answers
