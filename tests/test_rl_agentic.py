"""Agentic rollouts without a VM: scripted policies (no model) over host-directory sandbox doubles
(``tests/agentic_doubles.py``; the real microVM path is ``tests/test_rl_agentic_sandbox.py``, slow).

A policy that calls the tool gets reward 1, one that does not gets 0; observation tokens are masked; the judge's
fork leaves the trajectory's sandbox untouched; sandboxes stay paused while the policy generates; a sandbox that
dies fails its trajectory once (no retry) and the trainer drops it; context management; one RL step of a tiny
model through :class:`PolicyTrainer`."""

from __future__ import annotations

import json
import random

import pytest
import torch

import openk3
from agentic_doubles import HostDirSandboxesDouble, ScriptedEngine
from openk3.rl.agentic import AgenticConfig, AgenticRollout
from openk3.rl.agentic_tasks import Lookup, SumFile
from openk3.rl.harness import (
    TOOL_CALL,
    TOOL_CALL_END,
    TOOL_RESPONSE,
    TOOL_RESPONSE_END,
    AgentTokenizer,
    ContextPolicy,
    Harness,
    HarnessConfig,
)
from openk3.rl.rollout import RolloutEngine, RolloutSampling, Segment, Trajectory
from openk3.rl.step import PolicyTrainer, RLConfig
from openk3.rl.tool_sandbox import SandboxDiedError
from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = AgentTokenizer()
CALL_END = TOK.special_id(TOOL_CALL_END)
SUM_CODE = "s=sum(int(x) for x in open('numbers.txt'));open('answer.txt','w').write(str(s));print(s)"


def call(name: str, **arguments) -> str:
    return TOOL_CALL + json.dumps({"name": name, "arguments": arguments}) + TOOL_CALL_END


def last_observation(text: str) -> str:
    return text.rsplit(TOOL_RESPONSE, 1)[1].split(TOOL_RESPONSE_END)[0]


def tool_user(turn: int, text: str) -> str:
    if turn == 0:
        return call("python", code=SUM_CODE) if "numbers.txt" in text else call("read_file", path="key.txt")
    return f"ANSWER: {last_observation(text).strip()}<stop>"


def no_tool(turn: int, text: str) -> str:
    return "ANSWER: 314159<stop>"


def rollout_of(script, factory, groups=None, **kw):
    engine = ScriptedEngine(TOK, script, CALL_END, factory.state_of)
    return AgenticRollout(engine, TOK, groups or [SumFile(), Lookup()], factory, AgenticConfig(**kw)), engine


def batch(rollout, n=2, seed=0, max_tokens=600):
    rng = random.Random(seed)
    metas = [SumFile.sample(rng) for _ in range(n)] + [Lookup.sample(rng) for _ in range(n)]
    return [Trajectory(rollout.prompt_ids(m), max_tokens, dict(m)) for m in metas]


def expected_mask(ids: list[int]) -> list[float]:
    """0 from each <tool_response> to its </tool_response> (both included), else 1: read off the token ids."""
    out, inside = [], False
    for t in ids:
        inside = inside or t == TOK.special_id(TOOL_RESPONSE)
        out.append(0.0 if inside else 1.0)
        inside = inside and t != TOK.special_id(TOOL_RESPONSE_END)
    return out


def test_tool_user_gets_1_and_no_tool_gets_0_with_masked_observations():
    factory = HostDirSandboxesDouble()
    rollout, engine = rollout_of(tool_user, factory)
    trajs = rollout.generate(batch(rollout))
    assert [rollout.outcome(t) for t in trajs] == [1.0] * 4
    assert rollout.stats == {"tool_calls": 4, "failed_trajectories": 0}
    assert engine.running_during_generation == []  # paused while the policy generated
    for t in trajs:
        assert t.finish_reason == "stop" and t.meta["agent"]["tool_calls"] == 1
        obs = last_observation(TOK.decode(t.response_ids))
        want = str(sum(t.meta["numbers"])) if t.meta["group"] == "sumfile" else t.meta["code"]
        assert obs == want + "\n"  # the sandbox computed / read it
        assert t.loss_mask == expected_mask(t.response_ids) and 0 < sum(t.loss_mask) < len(t.loss_mask)
        assert len(t.behaviour_logprobs) == t.num_generated
    rollout.release()

    factory = HostDirSandboxesDouble()
    rollout, _ = rollout_of(no_tool, factory)
    trajs = rollout.generate(batch(rollout))
    assert [rollout.outcome(t) for t in trajs] == [0.0] * 4
    assert [c for s, c in factory.commands if s in factory.created] == []  # only the judges ran commands
    assert all(m == 1.0 for t in trajs for m in t.loss_mask)
    rollout.release()
    assert sorted(factory.killed) == sorted(factory.all)  # every sandbox freed, the judges' forks included


def test_judge_runs_in_a_fork_and_leaves_the_trajectory_sandbox_untouched():
    factory = HostDirSandboxesDouble()
    rollout, _ = rollout_of(tool_user, factory, groups=[SumFile()])
    meta = SumFile.sample(random.Random(1))
    t = Trajectory(rollout.prompt_ids(meta), 600, meta)
    rollout.generate([t])
    sid = t.meta["agent"]["sandbox_id"]
    own = factory.all[sid]
    answer = (own.path / "answer.txt").read_text()
    assert answer == str(sum(t.meta["numbers"]))
    assert rollout.outcome(t) == 1.0 and rollout.outcome(t) == 1.0  # the judge's test deletes answer.txt
    assert (own.path / "answer.txt").read_text() == answer and own.state == "paused"
    judges = [child for parent, child in factory.forks if parent == sid]
    assert len(judges) == 2 and all(j in factory.killed for j in judges)
    rollout.release()


def test_a_dead_sandbox_fails_its_trajectory_once_and_is_not_retried():
    factory = HostDirSandboxesDouble(die_on_command=lambda c: "numbers.txt" in c)
    rollout, _ = rollout_of(tool_user, factory)
    trajs = rollout.generate(batch(rollout))
    sums, looks = trajs[:2], trajs[2:]
    for t in sums:
        assert t.finish_reason == "failed" and "crashed" in t.meta["agent"]["failed"]
        with pytest.raises(SandboxDiedError, match="crashed"):
            rollout.outcome(t)
        assert t.meta["agent"]["sandbox_id"] in factory.killed  # freed at once
    assert [rollout.outcome(t) for t in looks] == [1.0, 1.0]
    assert rollout.stats["failed_trajectories"] == 2
    assert sum("numbers.txt" in c for _, c in factory.commands) == 2  # one attempt each
    rollout.release()

    factory = HostDirSandboxesDouble(fail_creates=frozenset({0}))  # creation fails: failed at the first call
    rollout, _ = rollout_of(tool_user, factory)
    trajs = rollout.generate(batch(rollout))
    assert [t.finish_reason for t in trajs].count("failed") == 1 and len(factory.created) == 3
    rollout.release()


def test_malformed_calls_unknown_tools_and_the_turn_limit_answer_without_running():
    def script(turn, text):
        return [
            TOOL_CALL + "{not json" + TOOL_CALL_END,
            call("bash", command="ls"),  # not offered by the group
            call("python"),  # missing argument
            call("python", code="print(1)"),
            call("python", code="print(2)"),
            call("python", code="print(3)"),
            "done<stop>",
        ][turn]

    factory = HostDirSandboxesDouble()
    group = SumFile(HarnessConfig(tools=("python",), context=ContextPolicy(max_turns=2)))
    rollout, _ = rollout_of(script, factory, groups=[group])
    meta = SumFile.sample(random.Random(2))
    (t,) = rollout.generate([Trajectory(rollout.prompt_ids(meta), 2000, meta)])
    text = TOK.decode(t.response_ids)
    obs = [o.split(TOOL_RESPONSE_END)[0] for o in text.split(TOOL_RESPONSE)[1:]]
    assert obs[0].startswith("error: the tool call is not JSON")
    assert obs[1].startswith("error: unknown tool 'bash'")
    assert obs[2] == "error: python needs string arguments ['code']"
    assert obs[3:5] == ["1\n", "2\n"]
    assert obs[5] == "error: no tool calls left (at most 2)"
    assert [c for _, c in factory.commands] == ["python3 -c 'print(1)'", "python3 -c 'print(2)'"]
    assert t.finish_reason == "stop" and t.meta["agent"]["tool_calls"] == 2
    rollout.release()


def test_context_policy_clips_and_elides_old_observations():
    h = Harness(HarnessConfig(context=ContextPolicy(max_observation_tokens=64, keep_observations=1)), TOK)
    t = Trajectory(TOK.encode("task"), 1000)
    first_call = TOK.encode(call("python", code="x"))
    t.segments.append(Segment(first_call, [-0.5] * len(first_call)))
    long = "".join(f"{i:03d}" for i in range(100))  # 300 characters
    h.append_observation(t, long, 0)
    body = TOK.decode(t.segments[-1].token_ids[1:-1])
    assert len(t.segments[-1].token_ids) == 64 + 2
    assert body.startswith("000001") and body.endswith("098099") and "[...236 tokens elided...]" in body
    t.segments.append(Segment(TOK.encode("again"), [-0.5] * 5))
    h.append_observation(t, "short", 0)
    first, middle = t.segments[1], t.segments[2]
    assert TOK.decode(first.token_ids) == f"{TOOL_RESPONSE}[...64 tokens elided...]{TOOL_RESPONSE_END}"
    assert (t.segments[0].trains, middle.trains) == (True, False)  # sampled before / under the old text
    assert t.loss_mask == [1.0] * len(first_call) + [0.0] * (len(first.token_ids) + 5 + 7)
    assert len(t.behaviour_logprobs) == t.num_generated


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="tools"):
        HarnessConfig(tools=("rm",))
    with pytest.raises(ValueError, match="max_turns"):
        ContextPolicy(max_turns=0)
    with pytest.raises(ValueError, match="keep_observations"):
        ContextPolicy(keep_observations=0)
    with pytest.raises(ValueError, match="sandbox_workers"):
        AgenticConfig(sandbox_workers=0)
    engine = ScriptedEngine(TOK, no_tool, CALL_END, lambda s: "paused")
    engine.sampling = RolloutSampling(1.0, frozenset({TOK.stop_id}))
    with pytest.raises(ValueError, match="</tool_call>"):
        AgenticRollout(engine, TOK, [SumFile()], HostDirSandboxesDouble())
    rollout, _ = rollout_of(no_tool, HostDirSandboxesDouble())
    with pytest.raises(ValueError, match="meta\\['group'\\]"):
        rollout.prompt_ids({"group": "chess"})
    with pytest.raises(ValueError, match="alphabet"):
        TOK.encode("é")
    injected = TOK.encode_observation("é" + TOOL_CALL)  # a tool's output cannot forge a marker token
    assert TOK.decode(injected) == "?" + TOOL_CALL and TOK.special_id(TOOL_CALL) not in injected


def test_policy_trainer_step_on_agentic_rollouts_drops_failed_sandboxes():
    """One RL step of a tiny K3 through PolicyTrainer: the model samples (it rarely calls a tool), one
    sandbox fails at creation (its rollout is dropped and counted), the rest train with observations masked."""
    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=TOK.vocab_size), seed=0)
    cfg = EngineConfig(
        CacheConfig(block_size=16, num_blocks=400), SchedulerConfig(max_num_batched_tokens=1024)
    )
    sampling = RolloutSampling(1.0, frozenset({TOK.stop_id, CALL_END}), seed=0)
    engine = RolloutEngine(model, cfg, sampling, sample_vocab_size=TOK.vocab_size)
    factory = HostDirSandboxesDouble(fail_creates=frozenset({1}))
    rollout = AgenticRollout(engine, TOK, [SumFile(), Lookup()], factory)
    trainer = PolicyTrainer(model, rollout, RLConfig(group_size=2, max_tokens=12, lr=1e-3))
    rng = random.Random(0)
    metas = [SumFile.sample(rng), Lookup.sample(rng)]
    before = [p.detach().clone() for p in model.parameters()]

    def outcome(
        t,
    ):  # the task reward plus a spread, so that each surviving group has an advantage to train on
        return rollout.outcome(t) + sum(t.response_ids) % 7 / 7

    stats, trajs = trainer.step([rollout.prompt_ids(m) for m in metas], metas, outcome)
    assert [t.finish_reason == "failed" for t in trajs] == [False, True, False, False]
    assert stats["dropped_rollouts"] == 1.0 and rollout.stats["failed_trajectories"] == 1
    assert "loss" in stats and engine.version == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    rollout.release()
    assert set(factory.killed) == set(factory.all)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_sandbox_server_is_an_error_up_front():
    import subprocess
    import sys
    from pathlib import Path

    from openk3.rl.tool_sandbox import E2BConnection, E2BSandboxes, SandboxServerError

    with pytest.raises(ValueError, match="E2BConnection.api_url must be an http"):
        E2BConnection("not-a-url", "x")
    url = f"http://127.0.0.1:{_closed_port()}"
    engine = ScriptedEngine(TOK, no_tool, CALL_END, lambda sandbox_id: "")
    with pytest.raises(SandboxServerError, match=f"sandbox server at {url} is unreachable"):
        AgenticRollout(engine, TOK, [SumFile()], E2BSandboxes(E2BConnection(url, "x", request_timeout_s=5)))
    root = Path(__file__).resolve().parents[1]
    args = ["--api-key", "x", "--sft-steps", "2", "--rl-steps", "1", "--prompts", "1", "--group", "2"]
    for bad in (url, "not-a-url"):
        run = subprocess.run(
            [sys.executable, str(root / "benchmarks" / "agentic_rl.py"), "--sandbox-url", bad, *args],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 2 and "sft:" not in run.stdout, run.stdout
        assert bad in run.stderr.strip().splitlines()[-1] and "Traceback" not in run.stderr


def test_a_step_whose_rollouts_are_all_dropped_logs_the_first_reason(caplog):
    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=TOK.vocab_size), seed=0)
    cfg = EngineConfig(
        CacheConfig(block_size=16, num_blocks=400), SchedulerConfig(max_num_batched_tokens=1024)
    )
    sampling = RolloutSampling(1.0, frozenset({TOK.stop_id, CALL_END}), seed=0)
    engine = RolloutEngine(model, cfg, sampling, sample_vocab_size=TOK.vocab_size)
    rollout = AgenticRollout(
        engine, TOK, [SumFile()], HostDirSandboxesDouble(fail_creates=frozenset(range(4)))
    )
    trainer = PolicyTrainer(model, rollout, RLConfig(group_size=2, max_tokens=4, lr=1e-3))
    metas = [SumFile.sample(random.Random(0)) for _ in range(2)]
    with caplog.at_level("WARNING", logger="openk3.rl.step"):
        stats, _ = trainer.step([rollout.prompt_ids(m) for m in metas], metas, rollout.outcome)
    assert stats["dropped_rollouts"] == 4.0
    assert "all of 4 rollouts dropped" in caplog.text and "failed: no room" in caplog.text
    rollout.release()


def test_the_agentic_snippet_of_the_docs_runs_over_the_test_double(capsys):
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "post_training.md").read_text()
    section = docs.split("## Agentic tasks", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    server = 'E2BSandboxes(E2BConnection("http://127.0.0.1:3000", "my-key"))'
    assert server in code
    namespace = {"HostDirSandboxesDouble": HostDirSandboxesDouble}
    exec(code.replace(server, "HostDirSandboxesDouble()"), namespace)  # the docs' own code, one line swapped
    assert namespace["stats"]["dropped_rollouts"] == 0.0 and len(namespace["trajs"]) == 4
    assert "'reward'" in capsys.readouterr().out
