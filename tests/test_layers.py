"""Unit tests of the K3 layers against closed forms and their own reference paths.

* MLA (``docs/references.md#gated-nope-mla``): the absorbed path equals the naive path in fp64, without a
  cache, over a cache filled by prefill + several decode steps, and with packed documents; both are
  causal; the cache holds exactly ``kv_lora_rank + qk_rope_head_dim`` numbers per token (576 for kimi-k3).
* Routed experts (``docs/references.md#router``, ``docs/references.md#stable-latentmoe``): the grouped path
  equals ``experts_loop_reference`` and a per-token formula,
  in fp32 and fp64, with experts that receive no token.
* Router (``docs/references.md#router``): unbiased weights renormalised × ``routed_scaling_factor``; the bias
  moves the
  selection only; the cutoff is the biased (k+1)-th score; counts match a bincount.
* SiTU-GLU (``docs/references.md#situ-glu``): closed form with β 4 / 25, |h| ≤ β₁·β₂ = 100 for huge inputs, ≈
  SwiGLU near 0.
* AttnRes mix (``docs/references.md#block-attention-residuals``): a direct per-token formula in fp64.
* ShortConvolution (``docs/references.md#kda-layer``): a direct formula; chunks with a cache equal one pass;
  ``cu_seqlens`` equals
  per-document runs (final states too).

Legend: ``B`` batch, ``T`` tokens, ``S`` cached + new tokens, ``D`` width, ``C`` channels, ``N`` tokens or
documents, ``E`` experts, ``k`` experts per token, ``L`` expert input width, ``F`` expert width.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import openk3
from openk3.config import KimiK3Config
from openk3.model.activations import situ_glu
from openk3.model.attn_res import attn_res_mix
from openk3.model.cache import MLACache
from openk3.model.mla import MultiheadLatentAttention
from openk3.model.moe import RoutedExperts, experts_loop_reference
from openk3.model.norm import RMSNorm
from openk3.model.router import MoEGate
from openk3.model.short_conv import ShortConvolution
from openk3.presets import k3_shaped

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def randomise_(module: nn.Module, seed: int) -> nn.Module:
    """Unit-scale weights: matrices std 1/√fan_in (last dim), 1-D gains 1 ± 0.1."""
    g = gen(seed)
    for p in module.parameters():
        if p.dim() == 1:
            p.copy_(1 + 0.1 * (2 * torch.rand(p.shape, generator=g, dtype=F64) - 1))
        else:
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) / p.shape[-1] ** 0.5)
    return module


def text(depth: int = 8):
    return k3_shaped(depth).text_config


# --- MLA ---------------------------------------------------------------------------------------------
def mla_module(seed: int = 0) -> MultiheadLatentAttention:
    return randomise_(MultiheadLatentAttention(text()).to(F64), seed).eval()


def run_mla(
    attn: MultiheadLatentAttention,
    impl: str,
    x_BTD: torch.Tensor,
    splits: list[int] | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Whole sequence in one call (``splits`` None) or through a cache in pieces of the given lengths."""
    attn.attn_impl = impl
    with torch.no_grad():
        if splits is None:
            return attn(x_BTD, None, cu_seqlens)
        cache, outs, t = MLACache(), [], 0
        for n in splits:
            outs.append(attn(x_BTD[:, t : t + n], cache))
            t += n
        return torch.cat(outs, dim=1)


def test_mla_absorbed_equals_naive_without_cache():
    attn = mla_module()
    x = torch.randn(2, 9, attn.o_proj.out_features, generator=gen(1), dtype=F64)
    naive, absorbed = run_mla(attn, "naive", x), run_mla(attn, "absorb", x)
    assert (naive - absorbed).abs().max().item() < 1e-12
    assert naive.abs().mean().item() > 0.1


def test_mla_both_paths_are_causal():
    attn = mla_module()
    x = torch.randn(1, 8, attn.o_proj.out_features, generator=gen(2), dtype=F64)
    x2 = x.clone()
    x2[:, 5:] += 1.0  # change the future of position 4
    for impl in ("naive", "absorb"):
        y, y2 = run_mla(attn, impl, x), run_mla(attn, impl, x2)
        assert (y[:, :5] - y2[:, :5]).abs().max().item() < 1e-13, impl
        assert (y[:, 5:] - y2[:, 5:]).abs().max().item() > 1e-3, impl


@pytest.mark.parametrize("splits", [[5, 1, 1, 1, 1], [1, 1, 1, 6], [4, 3, 1, 1]])
def test_mla_cached_paths_equal_full_forward(splits):
    """Prefill + decode steps (and multi-token steps) over a cache: naive == absorbed == one full pass."""
    attn = mla_module(3)
    x = torch.randn(2, sum(splits), attn.o_proj.out_features, generator=gen(4), dtype=F64)
    full = run_mla(attn, "naive", x)
    for impl in ("naive", "absorb", "auto"):
        err = (run_mla(attn, impl, x, splits) - full).abs().max().item()
        assert err < 1e-12, f"{impl} with cache {splits}: {err:.2e}"


def test_mla_absorbed_equals_naive_packed():
    attn = mla_module(5)
    x = torch.randn(1, 10, attn.o_proj.out_features, generator=gen(6), dtype=F64)
    cu = torch.tensor([0, 3, 4, 10])
    naive, absorbed = run_mla(attn, "naive", x, cu_seqlens=cu), run_mla(attn, "absorb", x, cu_seqlens=cu)
    assert (naive - absorbed).abs().max().item() < 1e-12
    separate = torch.cat([run_mla(attn, "naive", x[:, a:b]) for a, b in [(0, 3), (3, 4), (4, 10)]], dim=1)
    assert (naive - separate).abs().max().item() < 1e-12


def test_mla_cache_is_576_numbers_per_token_for_kimi_k3():
    cfg = openk3.get_preset("kimi-k3").text_config
    assert cfg.kv_lora_rank + cfg.qk_rope_head_dim == 576
    # the full kimi-k3 MLA layer, shapes only
    with torch.device("meta"):
        attn = MultiheadLatentAttention(cfg)
        cache = MLACache()
        attn(torch.empty(1, 3, cfg.hidden_size), cache)
        attn(torch.empty(1, 1, cfg.hidden_size), cache)
    assert tuple(cache.latent.shape) == (1, 4, 512) and tuple(cache.k_pe.shape) == (1, 4, 64)
    # a small real layer with kimi-k3's latent widths (512 + 64) and tiny everything else
    data = k3_shaped(4).to_dict()
    data["text_config"].update(kv_lora_rank=512, qk_rope_head_dim=64)
    small = KimiK3Config.from_dict(data).text_config
    attn = randomise_(MultiheadLatentAttention(small), 7)
    cache = MLACache()
    with torch.no_grad():
        attn(torch.randn(2, 5, small.hidden_size, generator=gen(8)), cache)
    per_token = sum(t.shape[-1] for t in (cache.latent, cache.k_pe))
    assert per_token == 576 and cache.latent.shape[:2] == (2, 5) and cache.k_pe.shape[:2] == (2, 5)


# --- routed experts -----------------------------------------------------------------------------------
def expert_inputs(E: int, k: int, N: int, L: int, dtype, seed: int):
    g = gen(seed)
    z = torch.randn(N, L, generator=g, dtype=F64).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g, dtype=F64).to(torch.float32)
    return z, w, idx


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_routed_experts_grouped_equals_loop(dtype):
    data = k3_shaped(8).to_dict()
    data["text_config"]["moe_intermediate_size"] = 96  # F ≠ L
    cfg = KimiK3Config.from_dict(data).text_config
    E, L = cfg.num_experts, cfg.routed_expert_hidden_size
    experts = randomise_(RoutedExperts(cfg, L).to(F64), 9)
    with torch.no_grad():
        experts.w1.mul_(3.0)  # gate pre-activations reach the SiTU cap
        experts = experts.to(dtype)
        z, w, idx = expert_inputs(E, 3, 7, L, dtype, seed=10)
        idx[0] = torch.tensor([4, 5, 30])
        idx[1] = torch.tensor([30, 4, 2])  # expert 30 and 4 get several tokens
        grouped = experts(z, w, idx)
        loop = experts_loop_reference(experts, z, w, idx)
    assert grouped.dtype == dtype
    assert len(set(range(E)) - set(idx.flatten().tolist())) > 10, "some experts must receive no token"
    # independent per-token formula: Σ_k w · W2 SiTU(W1 z, W3 z), fp64
    e64 = {name: p.detach().to(F64) for name, p in experts.named_parameters()}
    ref = torch.zeros(z.shape, dtype=F64)
    for n in range(z.shape[0]):
        for j in range(idx.shape[1]):
            e, zn = int(idx[n, j]), z[n].to(F64)
            g_, u_ = e64["w1"][e] @ zn, e64["w3"][e] @ zn
            h = 4 * torch.tanh(g_ / 4) * torch.sigmoid(g_) * 25 * torch.tanh(u_ / 25)
            ref[n] += float(w[n, j]) * (e64["w2"][e] @ h)
    tol = 1e-12 if dtype == F64 else 2e-5
    scale = ref.abs().max().item()
    assert (grouped.to(F64) - loop.to(F64)).abs().max().item() <= tol * scale
    assert (grouped.to(F64) - ref).abs().max().item() <= tol * scale
    assert (loop.to(F64) - ref).abs().max().item() <= tol * scale


# --- router -------------------------------------------------------------------------------------------
def router(k: int, scaling: float, seed: int) -> tuple[MoEGate, torch.Tensor]:
    data = k3_shaped(8).to_dict()
    data["text_config"].update(num_experts_per_token=k, routed_scaling_factor=scaling)
    cfg = KimiK3Config.from_dict(data).text_config
    gate = randomise_(MoEGate(cfg, cfg.hidden_size).to(F64), seed)
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(0.15 * torch.randn(cfg.num_experts, generator=gen(seed + 1)))
    x = torch.randn(64, cfg.hidden_size, generator=gen(seed + 2), dtype=F64)
    return gate, x


def test_router_matches_formula():
    k, scaling = 3, 2.5
    gate, x = router(k, scaling, seed=11)
    with torch.no_grad():
        out = gate(x)
    s = torch.sigmoid(x @ gate.weight.T)
    biased = s + gate.e_score_correction_bias.to(F64)
    order = torch.argsort(biased, dim=-1, descending=True)
    assert torch.equal(out.indices_Nk.sort(-1).values, order[:, :k].sort(-1).values)
    chosen = s.gather(-1, out.indices_Nk)
    assert (out.scores_NE - s).abs().max().item() < 1e-15
    assert (out.weights_Nk - chosen / chosen.sum(-1, keepdim=True) * scaling).abs().max().item() < 1e-14
    assert (out.weights_Nk.sum(-1) - scaling).abs().max().item() < 1e-14
    assert torch.equal(out.cutoff_N, biased.gather(-1, order[:, k : k + 1])[:, 0])
    N, E = x.shape[0], gate.weight.shape[0]
    assert int(out.counts_E.sum()) == N * k
    assert torch.equal(out.counts_E, torch.bincount(out.indices_Nk.flatten(), minlength=E))


def test_router_bias_moves_selection_not_weights():
    gate, x = router(3, 1.0, seed=12)
    with torch.no_grad():
        biased = gate(x)
        shifted_bias = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.add_(0.25)  # a common shift changes nothing
        shifted = gate(x)
        gate.e_score_correction_bias.zero_()
        plain = gate(x)
    assert torch.equal(shifted.indices_Nk, biased.indices_Nk)
    assert torch.equal(shifted.weights_Nk, biased.weights_Nk)
    assert not torch.equal(shifted_bias, gate.e_score_correction_bias)
    b_set, p_set = biased.indices_Nk.sort(-1), plain.indices_Nk.sort(-1)
    same = (b_set.values == p_set.values).all(-1)
    assert (~same).sum() > 0, "the bias must change some selections"
    # where the chosen set is the same, the weights are the same (they never see the bias)
    wb = biased.weights_Nk.gather(-1, b_set.indices)[same]
    wp = plain.weights_Nk.gather(-1, p_set.indices)[same]
    assert (wb - wp).abs().max().item() < 1e-15


def test_router_top1_is_not_renormalised():
    """k = 1: the weight is the raw score s (× scaling), not 1 (renormalise only when k > 1)."""
    gate, x = router(1, 2.0, seed=13)
    with torch.no_grad():
        out = gate(x)
    s = torch.sigmoid(x @ gate.weight.T)
    assert (out.weights_Nk[:, 0] - 2.0 * s.gather(-1, out.indices_Nk)[:, 0]).abs().max().item() < 1e-15
    assert out.weights_Nk.std().item() > 0.01


# --- SiTU-GLU -----------------------------------------------------------------------------------------
def situ_closed_form(g: float, u: float, b1: float = 4.0, b2: float | None = 25.0) -> float:
    up = u if b2 is None else b2 * math.tanh(u / b2)
    return b1 * math.tanh(g / b1) * (1 / (1 + math.exp(-g))) * up


def test_situ_closed_form():
    g = torch.linspace(-30, 30, 41, dtype=F64)
    u = torch.linspace(-80, 80, 41, dtype=F64).flip(0)
    G, U = torch.meshgrid(g, u, indexing="ij")
    h = situ_glu(G, U, 4.0, 25.0)
    ref = torch.tensor([[situ_closed_form(a, b) for b in u.tolist()] for a in g.tolist()], dtype=F64)
    assert (h - ref).abs().max().item() < 1e-12
    uncapped = situ_glu(G, U, 4.0, None)
    ref = torch.tensor([[situ_closed_form(a, b, b2=None) for b in u.tolist()] for a in g.tolist()], dtype=F64)
    assert (uncapped - ref).abs().max().item() < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16])
def test_situ_bounded_by_100(dtype):
    big = torch.tensor([1e4, -1e4, 3e38, -3e38, 60.0, 1e3], dtype=F64).to(dtype)
    G, U = torch.meshgrid(big, big, indexing="ij")
    h = situ_glu(G, U, 4.0, 25.0)
    assert h.dtype == dtype and torch.isfinite(h).all()
    assert h.abs().max().item() <= 100.0  # β₁·β₂; strict in exact arithmetic, tanh/σ round to 1 here
    assert h.float().max().item() > 99.0


def test_situ_near_zero_is_swiglu():
    x = torch.linspace(-1e-2, 1e-2, 21, dtype=F64)
    G, U = torch.meshgrid(x, x.flip(0) * 0.7 + 1e-3, indexing="ij")
    h = situ_glu(G, U, 4.0, 25.0)
    swiglu = G * torch.sigmoid(G) * U
    # softcap(x, β) = x(1 − x²/(3β²) + …): relative deviation ≤ g²/48 + u²/1875
    bound = G**2 / 48 + U**2 / 1875
    nonzero = swiglu != 0  # the row g = 0 gives h = SwiGLU = 0 exactly
    assert torch.equal(h[~nonzero], swiglu[~nonzero])
    rel = ((h - swiglu) / swiglu).abs()[nonzero]
    assert (rel <= bound[nonzero] * 1.01 + 1e-15).all()
    assert rel.max().item() < 3e-6


# --- AttnRes --------------------------------------------------------------------------------------------
def test_attn_res_mix_direct_formula():
    D, eps = 16, 1e-5
    norm, proj = RMSNorm(D, eps).to(F64).requires_grad_(False), nn.Linear(D, 1, bias=False).to(F64)
    proj.requires_grad_(False)
    g = gen(14)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g, dtype=F64))
        proj.weight.copy_(0.5 * torch.randn(1, D, generator=g, dtype=F64))
    blocks = [torch.randn(2, 3, D, generator=g, dtype=F64) * s for s in (1.0, 5.0, 0.2)]
    partial = torch.randn(2, 3, D, generator=g, dtype=F64)
    out = attn_res_mix(blocks, partial, norm, proj)
    sources = [*blocks, partial]
    ref = torch.zeros(2, 3, D, dtype=F64)
    for b in range(2):
        for t in range(3):
            scores = []
            for v in sources:
                vt = v[b, t]
                key = [vt[d] / math.sqrt(float((vt**2).mean()) + eps) for d in range(D)]
                scores.append(sum(float(key[d] * norm.weight[d] * proj.weight[0, d]) for d in range(D)))
            m = max(scores)
            e = [math.exp(s - m) for s in scores]
            ref[b, t] = sum(e[n] / sum(e) * sources[n][b, t] for n in range(len(sources)))
    assert (out - ref).abs().max().item() < 1e-12
    # the mix is not uniform with these queries; a zero query gives the plain mean
    assert (out - torch.stack(sources).mean(0)).abs().max().item() > 1e-2
    with torch.no_grad():
        proj.weight.zero_()
    assert (
        attn_res_mix(blocks, partial, norm, proj) - torch.stack(sources).mean(0)
    ).abs().max().item() < 1e-14


def test_attn_res_mix_fp32_and_bf16_follow_fp64():
    D = 32
    norm, proj = RMSNorm(D), nn.Linear(D, 1, bias=False)
    g = gen(15)
    with torch.no_grad():
        proj.weight.copy_(0.5 * torch.randn(1, D, generator=g))
    blocks = [torch.randn(1, 4, D, generator=g) for _ in range(3)]
    partial = torch.randn(1, 4, D, generator=g)
    ref = attn_res_mix([b.double() for b in blocks], partial.double(), norm.double(), proj.double())
    norm, proj = norm.float(), proj.float()
    out32 = attn_res_mix(blocks, partial, norm, proj)
    out16 = attn_res_mix([b.bfloat16() for b in blocks], partial.bfloat16(), norm, proj)
    assert out32.dtype == torch.float32 and out16.dtype == torch.bfloat16
    assert (out32.double() - ref).abs().max().item() < 1e-5
    assert (out16.double() - ref).abs().max().item() < 5e-2


def test_attn_res_mix_stays_fp32_under_autocast():
    """Under bf16 autocast (CPU here, CUDA in training) the mix still follows the fp64 formula to fp32
    rounding and runs no matrix product (autocast would run those in bf16)."""
    D = 64
    norm, proj = RMSNorm(D), nn.Linear(D, 1, bias=False)
    g = gen(151)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
        proj.weight.copy_(0.5 * torch.randn(1, D, generator=g))
    blocks = [torch.randn(2, 8, D, generator=g) * s for s in (1.0, 3.0, 0.5)]
    partial = torch.randn(2, 8, D, generator=g)
    ref = attn_res_mix([b.double() for b in blocks], partial.double(), norm.double(), proj.double())
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with torch.autocast("cpu", dtype=torch.bfloat16), Ops():
        out = attn_res_mix(blocks, partial, norm, proj)
    assert out.dtype == torch.float32
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert not {"mm", "bmm", "mv", "addmm", "baddbmm", "addmv"} & set(ops)


# --- ShortConvolution ---------------------------------------------------------------------------------
def conv(C: int = 6, seed: int = 16) -> ShortConvolution:
    m = ShortConvolution(C, 4).to(F64)
    with torch.no_grad():
        m.weight.copy_(0.5 * torch.randn(C, 1, 4, generator=gen(seed), dtype=F64))
    return m


def test_short_conv_direct_formula():
    m = conv()
    x = torch.randn(2, 7, 6, generator=gen(17), dtype=F64)
    with torch.no_grad():
        y, state = m(x, output_final_state=True)
    w = m.weight.detach()
    ref = torch.zeros_like(x)
    for t in range(7):
        for j in range(4):  # tap j reads token t − 3 + j; w[:, 0, 3] multiplies the current token
            if t - 3 + j >= 0:
                ref[:, t] += w[:, 0, j] * x[:, t - 3 + j]
    ref = ref * torch.sigmoid(ref)
    assert (y - ref).abs().max().item() < 1e-14
    assert torch.equal(state, x[:, -3:].transpose(1, 2))  # cache = last W−1 inputs, [B, C, W−1]


def test_short_conv_cache_in_chunks_equals_one_pass():
    m = conv()
    x = torch.randn(2, 11, 6, generator=gen(18), dtype=F64)
    with torch.no_grad():
        full, full_state = m(x, output_final_state=True)
        outs, state, t = [], None, 0
        for n in (2, 1, 1, 4, 3):
            y, state = m(x[:, t : t + n], state, output_final_state=True)
            outs.append(y)
            t += n
    assert (torch.cat(outs, dim=1) - full).abs().max().item() < 1e-14
    assert torch.equal(state, full_state)


def test_short_conv_packed_equals_per_document():
    m = conv()
    lengths = [3, 1, 5, 2, 6]  # includes documents shorter than W − 1
    x = torch.randn(1, sum(lengths), 6, generator=gen(19), dtype=F64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    with torch.no_grad():
        packed, packed_state = m(x, cu_seqlens=cu, output_final_state=True)
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            y, state = m(x[:, a:b], output_final_state=True)
            assert (packed[:, a:b] - y).abs().max().item() < 1e-14
            assert torch.equal(packed_state[n], state[0])
