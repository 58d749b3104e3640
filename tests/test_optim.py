"""Tests for openk3.train.optim: Muon / Per-Head Muon / AdamW in one optimizer, and the parameter partition.

Independent references: the Muon formula written out in fp64 on each matrix separately (Newton–Schulz by its
closed form through an fp64 SVD; per-head and per-expert Muon are that formula on each block as a separate
matrix), ``torch.optim.Muon`` (the public bf16 Muon, whose own error sets the bf16 tolerance),
``torch.optim.AdamW``, and the official per-head shapes of ``docs/references.md#muon-and-per-head-muon``.
Budget: about 25 s on 2 idle cores (most of it model builds and the CPU-forced CUDA path of a K3 step).
"""

from __future__ import annotations

import copy
import io
import math
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import openk3
import openk3.train.optim as optim_module
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import MultiheadLatentAttention
from openk3.presets import k3_shaped
from openk3.train.optim import (
    NS_COEFFICIENTS,
    KimiMuon,
    build_optimizer,
    muon_lr_scale,
    newton_schulz,
    partition_parameters,
    partition_table,
)

LR = 0.02
WD = 0.1
STEPS = 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    """Apply ``grads[step][i]`` to ``params[i]`` and step, for every step."""
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()


# ------------------------------------------------------------------------------------- Newton–Schulz


def _ns_closed_form_fp64(G: torch.Tensor) -> torch.Tensor:
    """NS₅ via the SVD: singular vectors kept, each σ/‖G‖_F mapped 5× by p(s) = as + bs³ + cs⁵, in fp64."""
    a, b, c = NS_COEFFICIENTS
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    s = S / torch.linalg.matrix_norm(G.double(), keepdim=True).squeeze(-1)
    for _ in range(5):
        s = a * s + b * s**3 + c * s**5
    return U @ torch.diag_embed(s) @ Vh


def _muon_fp64(init, grads, lr, wd=WD, nesterov=True, adjust_lr_fn="match_rms_adamw", mu=0.95):
    """The Muon update of optim.py's docstring on each 2-D matrix of ``init`` separately, in fp64::

    m ← μm + (1 − μ)g;  u ← (1 − μ)g + μm (Nesterov) | m;  W ← W(1 − lr·wd) − lr·s(A, B)·NS₅(u)
    """
    W = [w.double().clone() for w in init]
    m = [torch.zeros_like(w) for w in W]
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            g = g.double()
            m[i] = mu * m[i] + (1 - mu) * g
            u = (1 - mu) * g + mu * m[i] if nesterov else m[i]
            A, B = u.shape
            s = (
                0.2 * math.sqrt(max(A, B))
                if adjust_lr_fn == "match_rms_adamw"
                else math.sqrt(max(1.0, A / B))
            )
            W[i] = W[i] * (1 - lr * wd) - lr * s * _ns_closed_form_fp64(u)
    return W


BF16_U = 2.0**-8
"""bf16's unit roundoff (8 significant bits)."""
FP32_NS_TOL = 5e-5
"""Relative error of an fp32-NS update against the fp64 formula: fp32 rounding (6e-8) grown by five NS steps
on the smallest singular values; measured 0.7–1.2e-5 on these shapes."""


def _update_error(p: torch.Tensor, ref: torch.Tensor, w0: torch.Tensor) -> float:
    """‖p − ref‖ / ‖ref − w0‖: the error of the total update against the fp64 formula's update."""
    return ((p.detach().double() - ref).norm() / (ref - w0.double()).norm()).item()


def _assert_bf16_update(ours: float, torch_muon: float | None = None) -> None:
    """bf16 NS tolerance. Five NS steps round X, A = XXᵀ and B = bA + cA² to bf16 each step, so the
    orthogonalised update carries ~2 units of bf16 roundoff (0.8%) relative to the exact one: bound 4u
    (1.6%); and no worse than 1.25× the public bf16 Muon (torch.optim.Muon) on the same run (measured:
    ours 0.69–0.89%, torch 0.64–0.91%)."""
    assert ours < 4 * BF16_U, ours
    if torch_muon is not None:
        assert torch_muon < 4 * BF16_U, torch_muon  # the fp64 formula is torch's Muon
        assert ours < 1.25 * torch_muon, (ours, torch_muon)


@pytest.mark.parametrize("shape", [(48, 128), (128, 48), (3, 40, 96)])
def test_newton_schulz_matches_svd_closed_form(shape):
    G = torch.randn(shape, generator=_gen(1))
    out = newton_schulz(G, dtype=torch.float32)
    assert out.shape == G.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _ns_closed_form_fp64(G), rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (4, 32, 128)])
def test_newton_schulz_singular_values_in_band(shape, dtype):
    """Keller Jordan's docstring: the output is ≈ U S' Vᵀ with S' roughly in (0.5, 1.5), not exactly UVᵀ."""
    out = newton_schulz(torch.randn(shape, generator=_gen(2)), dtype=dtype)
    assert out.dtype == dtype
    sv = torch.linalg.svdvals(out.double())
    assert sv.min() > 0.5 and sv.max() < 1.5, (sv.min().item(), sv.max().item())
    assert (sv - 1).abs().max() > 0.05  # quintic with slope 3.4445 overshoots; exact UVᵀ would be a bug


def test_newton_schulz_rejects_vectors():
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.randn(5))


def test_muon_lr_scale_formulas():
    assert muon_lr_scale(128, 7168, "match_rms_adamw") == pytest.approx(0.2 * math.sqrt(7168))
    assert muon_lr_scale(256, 64, None) == pytest.approx(2.0)
    assert muon_lr_scale(64, 256, "original") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        muon_lr_scale(2, 2, "spectral")


# ------------------------------------------------------------------------- Muon against torch.optim.Muon


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_plain_muon_follows_the_fp64_formula(adjust_lr_fn, nesterov):
    """Tall, wide and square matrices: fp32 NS to fp32 rounding, bf16 NS within the bf16 budget (and as
    close as torch.optim.Muon, which runs NS in bf16)."""
    shapes = [(32, 48), (64, 16), (40, 40)]
    init = [torch.randn(s, generator=_gen(3)) for s in shapes]
    grads = [[torch.randn(s, generator=_gen(10 * t + i)) for i, s in enumerate(shapes)] for t in range(STEPS)]
    kw = dict(lr=LR, weight_decay=WD, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ref = _muon_fp64(init, grads, LR, WD, nesterov, adjust_lr_fn)
    runs = {}
    for name, make in (
        ("fp32", lambda ps: KimiMuon(ps, ns_dtype=torch.float32, **kw)),
        ("bf16", lambda ps: KimiMuon(ps, ns_dtype=torch.bfloat16, **kw)),
        ("torch", lambda ps: torch.optim.Muon(ps, **kw)),
    ):
        ps = [torch.nn.Parameter(w.clone()) for w in init]
        _run(make(ps), ps, grads)
        runs[name] = ps
    for i, w0 in enumerate(init):
        assert (ref[i] - w0.double()).abs().max() > 1e-2  # the reference moved
        assert _update_error(runs["fp32"][i], ref[i], w0) < FP32_NS_TOL
        _assert_bf16_update(
            _update_error(runs["bf16"][i], ref[i], w0), _update_error(runs["torch"][i], ref[i], w0)
        )


def test_default_ns_dtype_is_fp32_on_cpu():
    w0, g = torch.randn(24, 40, generator=_gen(4)), torch.randn(24, 40, generator=_gen(5))
    out = {}
    for dt in (None, torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(w0.clone())
        _run(KimiMuon([p], lr=LR, ns_dtype=dt), [p], [[g]])
        out[dt] = p.detach()
    assert torch.equal(out[None], out[torch.float32])
    assert not torch.equal(out[None], out[torch.bfloat16])


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d_h, d_in", [(16, 40), (24, 8)])
def test_per_head_muon_is_muon_on_each_head_block(d_h, d_in, ns_dtype):
    """Per-head update of ``[H·d_h, d_in]`` == the fp64 Muon formula on H separate ``[d_h, d_in]`` blocks,
    each scaled by its own block shape (the per-head choice documented in optim.py)."""
    H = 4
    w0 = torch.randn(H * d_h, d_in, generator=_gen(6))
    grads = [torch.randn(H * d_h, d_in, generator=_gen(20 + t)) for t in range(STEPS)]
    kw = dict(lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw")
    ours = torch.nn.Parameter(w0.clone())
    _run(
        KimiMuon([{"params": [ours], "kind": "muon_per_head", "heads": H}], ns_dtype=ns_dtype, **kw),
        [ours],
        [[g] for g in grads],
    )
    ref = torch.cat(_muon_fp64(list(w0.split(d_h)), [list(g.split(d_h)) for g in grads], LR))
    err = _update_error(ours, ref, w0)
    if ns_dtype == torch.float32:
        assert err < FP32_NS_TOL
    else:
        _assert_bf16_update(err)
    (full,) = _muon_fp64([w0], [[g] for g in grads], LR)
    assert _update_error(ours, full, w0) > 0.1  # per-head is not full-matrix Muon


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_stacked_experts_muon_is_muon_on_each_expert(ns_dtype):
    E, F, L = 3, 16, 24
    w0 = torch.randn(E, F, L, generator=_gen(7))
    grads = [torch.randn(E, F, L, generator=_gen(30 + t)) for t in range(STEPS)]
    kw = dict(lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw")
    ours = torch.nn.Parameter(w0.clone())
    _run(KimiMuon([ours], ns_dtype=ns_dtype, **kw), [ours], [[g] for g in grads])
    ref = torch.stack(_muon_fp64(list(w0), [list(g) for g in grads], LR))
    err = _update_error(ours, ref, w0)
    if ns_dtype == torch.float32:
        assert err < FP32_NS_TOL
    else:
        _assert_bf16_update(err)


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_groups_match_torch_adamw(fused, monkeypatch):
    """Both AdamW paths (foreach with CPU step counts; fused, as on CUDA, forced here on the CPU)."""
    monkeypatch.setattr(optim_module, "use_fused_adamw", lambda params: fused)
    shapes = [(7,), (5, 9), (6, 1, 4)]
    init = [torch.randn(s, generator=_gen(8)) for s in shapes]
    grads = [[torch.randn(s, generator=_gen(40 + 3 * t + i)) for i, s in enumerate(shapes)] for t in range(5)]
    for wd in (0.0, WD):
        ours = [torch.nn.Parameter(w.clone()) for w in init]
        ref = [torch.nn.Parameter(w.clone()) for w in init]
        _run(KimiMuon([{"params": ours, "kind": "adamw"}], lr=1e-2, weight_decay=wd), ours, grads)
        _run(torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd), ref, grads)
        for p, q in zip(ours, ref, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


class _OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops by name (``aten::bmm``, ``aten::_local_scalar_dense`` = a host read)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_groups_share_one_newton_schulz_per_shape():
    """Same-shape matrices of two groups (plain and per-head, different lr) go through one batched NS, and
    each still gets torch.optim.Muon's update with its own group's lr."""
    H, d_h, d_in = 3, 8, 24
    plain_shapes = [(8, 24), (8, 24), (24, 8), (16, 24)]  # NS shapes: (8, 24) ×2 + 3 heads, (24, 8), (16, 24)
    gen = _gen(11)
    plain0 = [torch.randn(s, generator=gen) for s in plain_shapes]
    head0 = torch.randn(H * d_h, d_in, generator=gen)
    grads = [[torch.randn(w.shape, generator=gen) for w in [*plain0, head0]] for _ in range(STEPS)]
    plain = [torch.nn.Parameter(w.clone()) for w in plain0]
    head = torch.nn.Parameter(head0.clone())
    groups = [
        {"params": plain, "lr": LR},
        {"params": [head], "kind": "muon_per_head", "heads": H, "lr": 2 * LR},
    ]
    opt = KimiMuon(groups, weight_decay=WD, ns_dtype=torch.bfloat16, adjust_lr_fn="match_rms_adamw")
    for step_grads in grads[:-1]:
        for p, g in zip([*plain, head], step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    for p, g in zip([*plain, head], grads[-1], strict=True):
        p.grad = g.clone()
    with _OpCounter() as ops:
        opt.step()
    assert ops.counts["aten::bmm"] == 5 * 3  # X Xᵀ once per NS step per shape: 3 shapes, not 7 matrices
    assert ops.counts["aten::baddbmm"] == 2 * 5 * 3
    assert ops.counts["aten::_foreach_copy_"] == 3  # each shape's matrices cast into one stacked tensor
    assert not {"aten::cat", "aten::_to_copy", "aten::clone", "aten::copy_"} & set(ops.counts)
    ref_plain = _muon_fp64(plain0, [g[:-1] for g in grads], LR)
    ref_head = torch.cat(_muon_fp64(list(head0.split(d_h)), [list(g[-1].split(d_h)) for g in grads], 2 * LR))
    for p, q, w0 in zip([*plain, head], [*ref_plain, ref_head], [*plain0, head0], strict=True):
        _assert_bf16_update(_update_error(p, q, w0))


def test_k3_1b_step_stays_batched(monkeypatch):
    """One optimizer step of k3-1b's parameters (built on the meta device, the CUDA choices forced: bf16 NS,
    fused AdamW): 3 matmuls per NS step per matrix shape (13 shapes for 7,671 matrices), one cast copy per
    shape into the stacked NS input, no other copy, no host read."""
    monkeypatch.setattr(optim_module, "use_fused_adamw", lambda params: True)
    model = openk3.build_model(openk3.get_preset("k3-1b"), device="meta")
    opt = build_optimizer(model, lr=1e-3, ns_dtype=torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    opt.step()
    with _OpCounter() as ops:
        opt.step()
    shapes = {r.matrix for r in partition_parameters(model) if r.kind != "adamw"}
    assert len(shapes) == 13
    matmuls = sum(ops.counts.get(f"aten::{n}", 0) for n in ("mm", "bmm", "addmm", "baddbmm", "matmul"))
    assert matmuls == 3 * 5 * len(shapes) <= 5 * len(shapes) * 5
    assert ops.counts["aten::_foreach_copy_"] == len(shapes)
    assert not {
        "aten::cat",
        "aten::_to_copy",
        "aten::clone",
        "aten::copy_",
        "aten::_local_scalar_dense",
    } & set(ops.counts)
    assert ops.counts["aten::_fused_adamw_"] == 2  # decayed and not decayed


def test_cuda_code_path_step_reads_nothing_back(monkeypatch):
    """With the CUDA choices (bf16 NS, fused AdamW; forced on the CPU) a step of a K3-shaped model issues
    no ``_local_scalar_dense`` (what ``.item()``/``bool()``/``int()`` of a tensor dispatch): no host sync."""
    monkeypatch.setattr(optim_module, "use_fused_adamw", lambda params: True)
    model = openk3.build_model(k3_shaped(4, vocab_size=512), seed=0)
    opt = build_optimizer(model, lr=1e-3, ns_dtype=torch.bfloat16)
    for seed in (1, 2):
        _random_grads(model, seed)
        with _OpCounter() as ops:
            opt.step()
        assert "aten::_local_scalar_dense" not in ops.counts
        assert "aten::_fused_adamw_" in ops.counts
    steps = {
        opt.state[p]["step"].item() for g in opt.param_groups if g["kind"] == "adamw" for p in g["params"]
    }
    assert steps == {2.0}


def test_invalid_groups_raise():
    with pytest.raises(ValueError, match="kind"):
        KimiMuon([{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "kind": "sgd"}])
    with pytest.raises(ValueError, match="2-D"):
        KimiMuon([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="heads=3"):
        KimiMuon([{"params": [torch.nn.Parameter(torch.zeros(8, 2))], "kind": "muon_per_head", "heads": 3}])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        KimiMuon([torch.nn.Parameter(torch.zeros(2, 2))], adjust_lr_fn="spectral")


# ----------------------------------------------------------------------------------------- partition

_ADAMW_DECAY = ("embed_tokens.weight", "lm_head.weight", "_res_proj.weight", "_conv1d.weight")
_ADAMW_NO_DECAY = ("A_log", "dt_bias", "norm.weight", "layernorm.weight")
_PER_HEAD = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_b_proj.weight", "kv_b_proj.weight")
_MUON = (
    "f_a_proj.weight",
    "f_b_proj.weight",
    "b_proj.weight",
    "g_proj.weight",
    "o_proj.weight",
    "q_a_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "gate.weight",
    "routed_expert_down_proj.weight",
    "routed_expert_up_proj.weight",
    "experts.w1",
    "experts.w2",
    "experts.w3",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def _expected_kind(name: str) -> str:
    """Hand-written rule table (the brief's list), independent of the regexes in optim.py."""
    if name.endswith(_ADAMW_DECAY):
        return "adamw+wd"
    if name.endswith(_ADAMW_NO_DECAY):
        return "adamw"
    if name.endswith(_PER_HEAD):
        return "muon_per_head"
    if name.endswith(_MUON):
        return "muon"
    raise AssertionError(f"no expectation for {name}")


@pytest.fixture(scope="module")
def tiny_meta():
    return openk3.build_model(openk3.get_preset("k3-tiny"), device="meta")


def test_partition_k3_tiny(tiny_meta):
    model, cfg = tiny_meta, openk3.config.text_config_of(openk3.get_preset("k3-tiny"))
    opt = build_optimizer(model, lr=1e-3, weight_decay=WD)
    params = dict(model.named_parameters())
    seen: dict[str, dict] = {}
    for group in opt.param_groups:
        for name, p in zip(group["param_names"], group["params"], strict=True):
            assert name not in seen, f"{name} is in two groups"
            assert p is params[name]
            seen[name] = group
    assert set(seen) == set(params)
    numel = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert numel == sum(p.numel() for p in params.values())
    for name, group in seen.items():
        kind = _expected_kind(name)
        assert group["kind"] == kind.removesuffix("+wd"), name
        assert group["weight_decay"] == (0.0 if kind == "adamw" else WD), name
    # per-head blocks follow the config: KDA [K, D]; MLA q_b [n + r, q_lora], kv_b [n + v, kv_lora]
    la = cfg.linear_attn_config
    blocks = {r.name: (r.heads, r.matrix) for r in partition_parameters(model) if r.kind == "muon_per_head"}
    n_kda = n_mla = 0
    for name, module in model.named_modules():
        if isinstance(module, KimiDeltaAttention):
            n_kda += 1
            for proj in ("q_proj", "k_proj", "v_proj"):
                assert blocks[f"{name}.{proj}.weight"] == (la.num_heads, (la.head_dim, cfg.hidden_size))
        elif isinstance(module, MultiheadLatentAttention):
            n_mla += 1
            H, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            assert blocks[f"{name}.q_b_proj.weight"] == (H, (qk, cfg.q_lora_rank))
            kv = (cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            assert blocks[f"{name}.kv_b_proj.weight"] == (H, kv)
    assert (n_kda, n_mla) == (6, 2) and len(blocks) == 3 * n_kda + 2 * n_mla
    # the QB bias is a buffer: in no group, by name or by identity
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert len(biases) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert not any("e_score_correction_bias" in n for n in seen)
    assert not any(p is b for g in opt.param_groups for p in g["params"] for b in biases)


def test_partition_switches(tiny_meta):
    roles = {r.name: r for r in partition_parameters(tiny_meta, per_head=False, router_muon=False)}
    assert not any(r.kind == "muon_per_head" for r in roles.values())
    routers = [r for n, r in roles.items() if n.endswith("block_sparse_moe.gate.weight")]
    assert routers and all(r.kind == "adamw" and r.decay for r in routers)
    assert roles["language_model.model.layers.0.self_attn.q_proj.weight"].kind == "muon"


@pytest.mark.parametrize(
    "preset, expected",
    [
        # docs/references.md#muon-and-per-head-muon (torchtitan's split for K3): 96 blocks each
        (
            "kimi-k3",
            {
                "q_proj": (96, (128, 7168)),
                "k_proj": (96, (128, 7168)),
                "v_proj": (96, (128, 7168)),
                "q_b_proj": (96, (192, 1536)),
                "kv_b_proj": (96, (256, 512)),
            },
        ),
        # Kimi-Linear-48B: q_lora_rank None, so MLA uses a plain q_proj (blocks of qk_nope + qk_rope = 192)
        (
            "kimi-linear-48b",
            {
                "q_proj": {(32, (128, 2304)), (32, (192, 2304))},
                "k_proj": (32, (128, 2304)),
                "v_proj": (32, (128, 2304)),
                "kv_b_proj": (32, (256, 512)),
            },
        ),
    ],
)
def test_per_head_blocks_of_official_configs(preset, expected):
    model = openk3.build_model(openk3.get_preset(preset), device="meta")
    found: dict[str, set] = {}
    for r in partition_parameters(model):
        if r.kind == "muon_per_head":
            found.setdefault(r.name.split(".")[-2], set()).add((r.heads, r.matrix))
    assert found == {k: v if isinstance(v, set) else {v} for k, v in expected.items()}


def test_partition_table_rows(tiny_meta):
    rows = partition_table(tiny_meta).splitlines()[2:]
    collapsed = {re.sub(r"\.layers\.\d+\.", ".layers.*.", n) for n, _ in tiny_meta.named_parameters()}
    assert len(rows) == len(collapsed)  # in k3-tiny each collapsed name has one shape and one kind
    q_b = next(line for line in rows if ".q_b_proj." in line)
    assert "| 3,7 | 384×128 | muon_per_head | 4 × 96×128 | yes |" in q_b
    a_log = next(line for line in rows if line.startswith("| language_model.model.layers.*.self_attn.A_log "))
    assert "| 0,1,2,4,5,6 | 128 | adamw | — | no |" in a_log


# ------------------------------------------------------------------------------ on a small K3 model


@pytest.fixture()
def small_k3():
    """The smallest K3-shaped model (depth 4: 3 KDA + 1 MLA, LatentMoE, AttnRes), vocab 512, fp32."""
    return openk3.build_model(k3_shaped(4, vocab_size=512), seed=0)


def _random_grads(model: torch.nn.Module, seed: int) -> None:
    g = _gen(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-2


def test_state_dict_round_trip(small_k3):
    model = small_k3
    opt = build_optimizer(model, lr=1e-2, weight_decay=WD)
    for seed in (1, 2):
        _random_grads(model, seed)
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)  # weights_only load: the state dict holds only plain types and tensors
    resumed, fresh = copy.deepcopy(model), copy.deepcopy(model)
    resumed.load_state_dict(saved["model"])
    opt_resumed = build_optimizer(resumed, lr=1e-2, weight_decay=WD)
    opt_resumed.load_state_dict(saved["optim"])
    opt_fresh = build_optimizer(fresh, lr=1e-2, weight_decay=WD)
    for m, o in ((model, opt), (resumed, opt_resumed), (fresh, opt_fresh)):
        _random_grads(m, 3)
        o.step()
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(), strict=True))


def test_lambda_lr_scales_every_group(small_k3):
    opt = build_optimizer(small_k3, lr=1e-3, muon_lr=2e-2, adamw_lr=3e-3)
    base = {(g["kind"], g["heads"], g["weight_decay"]): g["lr"] for g in opt.param_groups}
    assert {k[0]: v for k, v in base.items()} == {"muon": 2e-2, "muon_per_head": 2e-2, "adamw": 3e-3}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    _random_grads(small_k3, 4)
    opt.step()
    sched.step()
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(0.5 * base[(g["kind"], g["heads"], g["weight_decay"])])


def test_training_steps_reduce_loss(small_k3):
    model = small_k3
    ids = torch.randint(0, 512, (2, 17), generator=_gen(5))
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    opt = build_optimizer(model, lr=3e-3)
    losses = []
    for _ in range(5):
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(512), abs=0.5)  # near-uniform start
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < losses[0] - 1.0, losses
    for n, b in model.named_buffers():
        if n in biases:
            assert torch.equal(b, biases[n]), f"{n} changed: no optimizer may touch it"
