"""Two tiny agentic task groups where a tool pays: the answer is in the sandbox, not in the prompt.

* ``sumfile`` (tool ``python``; judged by tests in a fork): ``numbers.txt`` in the home directory holds
  ``n`` five-digit integers, one a line; the policy must write their sum to ``answer.txt``. The judge runs a
  test in a **fork** of the trajectory's sandbox; like a real test suite it has side effects (it deletes
  ``answer.txt``), which the fork keeps away from the trajectory's sandbox. Without a tool the policy cannot
  write the file: reward 0.
* ``lookup`` (tool ``read_file``; judged from the text, no sandbox): ``key.txt`` holds a random six-digit
  code; the answer turn must contain ``ANSWER: <code>``. A guess is right with probability 1e-6.

``meta`` of a task: ``{"group": "sumfile", "numbers": [...]}`` or ``{"group": "lookup", "code": "123456"}``.
"""

from __future__ import annotations

import random
import re

from openk3.rl.agentic import AgenticTaskGroup
from openk3.rl.harness import ContextPolicy, HarnessConfig
from openk3.rl.tool_sandbox import ToolSandbox

PASS = "PASS"


class SumFile(AgenticTaskGroup):
    name = "sumfile"
    judge_in_fork = True

    def __init__(self, harness: HarnessConfig | None = None, template: str = "base") -> None:
        self.harness = harness or HarnessConfig(
            tools=("python",),
            system_prompt="Solve the task in the sandbox with tools.",
            context=ContextPolicy(max_observation_tokens=128, keep_observations=2, max_turns=3),
        )
        self.template = template

    @staticmethod
    def sample(rng: random.Random, n: int = 6) -> dict:
        return {"group": "sumfile", "numbers": [rng.randint(10000, 99999) for _ in range(n)]}

    def task(self, meta: dict) -> str:
        return "numbers.txt holds one integer a line. Write their sum to answer.txt."

    def setup(self, sandbox: ToolSandbox, meta: dict) -> None:
        sandbox.write_file("numbers.txt", "".join(f"{x}\n" for x in meta["numbers"]))

    def test_command(self, meta: dict) -> str:
        """The judge's test: prints PASS when ``answer.txt`` holds the sum, and deletes the file."""
        code = (
            "import os\n"
            "try:\n v = open('answer.txt').read().strip()\n os.remove('answer.txt')\n"
            "except OSError:\n v = None\n"
            f"print({PASS!r} if v == {str(sum(meta['numbers']))!r} else 'FAIL')\n"
        )
        return f"python3 - <<'EOF'\n{code}EOF"

    def reward(self, final_text: str, meta: dict, judge: ToolSandbox | None) -> float:
        r = judge.run(self.test_command(meta), timeout_s=60)
        return 1.0 if r.stdout.strip() == PASS else 0.0


class Lookup(AgenticTaskGroup):
    name = "lookup"
    judge_in_fork = False

    def __init__(self, harness: HarnessConfig | None = None, template: str = "base") -> None:
        self.harness = harness or HarnessConfig(
            tools=("read_file",),
            system_prompt="Answer with ANSWER: followed by the code.",
            context=ContextPolicy(max_observation_tokens=64, max_turns=2),
        )
        self.template = template

    @staticmethod
    def sample(rng: random.Random) -> dict:
        return {"group": "lookup", "code": f"{rng.randint(0, 999999):06d}"}

    def task(self, meta: dict) -> str:
        return "What is the code in key.txt?"

    def setup(self, sandbox: ToolSandbox, meta: dict) -> None:
        sandbox.write_file("key.txt", meta["code"] + "\n")

    def reward(self, final_text: str, meta: dict, judge: ToolSandbox | None) -> float:
        m = re.search(r"ANSWER: *(\d+)", final_text)
        return 1.0 if m is not None and m.group(1) == meta["code"] else 0.0
