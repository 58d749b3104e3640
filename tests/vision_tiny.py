"""A tiny MoonViT-V2 config and a tiny K3 model config with it, shared by the vision tests."""

from __future__ import annotations

from openk3.config import KimiK3Config
from openk3.presets import k3_shaped

PLACEHOLDER = 8000
"""The media placeholder token id of :func:`tiny_config` (inside k3_shaped(4)'s 8192-token vocabulary)."""
TINY_VISION = dict(
    vt_hidden_size=32,
    vt_intermediate_size=64,
    vt_num_attention_heads=2,
    qkv_hidden_size=32,
    vt_num_hidden_layers=2,
    init_pos_emb_height=8,
    init_pos_emb_width=8,
)
"""A 2-block tower of width 32 with 2 heads of 16 and an 8 × 8 position table."""


def tiny_config(
    vision: bool = True, vocab_size: int | None = None, placeholder: int = PLACEHOLDER
) -> KimiK3Config:
    """k3_shaped(4) (width 128) with :data:`TINY_VISION` (or without a tower) and placeholder id
    ``placeholder``."""
    data = k3_shaped(4, vocab_size=vocab_size).to_dict()
    data["media_placeholder_token_id"] = placeholder
    data["vision_config"] = TINY_VISION if vision else None
    return KimiK3Config.from_dict(data)
