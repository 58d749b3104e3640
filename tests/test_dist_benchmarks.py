"""The multi-GPU benchmarks on the CPU (gloo, world 2, k3-tiny): they run end to end through the real launchers
and their numbers hold what they claim.

* ``benchmarks/dist_parity.py``: FSDP2 and FSDP2 + EP + CP follow one process's losses and final
  ``val_loss`` to fp32 rounding for 3 steps. The bound is 1e-5 nats (about 10 ulps of a ~9-nat fp32 loss,
  whose ulp is 9.5e-7): the layouts change only the order of fp32 sums (FSDP's reduce-scatter, the EP
  combine, CP's all-gathered summaries), measured ≤ 2e-6 in those steps on this machine
  (``benchmarks/results/dist_parity_cpu.md``). Later steps are not compared this tightly: the rounding
  flips a routing decision (step 4 at the earliest in that run), after which the MoE trajectories separate
  by up to ~0.1. Another seed moves the loss by far more than the bound (asserted: the scale the layouts
  are judged against).
* ``benchmarks/dist_scaling.py``: tokens per step are ``N · batch · seq_len``; MFU is recomputed from the
  parameter count of the module tree (:func:`openk3.accounting.count_parameters`, an independent count from
  the closed form the benchmark uses); an untrained model on uniform random tokens has a loss near
  ``ln V``; the KCP lengths double from ``kcp_start · N`` up to ``kcp_max`` (no out-of-memory on the CPU).
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest

from openk3.accounting import count_parameters
from openk3.config import text_config_of
from openk3.presets import get_preset

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return lambda name: importlib.import_module(name)


def test_parity_layouts_follow_the_world(bench):
    table = bench("dist_parity").layout_table
    assert list(table(1, 32)) == ["dp1", "dp1_seed1"]
    two = table(2, 32)
    assert two["fsdp"] == dict(ranks=2, dp_shard=2, ep=1, cp=1, seed=0)
    assert two["fsdp_ep_cp"] == dict(ranks=2, dp_shard=1, ep=2, cp=2, seed=0)
    eight = table(8, 64)
    assert eight["fsdp_ep"]["ep"] == 8 and eight["fsdp_cp"]["dp_shard"] == 4
    assert table(6, 32)["fsdp_ep"]["ep"] == 2  # the largest divisor of 6 that divides 32 experts
    assert "fsdp_ep" not in table(3, 32) and "fsdp_cp" not in table(3, 32)


def test_scaling_worlds(bench):
    assert bench("dist_scaling").worlds(8) == [1, 2, 4, 8]
    assert bench("dist_scaling").worlds(6) == [1, 2, 4, 6]
    assert bench("dist_scaling").worlds(1) == [1]


@pytest.mark.slow  # three launches of the trainer, ~3 min on 2 shared cores
def test_parity_fsdp_and_ep_cp_follow_one_process_on_gloo(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    report = bench("dist_parity").main(
        ["--world", "2", "--steps", "3", "--layouts", "dp1", "dp1_seed1", "fsdp", "fsdp_ep_cp",
         "--out", str(tmp_path / "parity")]
    )  # fmt: skip
    layouts = report["layouts"]
    assert all("error" not in r and len(r["losses"]) == 3 for r in layouts.values()), layouts
    vocab = text_config_of(get_preset("k3-tiny")).vocab_size
    assert abs(layouts["dp1"]["losses"][0] - math.log(vocab)) < 0.2  # untrained: about ln V
    for name in ("fsdp", "fsdp_ep_cp"):
        assert layouts[name]["max_abs_diff"] <= 1e-5, (
            name,
            layouts[name]["losses"],
            layouts["dp1"]["losses"],
        )
        assert abs(layouts[name]["val_loss"] - layouts["dp1"]["val_loss"]) <= 1e-5
    assert report["seed_spread"] > 1e-2, "another seed should move the loss far more than fp32 rounding"
    for suffix in (".json", ".md", ".png"):
        assert (tmp_path / f"parity{suffix}").stat().st_size > 0


@pytest.mark.slow  # four launches, ~2 min on 2 shared cores
def test_scaling_smoke_at_world_2(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    report = bench("dist_scaling").main(
        ["--world", "2", "--preset", "k3-tiny", "--batch-per-gpu", "1", "--seq-len", "32", "--steps", "1",
         "--warmup", "1", "--kcp-start", "32", "--kcp-max", "128", "--peak-tflops", "1",
         "--out", str(tmp_path / "scaling")]
    )  # fmt: skip
    active = count_parameters(get_preset("k3-tiny"))["active"]
    vocab = text_config_of(get_preset("k3-tiny")).vocab_size
    assert [r["world"] for r in report["weak"]] == [1, 2]
    for r in report["weak"]:
        assert "error" not in r, r
        assert r["tokens"] == r["world"] * 1 * 32
        assert r["tokens_per_s"] * r["step_s"] == pytest.approx(r["tokens"])
        assert r["mfu"] == pytest.approx(6 * active * r["tokens"] / r["step_s"] / r["world"] / 1e12)
        assert abs(r["first_loss"] - math.log(vocab)) < 0.5
    assert report["weak"][0]["efficiency"] == 1.0
    kcp = {r["world"]: r for r in report["kcp"]}
    assert [t["seq_len"] for t in kcp[1]["trained"]] == [32, 64, 128]
    assert [t["seq_len"] for t in kcp[2]["trained"]] == [64, 128]
    assert all(r["longest"]["seq_len"] == 128 and r["next"] == "--kcp-max reached" for r in kcp.values())
    assert (tmp_path / "scaling.md").read_text().count("\n| ") >= 4
