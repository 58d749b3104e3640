"""The routed experts' sync-free path (sort by expert, permutation dispatch, grouped GEMM, permutation combine)
against the readable per-expert loop ``experts_loop_reference``: forward and every gradient in fp64, and the
path traced by ``torch.compile`` as one graph (what the compiled decoder layers run on CUDA); the gathered
path of a few tokens (the compiled decode step) against the same loop, and when each path is taken."""

from __future__ import annotations

import pytest
import torch

from openk3.config import KimiK3Config
from openk3.model.moe import RoutedExperts, experts_loop_reference, gathered_experts
from openk3.model.router import MoEGate
from openk3.presets import k3_shaped
from openk3.train.host_syncs import HostSyncAudit

F64 = torch.float64


def experts_and_inputs(dtype, N: int = 23, k: int = 3, seed: int = 0):
    """k3-tiny's routed experts (32 experts, latent 128) with F ≠ L, and a routing in which some experts get
    no token and a few get many."""
    data = k3_shaped(8).to_dict()
    data["text_config"]["moe_intermediate_size"] = 96
    cfg = KimiK3Config.from_dict(data).text_config
    g = torch.Generator().manual_seed(seed)
    experts = RoutedExperts(cfg, cfg.routed_expert_hidden_size).to(F64)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) / p.shape[-1] ** 0.5)
        experts.w1.mul_(3.0)  # gate pre-activations reach the SiTU cap
    popular = torch.tensor([4, 30, 7, 2, 11])  # most tokens pick among these: experts with many rows
    idx = torch.stack([torch.cat([popular[torch.randperm(5, generator=g)[:2]],
                                  torch.randint(12, 30, (1,), generator=g)]) for _ in range(N)])  # fmt: skip
    idx = idx[:, :k]
    z = torch.randn(N, cfg.routed_expert_hidden_size, generator=g, dtype=F64)
    w = torch.rand(N, k, generator=g, dtype=F64)
    return experts.to(dtype), z.to(dtype), w.to(torch.float32 if dtype != F64 else F64), idx


def grads(fn, experts, z, w, idx):
    z, w = z.clone().requires_grad_(), w.clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    out = fn(experts, z, w, idx)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=F64).to(out.dtype)
    (out * cot).sum().backward()
    named = {"out": out.detach(), "z": z.grad, "weights": w.grad}
    return named | {name: p.grad.clone() for name, p in experts.named_parameters()}


def test_grouped_path_equals_the_loop_forward_and_backward_fp64():
    experts, z, w, idx = experts_and_inputs(F64)
    assert len(set(range(experts.w1.shape[0])) - set(idx.flatten().tolist())) > 5, "some experts get no token"
    assert torch.bincount(idx.flatten()).max() >= 8, "some expert gets many tokens"
    got = grads(lambda e, *a: e(*a), experts, z, w, idx)
    want = grads(experts_loop_reference, experts, z, w, idx)
    for name, ref in want.items():
        err = ((got[name] - ref).abs().max() / ref.abs().max()).item()
        print(f"{name}: max error / max value {err:.2e}")
        assert err < 1e-13, name


def test_grouped_path_traces_as_one_graph_and_matches_eager():
    """``fullgraph=True`` fails on any graph break; the traced path is the eager one op for op (bf16, the
    dtype of the CUDA training path; CPU ``grouped_mm`` has a compile-time kernel only for bf16)."""
    experts, z, w, idx = experts_and_inputs(torch.bfloat16)
    compiled = torch.compile(lambda e, *a: e(*a), backend="aot_eager", fullgraph=True)
    got = grads(compiled, experts, z, w, idx)
    want = grads(lambda e, *a: e(*a), experts, z, w, idx)
    for name, ref in want.items():
        assert torch.equal(got[name], ref), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_path_matches_fp64_in_low_precision(dtype):
    experts, z, w, idx = experts_and_inputs(F64)
    want = grads(experts_loop_reference, experts, z, w, idx)
    low = experts_and_inputs(dtype)[0]
    got = grads(lambda e, *a: e(*a), low, z.to(dtype), w.float(), idx)
    tol = 2e-6 if dtype == torch.float32 else 3e-2
    for name, ref in want.items():
        err = ((got[name].to(F64) - ref).norm() / ref.norm()).item()
        assert err < tol, f"{name}: relative error {err:.2e}"


def test_grouped_path_has_no_host_sync():
    experts, z, w, idx = experts_and_inputs(F64)
    z.requires_grad_()
    with HostSyncAudit() as audit:
        experts(z, w, idx).sum().backward()
    assert audit.counts() == {}
    with HostSyncAudit() as audit:  # the audit sees the reference loop's syncs: one nonzero per expert
        experts_loop_reference(experts, z, w, idx)
    assert audit.counts().get(f"aten::nonzero @ openk3/model/moe.py:{_loop_nonzero_line()}") == 32


def _loop_nonzero_line() -> int:
    import inspect

    lines, start = inspect.getsourcelines(experts_loop_reference)
    return start + next(i for i, line in enumerate(lines) if "nonzero" in line)


def test_gathered_path_equals_the_loop_fp64():
    """8 tokens × 3 slots = 24 ≤ 32 experts (the decode case), experts repeated across tokens."""
    experts, z, w, idx = experts_and_inputs(F64, N=8)
    assert torch.bincount(idx.flatten()).max() >= 3
    want = experts_loop_reference(experts, z, w, idx)
    got = gathered_experts(experts.config, z, w, idx, experts.w1, experts.w3, experts.w2)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-13


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_path_matches_fp64_in_low_precision(dtype):
    experts, z, w, idx = experts_and_inputs(F64, N=8)
    want = experts_loop_reference(experts, z, w, idx)
    low = experts_and_inputs(dtype, N=8)[0]
    got = gathered_experts(low.config, z.to(dtype), w.float(), idx, low.w1, low.w3, low.w2)
    assert got.dtype == dtype
    tol = 2e-6 if dtype == torch.float32 else 3e-2
    assert ((got.to(F64) - want).norm() / want.norm()).item() < tol


def _traced_ops(experts, z, w, idx, grad: bool) -> set[str]:
    """The functions in dynamo's graph of ``experts(z, w, idx)`` (run as traced), with or without grad."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda e, *a: e(*a), backend=backend, fullgraph=True)
    with torch.set_grad_enabled(grad):
        compiled(experts, z, w, idx)
    return {getattr(n.target, "__name__", str(n.target)) for g in graphs for n in g.graph.nodes}


def test_compiled_few_tokens_without_grad_take_the_gathered_path():
    """Traced without gradient and with ``N·k ≤ E`` the experts are read per slot (no sort, no grouped GEMM
    or its gathered fallback); with gradient (training) or more slots than experts, the sorted path."""
    experts, z, w, idx = experts_and_inputs(torch.float32, N=8)
    few = _traced_ops(experts, z, w, idx, grad=False)
    assert "sort" not in few and "grouped_mm" not in few and "bmm" not in few, few
    assert "sort" in _traced_ops(experts, z, w, idx, grad=True)
    experts, z, w, idx = experts_and_inputs(torch.float32, N=11)  # 33 slots > 32 experts
    assert "sort" in _traced_ops(experts, z, w, idx, grad=False)


@pytest.mark.slow
def test_inductor_gathered_path_equals_the_loop():
    """Inductor's kernels for the gathered path (the gathers read inside the reductions) against the loop, fp32
    (a C++ compile of about half a minute on a 2-core CPU)."""
    experts, z, w, idx = experts_and_inputs(torch.float32, N=8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda e, *a: e(*a), fullgraph=True)
    with torch.no_grad():
        got = compiled(experts, z, w, idx)
        want = experts_loop_reference(experts.double(), z.double(), w.double(), idx)
    assert ((got.double() - want).norm() / want.norm()).item() < 2e-6


@pytest.mark.parametrize("N", [8, 20], ids=["few-slots", "more-slots-than-experts"])
def test_traced_router_equals_the_eager_router(N):
    """Traced without gradient with ``N·k ≤ E`` the router's logits are products and sums and its top-k a
    sort; the experts, weights and cutoffs are the eager router's (fp64 scores: no near-ties), and the traced
    graph has no ``topk`` there (it keeps it with more slots than experts)."""
    cfg = experts_and_inputs(F64)[0].config
    gate = MoEGate(cfg, 40).to(F64)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g, dtype=F64))
        gate.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.num_experts, generator=g))
    x = torch.randn(N, 40, generator=g, dtype=F64)
    ops: list[str] = []

    def backend(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        want = gate(x)
        got = torch.compile(gate, backend=backend, fullgraph=True)(x)
    assert torch.equal(got.indices_Nk, want.indices_Nk)
    for a, b in (
        (got.weights_Nk, want.weights_Nk),
        (got.cutoff_N, want.cutoff_N),
        (got.scores_NE, want.scores_NE),
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    few = N * cfg.num_experts_per_token <= cfg.num_experts
    assert any("topk" in op for op in ops) != few and any("sort" in op for op in ops) == few, ops
