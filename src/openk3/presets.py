"""Presets: functions that return a config.

* ``kimi-k3`` — the published K3 ``config.json`` values (``docs/references.md#configuration``), with the
  MoonViT-V2 ``vision_config``.
* ``kimi-linear-48b`` — the published Kimi-Linear-48B-A3B values (``docs/references.md#configuration``).
* ``k3-tiny`` / ``k3-small`` / ``k3-1b`` — K3-shaped models behind one size dial, :func:`k3_shaped`
  (``depth``): 3 KDA : 1 MLA with MLA on every 4th layer (so the final layer is global), Block AttnRes,
  Stable LatentMoE with two shared experts, SiTU-GLU (β 4 / 25), gate lower bound −5, NoPE gated MLA.
* ``k3-vision-tiny`` — ``k3_shaped(4)`` with a two-block MoonViT-V2 (:func:`k3_vision`), for image-text runs.
"""

from __future__ import annotations

from collections.abc import Callable

from openk3.config import AnyConfig, KimiK3Config, KimiK3VisionConfig, KimiLinearConfig, LinearAttnConfig


def _layer_lists(num_layers: int, full_attn_layers: list[int]) -> dict[str, list[int]]:
    kda = [i for i in range(1, num_layers + 1) if i not in full_attn_layers]
    return dict(kda_layers=kda, full_attn_layers=full_attn_layers)


def kimi_k3() -> KimiK3Config:
    """The official Kimi K3 configuration (2,779,484,478,208 parameters, 104,189,614,848 active)."""
    full = list(range(4, 93, 4)) + [93]  # [4, 8, ..., 92, 93]: a double global tail
    text = KimiLinearConfig(
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=93,
        num_attention_heads=96,
        num_key_value_heads=96,
        intermediate_size=33792,
        hidden_act="situ",
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=1048576,
        tie_word_embeddings=False,
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_use_nope=True,
        mla_use_output_gate=True,
        num_experts=896,
        num_experts_per_token=16,
        num_shared_experts=2,
        moe_intermediate_size=3072,
        routed_expert_hidden_size=3584,
        latent_moe_use_norm=True,
        moe_renormalize=True,
        moe_router_activation_func="sigmoid",
        topk_method="noaux_tc",
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        attn_res_block_size=12,
        num_nextn_predict_layers=0,
        linear_attn_config=LinearAttnConfig(
            num_heads=96,
            head_dim=128,
            short_conv_kernel_size=4,
            use_full_rank_gate=True,
            gate_lower_bound=-5.0,
            **_layer_lists(93, full),
        ),
    )
    return KimiK3Config(text_config=text, vision_config=KimiK3VisionConfig())


def kimi_linear_48b() -> KimiLinearConfig:
    """The official Kimi-Linear-48B-A3B configuration (softplus gate, low-rank output gate, SwiGLU)."""
    full = [4, 8, 12, 16, 20, 24, 27]
    return KimiLinearConfig(
        vocab_size=163840,
        hidden_size=2304,
        num_hidden_layers=27,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=9216,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_use_nope=True,
        num_experts=256,
        num_experts_per_token=8,
        num_shared_experts=1,
        moe_intermediate_size=1024,
        moe_renormalize=True,
        moe_router_activation_func="sigmoid",
        routed_scaling_factor=2.446,
        first_k_dense_replace=1,
        bos_token_id=163584,
        eos_token_id=163585,
        linear_attn_config=LinearAttnConfig(
            num_heads=32, head_dim=128, short_conv_kernel_size=4, **_layer_lists(27, full)
        ),
    )


def k3_shaped(depth: int, vocab_size: int | None = None) -> KimiK3Config:
    """A K3-shaped model sized by one dial, ``depth`` (decoder layers, a multiple of 4, at least 4).

    Everything else follows from ``depth`` (width = 32·depth, head size 64, ``depth/4`` AttnRes blocks,
    ``4·depth`` experts with ``depth/4`` active, latent = width/2, expert width = width/2, dense FFN width
    11× the expert width as in K3). ``vocab_size`` defaults to 8192 below depth 16, else 32768.
    Raises ``ValueError`` for a depth that is not a positive multiple of 4.
    """
    if not isinstance(depth, int) or depth < 4 or depth % 4:
        raise ValueError(f"depth={depth!r} is invalid: use a multiple of 4 (8 → k3-tiny, 16 → k3-small)")
    width = 32 * depth
    head_dim = 64
    heads = width // head_dim
    expert_width = width // 2
    if vocab_size is None:
        vocab_size = 8192 if depth < 16 else 32768
    text = KimiLinearConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        num_hidden_layers=depth,
        num_attention_heads=heads,
        intermediate_size=11 * expert_width,
        hidden_act="situ",
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=65536,
        q_lora_rank=width // 2,
        kv_lora_rank=width // 4,
        qk_nope_head_dim=head_dim,
        qk_rope_head_dim=head_dim // 2,
        v_head_dim=head_dim,
        mla_use_nope=True,
        mla_use_output_gate=True,
        num_experts=4 * depth,
        num_experts_per_token=depth // 4,
        num_shared_experts=2,
        moe_intermediate_size=expert_width,
        routed_expert_hidden_size=width // 2,
        latent_moe_use_norm=True,
        moe_router_activation_func="sigmoid",
        topk_method="noaux_tc",
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        attn_res_block_size=max(1, depth // 4),
        linear_attn_config=LinearAttnConfig(
            num_heads=heads,
            head_dim=head_dim,
            short_conv_kernel_size=4,
            use_full_rank_gate=True,
            gate_lower_bound=-5.0,
            **_layer_lists(depth, list(range(4, depth + 1, 4))),
        ),
    )
    return KimiK3Config(
        text_config=text,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        media_placeholder_token_id=None,
    )


def k3_vision(depth: int) -> KimiK3Config:
    """:func:`k3_shaped` with a small MoonViT-V2 tower (width = the text width / 2, 2 blocks, heads of 32,
    a 16 × 16 position table) and the media placeholder at the last id of the vocabulary."""
    config = k3_shaped(depth)
    width = config.text_config.hidden_size // 2
    config.media_placeholder_token_id = config.text_config.vocab_size - 1
    config.vision_config = KimiK3VisionConfig(
        vt_hidden_size=width,
        vt_intermediate_size=4 * width,
        vt_num_attention_heads=width // 32,
        qkv_hidden_size=width,
        vt_num_hidden_layers=2,
        init_pos_emb_height=16,
        init_pos_emb_width=16,
    )
    config.__post_init__()
    return config


def dense_baseline(config: KimiK3Config) -> KimiLinearConfig:
    """A dense SwiGLU transformer with the same *active* parameters as ``config`` (an ablation baseline).

    Same width, depth, vocabulary and MLA shapes; every layer is (ungated) MLA with a dense SwiGLU FFN and
    plain residuals (no KDA, no AttnRes, no MoE). The FFN width is solved so that the active count
    (:mod:`openk3.accounting`) matches to within one FFN column per layer.
    """
    from openk3.accounting import closed_form_counts

    text = config.text_config
    data = text.to_dict()
    data.update(
        linear_attn_config=None,
        num_experts=None,
        attn_res_block_size=None,
        hidden_act="silu",
        activation_situ_beta=None,
        activation_situ_linear_beta=None,
        mla_use_output_gate=False,
        routed_expert_hidden_size=None,
        latent_moe_use_norm=False,
        first_k_dense_replace=0,
        intermediate_size=1,
    )
    base = closed_form_counts(KimiLinearConfig.from_dict(data))["active"]
    target = closed_form_counts(text)["active"]
    per_column = 3 * text.hidden_size * text.num_hidden_layers
    data["intermediate_size"] = max(1, 1 + round((target - base) / per_column))
    return KimiLinearConfig.from_dict(data)


PRESETS: dict[str, Callable[[], AnyConfig]] = {
    "kimi-k3": kimi_k3,
    "kimi-linear-48b": kimi_linear_48b,
    "k3-tiny": lambda: k3_shaped(8),
    "k3-small": lambda: k3_shaped(16),
    "k3-1b": lambda: k3_shaped(24),
    "k3-tiny-dense": lambda: dense_baseline(k3_shaped(8)),
    "k3-vision-tiny": lambda: k3_vision(4),
}


def get_preset(name: str) -> AnyConfig:
    """Config of preset ``name``; raises ``ValueError`` listing the presets for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
