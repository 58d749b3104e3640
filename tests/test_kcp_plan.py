"""The context-parallel plan, without processes: fragments, pieces, chains, halo sources, errors.

Expected values are worked out by hand from the layouts' definitions (contiguous: rank ``r`` holds interval
``r`` of ``W``; zig-zag: intervals ``r`` and ``2W−1−r`` of ``2W``).
"""

from __future__ import annotations

import pytest
import torch

from openk3.dist.cp_plan import ContextParallelPlan
from openk3.dist.kcp import context_parallel_kda


def test_contiguous_and_zigzag_positions():
    assert ContextParallelPlan((0, 8), 4, 2).positions().tolist() == [4, 5]
    zig = [ContextParallelPlan((0, 8), 2, r, "zigzag").positions().tolist() for r in range(2)]
    assert zig == [[0, 1, 6, 7], [2, 3, 4, 5]]
    x_BT = torch.arange(8).view(1, 8) * 10
    assert ContextParallelPlan((0, 8), 2, 0, "zigzag").shard(x_BT).tolist() == [[0, 10, 60, 70]]


def test_local_pieces_cut_at_documents_and_fragments():
    cu = (0, 3, 3, 5, 8)  # an empty document at 3
    r0 = ContextParallelPlan(cu, 2, 0, "zigzag")  # fragments (0, 2), (6, 8)
    r1 = ContextParallelPlan(cu, 2, 1, "zigzag")  # fragments (2, 4), (4, 6)
    assert r0.local_cu_seqlens.tolist() == [0, 2, 4]
    assert r1.local_cu_seqlens.tolist() == [0, 1, 2, 3, 4]
    assert r0.fragment_pieces == [(0, 0), (1, 1)]
    assert r1.fragment_pieces == [(0, 1), (2, 3)]


def test_chains_and_needed_slots():
    plan = ContextParallelPlan((0, 1, 8), 4, 0)  # a document from token 1 over every rank
    assert [plan.chain(s) for s in range(4)] == [[], [0], [0, 1], [0, 1, 2]]
    assert plan.needed_slots == {0, 1, 2}
    zig = ContextParallelPlan((0, 8), 2, 0, "zigzag")  # stream order of slots: 0, 2, 3, 1
    assert zig.chain(1) == [0, 2, 3] and zig.chain(3) == [0, 2] and zig.chain(2) == [0]
    boundaries = ContextParallelPlan((0, 2, 4, 6, 8), 4, 1)  # every document starts on a rank boundary
    assert boundaries.needed_slots == set()


def test_halo_sources_span_short_fragments_and_stop_at_documents():
    plan = ContextParallelPlan((0, 1, 8), 4, 2)  # fragments of 2 tokens, halo of 3
    assert plan.halo_sources(3) == [[(0, 2), (1, 1), (1, 2)]]
    first = ContextParallelPlan((0, 1, 8), 4, 1)
    assert first.halo_sources(3) == [[None, None, (0, 2)]]  # token −1 and token 0 (another document)


@pytest.mark.parametrize(
    ("cu", "world", "rank", "layout", "message"),
    [
        ((0, 10), 4, 0, "contiguous", "T=10 cannot be split by the contiguous layout over 4 CP ranks"),
        ((0, 12), 4, 0, "zigzag", "positive multiple of 8"),
        ((0, 8), 2, 2, "contiguous", "rank=2 is outside"),
        ((0, 5, 3, 8), 2, 0, "contiguous", "cu_seqlens must rise"),
        ((0, 8), 2, 0, "ring", "layout='ring'"),
    ],
)
def test_bad_plans_raise_naming_the_problem(cu, world, rank, layout, message):
    with pytest.raises(ValueError, match=message):
        ContextParallelPlan(cu, world, rank, layout)


def test_initial_state_is_refused_before_any_collective():
    t = torch.zeros(1, 4, 1, 4)
    plan = ContextParallelPlan((0, 8), 2, 0)
    with pytest.raises(ValueError, match="cannot honour initial_state"):
        context_parallel_kda(t, t, t, t, t[..., 0], plan=plan, initial_state=torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="cannot honour"):
        context_parallel_kda(t, t, t, t, t[..., 0], plan=plan, output_final_state=True)


def test_summary_bytes_of_k3_kda():
    """12 MiB per rank per layer for K3's KDA (96 heads, K = V = 128, fp32), 1.5 MiB at 12 heads (TP 8)."""
    from openk3.dist.kcp import summary_bytes

    assert summary_bytes(96, 128, 128) == 12 * 2**20
    assert summary_bytes(12, 128, 128) == 1.5 * 2**20
    assert summary_bytes(96, 128, 128, slots=2) == 24 * 2**20  # zig-zag: two fragments per rank


def test_training_context_lengths_are_checked_before_any_process_group():
    from openk3.dist.mesh import ParallelDims
    from openk3.dist.train import check_context_lengths

    check_context_lengths([(0, 64), (10, 512)], 4, "zigzag")  # multiples of 8
    with pytest.raises(
        ValueError, match=r"--cp 4 with the zigzag layout needs .* multiple of 8; the schedule has \[100\]"
    ):
        check_context_lengths([(0, 64), (10, 100)], 4, "zigzag")
    with pytest.raises(ValueError, match="--cp-layout 'ring'"):
        check_context_lengths([(0, 64)], 2, "ring")
    dims = ParallelDims(world_size=8, cp=4, ep=2)
    assert (dims.dp_shard, dims.efsdp) == (2, 4)
