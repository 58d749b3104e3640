"""The algebra of KDA context parallelism in float64, against the token-by-token recurrence.

The oracle is :func:`naive_recurrent_kda` (fp64, the exact recurrence). Checked: a segment summary
``[M | E]`` maps any entry state as the recurrence does; folding the summaries of a document's consecutive
segments from zero gives the recurrence's state at each cut; composition is associative and the composite of
consecutive segments is the summary of their concatenation; the cotangent of the entry state is ``Mᵀ dS_out``
(autograd through the recurrence); per-head ``A_log`` that differ; fp32 summaries within fp32 rounding.

Legend: ``T`` tokens, ``H`` heads, ``K`` key dim, ``V`` value dim, ``N`` segments, ``J`` chain length.
"""

from __future__ import annotations

import pytest
import torch

from openk3.ops.kda import naive_recurrent_kda
from openk3.ops.kda.summary import apply_summary, compose, fold_from_zero, segment_summaries

pytestmark = pytest.mark.usefixtures("one_thread", "nan_empty")

F64 = torch.float64
H, K, V = 3, 16, 8


def _inputs(T: int, seed: int = 0, dtype=F64) -> dict:
    """K3-gate inputs (raw gate, per-head ``A_log`` that differ, lb = −1 so that the state keeps a memory)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    tensors = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V), g=r(1, T, H, K), beta=r(1, T, H))
    tensors = {n: t.to(dtype) for n, t in tensors.items()}
    gate = dict(A_log=torch.tensor([-1.0, 0.0, 0.7]), dt_bias=r(H * K).float() * 0.3, lower_bound=-1.0)
    return dict(tensors, **gate, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _cut(x: dict, start: int, end: int) -> dict:
    """Tokens ``start:end`` of every token tensor in ``x``."""
    return {n: (t[:, start:end] if n in ("q", "k", "v", "g", "beta") else t) for n, t in x.items()}


def _serial_state(x: dict, S0=None, cu_seqlens=None) -> torch.Tensor:
    kw = {n: t for n, t in x.items()}
    return naive_recurrent_kda(**kw, initial_state=S0, output_final_state=True, cu_seqlens=cu_seqlens)[1]


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_summary_maps_any_entry_state_as_the_recurrence(chunk_size):
    T = 53  # not a multiple of the chunk
    x = _inputs(T)
    cu = torch.tensor([0, 20, 20, 53])  # three segments, one empty
    summ_NHKX = segment_summaries(**x, cu_seqlens=cu, chunk_size=chunk_size)
    assert summ_NHKX.shape == (3, H, K, K + V) and summ_NHKX.dtype == F64
    S0_NHKV = torch.randn(3, H, K, V, generator=torch.Generator().manual_seed(3), dtype=F64)
    want = _serial_state(x, S0_NHKV, cu)
    got = apply_summary(summ_NHKX, S0_NHKV)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # the empty segment is the identity map
    torch.testing.assert_close(summ_NHKX[1, ..., :K], torch.eye(K, dtype=F64).expand(H, K, K), rtol=0, atol=0)
    # E alone is the exit state from zero
    torch.testing.assert_close(summ_NHKX[..., K:], _serial_state(x, None, cu), rtol=0, atol=1e-12)


def test_fold_from_zero_equals_the_serial_states_at_every_cut():
    T, cuts = 70, [0, 9, 10, 41, 70]  # uneven segments of one document, one of a single token
    x = _inputs(T, seed=1)
    summ_JHKX = segment_summaries(**x, cu_seqlens=torch.tensor(cuts), chunk_size=16)
    for j in range(1, len(cuts)):
        want = _serial_state(_cut(x, 0, cuts[j]))[0]
        torch.testing.assert_close(fold_from_zero(summ_JHKX[:j]), want, rtol=0, atol=1e-12)
    assert fold_from_zero(summ_JHKX[:0]).abs().max() == 0


def test_composition_is_associative_and_composes_consecutive_segments():
    T, cuts = 60, [0, 17, 35, 60]
    x = _inputs(T, seed=2)
    a, b, c = segment_summaries(**x, cu_seqlens=torch.tensor(cuts), chunk_size=16).unbind(0)
    whole = segment_summaries(**x, chunk_size=16)[0]
    left, right = compose(compose(a, b), c), compose(a, compose(b, c))
    torch.testing.assert_close(left, right, rtol=0, atol=1e-12)
    torch.testing.assert_close(left, whole, rtol=0, atol=1e-12)


def test_entry_state_cotangent_is_the_transposed_map():
    T = 37
    x = _inputs(T, seed=4)
    gen = torch.Generator().manual_seed(5)
    S0_1HKV = torch.randn(1, H, K, V, generator=gen, dtype=F64, requires_grad=True)
    dS_out_1HKV = torch.randn(1, H, K, V, generator=gen, dtype=F64)
    (_serial_state(x, S0_1HKV) * dS_out_1HKV).sum().backward()
    M_HKK = segment_summaries(**x, chunk_size=16)[0, ..., :K]
    torch.testing.assert_close(S0_1HKV.grad[0], M_HKK.transpose(-1, -2) @ dS_out_1HKV[0], rtol=0, atol=1e-12)


def test_per_head_gate_rates_give_per_head_maps():
    """Heads with different ``A_log`` decay differently: each head's ``M`` must be its own (a summary that
    read head 0's gate for every head, the fla#1115 class of bug, fails the entry-state check above; here the
    maps themselves differ as the recurrence's do)."""
    x = _inputs(6, seed=6)  # short: M keeps entries of order 0.1
    x["k"] = x["k"][:, :, :1].expand(-1, -1, H, -1).contiguous()  # same keys, values, β in every head
    x["v"] = x["v"][:, :, :1].expand(-1, -1, H, -1).contiguous()
    x["beta"] = x["beta"][:, :, :1].expand(-1, -1, H).contiguous()
    x["g"] = x["g"][:, :, :1].expand(-1, -1, H, -1).contiguous()
    x["dt_bias"] = x["dt_bias"][:K].repeat(H)
    M_HKK = segment_summaries(**x, chunk_size=16)[0, ..., :K]
    assert (M_HKK[0] - M_HKK[1]).abs().max() > 1e-2 and (M_HKK[1] - M_HKK[2]).abs().max() > 1e-2
    S0 = torch.randn(1, H, K, V, generator=torch.Generator().manual_seed(7), dtype=F64)
    torch.testing.assert_close(apply_summary(M_HKK.new_zeros(()) + segment_summaries(**x, chunk_size=16), S0),
                               _serial_state(x, S0), rtol=0, atol=1e-12)  # fmt: skip


def test_fp32_summaries_stay_fp32_and_close_to_fp64():
    x64 = _inputs(90, seed=8)
    x32 = _inputs(90, seed=8, dtype=torch.float32)
    s64 = segment_summaries(**x64, chunk_size=64)
    s32 = segment_summaries(**x32, chunk_size=64)
    assert s32.dtype == torch.float32
    err = ((s32.double() - s64).norm() / s64.norm()).item()
    assert err < 1e-6, err
