"""The agent harness: the tools a task group offers, the system prompt that lists them, the tool-call format
the policy emits, tool execution in the trajectory's sandbox, and the context management applied to the
observations it appends.

**Format** (the Hermes / Qwen2.5 function-calling convention, https://qwen.readthedocs.io function calling):
the system prompt lists each tool's JSON schema (OpenAI's ``{"type": "function", "function": {...}}``) inside
``<tools>…</tools>``; the policy calls a tool by emitting
``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` and the harness appends
``<tool_response>OUTPUT</tool_response>``. ``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and
``</tool_response>`` are single special tokens, and ``</tool_call>`` is a stop token of the rollout engine, so
generation pauses exactly where a call ends. A call that does not parse, names an unknown tool or lacks an
argument gets an error as its observation (the policy sees what went wrong, as in the public harnesses).

**Observations** are appended to the trajectory as segments with ``observation=True``: they are context, not
actions, so their loss mask is 0 (:attr:`openk3.rl.rollout.Trajectory.loss_mask`).

**Context management** (:class:`ContextPolicy`):

* ``max_observation_tokens``: an observation longer than this keeps its head and tail around an elision mark
  (decided when it is appended, so every later token is sampled in the context it trains in);
* ``keep_observations``: only the newest ``k`` observations keep their text; an older one is replaced by the
  elision mark when a newer one arrives. The policy tokens sampled between the rewritten observation and the
  rewrite saw the old text, so they stop training (``Segment.trains = False``): the trainer's single forward
  over the final sequence would score them in a context they were not sampled in.
* ``max_turns``: tool calls allowed; the call after the last one is answered with a notice and not run.

Per task group everything above is one :class:`HarnessConfig`.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from openk3.rl.rollout import Segment, Trajectory
from openk3.rl.tool_sandbox import ToolSandbox

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
SPECIAL_TOKENS = (TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END)
ELIDED = "[...{n} tokens elided...]"


@dataclass(frozen=True)
class AgentTokenizer:
    """A character tokenizer for the tiny agentic tasks: id 0 padding, id 1 the stop token, ids 2–5 the four
    tool-call markers (one token each), then one id per character of ``alphabet`` (printable ASCII and
    newline by default; it must hold ``?``).

    :meth:`encode` raises ``ValueError`` on a character outside the alphabet; :meth:`encode_observation`
    replaces such characters with ``?`` (tool output is arbitrary bytes) and never makes a special token."""

    alphabet: str = "".join(chr(c) for c in range(32, 127)) + "\n"
    pad_id: int = 0
    stop_id: int = 1

    @property
    def vocab_size(self) -> int:
        return 2 + len(SPECIAL_TOKENS) + len(self.alphabet)

    def special_id(self, marker: str) -> int:
        return 2 + SPECIAL_TOKENS.index(marker)

    def encode(self, text: str) -> list[int]:
        ids = []
        for part in re.split("(" + "|".join(map(re.escape, SPECIAL_TOKENS)) + ")", text):
            if part in SPECIAL_TOKENS:
                ids.append(self.special_id(part))
                continue
            for ch in part:
                i = self.alphabet.find(ch)
                if i < 0:
                    raise ValueError(f"character {ch!r} is not in the tokenizer's alphabet")
                ids.append(2 + len(SPECIAL_TOKENS) + i)
        return ids

    def encode_observation(self, text: str) -> list[int]:
        """Characters only: a marker written by a tool stays characters, never a special token."""
        off = 2 + len(SPECIAL_TOKENS)
        return [off + (i if i >= 0 else self.alphabet.index("?")) for i in map(self.alphabet.find, text)]

    def decode(self, ids: list[int]) -> str:
        off = 2 + len(SPECIAL_TOKENS)
        return "".join(
            SPECIAL_TOKENS[i - 2] if 2 <= i < off else self.alphabet[i - off] for i in ids if i >= 2
        )


@dataclass(frozen=True)
class Tool:
    """A tool: its name, description, JSON-schema ``parameters`` (every property required), and
    ``command(arguments) → shell command line`` run in the sandbox."""

    name: str
    description: str
    parameters: dict
    command: Callable[[dict], str]

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}  # fmt: skip


def _string_params(**props: str) -> dict:
    return {"type": "object", "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
            "required": list(props)}  # fmt: skip


TOOLS: dict[str, Tool] = {
    t.name: t
    for t in (
        Tool(
            "python",
            "Run Python 3 code; returns what it prints.",
            _string_params(code="Python source"),
            lambda a: "python3 -c " + shlex.quote(a["code"]),
        ),
        Tool(
            "read_file",
            "Read a text file.",
            _string_params(path="file path (relative to the home directory)"),
            lambda a: "cat -- " + shlex.quote(a["path"]),
        ),
        Tool(
            "bash",
            "Run a bash command line.",
            _string_params(command="the command line"),
            lambda a: "bash -c " + shlex.quote(a["command"]),
        ),
    )
}
"""The tools a :class:`HarnessConfig` can name."""


@dataclass(frozen=True)
class ContextPolicy:
    max_observation_tokens: int = 256
    """An observation longer than this keeps its head and tail around an elision mark."""
    keep_observations: int | None = None
    """Only the newest ``k`` observations keep their text (``None``: all)."""
    max_turns: int = 4
    """Tool calls run per trajectory."""

    def __post_init__(self) -> None:
        if self.max_observation_tokens < 64:
            raise ValueError(
                f"ContextPolicy.max_observation_tokens must be >= 64, got {self.max_observation_tokens}"
            )
        if self.keep_observations is not None and self.keep_observations < 1:
            raise ValueError(
                f"ContextPolicy.keep_observations must be >= 1 or None, got {self.keep_observations}"
            )
        if self.max_turns < 1:
            raise ValueError(f"ContextPolicy.max_turns must be >= 1, got {self.max_turns}")


@dataclass(frozen=True)
class HarnessConfig:
    """One task group's harness: the tools it offers (names in :data:`TOOLS`), the system prompt's opening,
    context management, and a tool command's time limit (seconds)."""

    tools: tuple[str, ...] = ("python",)
    system_prompt: str = "You can call tools. Give the final answer after 'ANSWER: '."
    context: ContextPolicy = field(default_factory=ContextPolicy)
    tool_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        unknown = [t for t in self.tools if t not in TOOLS]
        if unknown or not self.tools:
            raise ValueError(
                f"HarnessConfig.tools must name tools from {sorted(TOOLS)}, got {list(self.tools)}"
            )
        if not self.tool_timeout_s > 0:
            raise ValueError(f"HarnessConfig.tool_timeout_s must be > 0, got {self.tool_timeout_s}")


def last_turn_ids(trajectory: Trajectory) -> list[int]:
    """The policy's tokens after the last observation (the whole response if there is none)."""
    ids: list[int] = []
    for seg in trajectory.segments:
        ids = [] if seg.observation else ids + seg.token_ids
    return ids


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


class Harness:
    """Renders prompts, parses calls, runs them, and appends observations for one :class:`HarnessConfig`."""

    def __init__(self, config: HarnessConfig, tokenizer: AgentTokenizer) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.tools = {name: TOOLS[name] for name in config.tools}
        self.call_end_id = tokenizer.special_id(TOOL_CALL_END)

    def system_prompt(self) -> str:
        schemas = "\n".join(json.dumps(t.schema(), separators=(",", ":")) for t in self.tools.values())
        return (
            f"{self.config.system_prompt}\n<tools>\n{schemas}\n</tools>\n"
            f'Call a tool with {TOOL_CALL}{{"name":NAME,"arguments":{{...}}}}{TOOL_CALL_END}.\n'
        )

    def prompt_ids(self, task: str) -> list[int]:
        return self.tokenizer.encode(f"{self.system_prompt()}{task}\n")

    def pending_call(self, trajectory: Trajectory) -> bool:
        """Whether the trajectory's last token ends a tool call."""
        ids = trajectory.response_ids
        return bool(ids) and ids[-1] == self.call_end_id

    def parse_call(self, trajectory: Trajectory) -> ToolCall | str:
        """The call the last turn (the policy's tokens after the last observation) ends with, or an error
        message for the policy."""
        ids = last_turn_ids(trajectory)
        opener = self.tokenizer.special_id(TOOL_CALL)
        starts = [i for i, t in enumerate(ids[:-1]) if t == opener]
        if not starts:
            return f"error: {TOOL_CALL_END} without {TOOL_CALL}"
        text = self.tokenizer.decode(ids[starts[-1] + 1 : -1])
        try:
            obj = json.loads(text)
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return f"error: the tool call is not JSON with a name: {text[:80]!r}"
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return f"error: unknown tool {name!r}; tools: {', '.join(self.tools)}"
        missing = [
            k
            for k in tool.parameters["required"]
            if not isinstance(args, dict) or not isinstance(args.get(k), str)
        ]
        if missing:
            return f"error: {name} needs string arguments {missing}"
        return ToolCall(name, args)

    def execute(self, call: ToolCall | str, sandbox: ToolSandbox) -> str:
        """The observation text of ``call`` run in the running ``sandbox`` (raises ``SandboxDiedError``)."""
        if isinstance(call, str):
            return call
        r = sandbox.run(self.tools[call.name].command(call.arguments), self.config.tool_timeout_s)
        out = r.stdout + r.stderr
        return out if r.exit_code == 0 else f"{out}[exit code {r.exit_code}]"

    def clip(self, text: str) -> list[int]:
        """Observation tokens, head and tail kept around the elision mark beyond ``max_observation_tokens``."""
        ids = self.tokenizer.encode_observation(text)
        cap = self.config.context.max_observation_tokens
        if len(ids) <= cap:
            return ids
        mark = self.tokenizer.encode(ELIDED.format(n=len(ids) - cap))
        head = (cap - len(mark)) // 2
        tail = cap - len(mark) - head
        return ids[:head] + mark + ids[len(ids) - tail :]

    def append_observation(self, trajectory: Trajectory, text: str, version: int) -> None:
        """Append ``<tool_response>text</tool_response>`` (clipped) as an observation segment, then apply
        ``keep_observations``."""
        tok = self.tokenizer
        ids = [tok.special_id(TOOL_RESPONSE), *self.clip(text), tok.special_id(TOOL_RESPONSE_END)]
        trajectory.segments.append(Segment(ids, [0.0] * len(ids), version, observation=True))
        keep = self.config.context.keep_observations
        if keep is None:
            return
        obs = [i for i, s in enumerate(trajectory.segments) if s.observation]
        for i in obs[:-keep]:
            seg = trajectory.segments[i]
            body = seg.token_ids[1:-1]
            elided = [seg.token_ids[0], *tok.encode(ELIDED.format(n=len(body))), seg.token_ids[-1]]
            if len(elided) >= len(seg.token_ids):  # short, or elided already: the context stays as it was
                continue
            seg.token_ids, seg.logprobs = elided, [0.0] * len(elided)
            for later in trajectory.segments[i + 1 : -1]:  # sampled while the old text was in context
                if not later.observation:
                    later.trains = False
