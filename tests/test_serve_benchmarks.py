"""The serving benchmarks on the CPU: the argument checks of ``benchmarks/serve.py`` and
``benchmarks/serve_profile.py``; that a profiled decode step is one engine step that gives every stream
exactly one token; ``serve.py``'s limits against the numbers of the issue that set the targets (k3-small:
70,082,496 active parameters, ~140 MB read per token in bf16)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

import openk3

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def bench_script(monkeypatch, name: str):
    """The module of ``benchmarks/<name>.py``."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module(name)


@pytest.fixture
def serve_profile(monkeypatch):
    return bench_script(monkeypatch, "serve_profile")


@pytest.fixture
def serve_bench(monkeypatch):
    return bench_script(monkeypatch, "serve")


def test_serve_limits_of_k3_small(serve_bench, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA defaults, on any machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = serve_bench.parse_args(["--device", "cuda", "--preset", "k3-small", "--prefix", "32768"])
    assert args.dtype == "bfloat16" and args.long_prefill_token_threshold == 16384 and args.block_size == 512
    assert args.checkpoint_interval == 16384 // 512  # checkpoints never cut a chunk
    text = openk3.config.text_config_of(openk3.get_preset("k3-small"))
    lim = serve_bench.limits(text, args)
    assert lim["weight_bytes_1"] == 2 * 70_082_496  # every active weight once, in bf16
    # 12 KDA layers × (8 heads × 64 × 64 state + 3 × 512 × 3 conv inputs) in fp32
    assert lim["state_bytes"] == 12 * (8 * 64 * 64 + 3 * 512 * 3) * 4
    per_token = 140.16e6 / 4.3e12  # seconds for the weights; the states and latents add a little
    assert 0.9 / per_token < lim["decode_tok_s"][1] < 1 / per_token
    assert lim["decode_tok_s"][64] > 10 * lim["decode_tok_s"][1]  # 64 streams share the weights


def test_serve_report_names_the_limits_it_compares_with(serve_bench, monkeypatch, tmp_path):
    """The default limits are an H200's on any device, and the report says so (on the CPU: not this CPU's);
    given ones are named as given."""

    def measured(name, args):  # the report of a run, without running it
        text = openk3.config.text_config_of(openk3.get_preset(name))
        row = {"streams": 1, "engine_tok_s": 30.0, "decode_tok_s": 40.0, "plain_tok_s": 30.0, "speedup": 1.0}
        miss, hit = ({"cached_tokens": c, "ttft_s": t, "total_s": 2 * t} for c, t in [(0, 0.1), (16, 0.05)])
        limits = serve_bench.limits(text, args)
        return {"preset": name, "ttft": {"miss": miss, "hit": hit}, "throughput": [row], "limits": limits}

    monkeypatch.setattr(serve_bench, "run_preset", measured)
    out = tmp_path / "r.md"
    serve_bench.main(["--streams", "1", "--out", str(out)])
    report = out.read_text()
    assert (
        "Limits: 4.3 TB/s and 790 TFLOP/s, an H200's (the defaults of --bandwidth and --peak), not this CPU's: "
        "each share of the limit compares this run with an H200" in report
    )
    assert "## k3-tiny: against an H200's limits" in report
    serve_bench.main(["--streams", "1", "--bandwidth", "1e11", "--peak", "2e12", "--out", str(out)])
    report = out.read_text()
    assert (
        "Limits: 0.1 TB/s and 2 TFLOP/s, given by --bandwidth and --peak" in report and "H200" not in report
    )


def test_serve_takes_the_longest_requests_the_preset_fits(serve_bench):
    """At the bound, each engine's ``max_model_len`` is ``max_position_embeddings`` (which the engine takes);
    the warm-up's requests are no longer than the measured ones."""
    args = serve_bench.parse_args(
        ["--prefix", "65455", "--prompt", "65532", "--decode-tokens", "3", "--threads", "1"]
    )
    assert serve_bench.ttft_model_len(args) == serve_bench.throughput_model_len(args) == 65536


def test_serve_refuses_a_zero_chunk_a_missing_gpu_and_an_unwritable_out(serve_bench, capsys, monkeypatch):
    """0 is not read as the default chunk (the engine's ``SchedulerConfig`` refuses it too); ``--out`` (a
    folder, or a ``.md`` file whose folder is made) is checked before the first preset runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for args, says in [
        (["--long-prefill-token-threshold", "0"], "--long-prefill-token-threshold must be at least 1, got 0"),
        (["--device", "cuda"], "--device cuda: no CUDA device is available"),
        (["--preset", "k3-tiny", "nope"], "argument --preset: invalid choice: 'nope'"),
        (["--out", "/proc/q"], "--out /proc/q: cannot create /proc/q (No such file or directory)"),
        (
            ["--out", "/proc/r.md"],
            "--out /proc/r.md: its folder /proc: /proc is not writable (creating a folder in it fails: "
            "No such file or directory)",
        ),
        (["--out", str(ROOT / "docs")], None),  # a folder: accepted
        (["--out", str(ROOT / "README.md" / "r.md")], "README.md exists and is not a directory"),
    ]:
        if says is None:
            assert serve_bench.parse_args(args).out == ROOT / "docs"
            continue
        with pytest.raises(SystemExit) as stop:
            serve_bench.parse_args(args)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and says in err and "Traceback" not in err, err


BAD_ARGUMENTS = {
    "serve_profile": [
        (["--streams", "0"], "every --streams value must be at least 1"),
        (["--preset", "nope"], "argument --preset: invalid choice: 'nope'"),
        (["--device", "cuda"], "--device cuda: no CUDA device is available"),
        (["--device", "tpu"], "--device tpu: give cpu, cuda or cuda:N"),
        (
            ["--long-prefill-token-threshold", "-8"],
            "--long-prefill-token-threshold must be at least 1, got -8",
        ),
        (
            ["--long-prefill-token-threshold", "0"],
            "--long-prefill-token-threshold must be at least 1, got 0",
        ),
        (["--block-size", "0"], "--block-size must be at least 1, got 0"),
        (["--pool-mib", "0"], "--pool-mib must be a number of MiB > 0, got 0"),
        (
            ["--prefill", "65535"],
            "--prefill 65535: too long for k3-tiny, whose max_position_embeddings 65536 must hold "
            "--prefill + 2: give --prefill at most 65534",
        ),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (
            ["--steps", "40000"],
            "--steps 40000: the decode streams would outgrow k3-tiny's 65536 positions",
        ),
        (["--out", "/proc/q"], "--out /proc/q: cannot create /proc/q (No such file or directory)"),
        (["--out", str(ROOT / "pyproject.toml")], "pyproject.toml exists and is not a directory"),
        (["--out", ""], "give a directory name"),
    ],
    "serve": [
        (["--prefix", "0"], "--prefix must be at least 1, got 0"),
        (["--plain-requests", "0"], "--plain-requests must be at least 1, got 0"),
        (["--bandwidth", "0"], "--bandwidth must be a number of bytes/s > 0, got 0"),
        (["--bandwidth", "nan"], "--bandwidth must be a number of bytes/s > 0, got nan"),
        (["--peak", "-1"], "--peak must be a number of FLOP/s > 0, got -1"),
        (["--threads", "-1"], "--threads must be at least 1, got -1"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (  # k3-tiny: 65,536 positions; a TTFT request: prefix, 16 suffix tokens, its new tokens, one more
            ["--prefix", "65456"],
            "--prefix 65456, --new-tokens 64: too long for k3-tiny, whose max_position_embeddings 65536 "
            "must hold --prefix + --new-tokens + 17: give --prefix + --new-tokens at most 65519",
        ),
        (
            ["--preset", "k3-tiny", "k3-small", "--prompt", "65536", "--decode-tokens", "8"],
            "--prompt 65536, --decode-tokens 8: too long for k3-tiny, whose max_position_embeddings "
            "65536 must hold --prompt + --decode-tokens + 1: give --prompt + --decode-tokens at most 65535",
        ),
    ],
}
"""Per script, arguments and the line that refuses them."""


@pytest.mark.parametrize(
    ("script", "args", "says"),
    [(script, args, says) for script, rows in BAD_ARGUMENTS.items() for args, says in rows],
)
def test_bad_arguments_are_refused(capsys, monkeypatch, script, args, says):
    """One line and exit status 2 from argparse before any work, never a traceback, whether or not a GPU is
    present; ``serve.py`` and ``serve_profile.py`` share the checks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        bench_script(monkeypatch, script).parse_args(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and says in err.splitlines()[-1] and "Traceback" not in err, err


def test_an_unwritable_out_is_refused_before_the_profile(serve_profile, capsys, monkeypatch):
    monkeypatch.setattr(openk3, "build_model", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(SystemExit) as stop:
        serve_profile.main(["--prefill", "16", "--streams", "1", "--out", "/proc/q"])
    assert stop.value.code == 2 and "--out /proc/q: cannot create /proc/q" in capsys.readouterr().err


def test_given_sizes_are_kept_and_defaults_fill_the_rest(serve_profile):
    """A given chunk is kept, the others take their CPU defaults; 600 streams get a step budget of a chunk
    beside them (the engine's config refuses a budget that a full decode batch uses up)."""
    args = serve_profile.parse_args(["--long-prefill-token-threshold", "64", "--streams", "1", "600"])
    assert (args.long_prefill_token_threshold, args.block_size, args.max_num_batched_tokens) == (64, 16, 664)
    assert args.checkpoint_interval == 4  # 64 tokens of 16-token blocks
    args = serve_profile.parse_args(["--max-num-batched-tokens", "300", "--streams", "1", "8"])
    assert (args.long_prefill_token_threshold, args.max_num_batched_tokens) == (256, 300)
    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=512), seed=0).eval()
    engine = serve_profile.make_engine(model, args, serve_profile.decode_model_len(args), 600)
    assert engine.scheduler.config.max_num_batched_tokens == 601


def test_device_annotations_are_not_counted_as_kernels(serve_profile):
    """The profiler mirrors a host range (``record_function``, a custom op) on the device timeline, spanning
    its kernels: such a device event is skipped, so the step's kernel time is the kernels' own."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, device, start, end):
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, device_type=device, time_range=span)

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [
        event(serve_profile.STEP, cpu, 0, 100),
        event("aten::mul", cpu, 10, 20),
        event("openk3::kda_pool_decode", cpu, 30, 40),
        event(serve_profile.STEP, gpu, 5, 95),  # the step's mirror
        event("openk3::kda_pool_decode", gpu, 40, 60),  # the custom op's mirror
        event("void at::native::vectorized_elementwise_kernel<4, MulFunctor>", gpu, 20, 27),
        event("kda_decode_kernel", gpu, 40, 58),
    ]
    s = serve_profile.step_summary(SimpleNamespace(events=lambda: events), 1, cuda=True)
    assert (s["kernels"], s["kernel_ms"]) == (2, 25 / 1e3)
    assert s["families"] == {"ATen elementwise / reduce": [1, 7.0], "KDA op": [1, 18.0]}
    prof = SimpleNamespace(events=lambda: events)
    seq = serve_profile.kernel_sequence(prof)  # the kernels in launch order, mirrors skipped
    assert seq == [
        ("void at::native::vectorized_elementwise_kernel<4, MulFunctor>", 0, 7),
        ("kda_decode_kernel", 20, 18),
    ]
    (line, _) = serve_profile.timeline_lines([{"streams": 1, "kernel_sequence": seq}])
    assert "1 streams: 2 kernels over 38 µs, idle 13 µs" in line  # 38 µs span, 25 µs of kernels


def test_profiled_decode_steps(serve_profile):
    args = serve_profile.parse_args(["--steps", "2", "--pool-mib", "16"])
    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=512), seed=0).eval()
    gen = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(1, 512, (n,), generator=gen).tolist()

    calls = []
    real_step = openk3.serve.LLMEngine.step

    def counting_step(self, *a, **kw):
        out = real_step(self, *a, **kw)
        calls.append(sorted(len(r.output_token_ids) for r in self.scheduler.running))
        return out

    keep: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(openk3.serve.LLMEngine, "step", counting_step)
        steps, unprofiled_ms = serve_profile.profile_decode(
            model, args, tokens, 3, [torch.profiler.ProfilerActivity.CPU], keep
        )
    assert len(steps) == len(keep) == 2 and unprofiled_ms > 0
    # two profiled engine steps, then two timed ones: each added one token to each of the 3 streams
    assert [c[0] - calls[-5][0] for c in calls[-4:]] == [1, 2, 3, 4] and all(
        len(set(c)) == 1 for c in calls[-5:]
    )
    for s in steps:
        assert s["tokens"] == 3 and s["host_ms"] > 0 and s["ops"] > 0
        assert s["step_ms"] == s["host_ms"] and s["wait_ms"] == 0  # no device to wait for on a CPU
        assert s["kernel_ms"] == s["kernels"] == 0 and s["launches"] == 0 and s["syncs"] is None
    assert serve_profile.median_step(steps)["tokens"] == 3


def test_profiled_prefill_steps_and_their_operator_table(serve_profile):
    """Each prefill step is kept for the prefill's own operator table (where a miss's TTFT goes)."""
    args = serve_profile.parse_args(
        ["--prefill", "40", "--long-prefill-token-threshold", "16", "--pool-mib", "16", "--top", "3"]
    )
    model = openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=512), seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    keep: list = []
    steps = serve_profile.profile_prefill(
        model, args, lambda n: torch.randint(1, 512, (n,), generator=gen).tolist(),
        [torch.profiler.ProfilerActivity.CPU], keep,
    )  # fmt: skip
    assert [s["tokens"] for s in steps] == [16, 16, 8] and len(keep) == 3
    for s, prof in zip(steps, keep):  # each step's own leaders, host ops only, largest first
        top = s["top_ops"]
        assert len(top) == 4 and all(n.startswith("aten::") or "::" in n for n, _ in top)
        assert [ms for _, ms in top] == sorted((ms for _, ms in top), reverse=True) and top[-1][1] > 0
        assert top[0][0] == serve_profile.top_ops([prof], 1, cuda=False)[0]["name"]
    ops = serve_profile.top_ops(keep, args.top, cuda=False)
    assert len(ops) == 3 and ops[0]["self_cpu_ms"] >= ops[-1]["self_cpu_ms"] > 0


def test_profile_report_lists_each_batch_sizes_operators_per_step(serve_profile, tmp_path):
    """The report of a whole run: one operator table per decode batch size, its calls and times per step (the
    totals of that batch size's profiled steps divided by ``--steps``), beside the prefill's table."""
    report = serve_profile.main(
        ["--prefill", "16", "--streams", "1", "2", "--steps", "2", "--top", "3", "--threads", "1",
         "--out", str(tmp_path)]
    )  # fmt: skip
    text = (tmp_path / "serve_profile_cpu.md").read_text()
    for d in report["decode"]:
        assert len(d["top_ops"]) == 3 and d["top_ops"][0]["self_cpu_ms"] > 0
        head = f"## Decode of {d['streams']} streams: operators with the most self host time, per step"
        section = text.split(head)[1].split("##")[0]
        first = d["top_ops"][0]
        assert (
            f"| `{first['name']}` | {first['calls'] / 2:g} | {1e3 * first['self_cpu_ms'] / 2:.1f} |"
            in section
        )
    assert "## Operators with the most self host time, the prefill's steps" in text
