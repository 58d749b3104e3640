"""Parameter and cache accounting, from the real module tree on the meta device.

Counts include persistent buffers (the router's ``e_score_correction_bias``), as the published count does
(``docs/references.md#parameter-counts``). *Active* parameters are every parameter except the input embedding
(a
lookup) and the routed experts a token does not use: ``total − embed − (E − k)·expert·(MoE layers)``.

Cache sizes per request (``docs/references.md#caches``, ``docs/references.md#parameter-counts``):

* KDA: recurrent state ``H·K·V`` plus three conv caches ``P·(W−1)`` per KDA layer; ``bf16`` counts both in
  bf16, ``fp32`` counts the recurrent state in fp32 and the conv caches in bf16 (the serving layout).
* MLA: ``kv_lora_rank + qk_rope_head_dim`` numbers per token per MLA layer, in bf16.
* Crossover: the length below which the hybrid holds more cache bytes (bf16) than an all-MLA model of the
  same depth: ``kda_bytes / ((L − L_mla) · mla_bytes_per_token_per_layer)``.

Checkpoint size (:func:`checkpoint_bytes`), in the official dtypes: fp32 for the tensors the release stores in
F32 (:data:`~openk3.model.modeling.FP32_TENSORS`), bf16 for the rest, and, in the MXFP4 layout, 4.25 bits per
routed-expert weight (half a byte of E2M1 code plus one E8M0 byte per 32 numbers; ``docs/quantization.md``).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from torch import nn

from openk3.checkpoint.names import is_stacked
from openk3.config import AnyConfig, KimiLinearConfig, text_config_of
from openk3.model.modeling import FP32_TENSORS, build_model
from openk3.quant.mxfp4 import MXFP4_BYTES_PER_NUMBER

BF16, FP32 = 2, 4


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters()) + sum(
        b.numel() for name, b in module.named_buffers() if name.endswith("e_score_correction_bias")
    )


def count_parameters(config: AnyConfig) -> dict[str, int]:
    """Per-component counts from a meta-device build. Keys are described in :func:`accounting_report`."""
    text = text_config_of(config)
    model = build_model(config, device="meta")
    lm = getattr(model, "language_model", model)
    out: dict[str, int] = OrderedDict()
    out["embed_tokens"] = _numel(lm.model.embed_tokens)
    out["lm_head"] = _numel(lm.lm_head)
    kda = mla = dense = moe = norms = experts = 0
    kda_layer = mla_layer = moe_layer = expert_one = 0
    for layer in lm.model.layers:
        attn = _numel(layer.self_attn)
        if layer.is_kda:
            kda += attn
            kda_layer = attn
        else:
            mla += attn
            mla_layer = attn
        if hasattr(layer, "mlp"):
            dense += _numel(layer.mlp)
        else:
            block = layer.block_sparse_moe
            moe += _numel(block)
            moe_layer = _numel(block)
            experts += _numel(block.experts)
            expert_one = _numel(block.experts) // text.num_experts
        norms += sum(
            _numel(m)
            for name, m in layer.named_children()
            if name.endswith(("layernorm", "_res_norm", "_res_proj"))
        )
    final = sum(
        _numel(m)
        for name, m in lm.model.named_children()
        if name == "norm" or name.startswith("output_attn_res")
    )
    out.update(
        kda_attention=kda,
        mla_attention=mla,
        dense_ffn=dense,
        moe=moe,
        routed_experts=experts,
        layer_norms_and_attn_res=norms,
        final_norm_and_attn_res=final,
    )
    out["total"] = sum(_numel(m) for m in (lm,))
    n_moe = sum(1 for layer in lm.model.layers if not hasattr(layer, "mlp"))
    unused = (text.num_experts - text.num_experts_per_token) * expert_one * n_moe if n_moe else 0
    out["active"] = out["total"] - out["embed_tokens"] - unused
    out.update(kda_layer=kda_layer, mla_layer=mla_layer, moe_layer=moe_layer, routed_expert=expert_one)
    if hasattr(model, "vision_tower"):  # not in ``total``: the published headline count is text-only
        out["vision_tower"] = _numel(model.vision_tower)
        out["mm_projector"] = _numel(model.mm_projector)
        out["total_with_vision"] = out["total"] + out["vision_tower"] + out["mm_projector"]
    return out


def closed_form_counts(text: KimiLinearConfig) -> dict[str, int]:
    """The same counts from the closed-form formulas of ``docs/references.md#parameter-counts`` (an
    independent check of the module tree)."""
    D, V = text.hidden_size, text.vocab_size
    la = text.linear_attn_config
    counts = {"embed_tokens": V * D, "lm_head": V * D}
    kda_layer = mla_layer = 0
    if la is not None:
        H, K, W = la.num_heads, la.head_dim, la.short_conv_kernel_size
        P = H * K
        gate = D * P if la.use_full_rank_gate else D * K + K * P
        kda_layer = 3 * D * P + 3 * P * W + D * K + K * P + max(H, 128) + P + D * H + gate + K + P * D
    H, n, r, v, C = (
        text.num_attention_heads,
        text.qk_nope_head_dim,
        text.qk_rope_head_dim,
        text.v_head_dim,
        text.kv_lora_rank,
    )
    q = (
        D * H * (n + r)
        if text.q_lora_rank is None
        else (D * text.q_lora_rank + text.q_lora_rank + text.q_lora_rank * H * (n + r))
    )
    mla_layer = q + D * (C + r) + C + C * H * (n + v) + H * v * D
    mla_layer += D * H * v if text.mla_use_output_gate else 0
    E, k, F = text.num_experts or 0, text.num_experts_per_token, text.moe_intermediate_size
    L = text.expert_input_size
    expert = 3 * L * F
    fixed = E * D + E + 3 * D * F * text.num_shared_experts
    if text.is_latent_moe:
        fixed += 2 * D * L + (L if text.latent_moe_use_norm else 0)
    moe_layer = fixed + E * expert
    if not E:  # no MoE layers at all
        expert = moe_layer = 0
    kinds = text.layer_types
    n_kda = kinds.count("kda")
    n_mla = len(kinds) - n_kda
    n_moe = sum(text.is_moe_layer(i) for i in range(text.num_hidden_layers))
    n_dense = text.num_hidden_layers - n_moe
    per_layer_norms = (6 if text.uses_attn_res else 2) * D
    final = (3 if text.uses_attn_res else 1) * D
    total = (
        counts["embed_tokens"]
        + counts["lm_head"]
        + n_kda * kda_layer
        + n_mla * mla_layer
        + n_moe * moe_layer
        + n_dense * 3 * D * text.intermediate_size
        + text.num_hidden_layers * per_layer_norms
        + final
    )
    counts.update(
        kda_layer=kda_layer,
        mla_layer=mla_layer,
        moe_layer=moe_layer,
        routed_expert=expert,
        total=total,
        active=total - counts["embed_tokens"] - n_moe * (E - k) * expert,
    )
    return counts


def cache_sizes(text: KimiLinearConfig) -> dict[str, float]:
    """Per-request cache bytes (see module docstring)."""
    kinds = text.layer_types
    n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
    la = text.linear_attn_config
    state = conv = 0
    if la is not None:
        state = la.num_heads * la.head_dim * la.head_dim
        conv = 3 * la.num_heads * la.head_dim * (la.short_conv_kernel_size - 1)
    kda_bf16 = n_kda * (state + conv) * BF16
    kda_fp32 = n_kda * (state * FP32 + conv * BF16)
    mla_layer_token = (text.kv_lora_rank + text.qk_rope_head_dim) * BF16
    crossover = kda_bf16 / ((n_kda) * mla_layer_token) if n_kda else 0.0
    return {
        "kda_layers": n_kda,
        "mla_layers": n_mla,
        "kda_state_bytes_bf16": kda_bf16,
        "kda_state_bytes_fp32": kda_fp32,
        "mla_numbers_per_token_per_layer": text.kv_lora_rank + text.qk_rope_head_dim,
        "mla_bytes_per_token_bf16": n_mla * mla_layer_token,
        "crossover_tokens_vs_all_mla": math.ceil(crossover) if n_kda else 0,
    }


def checkpoint_bytes(config: AnyConfig) -> dict[str, int]:
    """Bytes of the model's tensors in a checkpoint: ``bf16`` (all weights in bf16 apart from
    :data:`FP32_TENSORS`) and ``mxfp4`` (the same with routed experts in MXFP4), from a meta-device build."""
    model = build_model(config, device="meta")
    dense = experts = 0
    for name, t in model.state_dict().items():
        if is_stacked(name):
            experts += t.numel()
        else:
            dense += t.numel() * (FP32 if name.endswith(FP32_TENSORS) else BF16)
    return {"bf16": dense + experts * BF16, "mxfp4": dense + math.ceil(experts * MXFP4_BYTES_PER_NUMBER)}


def accounting_report(config: AnyConfig) -> dict:
    """Everything ``openk3 info`` prints, as one JSON-ready dict (keys ``total_params``, ``active_params``,
    ``total_with_vision_params`` (``total_params`` plus the vision tower and projector, if any),
    ``kda_state_bytes_bf16``, ``mla_bytes_per_token_bf16``, ``components``, …)."""
    text = text_config_of(config)
    counts = count_parameters(config)
    caches = cache_sizes(text)
    return {
        "model_type": config.model_type,
        "total_params": counts["total"],
        "active_params": counts["active"],
        "total_with_vision_params": counts.get("total_with_vision", counts["total"]),
        "components": {k: v for k, v in counts.items() if k not in ("total", "active", "total_with_vision")},
        **caches,
        **{f"checkpoint_bytes_{k}": v for k, v in checkpoint_bytes(config).items()},
    }
