"""The demo's two task domains, where written effort pays, and their character tokenizer.

* ``add`` — two-digit addition ``a+b``. High effort writes every column with its carry (right to left)
  ``7+5=12,4+8+1=13|132``; medium writes only the carry bits ``c:11|132``; low writes the answer ``|132``.
* ``chain`` — the sum of four digits ``3+5+2+6``. High effort writes the running sums ``8,10,16|16``; medium
  the two pair sums ``8,8|16``; low the answer ``|16``.

A prompt is ``<effort><domain>problem=`` (effort ``H``/``M``/``L``, domain ``A``/``C``); the answer is what
follows the last ``|``, and the response ends with the stop token. A response is correct when its answer
equals the true value, whatever it wrote before.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

DOMAINS = ("add", "chain")
EFFORTS = ("high", "medium", "low")
_DOMAIN_CHAR = {"add": "A", "chain": "C"}
_EFFORT_CHAR = {"high": "H", "medium": "M", "low": "L"}


@dataclass(frozen=True)
class CharTokenizer:
    """Id 0 padding, id 1 the stop token, then one id per character of ``alphabet``."""

    alphabet: str = "0123456789+=,|c:ACHML"
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
        return sum(self.operands)

    @property
    def id(self) -> str:
        return f"{self.domain}:{'+'.join(map(str, self.operands))}"

    def prompt(self, effort: str) -> str:
        return f"{_EFFORT_CHAR[effort]}{_DOMAIN_CHAR[self.domain]}{'+'.join(map(str, self.operands))}="


def sample_problem(domain: str, rng: random.Random) -> Problem:
    if domain == "add":
        return Problem(domain, (rng.randint(10, 99), rng.randint(10, 99)))
    if domain == "chain":
        return Problem(domain, tuple(rng.randint(0, 9) for _ in range(4)))
    raise ValueError(f"unknown domain {domain!r}; choose one of {DOMAINS}")


def solution(problem: Problem, effort: str) -> str:
    """The response written at ``effort`` (without the stop token)."""
    answer = f"|{problem.answer}"
    if effort == "low":
        return answer
    if problem.domain == "add":
        a, b = problem.operands
        steps, carries, carry = [], "", 0
        for da, db in zip(reversed(str(a)), reversed(str(b))):
            s = int(da) + int(db) + carry
            steps.append(f"{da}+{db}" + (f"+{carry}" if carry else "") + f"={s}")
            carry = s // 10
            carries += str(carry)
        return (",".join(steps) if effort == "high" else f"c:{carries}") + answer
    ops = problem.operands
    if effort == "high":
        run = [ops[0] + ops[1], ops[0] + ops[1] + ops[2], sum(ops)]
        return ",".join(map(str, run)) + answer
    return f"{ops[0] + ops[1]},{ops[2] + ops[3]}" + answer


def written_effort(problem: Problem, response_text: str) -> str:
    """Which effort's format ``response_text`` was written in, from its shape before the last ``|``:
    ``"high"``, ``"medium"``, ``"low"`` (nothing before ``|``) or ``"other"`` (no ``|``, or a shape of no
    effort). ``add``: column sums with ``=`` are high, ``c:`` carry bits medium; ``chain``: two commas
    (three running sums) are high, one comma (two pair sums) medium. Correctness is not checked."""
    if "|" not in response_text:
        return "other"
    head = response_text.rsplit("|", 1)[0]
    if not head:
        return "low"
    if problem.domain == "add":
        if head.startswith("c:") and head[2:].isdigit():
            return "medium"
        return "high" if "=" in head and "c" not in head else "other"
    parts = head.split(",")
    if all(x.isdigit() for x in parts):
        return {3: "high", 2: "medium"}.get(len(parts), "other")
    return "other"


def parse_answer(text: str) -> int | None:
    tail = text.rsplit("|", 1)
    if len(tail) != 2 or not tail[1].isdigit():
        return None
    return int(tail[1])


def is_correct(problem: Problem, response_text: str) -> bool:
    return parse_answer(response_text) == problem.answer
