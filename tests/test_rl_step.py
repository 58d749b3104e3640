"""One RL update end to end on a tiny model: group advantages over surviving rollouts, a reward that raises
drops its rollout and training continues, the engine gets the new weights; the demo's tasks and CLI."""

from __future__ import annotations

import argparse
import json
import random

import pytest
import torch

import openk3
from openk3.cli import build_parser
from openk3.rl.rollout import RolloutEngine, RolloutSampling
from openk3.rl.step import PolicyTrainer, RLConfig, masked_group_advantages
from openk3.rl.tasks import (
    DOMAINS,
    EFFORTS,
    CharTokenizer,
    is_correct,
    parse_answer,
    sample_problem,
    solution,
    written_effort,
)
from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def test_masked_group_advantages_hand_values():
    nan = float("nan")
    r = torch.tensor([[1.0, 0.0, nan, 1.0], [1.0, nan, nan, nan]])
    adv, keep = masked_group_advantages(r, eps=0.0)
    # group 0 over {1, 0, 1}: mean 2/3, population std √2/3 → (1/3)/(√2/3) = 1/√2, (−2/3)/(√2/3) = −√2
    torch.testing.assert_close(adv[0], torch.tensor([2**-0.5, -(2**0.5), 0.0, 2**-0.5]))
    assert keep.tolist() == [[True, True, False, True], [False, False, False, False]]


def test_step_drops_a_raising_reward_and_syncs():
    tok = CharTokenizer()
    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=tok.vocab_size), seed=0)
    cfg = EngineConfig(
        CacheConfig(block_size=8, num_blocks=400),
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32),
    )
    engine = RolloutEngine(model, cfg, RolloutSampling(1.0, frozenset({tok.stop_id}), seed=0))
    trainer = PolicyTrainer(model, engine, RLConfig(group_size=4, max_tokens=6, lr=1e-3))
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def outcome(t):
        calls.append(t)
        if len(calls) == 2:
            raise RuntimeError("reward service down")
        return float(len(calls) % 2)

    prompts = [tok.encode("HA123+456="), tok.encode("LX123*4=")]
    stats, trajs = trainer.step(prompts, [{}, {}], outcome)
    assert len(trajs) == 8 and stats["dropped_rollouts"] == 1.0 and "loss" in stats
    assert engine.version == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for a, b in zip(engine.model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert all(t.versions == [0] * t.num_generated for t in trajs)


def test_tasks_solutions_are_correct_and_lengths_ordered():
    tok, rng = CharTokenizer(), random.Random(0)
    for d in DOMAINS:
        for _ in range(50):
            p = sample_problem(d, rng)
            lengths = []
            for e in EFFORTS:
                text = solution(p, e)
                assert is_correct(p, text) and tok.decode(tok.encode(text)) == text
                lengths.append(len(text))
            assert lengths[0] > lengths[1] > lengths[2]  # high > medium > low
    assert parse_answer("no bar") is None and parse_answer("|12x") is None
    with pytest.raises(ValueError, match="alphabet"):
        tok.encode("x")


def test_written_effort_reads_each_format():
    rng = random.Random(1)
    for d in DOMAINS:
        for _ in range(50):
            p = sample_problem(d, rng)
            for e in EFFORTS:
                assert written_effort(p, solution(p, e)) == e
    add, mul = sample_problem("add", rng), sample_problem("mul", rng)
    assert written_effort(add, "12") == "other" and written_effort(add, "c1|3") == "other"
    assert written_effort(mul, "1,2|5") == "other" and written_effort(mul, "|5") == "low"


def _solve_columns(a: int, b: int, times: bool) -> list[tuple[int, int, int, int]]:
    """Schoolbook addition (``a + b``) or multiplication by a digit (``a * b``) by integer division,
    independent of ``tasks.solution``: per column from the right, ``(digit of a, digit of b or b, carry in,
    column result)``."""
    cols, carry = [], 0
    while a or (b and not times):
        other = b if times else b % 10
        s = (a % 10) * other + carry if times else a % 10 + other + carry
        cols.append((a % 10, other, carry, s))
        a, b, carry = a // 10, b if times else b // 10, s // 10
    return cols


def test_task_formats_match_an_independent_solver():
    """Every written step of every format, parsed back and checked against schoolbook column arithmetic,
    and the answers against Python's integers; the operand ranges are the tasks' (three-digit ``a``; ``b``
    three-digit for add, a digit 2–9 for mul)."""
    rng = random.Random(2)
    for d, op in (("add", "+"), ("mul", "*")):
        for _ in range(400):
            p = sample_problem(d, rng)
            a, b = p.operands
            assert 100 <= a <= 999 and (100 <= b <= 999 if d == "add" else 2 <= b <= 9)
            assert p.prompt("low") == f"L{'A' if d == 'add' else 'X'}{a}{op}{b}="
            cols = _solve_columns(a, b, times=d == "mul")
            high, medium, low = (solution(p, e) for e in EFFORTS)
            assert low == f"|{a + b if d == 'add' else a * b}" and medium.endswith(low) and high.endswith(low)
            steps = high[: -len(low)].split(",")
            assert len(steps) == len(cols) == 3
            for step, (da, db, cin, s) in zip(steps, cols):
                lhs, rhs = step.split("=")
                terms = lhs.replace("*", "+").split("+")  # digit, digit or b, then the carry in if any
                assert [int(x) for x in terms] == [da, db] + ([cin] if cin else []) and int(rhs) == s
                assert ("*" in lhs) == (d == "mul")
            assert medium[: -len(low)] == "c:" + "".join(str(s // 10) for *_, s in cols)
            # the written answer is the last column's result followed by the lower columns' last digits
            assert int(low[1:]) == int(str(cols[-1][3]) + "".join(str(s % 10) for *_, s in cols[-2::-1]))


def test_demo_efforts_separate_the_formats_on_every_problem():
    """With b0 at the scratchpad's length, the demo's τ per effort admits each effort's own format and shuts
    out the next longer one on the problems of both domains (add: a grid over the operands that meets each
    carry pattern and answer width; mul: every problem)."""
    from openk3.rl.recipe import DemoConfig
    from openk3.rl.rewards.budget import ProblemBudget, budget_limit
    from openk3.rl.tasks import Problem

    efforts = DemoConfig().efforts
    grid = [100, 101, 109, 150, 199, 455, 499, 500, 545, 555, 901, 990, 999]
    problems = [Problem("add", (a, b)) for a in grid for b in grid]
    problems += [Problem("add", (a, b)) for a in range(100, 1000, 7) for b in range(100, 1000, 11)]
    problems += [Problem("mul", (a, b)) for a in range(100, 1000) for b in range(2, 10)]
    for p in problems:
        n = {e: len(solution(p, e)) + 1 for e in EFFORTS}  # + the stop token
        for e, longer in (("medium", "high"), ("low", "medium")):
            limit = budget_limit(ProblemBudget(b0=n["high"], min_correct=n["low"]), efforts.tau(e))
            assert n[e] <= limit < n[longer], (p, e, limit, n)


def test_effort_tag_is_one_distinct_token_first_in_the_prompt():
    tok, rng = CharTokenizer(), random.Random(3)
    for d in DOMAINS:
        p = sample_problem(d, rng)
        ids = {e: tok.encode(p.prompt(e)) for e in EFFORTS}
        assert len({v[0] for v in ids.values()}) == 3  # one token per effort
        assert all(v[1:] == ids["high"][1:] for v in ids.values())  # the rest is the problem


def test_demo_mopd_prompts_balance_every_domain_and_effort_under_its_tag(tmp_path):
    from openk3.rl.recipe import Demo, DemoConfig

    cfg = DemoConfig(prompts_per_step=12, train_problems=8, eval_problems=2)
    demo = Demo(cfg, tmp_path)
    tags = {e: CharTokenizer().encode(sample_problem("add", random.Random(0)).prompt(e))[0] for e in EFFORTS}
    prompts, metas = demo.mopd_prompts(random.Random(0))
    keys = [(m["domain"], m["effort"]) for m in metas]
    assert sorted(keys) == sorted([(d, e) for d in DOMAINS for e in EFFORTS] * 2)
    train_prompts = {
        d: {demo.tok.decode(demo.tok.encode(p.prompt("high"))[1:]) for p in demo.train[d]} for d in DOMAINS
    }
    for ids, (d, e) in zip(prompts, keys):
        assert ids[0] == tags[e] and demo.tok.decode(ids[1:]) in train_prompts[d]
    with pytest.raises(ValueError, match="prompts_per_step"):
        DemoConfig(prompts_per_step=4)


def test_demo_warm_start_keeps_every_greedy_answer_that_stopped(tmp_path, monkeypatch):
    """The warm start asks each expert, greedily, for the warm-start problems of its domain under its tag and
    fine-tunes on every answer that stopped, right or wrong (cut-off ones dropped), each (domain, effort)
    resampled to the largest count."""
    import openk3.rl.recipe as recipe
    from openk3.rl.rollout import Segment

    demo = recipe.Demo(recipe.DemoConfig(train_problems=2, eval_problems=2, distill_problems=6), tmp_path)
    tok, temps = demo.tok, []
    answers = {}  # prompt text -> (response text, finish reason) the scripted expert gives

    class Scripted:
        def __init__(self, expert):
            self.expert = expert

        def generate(self, trajs):
            for i, t in enumerate(trajs):
                prompt = tok.decode(t.prompt_ids)
                p = next(q for q in demo.distill[self.expert[0]] if prompt[1:] == q.prompt("high")[1:])
                cut = i % 3 == 2 or (self.expert == ("mul", "low") and i >= 3)  # mul-low: 2 stop, not 4
                text = solution(p, self.expert[1]) if i % 3 == 0 else "|7" if i % 3 == 1 else "c:1"
                reason = "length" if cut else "stop"
                ids = tok.encode(text) + ([tok.stop_id] if reason == "stop" else [])
                t.segments, t.finish_reason = [Segment(ids, [0.0] * len(ids))], reason
                answers[(self.expert, prompt)] = (text, reason)
            return trajs

    def engine(model, temperature):
        temps.append(temperature)
        return Scripted(model)

    seen = []
    monkeypatch.setattr(demo, "engine", engine)
    monkeypatch.setattr(recipe, "sft", lambda model, examples, *a, **k: seen.extend(examples))
    experts = {(d, e): (d, e) for d in DOMAINS for e in EFFORTS}  # the scripted engine's "model" is its key
    demo.stage_distill(torch.nn.Linear(1, 1), experts)  # sft is replaced: the base is only copied
    assert temps == [0.0] * 6
    held = {p.id for ps in (*demo.train.values(), *demo.eval.values(), *demo.table_set.values()) for p in ps}
    assert not held & {p.id for ps in demo.distill.values() for p in ps}
    assert len(seen) == 6 * 4  # 4 of 6 answers stop per expert (2 right, 2 wrong), 2 for mul-low ...
    per_tag = {}
    for prompt_ids, _ in seen:
        per_tag[tok.decode(prompt_ids)[:2]] = per_tag.get(tok.decode(prompt_ids)[:2], 0) + 1
    assert per_tag == {
        f"{t}{dom}": 4 for t in "HML" for dom in "AX"
    }  # ... resampled: each tag weighs the same
    tags = {"H": "high", "M": "medium", "L": "low"}
    domain = {"A": "add", "X": "mul"}
    for prompt_ids, response_ids in seen:
        prompt = tok.decode(prompt_ids)
        text, reason = answers[((domain[prompt[1]], tags[prompt[0]]), prompt)]
        assert reason == "stop" and response_ids == tok.encode(text) + [tok.stop_id]
    wrong = [tok.decode(p)[:2] for p, r in seen if tok.decode(r) == "|7"]  # wrong answers are kept
    assert len([w for w in wrong if w != "LX"]) == 5 * 2 and "LX" in wrong


def test_demo_evaluate_decodes_the_stages_or_the_table_problems(tmp_path, monkeypatch):
    """``evaluate`` decodes, greedily, exactly the stages' held-out problems, or with ``table`` the table's,
    under the effort's tag, and scores what comes back."""
    import openk3.rl.recipe as recipe
    from openk3.rl.rollout import Segment

    demo = recipe.Demo(recipe.DemoConfig(train_problems=2, eval_problems=3, table_problems=5), tmp_path)
    tok, asked = demo.tok, []

    class Scripted:
        def generate(self, trajs):
            for t in trajs:
                asked.append(tok.decode(t.prompt_ids))
                p = next(
                    q for q in (*demo.eval["mul"], *demo.table_set["mul"]) if q.prompt("medium") == asked[-1]
                )
                ids = tok.encode(solution(p, "medium") if len(asked) % 2 else "c:0|1") + [tok.stop_id]
                t.segments, t.finish_reason = [Segment(ids, [0.0] * len(ids))], "stop"
            return trajs

    temps = []
    monkeypatch.setattr(demo, "engine", lambda model, temperature: temps.append(temperature) or Scripted())
    for table, problems in ((False, demo.eval["mul"]), (True, demo.table_set["mul"])):
        asked.clear()
        ev = demo.evaluate(None, "mul", "medium", table=table)
        assert asked == [p.prompt("medium") for p in problems]
        right = (len(problems) + 1) // 2  # the odd calls answer right
        assert ev["accuracy"] == right / len(problems) and ev["formats"]["medium"] == 1.0
    assert temps == [0.0, 0.0] and len(demo.table_set["mul"]) == 5


def test_demo_stages_file_is_checked_before_work_and_on_load(tmp_path):
    """A ``--stages`` path is refused before any stage runs when its folder is missing or a file is there; a
    stages file is refused on load when it is not one, or was made with another config or seed."""
    from openk3.rl.recipe import DemoConfig, check_stages_path, load_stages, stages_config

    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_stages_path(tmp_path / "missing" / "s.pt")
    (tmp_path / "there.pt").write_text("not a torch file")
    with pytest.raises(FileExistsError, match="already exists"):
        check_stages_path(tmp_path / "there.pt")
    with pytest.raises(ValueError, match="not a stages file"):
        load_stages(tmp_path / "there.pt", DemoConfig())
    torch.save({"warm": 1}, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="no warm start"):
        load_stages(tmp_path / "old.pt", DemoConfig())
    torch.save({"warm": 1, "experts": {}, "config": stages_config(DemoConfig(seed=0))}, tmp_path / "s.pt")
    assert load_stages(tmp_path / "s.pt", DemoConfig(seed=0, mopd_steps=3, mopd_lr=1e-4)) == (1, {})
    with pytest.raises(ValueError, match="seed 0 there, 1 here"):
        load_stages(tmp_path / "s.pt", DemoConfig(seed=1))


def test_demo_config_refuses_sizes_it_cannot_run():
    from openk3.rl.recipe import DemoConfig

    for bad, match in (
        (dict(distill_problems=7200), "mul has 7200"),
        (dict(group_size=0), "group_size"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(rho=5.0), "rho"),
        (dict(r_max=-1.0), "r_max"),
        (dict(mopd_lr=float("inf")), "mopd_lr"),
    ):
        with pytest.raises(ValueError, match=match):
            DemoConfig(**bad)


def test_demo_sft_set_holds_no_rl_or_held_out_problem(tmp_path):
    """The SFT examples are ``sft_steps × sft_batch`` problems none of which is an RL training, held-out or
    table problem, both domains present; the four problem sets are disjoint."""
    from openk3.rl.recipe import Demo, DemoConfig

    cfg = DemoConfig(sft_steps=50, sft_batch=16, train_problems=48, eval_problems=48, table_problems=40)
    demo = Demo(cfg, tmp_path)
    tok = demo.tok
    reserved = {
        p.text for ps in (*demo.train.values(), *demo.eval.values(), *demo.table_set.values()) for p in ps
    }
    assert len(reserved) == 4 * 48 + 2 * 40
    assert not reserved & {p.text for ps in demo.distill.values() for p in ps}
    assert all(len(demo.distill[d]) == cfg.distill_problems for d in DOMAINS)
    examples = demo.sft_examples()
    assert len(examples) == 50 * 16
    texts = [tok.decode(prompt)[2:-1] for prompt, _ in examples]  # drop the effort and domain tags and "="
    assert not reserved & set(texts)
    assert {tok.decode(prompt)[1] for prompt, _ in examples} == {"A", "X"}
    for (_, response), text in zip(examples, texts):  # each response solves its own prompt
        a, op, b = text.partition("+") if "+" in text else text.partition("*")
        answer = int(a) + int(b) if op == "+" else int(a) * int(b)
        assert response[-1] == tok.stop_id and tok.decode(response).endswith(f"|{answer}")


def test_demo_engine_runs_a_rollout_batch_at_once(tmp_path):
    """The demo's rollout engine runs 128 requests of the depth-4 model at once (admitted over two steps:
    64 first prefill chunks of 8 tokens fill the 512-token budget): each holds its KDA state pages besides
    its latent blocks, and a pool of 1,024 blocks had room for 16."""
    import openk3
    from openk3.rl.recipe import Demo, DemoConfig
    from openk3.rl.rollout import Trajectory

    demo = Demo(DemoConfig(train_problems=4, eval_problems=1), tmp_path)
    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=demo.tok.vocab_size), seed=0)
    engine = demo.engine(model, 1.0)
    active = {
        engine.submit(t): t
        for t in [
            Trajectory(demo.tok.encode(p.prompt("high")), demo.cfg.max_tokens) for p in demo.train["add"] * 32
        ]
    }
    done = engine.step(active)
    assert len(engine.engine.scheduler.running) + len(done) == 64
    done += engine.step(active)
    assert len(engine.engine.scheduler.running) + len(done) == 128  # some stop at their first token
    assert not engine.engine.scheduler.waiting and not engine.pending


def test_posttrain_cli_parses():
    args = build_parser().parse_args(["posttrain", "--recipe", "demo", "--quick", "--out", "/tmp/x"])
    assert args.quick and args.recipe == "demo" and callable(args.func)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["posttrain", "--recipe", "other"])


@pytest.mark.slow
def test_demo_quick_runs_end_to_end(tmp_path):
    from openk3.rl.recipe import Demo, quick_config

    cfg = quick_config()
    Demo(cfg, tmp_path).run(stages=tmp_path / "stages.pt")
    for name in ("sft", "rl-add-high", "rl-add-low", "rl-mul-medium", "mopd"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0
    text = (tmp_path / "results.md").read_text()
    assert text.count("\n| add |") == 3 and text.count("\n| mul |") == 3
    # the table's teacher columns are the experts on the table's problems: decoding again agrees
    demo = Demo(cfg, tmp_path / "again")
    saved = torch.load(tmp_path / "stages.pt", weights_only=False)
    rows = {(r["domain"], r["effort"]): r for r in json.loads((tmp_path / "table.json").read_text())}
    for (d, e), expert in saved["experts"].items():
        assert demo.evaluate(expert, d, e, table=True) == rows[(d, e)]["teacher"]
    saved = torch.load(tmp_path / "stages.pt", weights_only=False)  # what mopd_ablation.py --stages loads
    assert sorted(saved["experts"]) == sorted((d, e) for d in DOMAINS for e in EFFORTS)
    assert isinstance(saved["warm"], torch.nn.Module)


def test_partial_step_trains_complete_groups_only():
    """With partial rollout (λ = 1/3) a step trains the groups whose every member finished, each group whole;
    the rest wait and train later, with tokens from the older version counted as stale."""
    from openk3.rl.partial_rollout import PartialRolloutConfig

    tok = CharTokenizer()
    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=tok.vocab_size), seed=1)
    cfg = EngineConfig(
        CacheConfig(block_size=8, num_blocks=400),
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=32),
    )
    engine = RolloutEngine(
        model, cfg, RolloutSampling(3.0, frozenset({tok.stop_id}), seed=0)
    )  # hot: lengths vary
    partial = PartialRolloutConfig(finish_fraction=1 / 3, max_staleness=4)
    trainer = PolicyTrainer(model, engine, RLConfig(group_size=3, max_tokens=30, lr=1e-3, partial=partial))
    prompts = [tok.encode(f"HX12{i}*3=") for i in range(6)]
    trained, outstanding, paused = [], 0, 0
    for step in range(3):
        batch = prompts[2 * step : 2 * step + 2]
        stats, trajs = trainer.step(
            batch, [{"i": 2 * step + k} for k in range(2)], lambda t: float(t.num_generated)
        )
        assert len(trajs) == 3 * stats["groups_trained"] and stats["groups_trained"] >= 1
        for g in range(0, len(trajs), 3):
            group = trajs[g : g + 3]
            assert all(t.finished for t in group) and len({t.meta["i"] for t in group}) == 1
            trained.append(group[0].meta["i"])
        outstanding += 2
        assert stats["groups_trained"] + stats["groups_paused"] == outstanding
        outstanding -= int(stats["groups_trained"])
        paused += stats["groups_paused"]
    assert engine.version == 3 and len(trained) == len(set(trained)) and paused > 0
    trainer.partial.config = PartialRolloutConfig(finish_fraction=1.0, max_staleness=4)
    stats, trajs = trainer.step([], [], lambda t: float(t.num_generated))
    trained += [trajs[g].meta["i"] for g in range(0, len(trajs), 3)]
    assert sorted(trained) == list(range(6)) and not trainer.partial.buffer
    if any(len(t.segments) > 1 for t in trajs):
        assert stats["stale_token_fraction"] > 0


def test_the_demo_creates_its_folder_only_to_write_and_keeps_earlier_results(tmp_path):
    """A run refused or interrupted before its first output leaves no folder; an earlier run's results are
    not overwritten; an output path below a file is refused before any work."""
    from openk3.rl.cli import run
    from openk3.rl.recipe import Demo, DemoConfig

    out = tmp_path / "new" / "demo"
    args = argparse.Namespace(quick=True, out=out, seed=0, stages=tmp_path / "missing" / "s.pt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run(args)
    assert not (tmp_path / "new").exists()
    Demo(DemoConfig(), out)
    assert not (tmp_path / "new").exists()
    out.mkdir(parents=True)
    (out / "results.md").write_text("an earlier run")
    with pytest.raises(FileExistsError, match="holds an earlier run's results.md"):
        Demo(DemoConfig(), out)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        Demo(DemoConfig(), tmp_path / "file" / "demo")
