"""Quantile Balancing and the DeepSeek sign rule (openk3.train.balance) against independent computations.

Oracles: routing and cutoffs by a full fp64 sort (not the router's topk); the exact quantile bias as the
``⌈m·k/n⌉``-th smallest required bias by sorting; the sign rule and max violation in closed form.
Sources of the rules: ``docs/references.md#quantile-balancing``.

Legend: ``N`` tokens, ``E`` experts, ``k`` experts per token.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import openk3
import openk3.train.balance as balance_module
from openk3.config import text_config_of
from openk3.model.moe import SparseMoeBlock
from openk3.model.router import RouterOutput
from openk3.train.balance import (
    QuantileBalancer,
    accumulate_histogram_,
    quantile_from_histogram,
    sign_rule_delta,
)


def moe_stack(E: int, k: int, layers: int = 1) -> nn.Module:
    """A module holding ``layers`` real SparseMoeBlocks with E experts, top-k (k3-tiny widths)."""
    cfg = dataclasses.replace(
        text_config_of(openk3.get_preset("k3-tiny")), num_experts=E, num_experts_per_token=k
    )
    model = nn.Module()
    model.layers = nn.ModuleList(SparseMoeBlock(cfg) for _ in range(layers))
    return model


def route(s_NE: torch.Tensor, b_E: torch.Tensor, k: int) -> RouterOutput:
    """Biased top-(k+1) by a full fp64 sort: indices of the k best, cutoff = the (k+1)-th biased score."""
    c_NE = s_NE.double() + b_E.double()
    vals_NE, order_NE = c_NE.sort(-1, descending=True)
    idx_Nk = order_NE[:, :k]
    return RouterOutput(s_NE.gather(-1, idx_Nk), idx_Nk, s_NE.float(), vals_NE[:, k].float())


def skewed_scores(N: int, E: int, seed: int, skew: float = 1.0) -> torch.Tensor:
    """Sigmoid scores with per-expert logit offsets spread over [-skew, skew]: a badly balanced router."""
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(N, E, generator=g, dtype=torch.float64) + torch.linspace(-skew, skew, E))


def feed(model: nn.Module, s_NE: torch.Tensor, k: int) -> None:
    """Count the routing of scores ``s_NE`` under each block's current bias in the block's statistics."""
    for block in model.layers:
        block.count_routing(route(s_NE, block.gate.e_score_correction_bias, k))


def maxvio_of(s_NE: torch.Tensor, b_E: torch.Tensor, k: int) -> float:
    loads = route(s_NE, b_E, k).counts_E.double()
    return (loads.max() / loads.mean() - 1).item()


def exact_quantile_bias(s_NE: torch.Tensor, b_E: torch.Tensor, k: int) -> torch.Tensor:
    """Per expert, the ⌈N·k/E⌉-th smallest r_ij = α_i − s_ij by sorting (fp64), not mean-centred."""
    N, E = s_NE.shape
    alpha_N = (s_NE.double() + b_E.double()).sort(-1, descending=True).values[:, k]
    r_NE = alpha_N[:, None] - s_NE.double()
    t = math.ceil(N * k / E)
    return r_NE.sort(0).values[t - 1]


# ------------------------------------------------------------------------------------------------ (a)
def test_histogram_quantile_matches_sorted_quantile():
    N, E, k, bins = 3000, 16, 2, 1000
    s_NE = skewed_scores(N, E, seed=1)
    b_E = 0.2 * torch.randn(E, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    exact_E = exact_quantile_bias(s_NE, b_E, k)
    width = (b_E.max() - b_E.min() + 2).item() / bins

    # the interpolation alone, on a histogram binned independently (bucketize on fp64 edges)
    lo = b_E.min() - 1
    edges = lo + width * torch.arange(1, bins, dtype=torch.float64)
    alpha_N = (s_NE + b_E).sort(-1, descending=True).values[:, k]
    r_NE = alpha_N[:, None] - s_NE
    assert lo <= r_NE.min() and r_NE.max() <= lo + bins * width  # the range derivation holds
    bin_NE = torch.bucketize(r_NE, edges, right=True)
    hist_EB = torch.stack([torch.bincount(bin_NE[:, j], minlength=bins) for j in range(E)])
    raw_E, count_E = quantile_from_histogram(hist_EB, lo, torch.tensor(width, dtype=torch.float64), k)
    assert count_E.tolist() == [N] * E
    err = (raw_E - exact_E).abs().max().item()
    spread = (exact_E.max() - exact_E.min()).item()
    print(f"raw quantile error {err:.2e}, bin width {width:.2e}, bias spread {spread:.3f}")
    assert err <= width * (1 + 1e-9)

    # the balancer end to end: mean-centred, so each expert's error minus the mean error (≤ 2 widths)
    model = moe_stack(E, k)
    bias = model.layers[0].gate.e_score_correction_bias
    bias.copy_(b_E)
    balancer = QuantileBalancer(model, bins=bins)
    feed(model, s_NE, k)
    balancer.step()
    want_E = exact_E - exact_E.mean()
    err_c = (bias.double() - want_E).abs().max().item()
    print(f"centred bias error {err_c:.2e}")
    assert err_c <= 2 * width + 1e-6
    assert (exact_E.max() - exact_E.min()).item() > 50 * width  # the check is not vacuous


# ------------------------------------------------------------------------------------------------ (b), (c)
def test_quantile_balancing_fixes_skew_in_few_steps_sign_rule_does_not():
    N, E, k = 4096, 16, 4
    s_NE = skewed_scores(N, E, seed=3)
    start = maxvio_of(s_NE, torch.zeros(E), k)
    assert start > 1.0  # the router is badly skewed

    result = {}
    for method in ("quantile", "sign"):
        model = moe_stack(E, k)
        bias = model.layers[0].gate.e_score_correction_bias
        balancer = QuantileBalancer(model, method=method)
        history = []
        for _ in range(3):
            feed(model, s_NE, k)
            stats = balancer.step()
            history.append(maxvio_of(s_NE, bias, k))
        result[method] = history
        assert stats["tokens"] == N
        if method == "quantile":
            assert bias.double().mean().abs().item() < 1e-6  # (c) mean-centred
    print(f"maxvio start {start:.3f}; QB {result['quantile']}; sign {result['sign']}")
    assert result["quantile"][0] < start / 5  # one QB update removes most of the imbalance
    assert result["quantile"][2] < 0.1
    # sign rule: each bias moves at most 2γ per step, so three steps barely help
    assert result["sign"][2] > 0.9 * start


def test_step_stats_are_the_loads_routed_during_the_step():
    N, E, k = 512, 8, 2
    model = moe_stack(E, k, layers=2)
    s0, s1 = skewed_scores(N, E, seed=4), skewed_scores(N, E, seed=5, skew=0.1)
    balancer = QuantileBalancer(model)
    model.layers[0].count_routing(route(s0, torch.zeros(E), k))
    model.layers[1].count_routing(route(s1, torch.zeros(E), k))
    stats = balancer.step()
    want = [maxvio_of(s0, torch.zeros(E), k), maxvio_of(s1, torch.zeros(E), k)]
    names = balancer.layer_names
    assert [stats["maxvio_per_layer"][n] for n in names] == pytest.approx(want, abs=1e-12)
    assert stats["maxvio"] == pytest.approx(max(want), abs=1e-12)


def test_sign_rule_closed_form_and_mean_preserved():
    loads_E = torch.tensor([10, 2, 3, 5, 5])  # mean 5: signs [-1, 1, 1, 0, 0], mean 0.2
    delta = sign_rule_delta(loads_E, 1e-3)
    assert delta.tolist() == pytest.approx([-1.2e-3, 0.8e-3, 0.8e-3, -0.2e-3, -0.2e-3], abs=1e-15)

    N, E, k = 256, 8, 2
    model = moe_stack(E, k)
    bias = model.layers[0].gate.e_score_correction_bias
    b0 = torch.linspace(-0.3, 0.5, E)
    bias.copy_(b0)
    s_NE = skewed_scores(N, E, seed=6)
    out = route(s_NE, b0, k)
    balancer = QuantileBalancer(model, method="sign", gamma=0.01)
    model.layers[0].count_routing(out)
    balancer.step()
    loads = out.counts_E.double()
    sign = torch.sign(loads.mean() - loads)
    want = b0.double() + 0.01 * (sign - sign.mean())
    torch.testing.assert_close(bias.double(), want, atol=1e-7, rtol=0)
    assert bias.double().mean().item() == pytest.approx(b0.double().mean().item(), abs=1e-7)


# ------------------------------------------------------------------------------------------------ (d)
def test_nothing_counted_keeps_bias_and_eval_forwards_are_not_counted():
    E, k = 8, 2
    b0 = torch.linspace(-0.2, 0.2, E)
    model = moe_stack(E, k)
    block = model.layers[0]
    block.gate.e_score_correction_bias.copy_(b0)
    balancer = QuantileBalancer(model)
    stats = balancer.step()  # a step with nothing counted
    assert torch.equal(block.gate.e_score_correction_bias, b0)
    assert stats["tokens"] == 0 and stats["maxvio"] == 0.0

    x_BTD = torch.randn(2, 5, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        block.eval()(x_BTD)  # evaluation and generation do not count
        assert block.routing_stats().expert_counts_E.sum().item() == 0
        block.train()(x_BTD)
    st = block.routing_stats()
    assert st.expert_counts_E.sum().item() == 10 * k and st.range_fixed
    assert st.margin_hist_EB.sum(-1).tolist() == [10] * E  # every token reaches every expert's histogram
    assert balancer.step()["tokens"] == 10
    assert not torch.equal(block.gate.e_score_correction_bias, b0)
    assert block.routing_stats().expert_counts_E.sum().item() == 0  # the step reset the statistics


def test_errors():
    model = moe_stack(8, 2)
    with pytest.raises(ValueError, match="method"):
        QuantileBalancer(model, method="aux")
    with pytest.raises(ValueError, match="bins"):
        QuantileBalancer(model, bins=0)
    with pytest.raises(ValueError, match="no SparseMoeBlock"):
        QuantileBalancer(nn.Linear(2, 2))
    untracked = moe_stack(8, 2).layers[0]
    with pytest.raises(RuntimeError, match="track_routing"):
        untracked.routing_stats()
    with pytest.raises(ValueError, match="bins"):
        untracked.track_routing(-1)


# ------------------------------------------------------------------------------------------------ (e)
def test_two_micro_batches_equal_one_batch():
    N, E, k = 1000, 16, 2
    b0 = torch.linspace(0.1, -0.1, E)
    s_NE = skewed_scores(N, E, seed=9)
    split, whole = moe_stack(E, k, layers=2), moe_stack(E, k, layers=2)
    for m in (split, whole):
        for block in m.layers:
            block.gate.e_score_correction_bias.copy_(b0)
    bal_split, bal_whole = QuantileBalancer(split), QuantileBalancer(whole)
    for part in (s_NE[:370], s_NE[370:]):
        feed(split, part, k)
    feed(whole, s_NE, k)
    assert bal_split.step() == bal_whole.step()
    for a, b in zip(split.layers, whole.layers, strict=True):
        assert torch.equal(a.gate.e_score_correction_bias, b.gate.e_score_correction_bias)
        assert not torch.equal(a.gate.e_score_correction_bias, b0)


# ------------------------------------------------------------------------------------------------ (f)
@pytest.mark.parametrize("method", ["quantile", "sign"])
def test_state_dict_round_trip_mid_step(method):
    N, E, k = 800, 8, 2
    model = moe_stack(E, k, layers=2)
    balancer = QuantileBalancer(model, method=method, bins=200)
    mb = [skewed_scores(N, E, seed=10 + i) for i in range(4)]
    feed(model, mb[0], k)
    balancer.step()
    feed(model, mb[1], k)

    state = copy.deepcopy(balancer.state_dict())
    model2 = copy.deepcopy(model)
    balancer2 = QuantileBalancer(model2, method=method, bins=200)
    balancer2.load_state_dict(state)
    assert balancer2.num_steps == 1
    for m, bal in ((model, balancer), (model2, balancer2)):
        feed(m, mb[2], k)
        bal.step()
        feed(m, mb[3], k)
        bal.step()
    assert balancer.last_stats == balancer2.last_stats
    for a, b in zip(model.layers, model2.layers, strict=True):
        assert torch.equal(a.gate.e_score_correction_bias, b.gate.e_score_correction_bias)
    with pytest.raises(ValueError, match="bins"):
        QuantileBalancer(model2, method=method, bins=100).load_state_dict(state)


# ------------------------------------------------------------------------------------------------ (g)
def test_real_k3_tiny_forward_updates_bias_outside_the_optimizer():
    model = openk3.build_model(openk3.get_preset("k3-tiny"), seed=0)
    balancer = QuantileBalancer(model)
    blocks = balancer.blocks
    assert len(blocks) == 7  # layers 1..7 of 8 are MoE (first_k_dense_replace = 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    balancer.attach_to(optimizer)
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    biases = [b.gate.e_score_correction_bias for b in blocks]
    assert not any(id(b) in owned for b in biases)
    before = [b.clone() for b in biases]

    ids = torch.randint(0, 8192, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.train()(ids)
    assert all(b.routing_stats().expert_counts_E.sum().item() == 24 * b.gate.top_k for b in blocks)
    assert "routing_counts_E" not in "".join(model.state_dict())  # statistics are not checkpointed
    optimizer.step()  # no grads: parameters untouched, the pre-hook runs the balancer step
    stats = balancer.last_stats
    assert stats["tokens"] == 24 and len(stats["maxvio_per_layer"]) == 7
    assert stats["maxvio"] == max(stats["maxvio_per_layer"].values()) >= 0
    for b, b0 in zip(biases, before, strict=True):
        assert b.dtype == torch.float32 and torch.isfinite(b).all()
        assert not torch.equal(b, b0)
        assert abs(b.double().mean().item()) < 1e-6
        assert (b.max() - b.min()).item() <= 2.0  # r_ij spans at most max(b) - min(b) + 2 = 2


# ------------------------------------------------------------------------------------------------ (h)
@pytest.mark.parametrize("method", ["quantile", "sign"])
def test_single_process_gloo_group_gives_the_same_result(method, tmp_path, monkeypatch):
    N, E, k = 500, 8, 2
    s_NE = skewed_scores(N, E, seed=20)
    local, dist_model = moe_stack(E, k, layers=2), moe_stack(E, k, layers=2)
    bal_local = QuantileBalancer(local, method=method)
    feed(local, s_NE, k)
    want = bal_local.step()

    calls = []
    real_all_reduce = dist.all_reduce
    monkeypatch.setattr(
        dist, "all_reduce", lambda t, *a, **kw: calls.append(t.numel()) or real_all_reduce(t, *a, **kw)
    )
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        bal_dist = QuantileBalancer(dist_model, method=method)
        feed(dist_model, s_NE, k)
        got = bal_dist.step()
    finally:
        dist.destroy_process_group()
    hist = 2 * E * 1000 if method == "quantile" else 0
    assert calls == [hist + 2 * E]  # one all-reduce: every layer's histogram and loads
    assert got == want
    for a, b in zip(local.layers, dist_model.layers, strict=True):
        assert torch.equal(a.gate.e_score_correction_bias, b.gate.e_score_correction_bias)


def test_rank_that_observed_nothing_applies_the_reduced_update(monkeypatch):
    """A rank with no tokens this step still applies what the all-reduce brought (biases stay replicated)."""
    N, E, k = 400, 8, 2
    busy_model, idle_model = moe_stack(E, k, layers=2), moe_stack(E, k, layers=2)
    busy = QuantileBalancer(busy_model)
    feed(busy_model, skewed_scores(N, E, seed=30), k)
    busy_counts = busy.state_dict()["counts"]  # what the busy rank contributes to the SUM
    want = busy.step()

    idle = QuantileBalancer(idle_model)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: tensor.add_(busy_counts))
    assert idle.step() == want
    for a, b in zip(busy_model.layers, idle_model.layers, strict=True):
        assert torch.equal(a.gate.e_score_correction_bias, b.gate.e_score_correction_bias)


# ------------------------------------------------------------------------------------------------ (i)
def mixed_stack(shapes: list[tuple[int, int]]) -> nn.Module:
    """SparseMoeBlocks with the given (E, k) per layer."""
    model = nn.Module()
    model.layers = nn.ModuleList(moe_stack(E, k).layers[0] for E, k in shapes)
    return model


@pytest.mark.parametrize("method", ["quantile", "sign"])
def test_layers_batched_equal_layers_alone(method, monkeypatch):
    """Layers updated together (runs of equal (E, k)) or one chunk at a time give bit for bit what a balancer
    of each layer alone gives."""
    shapes = [(8, 2), (8, 2), (16, 2), (8, 2), (8, 4)]  # runs: layers 0-1, 2, 3, 4
    N = 300
    scores = [skewed_scores(N, E, seed=40 + i, skew=0.5 + 0.2 * i) for i, (E, _) in enumerate(shapes)]

    def run(model, balancer, layers):
        for _ in range(2):  # two optimizer steps, the second from the updated biases
            for mb in (slice(0, 170), slice(170, N)):
                for i, block in zip(layers, model.layers, strict=True):
                    bias = block.gate.e_score_correction_bias
                    block.count_routing(route(scores[i][mb], bias, shapes[i][1]))
            stats = balancer.step()
        return stats

    # every run in one chunk (the accelerator rule), then one layer per chunk (the CPU rule)
    monkeypatch.setattr(balance_module, "layers_per_chunk", lambda elements, device: len(shapes))
    together = mixed_stack(shapes)
    bal = QuantileBalancer(together, method=method, bins=100)
    stats = run(together, bal, range(len(shapes)))

    monkeypatch.setattr(balance_module, "layers_per_chunk", lambda elements, device: 1)
    chunked = mixed_stack(shapes)
    chunked_stats = run(chunked, QuantileBalancer(chunked, method=method, bins=100), range(len(shapes)))
    assert chunked_stats == stats
    for i in range(len(shapes)):
        alone = mixed_stack(shapes[i : i + 1])
        alone_stats = run(alone, QuantileBalancer(alone, method=method, bins=100), [i])
        want = together.layers[i].gate.e_score_correction_bias
        assert torch.equal(alone.layers[0].gate.e_score_correction_bias, want), i
        assert torch.equal(chunked.layers[i].gate.e_score_correction_bias, want), i
        assert alone_stats["maxvio"] == stats["maxvio_per_layer"][bal.layer_names[i]]
        assert not torch.equal(want, torch.zeros_like(want))


def test_layers_per_chunk_rule():
    assert balance_module.layers_per_chunk(10**6, torch.device("cpu")) == 1
    assert balance_module.layers_per_chunk(balance_module.BATCH_ELEMENTS // 4, torch.device("meta")) == 4
    assert balance_module.layers_per_chunk(balance_module.BATCH_ELEMENTS * 2, torch.device("meta")) == 1


def test_histogram_keeps_non_finite_scores_in_range():
    """NaN lands in bin 0, ±inf in the end bins; every valid token is counted once (no index overflow)."""
    hist_EB = torch.zeros(2, 10, dtype=torch.int32)
    r_NE = torch.tensor([[float("nan"), 0.55], [float("inf"), float("-inf")], [0.05, 0.95]])
    accumulate_histogram_(
        hist_EB, r_NE, torch.tensor(0.0, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64),
        torch.ones(3, dtype=torch.int32),
    )  # fmt: skip
    assert hist_EB[0].tolist() == [2, 0, 0, 0, 0, 0, 0, 0, 0, 1]
    assert hist_EB[1].tolist() == [1, 0, 0, 0, 0, 1, 0, 0, 0, 1]
