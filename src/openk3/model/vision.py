"""MoonViT-V2, K3's vision tower, and the ``patchmergerv2`` projector into the text width.

An image is a grid of ``h × w`` patches of ``P × P`` pixels (P = 14); a video chunk is ``t ≤ 4`` such
frames. Every medium of a batch is packed into one stream of patches, ``L = Σ t·h·w`` rows, with no padding:
attention stays inside each medium (its ``cu_seqlens`` segment, FlashAttention's convention).

Flow (``docs/vision.md``, ``docs/references.md#moonvit-v2``):

1. ``patch_embed``: a bias-free ``P × P`` convolution per patch, plus the *divided fixed* position embedding:
   the learned ``64 × 64 × D`` table resized (bilinear, ``align_corners=False``) to the medium's ``h × w``
   grid, plus, for a video of ``t > 1`` frames, the fixed 1-D sincos time table's row ``τ`` on frame ``τ``.
2. ``encoder``: 27 pre-norm blocks ``x += wo(attn(RoPE₂(wqkv(RMSNorm(x)))))``,
   ``x += fc1(gelu_tanh(fc0(RMSNorm(x))))`` with 12 heads of 128 and no biases, then ``final_layernorm``.
   2-D RoPE rotates channel pair ``2i`` by ``column · θ_i`` and pair ``2i + 1`` by ``row · θ_i``,
   ``θ_i = 10000^(−4i/K)``, the same for every frame of a video (MoonViT, Kimi-VL).
3. ``sd2_tpool`` merge: the mean over a medium's frames, then each ``2 × 2`` block of patches concatenated
   (row-major) into one ``4·D`` vector.
4. ``mm_projector``: ``RMSNorm(W₂ · gelu(W₁ · m))``, ``4·D → 4·D → hidden_size``, no biases.

A medium therefore gives ``(h/2)·(w/2)`` text embeddings, placed at as many ``media_placeholder_token_id``
tokens of the text (:func:`place_media`).

Legend: ``L`` packed patches, ``N`` media, ``D`` tower width (1024), ``A`` heads, ``K`` head size, ``C``
channels (3), ``P`` patch size, ``M`` merged tokens, ``E`` text width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openk3.config import KimiK3VisionConfig
from openk3.model.norm import RMSNorm

VISION_NORM_EPS = 1e-5
"""Epsilon of the tower's RMSNorms (``norm0``, ``norm1``, ``final_layernorm``)."""
MAX_GRID_SIDE = 256
"""Most patches per image side: 256 × 14 = 3584 pixels, the largest image MoonViT-V2 takes."""
ROPE_THETA = 10000.0


def grid_list(grid_thws) -> list[tuple[int, int, int]]:
    """``grid_thws`` (int ``[N, 3]`` tensor or a list of ``(t, h, w)``) as a host list of int triples."""
    if isinstance(grid_thws, torch.Tensor):
        if grid_thws.dim() != 2 or grid_thws.shape[1] != 3 or grid_thws.is_floating_point():
            raise ValueError(
                f"grid_thws must be an int [N, 3] tensor of (t, h, w), got {tuple(grid_thws.shape)}"
            )
        grid_thws = grid_thws.tolist()
    return [tuple(int(v) for v in g) for g in grid_thws]


def check_media(
    config: KimiK3VisionConfig, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
) -> None:
    """Raise ``ValueError`` naming the medium and the problem unless every ``(t, h, w)`` is a grid the tower
    takes (``1 ≤ t ≤ init_pos_emb_time``; ``h``, ``w`` multiples of the merge kernel and at most
    :data:`MAX_GRID_SIDE`) and ``pixel_values`` is ``[Σ t·h·w, C, P, P]``."""
    P = config.patch_size
    kh, kw = config.merge_kernel_size
    if not grids:
        raise ValueError("grid_thws is empty: pass at least one image or video, or neither argument")
    for i, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1:
            raise ValueError(f"medium {i} has grid (t, h, w) = {(t, h, w)}: every entry must be >= 1")
        if max(h, w) > MAX_GRID_SIDE:
            side = MAX_GRID_SIDE * P
            raise ValueError(
                f"medium {i} is too large: {h}×{w} patches ({h * P}×{w * P} pixels); MoonViT-V2 takes at most "
                f"{MAX_GRID_SIDE}×{MAX_GRID_SIDE} patches ({side}×{side} pixels): resize it"
            )
        if h % kh or w % kw:
            raise ValueError(
                f"medium {i} has a {h}×{w} patch grid: both sides must be multiples of {kh}×{kw}"
            )
        if t > config.init_pos_emb_time:
            raise ValueError(
                f"medium {i} has {t} frames; a video chunk holds at most init_pos_emb_time="
                f"{config.init_pos_emb_time}: split the video into chunks"
            )
    L = sum(t * h * w for t, h, w in grids)
    want = (L, 3, P, P)
    if not isinstance(pixel_values, torch.Tensor) or tuple(pixel_values.shape) != want:
        raise ValueError(
            f"pixel_values must be [{L}, 3, {P}, {P}] (the patches of grid_thws, packed), "
            f"got {tuple(getattr(pixel_values, 'shape', ()))}"
        )


def sincos_table(length: int, dim: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Fixed 1-D sincos table ``[length, dim]``: row τ is ``[sin(τ·ω), cos(τ·ω)]``, ``ω_i = 10000^(−i/(dim/2))``."""
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 2, dtype=torch.float64, device=device) / (dim / 2))
    angle = torch.arange(length, dtype=torch.float64, device=device)[:, None] * omega[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=1).to(dtype)


class PositionEmbedding2D(nn.Module):
    """The learned 2-D table ``weight`` ``[H₀, W₀, D]`` (official ``patch_embed.pos_emb.weight``) and the fixed
    time table (computed, not stored: the checkpoint has none)."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(config.init_pos_emb_height, config.init_pos_emb_width, config.vt_hidden_size)
        )
        self.mode = config.pos_emb_interpolation_mode
        self.frames = config.init_pos_emb_time

    def spatial(self, h: int, w: int) -> torch.Tensor:
        """The table resized to an ``h × w`` grid, ``[h·w, D]`` row-major (at ``H₀ × W₀`` it is the table)."""
        table = self.weight.permute(2, 0, 1).unsqueeze(0)
        table = table.float() if table.dtype != torch.float64 else table
        resized = F.interpolate(table, size=(h, w), mode=self.mode, align_corners=False)
        return resized[0].permute(1, 2, 0).reshape(h * w, -1).to(self.weight.dtype)

    def forward(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Position embeddings of the packed stream, ``[L, D]``."""
        D = self.weight.shape[-1]
        time_TD = sincos_table(self.frames, D, self.weight.dtype, self.weight.device)
        parts = []
        for t, h, w in grids:
            pos_SD = self.spatial(h, w)
            if t == 1:  # an image takes no time row
                parts.append(pos_SD)
            else:
                parts.append((pos_SD.unsqueeze(0) + time_TD[:t, None, :]).reshape(t * h * w, D))
        return torch.cat(parts)


class PatchEmbed(nn.Module):
    """``proj`` (bias-free ``P × P`` convolution ``C → D``) plus ``pos_emb``: ``[L, C, P, P] → [L, D]``."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        P = config.patch_size
        self.proj = nn.Conv2d(3, config.vt_hidden_size, kernel_size=P, stride=P, bias=False)
        self.pos_emb = PositionEmbedding2D(config)

    def forward(self, pixels_LCPP: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x_LD = self.proj(pixels_LCPP.to(self.proj.weight.dtype)).flatten(1)
        return x_LD + self.pos_emb(grids)


def rope_2d_angles(grids: list[tuple[int, int, int]], head_dim: int, device=None) -> torch.Tensor:
    """Rotation angles ``[L, K/2]`` (fp64) of the packed stream: pair ``2i`` turns by ``column·θ_i``, pair
    ``2i + 1`` by ``row·θ_i``, ``θ_i = 10000^(−4i/K)``; each frame of a video repeats its image's angles."""
    theta = ROPE_THETA ** (-torch.arange(0, head_dim, 4, dtype=torch.float64, device=device) / head_dim)
    parts = []
    for t, h, w in grids:
        rows = torch.arange(h, dtype=torch.float64, device=device).repeat_interleave(w)
        cols = torch.arange(w, dtype=torch.float64, device=device).repeat(h)
        frame = torch.stack([cols[:, None] * theta, rows[:, None] * theta], dim=-1).flatten(1)
        parts.append(frame.repeat(t, 1))
    return torch.cat(parts)


def apply_rope(x_LAK: torch.Tensor, angles_LK2: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs ``(x_{2j}, x_{2j+1})`` of every head by ``angles[:, j]`` (fp32 or fp64)."""
    L, A, K = x_LAK.shape
    x = x_LAK.float() if x_LAK.dtype != torch.float64 else x_LAK
    pairs = x.reshape(L, A, K // 2, 2)
    cos = angles_LK2.cos().to(x.dtype)[:, None, :]
    sin = angles_LK2.sin().to(x.dtype)[:, None, :]
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.reshape(L, A, K).to(x_LAK.dtype)


class VisionMLP(nn.Module):
    """``mlp2``: ``fc1(gelu_tanh(fc0(x)))``, ``D → F → D``, no biases."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(config.vt_hidden_size, config.vt_intermediate_size, bias=False)
        self.fc1 = nn.Linear(config.vt_intermediate_size, config.vt_hidden_size, bias=False)

    def forward(self, x_LD: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x_LD), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm encoder block: 2-D-RoPE attention within each medium, then the MLP (names ``norm0``,
    ``wqkv`` ``[3·A·K, D]`` (q, k, v stacked), ``wo``, ``norm1``, ``mlp.fc0``, ``mlp.fc1``)."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.vt_num_attention_heads
        self.head_dim = config.head_dim
        D = config.vt_hidden_size
        self.norm0 = RMSNorm(D, VISION_NORM_EPS)
        self.wqkv = nn.Linear(D, 3 * config.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(config.qkv_hidden_size, D, bias=False)
        self.norm1 = RMSNorm(D, VISION_NORM_EPS)
        self.mlp = VisionMLP(config)

    def attention(self, x_LD: torch.Tensor, angles_LK2: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        L = x_LD.shape[0]
        q_LAK, k_LAK, v_LAK = self.wqkv(x_LD).view(L, 3, self.num_heads, self.head_dim).unbind(1)
        q_ALK = apply_rope(q_LAK, angles_LK2).transpose(0, 1)
        k_ALK = apply_rope(k_LAK, angles_LK2).transpose(0, 1)
        v_ALK = v_LAK.transpose(0, 1)
        out_ALK = torch.cat(
            [
                F.scaled_dot_product_attention(q_ALK[:, s:e], k_ALK[:, s:e], v_ALK[:, s:e])
                for s, e in zip(bounds[:-1], bounds[1:])
            ],
            dim=1,
        )
        return self.wo(out_ALK.transpose(0, 1).reshape(L, -1))

    def forward(self, x_LD: torch.Tensor, angles_LK2: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        x_LD = x_LD + self.attention(self.norm0(x_LD), angles_LK2, bounds)
        return x_LD + self.mlp(self.norm1(x_LD))


class VisionEncoder(nn.Module):
    """``blocks`` (27 in K3) and ``final_layernorm``."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(config.vt_hidden_size, VISION_NORM_EPS)

    def forward(self, x_LD: torch.Tensor, grids: list[tuple[int, int, int]], head_dim: int) -> torch.Tensor:
        angles_LK2 = rope_2d_angles(grids, head_dim, x_LD.device)
        bounds = [0]
        for t, h, w in grids:
            bounds.append(bounds[-1] + t * h * w)  # cu_seqlens of the packed media
        for block in self.blocks:
            x_LD = block(x_LD, angles_LK2, bounds)
        return self.final_layernorm(x_LD)


class MoonViT(nn.Module):
    """The vision tower (official prefix ``vision_tower.``): packed patches → encoded patches ``[L, D]``."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.encoder = VisionEncoder(config)

    def forward(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        """``pixel_values`` ``[L, 3, P, P]`` (the media's patches in row-major order, frame by frame, media one
        after another), ``grid_thws`` ``[N, 3]`` ``(t, h, w)`` per medium → ``[L, D]`` in the tower's dtype.

        Raises ``ValueError`` naming the medium for a grid the tower does not take (:func:`check_media`)."""
        grids = grid_list(grid_thws)
        check_media(self.config, pixel_values, grids)
        return self.encoder(self.patch_embed(pixel_values, grids), grids, self.config.head_dim)


def merge_patches(x_LD: torch.Tensor, grid_thws, merge_kernel_size) -> torch.Tensor:
    """``sd2_tpool``: per medium, the mean over its ``t`` frames, then each ``kh × kw`` block of patches
    concatenated row-major: ``[L, D] → [M, kh·kw·D]`` with ``M = Σ (h/kh)·(w/kw)``, media in order."""
    kh, kw = merge_kernel_size
    D = x_LD.shape[-1]
    out, start = [], 0
    for t, h, w in grid_list(grid_thws):
        x = x_LD[start : start + t * h * w].view(t, h // kh, kh, w // kw, kw, D).mean(0)
        out.append(x.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw * D))
        start += t * h * w
    return torch.cat(out)


class PatchMergerProjector(nn.Module):
    """``patchmergerv2`` (official prefix ``mm_projector.``): ``post_norm(proj.2(gelu(proj.0(m))))``,
    ``[M, kh·kw·D] → [M, E]``, no biases."""

    def __init__(self, config: KimiK3VisionConfig) -> None:
        super().__init__()
        merged = config.merged_size
        self.proj = nn.Sequential(
            nn.Linear(merged, merged, bias=False),
            nn.GELU(),
            nn.Linear(merged, config.text_hidden_size, bias=False),
        )
        self.post_norm = RMSNorm(config.text_hidden_size, config.projector_ln_eps)

    def forward(self, merged_MX: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(merged_MX))


def media_token_count(config: KimiK3VisionConfig, grid_thw) -> int:
    """Text tokens one medium of grid ``(t, h, w)`` becomes: ``(h/kh)·(w/kw)`` (frames are pooled)."""
    _, h, w = grid_thw
    kh, kw = config.merge_kernel_size
    return (h // kh) * (w // kw)


def place_media(
    input_ids_BT: torch.Tensor, embeds_BTE: torch.Tensor, media_ME: torch.Tensor, placeholder_id: int
) -> torch.Tensor:
    """Text embeddings with the ``placeholder_id`` positions replaced, in reading order, by the ``M`` media
    embeddings (a new tensor; ``embeds_BTE`` is not changed).

    Raises ``ValueError`` when the number of placeholder tokens differs from ``M``."""
    mask_BT = input_ids_BT == placeholder_id
    found = int(mask_BT.sum())
    if found != media_ME.shape[0]:
        raise ValueError(
            f"input_ids hold {found} media placeholder tokens (id {placeholder_id}) but the media give "
            f"{media_ME.shape[0]} embeddings: each image of an h×w patch grid needs (h/2)·(w/2) placeholders"
        )
    return embeds_BTE.masked_scatter(mask_BT.unsqueeze(-1), media_ME.to(embeds_BTE.dtype))


def image_side_limit(config: KimiK3VisionConfig) -> int:
    """Largest image side in pixels: :data:`MAX_GRID_SIDE` patches."""
    return MAX_GRID_SIDE * config.patch_size
