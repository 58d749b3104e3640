"""The state-pool decode entry point (:func:`openk3.ops.kda.fused_recurrent_kda_pool`) against the fp64
reference recurrence: outputs, the pool rows it overwrites, the rows it must leave alone, and bad input."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.kda import fused_recurrent_kda_pool, naive_recurrent_kda

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(N, T, H, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, g_raw = (torch.randn(N, T, H, K, generator=g, dtype=torch.float64) for _ in range(4))
    beta = torch.randn(N, T, H, generator=g, dtype=torch.float64)
    gate = dict(
        A_log=torch.randn(max(H, 8), generator=g, dtype=torch.float64) * 0.5,
        dt_bias=torch.randn(H * K, generator=g, dtype=torch.float64),
        lower_bound=-5.0,
    )
    return (q, k, v, g_raw, beta), gate


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("slots", [None, [4, 0, 2]])
def test_pool_decode_equals_the_reference(T, slots):
    N, H, K, S = 3, 2, 8, 6
    tokens, gate = inputs(N, T, H, K)
    pool = torch.randn(S, H, K, K, dtype=torch.float64) * 0.1
    rows = list(range(N)) if slots is None else slots
    want_o, want_state = naive_recurrent_kda(
        *tokens, initial_state=pool[rows].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, **gate,
    )  # fmt: skip
    before = pool.clone()
    idx = None if slots is None else torch.tensor(slots)
    o = fused_recurrent_kda_pool(*tokens, pool, idx, use_beta_sigmoid_in_kernel=True, **gate)
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pool[rows], want_state, rtol=1e-12, atol=1e-12)
    untouched = [i for i in range(S) if i not in rows]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("slots", [None, [4, 0, 2]])
def test_pool_decode_step_states_are_each_prefix_state(slots):
    """``step_states[n, t]`` is the reference recurrence's final state over sequence ``n``'s first ``t + 1``
    tokens; the outputs and the pool are those of the call without it."""
    N, T, H, K, S = 3, 4, 2, 8, 6
    tokens, gate = inputs(N, T, H, K, seed=3)
    pool = torch.randn(S, H, K, K, dtype=torch.float64) * 0.1
    rows = list(range(N)) if slots is None else slots
    idx = None if slots is None else torch.tensor(slots)
    plain_pool = pool.clone()
    plain_o = fused_recurrent_kda_pool(*tokens, plain_pool, idx, use_beta_sigmoid_in_kernel=True, **gate)
    steps = torch.empty(N, T, H, K, K, dtype=torch.float64)
    start = pool[rows].clone()
    o = fused_recurrent_kda_pool(
        *tokens, pool, idx, use_beta_sigmoid_in_kernel=True, step_states=steps, **gate
    )
    assert torch.equal(o, plain_o) and torch.equal(pool, plain_pool)
    for t in range(T):
        _, want = naive_recurrent_kda(
            *(x[:, : t + 1] for x in tokens), initial_state=start.clone(), output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **gate,
        )  # fmt: skip
        torch.testing.assert_close(steps[:, t], want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="step_states must be contiguous"):
        fused_recurrent_kda_pool(*tokens, pool, idx, step_states=steps[:, :2], **gate)


def test_pool_decode_fp32_pool_with_bf16_inputs():
    """A bf16 model's tokens on an fp32 pool: within bf16 rounding of the fp64 reference."""
    tokens, gate = inputs(2, 1, 2, 16, seed=1)
    pool64 = torch.randn(2, 2, 16, 16, dtype=torch.float64) * 0.1
    want_o, want_state = naive_recurrent_kda(
        *tokens, initial_state=pool64.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, **gate,
    )  # fmt: skip
    pool = pool64.float()
    low = [t.bfloat16() for t in tokens]
    o = fused_recurrent_kda_pool(*low, pool, use_beta_sigmoid_in_kernel=True, **gate)
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.float32
    torch.testing.assert_close(o.double(), want_o, rtol=0.05, atol=0.05)
    torch.testing.assert_close(pool.double(), want_state, rtol=0.05, atol=0.05)


def test_pool_decode_bad_input():
    tokens, gate = inputs(2, 1, 2, 8)
    with pytest.raises(ValueError, match=r"state_pool must be \[S, 2, 8, 8\]"):
        fused_recurrent_kda_pool(*tokens, torch.zeros(4, 2, 8, 4, dtype=torch.float64), **gate)
    with pytest.raises(ValueError, match="contiguous fp32 or fp64"):
        fused_recurrent_kda_pool(*tokens, torch.zeros(4, 2, 8, 8, dtype=torch.bfloat16), **gate)
    with pytest.raises(ValueError, match="slot_idx must be"):
        fused_recurrent_kda_pool(*tokens, torch.zeros(4, 2, 8, 8), torch.tensor([0.0, 1.0]), **gate)
    with pytest.raises(ValueError, match="need A_log"):
        fused_recurrent_kda_pool(*tokens, torch.zeros(4, 2, 8, 8), lower_bound=-5.0)
