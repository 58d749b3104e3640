"""The MoonEP-contract planner's properties on random, skewed and duplicate routings (no processes)."""

from __future__ import annotations

import pytest
import torch

from openk3.dist.moonep_planner import plan_moonep


def _routing_counts(R, E, S, K, sigma, seed, duplicates=False):
    """``tpe[R, E]`` from real top-K draws: expert popularity lognormal(σ) (0 = uniform), per-rank tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(E, generator=g) * sigma
    tpe = torch.zeros(R, E, dtype=torch.int64)
    for r in range(R):
        p = torch.softmax(logits, 0).expand(S, E)
        idx_SK = torch.multinomial(p, K, replacement=duplicates, generator=g)
        tpe[r] = torch.bincount(idx_SK.flatten(), minlength=E)
    return tpe


def _check_invariants(tpe, plan, capacity):
    R, E = tpe.shape
    P = E // R
    alloc = plan.alloc_ER
    assert (alloc >= 0).all()
    assert torch.equal(alloc.sum(1), tpe.sum(0)), "per-expert conservation"
    assert torch.equal(alloc.sum(0), torch.full((R,), capacity)), "every rank computes exactly S·K rows"
    home = torch.arange(E) // P
    for d in range(R):
        remote = [e for e in range(E) if alloc[e, d] > 0 and home[e] != d]
        assert len(remote) <= P, f"rank {d} holds {len(remote)} redundant experts > epn={P}"
        assert {int(home[e]) for e in remote} <= {int(plan.donor_R[d])}, "redundant experts from one donor"
        assert plan.experts_to_copy_RP[d, : len(remote)].tolist() == remote
        assert (plan.experts_to_copy_RP[d, len(remote) :] == -1).all()
        assert int((alloc[:, d] > 0).sum()) <= 2 * P, "segment bound 2·epn"


def test_hand_worked_plan():
    # R=2, E=4, epn=2, CAP=4: expert 0 gets 7 entries, rank 0's group 8 > 4, rank 1's group 0 < 4.
    tpe = torch.tensor([[4, 0, 0, 0], [3, 1, 0, 0]])
    plan = plan_moonep(tpe, capacity=4)
    assert plan.alloc_ER.tolist() == [[3, 4], [1, 0], [0, 0], [0, 0]]
    assert plan.donor_R.tolist() == [-1, 0]
    assert plan.experts_to_copy_RP.tolist() == [[-1, -1], [0, -1]]


@pytest.mark.parametrize(
    "R,E,S,K,sigma,duplicates",
    [
        (4, 16, 32, 2, 0.0, False),  # random, near-uniform
        (8, 32, 64, 4, 1.0, False),  # typical skew
        (8, 32, 64, 4, 2.0, False),  # heavy skew
        (4, 8, 16, 2, 5.0, False),  # near-degenerate: a handful of experts take everything
        (4, 16, 32, 4, 1.0, True),  # duplicate experts within a token's top-K
        (1, 4, 8, 2, 1.0, False),  # one rank: everything local
        (16, 16, 4, 1, 2.0, False),  # epn = 1
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planner_properties(R, E, S, K, sigma, duplicates, seed):
    tpe = _routing_counts(R, E, S, K, sigma, seed, duplicates)
    plan = plan_moonep(tpe, S * K)
    _check_invariants(tpe, plan, S * K)
    again = plan_moonep(tpe.clone(), S * K)
    assert torch.equal(plan.alloc_ER, again.alloc_ER) and torch.equal(plan.donor_R, again.donor_R)


def test_all_tokens_to_one_rank_experts():
    R, E, S, K = 8, 32, 16, 4
    tpe = torch.zeros(R, E, dtype=torch.int64)
    tpe[:, :K] = S  # every token picks experts 0..K-1, all homed on rank 0
    plan = plan_moonep(tpe, S * K)
    _check_invariants(tpe, plan, S * K)
    assert (plan.donor_R[1:] == 0).all()


def test_kimi_k3_scale_is_deterministic_and_fast():
    import time

    tpe = _routing_counts(64, 896, 256, 16, 1.0, 0)
    start = time.perf_counter()
    plan = plan_moonep(tpe, 256 * 16)
    elapsed = time.perf_counter() - start
    _check_invariants(tpe, plan, 256 * 16)
    assert elapsed < 5.0, f"planning E=896, R=64 took {elapsed:.2f} s"


def test_bad_counts_name_the_problem():
    with pytest.raises(ValueError, match="rank 1 sends 3 entries, not capacity S·K = 4"):
        plan_moonep(torch.tensor([[4, 0], [3, 0]]), 4)
    with pytest.raises(ValueError, match="num_experts=3 is not divisible by the EP size R=2"):
        plan_moonep(torch.zeros(2, 3, dtype=torch.int64), 0)


@pytest.mark.parametrize("sigma,duplicates", [(0.0, False), (2.0, False), (1.0, True)])
def test_dispatch_layout_of_the_plan(sigma, duplicates):
    """The tables every rank derives from the plan (``openk3.dist.moonep``): each source sends and each rank
    receives exactly ``S·K`` entries, and on every rank the expert segments tile ``[0, S·K)`` exactly, home
    experts first (in expert order), then the redundant copies."""
    from openk3.dist.moonep import dispatch_layout

    R, E, S, K = 8, 32, 64, 4
    tpe = _routing_counts(R, E, S, K, sigma, 0, duplicates)
    plan = plan_moonep(tpe, S * K)
    slice_start, slice_end, buf_start, slot_sizes, entries_RR = dispatch_layout(plan, tpe)
    assert torch.equal(entries_RR.sum(1), torch.full((R,), S * K)), "each source sends S·K entries"
    assert torch.equal(entries_RR.sum(0), torch.full((R,), S * K)), "each rank receives S·K entries"
    assert torch.equal(slice_end[:, -1], tpe.sum(0)), "the ranks' slices of an expert cover its load"
    P = E // R
    for d in range(R):
        segments = sorted(
            (int(buf_start[e, d]), int(plan.alloc_ER[e, d]), e) for e in range(E) if plan.alloc_ER[e, d] > 0
        )
        ends = [0] + [start + n for start, n, _ in segments]
        assert [start for start, _, _ in segments] == ends[:-1] and ends[-1] == S * K, f"rank {d} not tiled"
        experts = [e for _, _, e in segments]
        home = [e for e in experts if e // P == d]
        assert experts[: len(home)] == sorted(home), "home experts first, in order"
        assert int(slot_sizes[d].sum()) == S * K
