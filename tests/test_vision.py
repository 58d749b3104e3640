"""MoonViT-V2 (``openk3.model.vision``): counts, packing, position embeddings, merge, bad inputs.

Expected values come from the published counts (``docs/references.md#moonvit-v2``), a plain per-medium
fp64 reference of the tower written here with complex-number rotations and an explicit softmax, and
closed-form facts of bilinear resizing and sincos tables."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from openk3.accounting import count_parameters
from openk3.cli import main
from openk3.config import KimiK3VisionConfig
from openk3.model.init import init_weights
from openk3.model.vision import (
    MAX_GRID_SIDE,
    MoonViT,
    PatchMergerProjector,
    merge_patches,
    rope_2d_angles,
    sincos_table,
)
from openk3.presets import get_preset
from vision_tiny import TINY_VISION

TINY = {**TINY_VISION, "text_hidden_size": 48}
STD = SimpleNamespace(initializer_range=0.2)
"""What :func:`init_weights` reads from a config."""


def tiny_tower(seed: int = 0) -> MoonViT:
    cfg = KimiK3VisionConfig(**TINY)
    tower = MoonViT(cfg).double()
    init_weights(tower, STD, seed)
    with torch.no_grad():  # norms away from 1 so that a missing gain would show
        for name, p in tower.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
    return tower


def media(grids, seed=1):
    g = torch.Generator().manual_seed(seed)
    L = sum(t * h * w for t, h, w in grids)
    return torch.randn(L, 3, 14, 14, generator=g, dtype=torch.float64)


# ---- counts --------------------------------------------------------------------------------------------
def test_kimi_k3_vision_counts_are_exact():
    counts = count_parameters(get_preset("kimi-k3"))
    assert counts["vision_tower"] == 401_214_464
    assert counts["mm_projector"] == 46_144_512
    assert counts["total"] == 2_779_484_478_208  # the headline count stays text-only
    assert counts["total_with_vision"] == 2_779_484_478_208 + 401_214_464 + 46_144_512
    assert round(counts["total_with_vision"] / 1e12, 4) == 2.7799


def test_info_prints_the_vision_total(capsys):
    assert main(["info", "--preset", "kimi-k3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total_with_vision_params"] == 2_779_931_837_184
    assert report["components"]["vision_tower"] == 401_214_464
    assert main(["info", "--preset", "kimi-k3"]) == 0
    assert "total with vision                 2,779,931,837,184" in capsys.readouterr().out


def test_official_tensor_names_and_shapes():
    cfg = KimiK3VisionConfig(text_hidden_size=7168)
    with torch.device("meta"):
        tower, proj = MoonViT(cfg), PatchMergerProjector(cfg)
    shapes = {f"vision_tower.{k}": tuple(v.shape) for k, v in tower.state_dict().items()}
    shapes |= {f"mm_projector.{k}": tuple(v.shape) for k, v in proj.state_dict().items()}
    assert shapes["vision_tower.patch_embed.proj.weight"] == (1024, 3, 14, 14)
    assert shapes["vision_tower.patch_embed.pos_emb.weight"] == (64, 64, 1024)
    assert shapes["vision_tower.encoder.blocks.26.wqkv.weight"] == (3 * 1536, 1024)
    assert shapes["vision_tower.encoder.blocks.26.wo.weight"] == (1024, 1536)
    assert shapes["vision_tower.encoder.blocks.0.mlp.fc0.weight"] == (4096, 1024)
    assert shapes["vision_tower.encoder.blocks.0.mlp.fc1.weight"] == (1024, 4096)
    assert shapes["vision_tower.encoder.blocks.0.norm0.weight"] == (1024,)
    assert shapes["vision_tower.encoder.blocks.0.norm1.weight"] == (1024,)
    assert shapes["vision_tower.encoder.final_layernorm.weight"] == (1024,)
    assert shapes["mm_projector.proj.0.weight"] == (4096, 4096)
    assert shapes["mm_projector.proj.2.weight"] == (7168, 4096)
    assert shapes["mm_projector.post_norm.weight"] == (7168,)
    assert len(shapes) == 3 + 27 * 6 + 3


# ---- an independent fp64 reference of the tower ----------------------------------------------------------
def reference_tower(tower: MoonViT, pixels, t, h, w):
    """One medium through the tower with plain loops: complex rotations, explicit softmax."""
    cfg = tower.config
    D, A = cfg.vt_hidden_size, cfg.vt_num_attention_heads
    K = cfg.qkv_hidden_size // A
    x = pixels.reshape(t * h * w, -1) @ tower.patch_embed.proj.weight.reshape(D, -1).T
    table = tower.patch_embed.pos_emb.weight.permute(2, 0, 1)[None]
    pos = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=False)[0].permute(1, 2, 0)
    pos = pos.reshape(h * w, D).repeat(t, 1)
    if t > 1:
        for tau in range(t):
            for i in range(D // 2):
                omega = 10000.0 ** (-i / (D / 2))
                pos[tau * h * w : (tau + 1) * h * w, i] += math.sin(tau * omega)
                pos[tau * h * w : (tau + 1) * h * w, D // 2 + i] += math.cos(tau * omega)
    x = x + pos
    # rotation factors: pair 2i by column·θ_i, pair 2i+1 by row·θ_i
    rot = torch.empty(t * h * w, K // 2, dtype=torch.complex128)
    for n in range(t * h * w):
        row, col = (n % (h * w)) // w, n % w
        for i in range(K // 4):
            theta = 10000.0 ** (-4 * i / K)
            rot[n, 2 * i] = complex(math.cos(col * theta), math.sin(col * theta))
            rot[n, 2 * i + 1] = complex(math.cos(row * theta), math.sin(row * theta))

    def rms(v, weight):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-5) * weight

    for blk in tower.encoder.blocks:
        qkv = rms(x, blk.norm0.weight) @ blk.wqkv.weight.T
        q, k, v = qkv.view(-1, 3, A, K).unbind(1)
        q = torch.view_as_real(torch.view_as_complex(q.reshape(-1, A, K // 2, 2).contiguous()) * rot[:, None])
        k = torch.view_as_real(torch.view_as_complex(k.reshape(-1, A, K // 2, 2).contiguous()) * rot[:, None])
        q, k = q.reshape(-1, A, K), k.reshape(-1, A, K)
        scores = torch.einsum("nak,mak->anm", q, k) / math.sqrt(K)
        o = torch.einsum("anm,mak->nak", scores.softmax(-1), v).reshape(-1, A * K)
        x = x + o @ blk.wo.weight.T
        hdn = rms(x, blk.norm1.weight) @ blk.mlp.fc0.weight.T
        hdn = 0.5 * hdn * (1 + torch.tanh(math.sqrt(2 / math.pi) * (hdn + 0.044715 * hdn**3)))
        x = x + hdn @ blk.mlp.fc1.weight.T
    return rms(x, tower.encoder.final_layernorm.weight)


@pytest.mark.parametrize("grid", [(1, 4, 6), (3, 2, 4), (1, 10, 12)])
def test_tower_matches_the_plain_reference(grid):
    tower = tiny_tower()
    pixels = media([grid])
    with torch.no_grad():
        got = tower(pixels, torch.tensor([grid]))
        want = reference_tower(tower, pixels, *grid)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_patches_are_independent_of_packing():
    tower = tiny_tower()
    grids = [(1, 4, 6), (1, 2, 2), (3, 4, 4), (1, 16, 2)]
    pixels = [media([g], seed=i) for i, g in enumerate(grids)]
    with torch.no_grad():
        alone = [tower(p, torch.tensor([g])) for p, g in zip(pixels, grids)]
        for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
            packed = tower(torch.cat([pixels[i] for i in order]), torch.tensor([grids[i] for i in order]))
            parts = packed.split([math.prod(grids[i]) for i in order])
            for i, part in zip(order, parts):
                torch.testing.assert_close(part, alone[i], rtol=1e-12, atol=1e-12)


# ---- position embeddings -------------------------------------------------------------------------------
def test_interpolated_position_table_at_the_native_grid_is_the_stored_one():
    tower = tiny_tower()
    pe = tower.patch_embed.pos_emb
    assert torch.equal(pe.spatial(8, 8), pe.weight.reshape(64, -1))
    # halving the grid averages each 2×2 block (bilinear, align_corners=False, at scale 2)
    want = pe.weight.reshape(4, 2, 4, 2, -1).mean((1, 3)).reshape(16, -1)
    torch.testing.assert_close(pe.spatial(4, 4), want, rtol=1e-12, atol=1e-12)


def test_time_table_is_the_sincos_formula_and_images_take_none():
    table = sincos_table(4, 6, torch.float64)
    for tau in range(4):
        for i in range(3):
            assert table[tau, i].item() == pytest.approx(math.sin(tau / 10000 ** (i / 3)), abs=1e-15)
            assert table[tau, 3 + i].item() == pytest.approx(math.cos(tau / 10000 ** (i / 3)), abs=1e-15)
    pe = tiny_tower().patch_embed.pos_emb
    image, video = pe([(1, 2, 2)]), pe([(2, 2, 2)])
    assert torch.equal(image, pe.spatial(2, 2))
    assert torch.equal(video[:4], pe.spatial(2, 2) + sincos_table(4, 32, torch.float64)[0])
    assert torch.equal(video[4:], pe.spatial(2, 2) + sincos_table(4, 32, torch.float64)[1])


def test_rope_scores_depend_only_on_the_relative_offset():
    K = 16
    grid = [(1, 12, 12)]
    angles = rope_2d_angles(grid, K)
    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, 1, K, generator=g, dtype=torch.float64),
        torch.randn(1, 1, K, generator=g, dtype=torch.float64),
    )
    from openk3.model.vision import apply_rope

    def score(p, r):  # positions as flat indices into the 12×12 grid
        return (apply_rope(q, angles[p : p + 1]) * apply_rope(k, angles[r : r + 1])).sum().item()

    base = score(1 * 12 + 2, 4 * 12 + 7)
    assert score(6 * 12 + 3, 9 * 12 + 8) == pytest.approx(base, abs=1e-12)  # both shifted by (+5, +1)
    assert score(1 * 12 + 2, 4 * 12 + 8) != pytest.approx(base, abs=1e-6)


# ---- merge and projector -------------------------------------------------------------------------------
def test_merge_pools_frames_and_concatenates_two_by_two_blocks():
    t, h, w, D = 2, 2, 4, 3
    x = torch.randn(t * h * w, D, dtype=torch.float64)
    out = merge_patches(x, [(t, h, w)], [2, 2])
    grid = x.view(t, h, w, D)
    assert out.shape == (2, 4 * D)
    for m, (r0, c0) in enumerate([(0, 0), (0, 2)]):
        want = torch.cat([grid[:, r0 + dr, c0 + dc].mean(0) for dr in (0, 1) for dc in (0, 1)])
        torch.testing.assert_close(out[m], want, rtol=0, atol=1e-15)


def test_projector_is_norm_of_gelu_mlp():
    cfg = KimiK3VisionConfig(**TINY)
    proj = PatchMergerProjector(cfg).double()
    init_weights(proj, STD, 0)
    m = torch.randn(5, 128, dtype=torch.float64)
    h = m @ proj.proj[0].weight.T
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    h = h @ proj.proj[2].weight.T
    want = h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(proj(m), want, rtol=1e-12, atol=1e-12)


# ---- bad inputs ----------------------------------------------------------------------------------------
def test_too_large_image_is_rejected():
    tower = tiny_tower()
    side = MAX_GRID_SIDE + 2
    with pytest.raises(
        ValueError, match=r"medium 1 is too large: 258×2 patches \(3612×28 pixels\).*3584×3584"
    ):
        tower(
            torch.zeros(4 + side * 2, 3, 14, 14, dtype=torch.float64), torch.tensor([[1, 2, 2], [1, side, 2]])
        )
    assert MAX_GRID_SIDE * 14 == 3584


@pytest.mark.parametrize(
    "grid, pixels, match",
    [
        ((5, 2, 2), 20, "5 frames; a video chunk holds at most init_pos_emb_time=4"),
        ((1, 3, 2), 6, "multiples of 2×2"),
        ((1, 2, 2), 5, r"pixel_values must be \[4, 3, 14, 14\]"),
        ((1, 0, 2), 0, "every entry must be >= 1"),
    ],
)
def test_bad_media_name_the_problem(grid, pixels, match):
    tower = tiny_tower()
    with pytest.raises(ValueError, match=match):
        tower(torch.zeros(pixels, 3, 14, 14, dtype=torch.float64), torch.tensor([grid]))


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("merge_type", "sd2", "merge_type"),
        ("attn_bias", True, "no biases"),
        ("qkv_hidden_size", 36, "head size divisible by 4"),
        ("mm_hidden_size", 7, "vt_hidden_size"),
    ],
)
def test_vision_config_errors_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        KimiK3VisionConfig(**{**TINY, field: value})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tower_in_bf16_matches_fp64():
    """The tower on the GPU in bf16 (SDPA's fused kernels) against the fp64 CPU tower: packed images of
    several sizes, relative RMS error below 2%."""
    tower = tiny_tower()
    grids = [(1, 16, 12), (2, 8, 8), (1, 32, 32)]
    pixels = media(grids)
    with torch.no_grad():
        want = tower(pixels, torch.tensor(grids))
        gpu = copy.deepcopy(tower).to("cuda", torch.bfloat16)
        got = gpu(pixels.to("cuda", torch.bfloat16), torch.tensor(grids)).double().cpu()
    rel = ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt().item()
    print(f"bf16 vs fp64 relative RMS error {rel:.2e}")
    assert rel < 2e-2
