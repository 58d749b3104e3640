"""The demo's two task domains, where written effort pays, and their character tokenizer.

* ``add`` — three-digit addition ``a+b``. High effort writes every column with its carry (right to left)
  ``7+5=12,4+8+1=13,3+6+1=10|1032``; medium writes only the carry bits ``c:111|1032``; low writes the answer
  ``|1032``.
* ``mul`` — a three-digit number times a digit ``a*b`` (``b`` in 2–9). High effort writes every column's
  product with the carry in (right to left) ``7*8=56,4*8+5=37,3*8+3=27|2776``; medium writes only the carries
  out ``c:532|2776``; low writes the answer ``|2776``.

Both are sized so that writing pays for a small model: the bare answer needs every carry at once, each
written column is a one-digit step.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

DOMAINS = ("add", "mul")
EFFORTS = ("high", "medium", "low")
_DOMAIN_CHAR = {"add": "A", "mul": "X"}
_OPERATOR = {"add": "+", "mul": "*"}
_EFFORT_CHAR = {"high": "H", "medium": "M", "low": "L"}


@dataclass(frozen=True)
class CharTokenizer:
    """Id 0 padding, id 1 the stop token, then one id per character of ``alphabet``."""

    alphabet: str = "0123456789+*=,|c:AXHML"
    pad_id: int = 0
    stop_id: int = 1

    @property
    def vocab_size(self) -> int:
        return 2 + len(self.alphabet)

    @property
    def tokenizer_id(self) -> str:
        return "char-" + hashlib.sha1(self.alphabet.encode()).hexdigest()[:12]

    def encode(self, text: str) -> list[int]:
        bad = [ch for ch in text if ch not in self.alphabet]
        if bad:
            raise ValueError(f"character {bad[0]!r} is not in the tokenizer's alphabet {self.alphabet!r}")
        return [2 + self.alphabet.index(ch) for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i - 2] for i in ids if i >= 2)


@dataclass(frozen=True)
class Problem:
    domain: str
    operands: tuple[int, ...]

    @property
    def answer(self) -> int:
        a, b = self.operands
        return a + b if self.domain == "add" else a * b

    @property
    def text(self) -> str:
        return _OPERATOR[self.domain].join(map(str, self.operands))

    @property
    def id(self) -> str:
        return f"{self.domain}:{self.text}"

    def prompt(self, effort: str) -> str:
        return f"{_EFFORT_CHAR[effort]}{_DOMAIN_CHAR[self.domain]}{self.text}="


def sample_problem(domain: str, rng: random.Random) -> Problem:
    if domain == "add":
        return Problem(domain, (rng.randint(100, 999), rng.randint(100, 999)))
    if domain == "mul":
        return Problem(domain, (rng.randint(100, 999), rng.randint(2, 9)))
    raise ValueError(f"unknown domain {domain!r}; choose one of {DOMAINS}")


def solution(problem: Problem, effort: str) -> str:
    """The response written at ``effort`` (without the stop token)."""
    answer = f"|{problem.answer}"
    if effort == "low":
        return answer
    a, b = problem.operands
    steps, carries, carry = [], "", 0
    if problem.domain == "add":
        for da, db in zip(reversed(str(a)), reversed(str(b))):
            s = int(da) + int(db) + carry
            steps.append(f"{da}+{db}" + (f"+{carry}" if carry else "") + f"={s}")
            carry = s // 10
            carries += str(carry)
    else:
        for da in reversed(str(a)):
            s = int(da) * b + carry
            steps.append(f"{da}*{b}" + (f"+{carry}" if carry else "") + f"={s}")
            carry = s // 10
            carries += str(carry)
    return (",".join(steps) if effort == "high" else f"c:{carries}") + answer


def written_effort(problem: Problem, response_text: str) -> str:
    """Which effort's format ``response_text`` was written in, from its shape before the last ``|``:
    ``"high"``, ``"medium"``, ``"low"`` (nothing before ``|``) or ``"other"`` (no ``|``, or a shape of no
    effort): column results with ``=`` are high, ``c:`` and the carry digits medium. Correctness is not
    checked."""
    if "|" not in response_text:
        return "other"
    head = response_text.rsplit("|", 1)[0]
    if not head:
        return "low"
    if head.startswith("c:") and head[2:].isdigit():
        return "medium"
    return "high" if "=" in head and "c" not in head else "other"


def parse_answer(text: str) -> int | None:
    tail = text.rsplit("|", 1)
    if len(tail) != 2 or not tail[1].isdigit():
        return None
    return int(tail[1])


def is_correct(problem: Problem, response_text: str) -> bool:
    return parse_answer(response_text) == problem.answer
