"""KDA context parallelism (KCP) at world 2 and 4 (gloo) against the unsharded op and layer.

The oracle is the same computation in one process: :func:`chunk_kda` over the whole packed row (itself tested
against the fp64 recurrence), and the single-device KDA layer. Each rank runs its tokens of the plan; its
outputs and input gradients must equal the oracle's rows at the rank's global positions, and the parameter
gradients summed over ranks the oracle's (fp32: max relative difference ≤ 1e-5; fp64: ≤ 1e-12). Cases: one
document; documents cut at odd places (a document over several ranks, several per rank, one starting exactly
on a rank boundary, an empty one); one-token documents; every rank starting a document (nobody needs a
predecessor: the backward must not hang); zig-zag; per-head ``A_log`` that differ; the same op under
``torch.no_grad`` (no graph).

Legend: ``T`` global tokens, ``L`` local tokens, ``H`` heads, ``K`` key dim, ``V`` value dim.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_utils import layer_under_cp_error, rel_max
from dist_utils import run_world
from openk3.dist.cp_plan import ContextParallelPlan
from openk3.dist.kcp import context_parallel_kda
from openk3.model.modeling import build_model
from openk3.ops.kda import chunk_kda
from openk3.presets import k3_shaped

H, K, V = 2, 16, 8
FP32_TOL, FP64_TOL = 1e-5, 1e-12


def _cases(world: int) -> dict:
    """name → (T, cu_seqlens, layout, dtype, chunk_size); T a multiple of 2·world (zig-zag)."""
    T = 24 * world  # 24 tokens per rank: 12 per zig-zag fragment
    n = T // world
    return {
        "one_document": (T, [0, T], "contiguous", torch.float32, 16),
        "cut_odd_places": (T, [0, 5, n, n, n + 3, T - 7, T], "contiguous", torch.float32, 16),
        "one_token_docs": (T, [0, 1, 2, 3, n - 1, n + 1, T], "contiguous", torch.float32, 64),
        "all_start_on_boundaries": (T, list(range(0, T + 1, n)), "contiguous", torch.float32, 16),
        "zigzag_cut": (T, [0, 7, n + 2, T - 5, T], "zigzag", torch.float32, 16),
        "zigzag_one_document_fp64": (T, [0, T], "zigzag", torch.float64, 16),
        "cut_odd_places_fp64": (T, [0, 5, n, n + 3, T], "contiguous", torch.float64, 64),
    }


def _op_inputs(T: int, dtype, seed: int = 0) -> dict:
    """Leaves in ``dtype``: q, k, v, raw gate, β logits ``[1, T, …]``; ``A_log`` per head (differing), ``dt_bias``."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    return dict(
        q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V), g=r(1, T, H, K), beta=r(1, T, H),
        A_log=torch.tensor([-0.7, 0.4], dtype=dtype), dt_bias=r(H * K) * 0.3,
    )  # fmt: skip


TOKENS = ("q", "k", "v", "g", "beta")
GATE = dict(lower_bound=-1.0, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _op_world(rank: int, world: int) -> dict:
    """Every case at this world: the largest relative difference over o and every gradient."""
    errors = {}
    for name, (T, cu, layout, dtype, chunk) in _cases(world).items():
        x = {n: t.requires_grad_() for n, t in _op_inputs(T, dtype).items()}
        dO = torch.randn(1, T, H, V, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(
            dtype
        )
        o = chunk_kda(*(x[n] for n in TOKENS), A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=torch.tensor(cu),
                      chunk_size=chunk, **GATE)[0]  # fmt: skip
        (o * dO).sum().backward()
        plan = ContextParallelPlan(tuple(cu), world, rank, layout)
        mine = {n: (plan.shard(x[n]) if n in TOKENS else x[n]).detach().clone().requires_grad_() for n in x}
        o_l = context_parallel_kda(*(mine[n] for n in TOKENS), plan=plan, A_log=mine["A_log"],
                                   dt_bias=mine["dt_bias"], chunk_size=chunk, **GATE)  # fmt: skip
        (o_l * plan.shard(dO)).sum().backward()
        worst = rel_max(o_l.detach(), plan.shard(o.detach()))
        with torch.no_grad():  # the inference path: no local graph kept
            o_ng = context_parallel_kda(*(mine[n] for n in TOKENS), plan=plan, A_log=mine["A_log"],
                                        dt_bias=mine["dt_bias"], chunk_size=chunk, **GATE)  # fmt: skip
        worst = max(worst, rel_max(o_ng, plan.shard(o.detach())))
        for n in x:
            grad = mine[n].grad
            if n in TOKENS:
                worst = max(worst, rel_max(grad, plan.shard(x[n].grad)))
            else:
                dist.all_reduce(grad)
                worst = max(worst, rel_max(grad, x[n].grad))
        errors[name] = (worst, dtype)
    return errors


def _layer_world(rank: int, world: int) -> dict:
    """A K3-shaped KDA layer (per-head ``A_log`` set apart) under CP: layout × dtype → largest difference
    (:func:`cp_utils.layer_under_cp_error`)."""
    model = build_model(k3_shaped(4, vocab_size=256), device="cpu", seed=0)
    base = next(m for m in model.modules() if type(m).__name__ == "KimiDeltaAttention")
    with torch.no_grad():
        base.A_log.copy_(torch.linspace(-1.0, 1.0, base.A_log.numel()))
    T, D = 32 * world, model.language_model.model.config.hidden_size
    cases = (
        ("contiguous", [0, 3, T // world + 1, T // world + 1, T - 2, T], torch.float32),
        ("zigzag", [0, 5, T - 9, T], torch.float32),
        ("zigzag", [0, T // 2, T], torch.float64),
        ("zigzag", [0, 1, 4 * world], torch.float64),  # 2-token fragments: the halo spans two of them
    )
    return {
        f"{layout}_{cu[-1]}_{str(dtype)[6:]}": (
            layer_under_cp_error(base, layout, cu, dtype, D, seed=3),
            dtype,
        )
        for layout, cu, dtype in cases
    }


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_kcp_op_equals_unsharded(world):
    errors = run_world(_op_world, world, timeout=240)
    for rank_errors in errors:
        for name, (err, dtype) in rank_errors.items():
            tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
            assert err <= tol, (world, name, err)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_kda_layer_under_cp_equals_unsharded(world):
    errors = run_world(_layer_world, world, timeout=300)
    for rank_errors in errors:
        for name, (err, dtype) in rank_errors.items():
            assert err <= (FP64_TOL if dtype == torch.float64 else FP32_TOL), (world, name, err)


GPU_TOL = {
    "o": 1e-2,
    "dq": 1e-2,
    "dk": 1e-2,
    "dv": 1e-2,
    "dg": 2e-2,
    "dbeta": 2e-2,
    "dA_log": 2e-2,
    "ddt_bias": 2e-2,
}
"""Relative RMSE of CP against the unsharded op on the GPU in bf16 (fla's CP tests allow 8e-3 as an RMSE
ratio): both run the Triton kernels with bf16 intermediates, CP adds the kernels' summaries (whose state
operands are bf16-rounded where the unsharded op carries its state in fp32); the gate's and β's gradients
get the kernels' own looser bf16 tolerance (``docs/references.md#kda-tolerances``). ``o@starts`` is ``o``
on the first 256 rows of each local fragment, where the entry state weighs most."""


def _gpu_op_world(rank: int, world: int, T: int, D: int, device: str = "cuda") -> dict:
    """The KCP op on one GPU shared by the ranks (gloo through host copies), bf16, ``K = V = D``, 4 heads,
    zig-zag. The K3 gate (lb = −5, so the local op is the Triton chunked path and the summaries the
    kernels') with ``dt_bias = −8``: from no decay (head 3) to fast (head 0). Keys live in channels
    ``[0, D/2)`` in the first half of the stream and ``[D/2, D)`` in the second, so the state written before
    ``T/2`` passes the later fragments' maps ``M`` unerased (only gated) and every later query reads it:
    a wrong ``M`` or ``E`` shows in whole fragments, not only in their first tokens. Documents: one spans
    fragments 1–3 (its fragment-2 map is folded in), one crosses from fragment 0 into 1, one short one at
    the end. Returns the relative RMSE of ``o`` and of every gradient."""
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    Hg = 4
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    k = r(1, T, Hg, D)
    k[:, : T // 2, :, D // 2 :] = 0
    k[:, T // 2 :, :, : D // 2] = 0
    x = dict(q=r(1, T, Hg, D), k=k, v=r(1, T, Hg, D), g=r(1, T, Hg, D), beta=r(1, T, Hg))
    x = {n: t.to(dev, torch.bfloat16).requires_grad_() for n, t in x.items()}
    params = dict(A_log=torch.linspace(-1, 1, Hg), dt_bias=torch.full((Hg * D,), -8.0))
    params = {n: t.to(dev).requires_grad_() for n, t in params.items()}
    gate = dict(lower_bound=-5.0, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    cu = [0, 777, T // 4 + 300, T - 300, T]
    dO = r(1, T, Hg, D).to(dev, torch.bfloat16)
    o = chunk_kda(*(x[n] for n in TOKENS), cu_seqlens=torch.tensor(cu, device=dev), **params, **gate)[0]
    (o.float() * dO.float()).sum().backward()
    plan = ContextParallelPlan(tuple(cu), world, rank, "zigzag")
    mine = {n: plan.shard(t).detach().clone().requires_grad_() for n, t in x.items()}
    mine_p = {n: t.detach().clone().requires_grad_() for n, t in params.items()}
    o_l = context_parallel_kda(*(mine[n] for n in TOKENS), plan=plan, **mine_p, **gate)
    (o_l.float() * plan.shard(dO).float()).sum().backward()

    def rmse(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    o_want = plan.shard(o.detach())
    n = plan.local_len // plan.slots_per_rank
    starts = torch.cat([torch.arange(f * n, f * n + 256) for f in range(plan.slots_per_rank)]).to(dev)
    errors = {"o": rmse(o_l.detach(), o_want), "o@starts": rmse(o_l.detach()[:, starts], o_want[:, starts])}
    errors.update({f"d{n}": rmse(mine[n].grad, plan.shard(x[n].grad)) for n in TOKENS})
    for n, t in mine_p.items():
        grad = t.grad.cpu()
        dist.all_reduce(grad)
        errors[f"d{n}"] = rmse(grad, params[n].grad.cpu())
    return errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the ranks share it over gloo)")
@pytest.mark.parametrize(("T", "D"), [(8192, 64), (131072, 128)])
def test_gpu_kcp_op_bf16_on_one_shared_gpu(T, D):
    """Two gloo ranks on one GPU: D = 64 takes the one-call kernel summaries (K + V = 128), D = 128 (K3's
    heads) the two-call ones; T = 128K is 64K tokens a rank."""
    for rank, rank_errors in enumerate(run_world(_gpu_op_world, 2, T, D, timeout=600, pg_timeout=300)):
        print(f"T={T} D={D} rank {rank}:", {n: f"{e:.2e}" for n, e in rank_errors.items()})
        for name, err in rank_errors.items():
            assert err <= GPU_TOL[name.split("@")[0]], (rank, name, err, rank_errors)
