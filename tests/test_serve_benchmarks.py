"""``benchmarks/serve_profile.py`` on the CPU: its argument checks, and that a profiled decode step is one
engine step that gives every stream exactly one token, with the step's numbers read from the profile."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

import openk3

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def serve_profile(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("serve_profile")


def test_bad_arguments_are_refused(serve_profile, capsys):
    with pytest.raises(SystemExit) as stop:
        serve_profile.parse_args(["--streams", "0"])
    assert stop.value.code == 2 and "every --streams value must be at least 1" in capsys.readouterr().err


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
        steps = serve_profile.profile_decode(
            model, args, tokens, 3, [torch.profiler.ProfilerActivity.CPU], keep
        )
    assert len(steps) == len(keep) == 2
    # the last two engine steps were the profiled ones: each added one token to each of the 3 streams
    assert [c[0] - calls[-3][0] for c in calls[-2:]] == [1, 2] and all(len(set(c)) == 1 for c in calls[-3:])
    for s in steps:
        assert s["tokens"] == 3 and s["host_ms"] > 0 and s["ops"] > 0
        assert s["kernel_ms"] == 0 and s["launches"] == 0 and s["syncs"] is None  # no device on a CPU
    assert serve_profile.median_step(steps)["tokens"] == 3
