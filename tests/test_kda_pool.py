"""The state-pool decode entry point (:func:`openk3.ops.kda.fused_recurrent_kda_pool`) against the fp64
reference recurrence: outputs, the pool rows it overwrites, the rows it must leave alone, and bad input; the
custom op behind it (``openk3::kda_pool_decode``) through ``torch.compile`` without a graph break, equal to
the eager call, and its schema and fake implementation (``torch.library.opcheck``)."""

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


def _decode(q, k, v, g_raw, beta, pool, idx, A_log, dt_bias, steps):
    return fused_recurrent_kda_pool(
        q, k, v, g_raw, beta, pool, idx, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
        use_beta_sigmoid_in_kernel=True, step_states=steps,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("with_steps", [False, True])
def test_custom_op_compiles_in_place_without_graph_break(backend, with_steps):
    """One graph (``fullgraph``) around the op and torch glue on its inputs and output: the outputs, the pool
    (its chosen rows overwritten, the others not) and ``step_states`` equal the eager call's bit for bit (the
    op runs the same torch recurrence inside; the glue is elementwise)."""
    N, T, H, K, S = 3, 2, 2, 8, 6
    (q, k, v, g_raw, beta), gate = inputs(N, T, H, K, seed=5)
    pool = torch.randn(S, H, K, K, dtype=torch.float64) * 0.1
    idx = torch.tensor([4, 0, 2])

    def fn(q, k, v, g_raw, beta, pool, idx, A_log, dt_bias, steps):
        return _decode(q * 2, k, v, g_raw, beta, pool, idx, A_log, dt_bias, steps).tanh() + 1

    def run(f):
        p = pool.clone()
        steps = torch.zeros(N, T, H, K, K, dtype=torch.float64) if with_steps else None
        o = f(q, k, v, g_raw, beta, p, idx, gate["A_log"], gate["dt_bias"], steps)
        return o, p, steps

    torch._dynamo.reset()
    want = run(fn)
    got = run(torch.compile(fn, backend=backend, fullgraph=True))
    assert not torch.equal(want[1], pool)  # the call did write the pool
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("slots", [None, [4, 0, 2]])
@pytest.mark.parametrize("with_steps", [False, True])
def test_custom_op_opcheck(slots, with_steps):
    """Schema (the pool and ``step_states`` declared mutated, ``o`` aliasing nothing), the fake
    implementation's shape, dtype and layout, and the op under AOT dispatch with dynamic shapes."""
    N, T, H, K, S = 3, 2, 2, 8, 6
    (q, k, v, g_raw, beta), gate = inputs(N, T, H, K, seed=6)
    pool = torch.randn(S, H, K, K, dtype=torch.float64) * 0.1
    idx = None if slots is None else torch.tensor(slots)
    steps = torch.zeros(N, T, H, K, K, dtype=torch.float64) if with_steps else None
    args = (q, k, v, g_raw, beta, pool, idx, gate["A_log"], gate["dt_bias"], K**-0.5, -5.0, True, True, steps)
    torch.library.opcheck(torch.ops.openk3.kda_pool_decode.default, args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and triton")
def test_gpu_custom_op_compiles_on_cuda():
    """The op's CUDA branch (the Triton decode kernel) inside an Inductor graph, fp32 pool, bf16 tokens (as the
    server's compiled step calls it): the pool rows and ``step_states`` equal the eager call's bit for bit (the
    same kernel on the same inputs), the output within bf16 rounding of it (Inductor's ``tanh`` is not
    torch's)."""
    N, T, H, K, S = 3, 2, 4, 64, 6
    (q, k, v, g_raw, beta), gate = inputs(N, T, H, K, seed=7)
    q, k, v, g_raw = (t.cuda().bfloat16() for t in (q, k, v, g_raw))
    beta = beta.cuda().float()
    A_log, dt_bias = gate["A_log"].cuda().float(), gate["dt_bias"].cuda().float()
    pool = torch.randn(S, H, K, K, device="cuda") * 0.1
    idx = torch.tensor([4, 0, 2], device="cuda")

    def fn(q, k, v, g_raw, beta, pool, idx, A_log, dt_bias, steps):
        return _decode(q * 2, k, v, g_raw, beta, pool, idx, A_log, dt_bias, steps).tanh() + 1

    def run(f):
        p, steps = pool.clone(), torch.zeros(N, T, H, K, K, device="cuda")
        return f(q, k, v, g_raw, beta, p, idx, A_log, dt_bias, steps), p, steps

    torch._dynamo.reset()
    want = run(fn)
    got = run(torch.compile(fn, fullgraph=True))
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert not torch.equal(want[1], pool)
