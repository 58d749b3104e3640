"""Typed configuration for the Kimi-Linear / Kimi K3 model family.

Field names are the official ``config.json`` names (``docs/references.md#configuration``):

* :class:`KimiLinearConfig` — the text backbone, ``model_type = "kimi_linear"``. Kimi-Linear-48B uses it
  as is; Kimi K3 adds the SiTU, gated-MLA, latent-MoE and AttnRes fields (all optional).
* :class:`LinearAttnConfig` — the nested ``linear_attn_config`` dict (KDA heads and the 1-based layer lists).
* :class:`KimiK3VisionConfig` — the ``vision_config`` dict (MoonViT-V2 tower and patch-merger projector).
* :class:`KimiK3Config` — the top level, ``model_type = "kimi_k3"``, holding ``text_config`` and
  ``vision_config``.

Unknown keys read from a ``config.json`` are kept in ``extra`` and written back unchanged. Every
``__post_init__`` raises :class:`ValueError` naming the field and how to fix it. Presets live apart, in
:mod:`openk3.presets`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ACTS = ("silu", "situ")
MODEL_TYPES = ("kimi_k3", "kimi_linear")
"""The ``model_type`` values a ``config.json`` may hold (top level)."""
ESSENTIAL_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
"""Fields a ``kimi_linear`` dict must state: they fix the model's shape, so no default is assumed for them."""


def _fail(cls: str, name: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"{cls}.{name}={value!r} is invalid: {fix}")


def _check_int(cls: str, name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(cls, name, value, f"expected an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise _fail(cls, name, value, f"expected an int >= {minimum}")


def _check_opt_int(cls: str, name: str, value: Any, minimum: int = 1) -> None:
    if value is not None:
        _check_int(cls, name, value, minimum)


def _check_float(cls: str, name: str, value: Any, lo: float = -math.inf, hi: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(cls, name, value, f"expected a number, got {type(value).__name__}")
    if not (lo <= value <= hi) or math.isnan(value):
        raise _fail(cls, name, value, f"expected a number in [{lo}, {hi}]")


def _check_bools(obj: Any) -> None:
    """Raise ``ValueError`` for any ``bool`` field of dataclass ``obj`` that holds no JSON ``true``/``false``.

    A string such as ``"false"`` would otherwise be read as True (Python truthiness), and ``0``/``1`` as a
    number that only looks like a flag."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type == "bool" and not isinstance(value, bool):
            raise _fail(
                type(obj).__name__,
                f.name,
                value,
                f"expected true or false (a JSON boolean), got {type(value).__name__}",
            )


def _split_known(cls: type, data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    names = {f.name for f in dataclasses.fields(cls) if f.init and f.name != "extra"}
    known = {k: v for k, v in data.items() if k in names}
    extra = {k: v for k, v in data.items() if k not in names}
    return known, extra


def _to_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.name == "extra" or not f.init:
            continue
        value = getattr(obj, f.name)
        out[f.name] = value.to_dict() if hasattr(value, "to_dict") else value
    out.update(obj.extra)
    return out


@dataclass
class LinearAttnConfig:
    """``linear_attn_config``: which layers are KDA and how the KDA heads are shaped.

    Layer lists are **1-based**, as in the official config: layer ``i`` (0-based) is KDA iff ``i + 1`` is in
    ``kda_layers`` (``docs/references.md#configuration``).
    """

    kda_layers: list[int]
    """1-based indices of the Kimi Delta Attention layers."""
    full_attn_layers: list[int]
    """1-based indices of the (gated, NoPE) MLA layers; together with ``kda_layers`` they cover 1..L once."""
    num_heads: int
    """KDA heads H (K3: 96)."""
    head_dim: int
    """KDA head size d = K = V (K3: 128)."""
    short_conv_kernel_size: int = 4
    """Kernel of the causal depthwise ShortConvolution on q/k/v."""
    use_full_rank_gate: bool = False
    """K3: full-rank output gate ``g_proj`` (hidden → H·d). Kimi-Linear: low-rank ``g_a_proj``/``g_b_proj``."""
    gate_lower_bound: float | None = None
    """K3: decay gate ``lb·σ(e^A·(f + dt_bias))`` with lb = −5. ``None``: Kimi-Linear softplus gate."""
    decay_per_channel: bool = True
    """KDA: one decay rate per key channel. False: one per head, broadcast over the channels (Gated DeltaNet,
    the control of the synthetic tasks); ``f_b_proj`` and ``dt_bias`` then have H outputs, not H·K."""
    delta_rule: bool = True
    """KDA and Gated DeltaNet: the delta-rule update. False: the decay-only recurrence
    ``S ← e^g S + β k vᵀ`` (a Mamba2-like control; needs ``decay_per_channel=False``, no cache or packing)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Unknown keys from ``config.json``, written back unchanged."""

    def __post_init__(self) -> None:
        name = "LinearAttnConfig"
        for key in ("kda_layers", "full_attn_layers"):
            value = getattr(self, key)
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in value
            ):
                raise _fail(name, key, value, "expected a list of 1-based layer indices (ints >= 1)")
            setattr(self, key, [int(i) for i in value])
        _check_int(name, "num_heads", self.num_heads)
        _check_int(name, "head_dim", self.head_dim)
        _check_int(name, "short_conv_kernel_size", self.short_conv_kernel_size)
        _check_bools(self)
        if self.gate_lower_bound is not None:
            _check_float(name, "gate_lower_bound", self.gate_lower_bound)
            if not self.gate_lower_bound < 0:
                raise _fail(
                    name, "gate_lower_bound", self.gate_lower_bound, "must be negative (K3 uses -5.0)"
                )
            self.gate_lower_bound = float(self.gate_lower_bound)
        if not self.delta_rule and self.decay_per_channel:
            raise _fail(name, "delta_rule", False, "the decay-only recurrence needs decay_per_channel=false")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LinearAttnConfig:
        known, extra = _split_known(cls, data)
        missing = {"kda_layers", "full_attn_layers", "num_heads", "head_dim"} - known.keys()
        if missing:
            raise ValueError(f"linear_attn_config is missing {sorted(missing)}")
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict; the mixer variants' fields only when they differ from KDA's default."""
        out = _to_dict(self)
        for key in ("decay_per_channel", "delta_rule"):
            if out[key] is True and key not in self.extra:
                del out[key]
        return out


@dataclass
class KimiLinearConfig:
    """Text backbone config (``model_type = "kimi_linear"``), for Kimi-Linear and the K3 ``text_config``.

    The defaults are the Kimi-Linear remote-code defaults where one exists; K3-only features are off by
    default (``None``/``False``), so a Kimi-Linear ``config.json`` reads back as Kimi-Linear.
    Raises ``ValueError`` naming the field on any invalid value.
    """

    vocab_size: int = 163840
    """Vocabulary size V."""
    hidden_size: int = 2304
    """Model width D (K3: 7168)."""
    num_hidden_layers: int = 27
    """Decoder layers L (K3: 93)."""
    num_attention_heads: int = 32
    """MLA heads (K3: 96)."""
    num_key_value_heads: int | None = None
    """Kept for config compatibility; MLA has one shared latent, so it must equal ``num_attention_heads``."""
    head_dim: int | None = None
    """Kept for config compatibility (MLA head sizes come from the ``qk_*``/``v_head_dim`` fields)."""
    intermediate_size: int = 9216
    """Width of the dense FFN used below ``first_k_dense_replace`` (K3: 33792)."""
    hidden_act: str = "silu"
    """GLU activation: ``"silu"`` (SwiGLU, Kimi-Linear) or ``"situ"`` (SiTU-GLU, K3;
    ``docs/references.md#situ-glu``)."""
    activation_situ_beta: float | None = None
    """SiTU soft-cap β₁ on the gate branch (K3: 4.0)."""
    activation_situ_linear_beta: float | None = None
    """SiTU soft-cap β₂ on the up branch (K3: 25.0); ``None`` leaves the up branch uncapped."""
    initializer_range: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (model, MLA LoRA norms, KDA output norm, AttnRes key norm)."""
    max_position_embeddings: int = 1048576
    """Longest sequence the model accepts (NoPE: a limit, not a table size)."""
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    rope_theta: float | None = None
    """Unused (NoPE); kept for config compatibility."""
    rope_scaling: dict[str, Any] | None = None
    """Unused (NoPE); kept for config compatibility."""
    tie_word_embeddings: bool = False
    """K3 and Kimi-Linear keep an untied ``lm_head``."""
    # MoE
    num_experts: int | None = 256
    """Routed experts E (K3: 896); ``None`` makes every layer a dense FFN."""
    num_experts_per_token: int = 8
    """Experts chosen per token, top-k (K3: 16)."""
    num_shared_experts: int = 1
    """Shared experts, fused into one MLP of width ``num_shared_experts·moe_intermediate_size`` (K3: 2)."""
    moe_intermediate_size: int = 1024
    """Width of one routed expert (K3: 3072)."""
    routed_expert_hidden_size: int | None = None
    """Latent width ℓ of the Stable LatentMoE (K3: 3584); ``None``: experts run at ``hidden_size``."""
    latent_moe_use_norm: bool = False
    """K3: RMSNorm on the combined latent before the up-projection (``routed_expert_norm``)."""
    moe_renormalize: bool = True
    """Renormalise the top-k router weights to sum to one."""
    moe_router_activation_func: str = "sigmoid"
    """Router score function: ``"sigmoid"`` (both models) or ``"softmax"``."""
    routed_scaling_factor: float = 1.0
    """Multiplier on the routed weights (Kimi-Linear: 2.446, K3: 1.0)."""
    first_k_dense_replace: int = 1
    """Layers ``i < first_k_dense_replace`` use the dense FFN."""
    moe_layer_freq: int = 1
    """Layer ``i`` is MoE iff ``i >= first_k_dense_replace and i % moe_layer_freq == 0``."""
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    """Group-limited routing is not implemented; must be 1 (both published configs use 1)."""
    topk_group: int = 1
    topk_method: str | None = None
    """``"noaux_tc"`` in K3: bias-corrected selection (``e_score_correction_bias``)."""
    # MLA
    q_lora_rank: int | None = None
    """Query LoRA rank (K3: 1536); ``None``: a plain ``q_proj`` (Kimi-Linear)."""
    kv_lora_rank: int = 512
    """Latent width of the compressed KV (both: 512)."""
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    """Width of the key part shared by all heads; never rotated in these NoPE models."""
    v_head_dim: int = 128
    mla_use_nope: bool = True
    """Both published models are NoPE; rotary MLA is not implemented."""
    mla_use_output_gate: bool = False
    """K3 gated MLA: ``out ⊙ σ(g_proj(x))`` before ``o_proj``."""
    # K3 depth mixing
    attn_res_block_size: int | None = None
    """Block Attention Residuals: decoder layers per block (K3: 12); ``None``: plain residual adds."""
    # other
    num_nextn_predict_layers: int = 0
    """MTP layers; must be 0 (none in the releases). A speculative draft (``openk3.model.draft``) is an MTP
    layer kept in its own folder, whose ``config.json`` says 1 and is read by ``load_draft``."""
    linear_attn_config: LinearAttnConfig | None = None
    """KDA layout; ``None`` makes every layer MLA."""
    model_type: str = "kimi_linear"
    extra: dict[str, Any] = field(default_factory=dict)
    """Unknown keys from ``config.json``, written back unchanged."""

    def __post_init__(self) -> None:  # noqa: C901 - one check per field, in field order
        name = "KimiLinearConfig"
        if isinstance(self.linear_attn_config, dict):
            self.linear_attn_config = LinearAttnConfig.from_dict(self.linear_attn_config)
        if self.model_type != "kimi_linear":
            raise _fail(name, "model_type", self.model_type, 'the text backbone must be "kimi_linear"')
        _check_bools(self)
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "num_experts_per_token",
            "moe_intermediate_size",
            "moe_layer_freq",
        ):
            _check_int(name, key, getattr(self, key))
        for key in (
            "num_shared_experts",
            "first_k_dense_replace",
            "qk_rope_head_dim",
            "num_nextn_predict_layers",
        ):
            _check_int(name, key, getattr(self, key), minimum=0)
        for key in (
            "num_experts",
            "q_lora_rank",
            "routed_expert_hidden_size",
            "attn_res_block_size",
            "head_dim",
        ):
            _check_opt_int(name, key, getattr(self, key))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_key_value_heads != self.num_attention_heads:
            raise _fail(
                name,
                "num_key_value_heads",
                self.num_key_value_heads,
                f"MLA uses one shared latent; set it to num_attention_heads={self.num_attention_heads}",
            )
        if self.hidden_act not in SUPPORTED_ACTS:
            raise _fail(name, "hidden_act", self.hidden_act, f"supported: {SUPPORTED_ACTS}")
        if self.hidden_act == "situ":
            if self.activation_situ_beta is None:
                raise _fail(name, "activation_situ_beta", None, 'hidden_act="situ" needs it (K3: 4.0)')
            _check_float(name, "activation_situ_beta", self.activation_situ_beta, lo=1e-6)
            if self.activation_situ_linear_beta is not None:
                _check_float(name, "activation_situ_linear_beta", self.activation_situ_linear_beta, lo=1e-6)
        _check_float(name, "rms_norm_eps", self.rms_norm_eps, lo=0.0, hi=1.0)
        _check_float(name, "initializer_range", self.initializer_range, lo=0.0)
        _check_float(name, "routed_scaling_factor", self.routed_scaling_factor, lo=0.0)
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise _fail(
                name,
                "moe_router_activation_func",
                self.moe_router_activation_func,
                'use "sigmoid" or "softmax"',
            )
        if self.num_experts is not None and self.num_experts_per_token > self.num_experts:
            raise _fail(
                name,
                "num_experts_per_token",
                self.num_experts_per_token,
                f"must not exceed num_experts={self.num_experts}",
            )
        if self.num_expert_group != 1 or self.topk_group != 1:
            raise _fail(
                name,
                "num_expert_group",
                (self.num_expert_group, self.topk_group),
                "group-limited routing is not implemented; set num_expert_group=topk_group=1",
            )
        if not self.mla_use_nope:
            raise _fail(name, "mla_use_nope", False, "only NoPE MLA is implemented; set it to true")
        if self.num_nextn_predict_layers != 0:
            raise _fail(
                name,
                "num_nextn_predict_layers",
                self.num_nextn_predict_layers,
                "the model builds no MTP layer; a speculative draft folder loads with "
                "openk3.model.draft.load_draft (openk3 serve/generate --draft), else set it to 0",
            )
        if self.latent_moe_use_norm and self.routed_expert_hidden_size is None:
            raise _fail(
                name, "latent_moe_use_norm", True, "needs routed_expert_hidden_size (the latent width)"
            )
        if self.tie_word_embeddings:
            raise _fail(
                name, "tie_word_embeddings", True, "K3 and Kimi-Linear use an untied lm_head; set false"
            )
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or not 0 <= value < self.vocab_size):
                raise _fail(name, key, value, f"expected null or a token id in [0, {self.vocab_size})")
        self._check_layers()

    def _check_layers(self) -> None:
        la = self.linear_attn_config
        if la is None:
            return
        everything = set(range(1, self.num_hidden_layers + 1))
        kda, full = set(la.kda_layers), set(la.full_attn_layers)
        if kda & full:
            raise _fail(
                "LinearAttnConfig",
                "kda_layers",
                sorted(kda & full),
                "these layers are also in full_attn_layers; each layer is KDA or MLA, not both",
            )
        if (kda | full) != everything:
            raise _fail(
                "LinearAttnConfig",
                "full_attn_layers",
                sorted(everything - kda - full),
                f"these 1-based layers of 1..{self.num_hidden_layers} are in neither list; "
                "add each to kda_layers or full_attn_layers",
            )

    # --- derived facts -----------------------------------------------------------------------------
    def is_kda_layer(self, i: int) -> bool:
        """Whether 0-based layer ``i`` is a KDA layer (``i + 1 in kda_layers``)."""
        la = self.linear_attn_config
        return la is not None and (i + 1) in la.kda_layers

    def is_moe_layer(self, i: int) -> bool:
        """Whether 0-based layer ``i`` uses the MoE block (else the dense FFN),
        ``docs/references.md#configuration``."""
        return (
            self.num_experts is not None and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0
        )

    @property
    def layer_types(self) -> list[str]:
        """``"kda"`` or ``"mla"`` per 0-based layer."""
        return ["kda" if self.is_kda_layer(i) else "mla" for i in range(self.num_hidden_layers)]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def is_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_input_size(self) -> int:
        """Width the routed experts read and write: the latent ℓ (K3) or ``hidden_size``."""
        return self.routed_expert_hidden_size or self.hidden_size

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KimiLinearConfig:
        """Read a parsed ``kimi_linear`` dict (unknown keys go to ``extra``).

        Raises ``ValueError`` when a field of :data:`ESSENTIAL_FIELDS` is absent (a dict without the model's
        shape is not a Kimi-Linear config; the defaults are never taken for them) or any field is invalid.
        """
        missing = [k for k in ESSENTIAL_FIELDS if k not in data]
        if missing:
            raise ValueError(
                f"the kimi_linear config is missing {', '.join(missing)}: these fix the model's shape and "
                "have no default (a Kimi-Linear config.json or a K3 text_config states them all)"
            )
        known, extra = _split_known(cls, data)
        if "max_position_embeddings" not in known and "model_max_length" in extra:
            # transformers' KimiLinearConfig writes the limit under this name (kept in extra as written)
            known["max_position_embeddings"] = extra["model_max_length"]
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


VISION_CHOICES = {
    "pos_emb_type": ("divided_fixed",),
    "pos_emb_interpolation_mode": ("bilinear", "bicubic"),
    "video_attn_type": ("spatial_temporal",),
    "merge_type": ("sd2_tpool",),
    "mm_projector_type": ("patchmergerv2",),
    "projector_hidden_act": ("gelu",),
    "norm_type": ("rmsnorm",),
    "mlp_type": ("mlp2",),
    "activation_func": ("gelu_pytorch_tanh",),
}
"""The values of the ``vision_config`` string fields that MoonViT-V2 implements (the K3 release's)."""


@dataclass
class KimiK3VisionConfig:
    """``vision_config``: the MoonViT-V2 vision tower and the ``patchmergerv2`` projector
    (``docs/references.md#moonvit-v2``).

    Field names are the official ones (the ``vt_*`` prefix included); the defaults are K3's release
    (401,214,464 encoder and 46,144,512 projector parameters at ``text_hidden_size`` 7168). Raises
    ``ValueError`` naming the field for a value MoonViT-V2 does not implement.
    """

    patch_size: int = 14
    """Side of a square patch in pixels."""
    init_pos_emb_height: int = 64
    """Rows of the learned 2-D position table (interpolated to each image's patch grid)."""
    init_pos_emb_width: int = 64
    """Columns of the learned 2-D position table."""
    init_pos_emb_time: int = 4
    """Frames of the fixed 1-D sincos time table: the most frames one video chunk may hold."""
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    """Tower width."""
    vt_intermediate_size: int = 4096
    """Width of the tower MLP (``fc0``/``fc1``)."""
    qkv_hidden_size: int = 1536
    """Width of q, k and v (heads × head size; head size 128 in K3)."""
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])
    """Patches merged into one text token (rows, columns)."""
    video_attn_type: str = "spatial_temporal"
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int | None = None
    """Width of one merged patch before concatenation; ``None`` (or the value) means ``vt_hidden_size``."""
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    """Epsilon of the projector's ``post_norm`` (the tower's norms use 1e-5 too)."""
    norm_type: str = "rmsnorm"
    attn_bias: bool = False
    patch_embed_proj_bias: bool = False
    mlp_type: str = "mlp2"
    linear_bias: bool = False
    activation_func: str = "gelu_pytorch_tanh"
    text_hidden_size: int | None = None
    """Projector output width; ``None`` takes the text model's ``hidden_size`` (it must equal it)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Unknown keys from ``config.json``, written back unchanged."""

    def __post_init__(self) -> None:
        name = "KimiK3VisionConfig"
        for key in (
            "patch_size",
            "init_pos_emb_height",
            "init_pos_emb_width",
            "init_pos_emb_time",
            "vt_num_attention_heads",
            "vt_num_hidden_layers",
            "vt_hidden_size",
            "vt_intermediate_size",
            "qkv_hidden_size",
        ):
            _check_int(name, key, getattr(self, key))
        _check_opt_int(name, "text_hidden_size", self.text_hidden_size)
        _check_bools(self)
        for key, allowed in VISION_CHOICES.items():
            if getattr(self, key) not in allowed:
                raise _fail(name, key, getattr(self, key), f"MoonViT-V2 implements {allowed}")
        for key in ("attn_bias", "patch_embed_proj_bias", "linear_bias"):
            if getattr(self, key):
                raise _fail(name, key, True, "MoonViT-V2 has no biases; set it to false")
        if self.mm_hidden_size not in (None, self.vt_hidden_size):
            raise _fail(
                name,
                "mm_hidden_size",
                self.mm_hidden_size,
                f"must equal vt_hidden_size={self.vt_hidden_size}",
            )
        kernel = self.merge_kernel_size
        if not isinstance(kernel, (list, tuple)) or len(kernel) != 2:
            raise _fail(name, "merge_kernel_size", kernel, "expected [rows, columns]")
        for k in kernel:
            _check_int(name, "merge_kernel_size", k)
        self.merge_kernel_size = [int(k) for k in kernel]
        _check_float(name, "projector_ln_eps", self.projector_ln_eps, lo=0.0, hi=1.0)
        heads = self.vt_num_attention_heads
        if self.qkv_hidden_size % heads or (self.qkv_hidden_size // heads) % 4:
            raise _fail(
                name,
                "qkv_hidden_size",
                self.qkv_hidden_size,
                f"must be vt_num_attention_heads={heads} × a head size divisible by 4 (2-D RoPE)",
            )
        if self.vt_hidden_size % 2:
            raise _fail(name, "vt_hidden_size", self.vt_hidden_size, "must be even (sincos time table)")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merged_size(self) -> int:
        """Width of one merged token entering the projector: ``vt_hidden_size · rows · columns``."""
        return self.vt_hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KimiK3VisionConfig:
        known, extra = _split_known(cls, data)
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


@dataclass
class KimiK3Config:
    """Top-level K3 config (``model_type = "kimi_k3"``): ``text_config`` plus multimodal fields.

    ``vision_config`` ``None`` builds a text-only model. Images and videos enter the text sequence at the
    ``media_placeholder_token_id`` tokens (one per merged patch, :mod:`openk3.model.vision`).
    """

    text_config: KimiLinearConfig
    vision_config: KimiK3VisionConfig | None = None
    architectures: list[str] = field(default_factory=lambda: ["KimiK3ForConditionalGeneration"])
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839
    media_placeholder_token_id: int | None = 163605
    model_type: str = "kimi_k3"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.text_config, dict):
            self.text_config = KimiLinearConfig.from_dict(self.text_config)
        if not isinstance(self.text_config, KimiLinearConfig):
            raise _fail(
                "KimiK3Config",
                "text_config",
                type(self.text_config).__name__,
                "expected a kimi_linear config (dict or KimiLinearConfig)",
            )
        if self.model_type != "kimi_k3":
            raise _fail("KimiK3Config", "model_type", self.model_type, 'must be "kimi_k3"')
        if isinstance(self.vision_config, dict):
            self.vision_config = KimiK3VisionConfig.from_dict(self.vision_config)
        self._check_vision()

    def _check_vision(self) -> None:
        vision, width = self.vision_config, self.text_config.hidden_size
        if vision is None:
            return
        if not isinstance(vision, KimiK3VisionConfig):
            raise _fail("KimiK3Config", "vision_config", type(vision).__name__, "expected a dict or null")
        if vision.text_hidden_size is None:
            vision.text_hidden_size = width
        if vision.text_hidden_size != width:
            raise _fail(
                "KimiK3VisionConfig",
                "text_hidden_size",
                vision.text_hidden_size,
                f"the projector must emit the text width hidden_size={width}",
            )
        token = self.media_placeholder_token_id
        if (
            not isinstance(token, int)
            or isinstance(token, bool)
            or not 0 <= token < self.text_config.vocab_size
        ):
            raise _fail(
                "KimiK3Config",
                "media_placeholder_token_id",
                token,
                f"a model with a vision tower needs a token id in [0, {self.text_config.vocab_size})",
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KimiK3Config:
        known, extra = _split_known(cls, data)
        if "text_config" not in known:
            raise ValueError("a kimi_k3 config.json needs a text_config object")
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


AnyConfig = KimiLinearConfig | KimiK3Config


def text_config_of(config: AnyConfig) -> KimiLinearConfig:
    """The ``kimi_linear`` backbone config of either config kind."""
    return config.text_config if isinstance(config, KimiK3Config) else config


def config_from_dict(data: dict[str, Any]) -> AnyConfig:
    """Build the right config class from a parsed ``config.json`` (dispatch on ``model_type``).

    ``model_type`` must be present and one of :data:`MODEL_TYPES` (no default is assumed: a config of another
    model family would otherwise be read as Kimi-Linear with its defaults). Raises ``ValueError`` for a
    missing or unknown ``model_type``, a missing essential field or any invalid field.
    """
    if not isinstance(data, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(data).__name__}")
    known = ", ".join(repr(k) for k in MODEL_TYPES)
    if "model_type" not in data:
        raise ValueError(
            f"the config has no model_type field, so it is not read as a Kimi K3 or Kimi-Linear config; "
            f"known model types: {known}"
        )
    kind = data["model_type"]
    data = {k: v for k, v in data.items() if k != "auto_map"}  # transformers' remote-code map, see hf_remote
    if kind == "kimi_k3":
        return KimiK3Config.from_dict(data)
    if kind == "kimi_linear":
        return KimiLinearConfig.from_dict(data)
    raise ValueError(f"model_type={kind!r} is not supported; known model types: {known}")


def load_config(path: str | os.PathLike) -> AnyConfig:
    """Read ``config.json`` (a file, or a folder that holds one) with :func:`config_from_dict`.

    Raises ``FileNotFoundError`` when there is none and ``ValueError`` (prefixed with the file's path) for
    invalid JSON or an invalid config.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text (JSON): {e}") from e
    try:
        return config_from_dict(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def save_config(config: AnyConfig, path: str | os.PathLike) -> None:
    """Write ``config.json`` into folder ``path`` (unknown keys kept)."""
    with open(os.path.join(os.fspath(path), "config.json"), "w", encoding="utf-8") as f:
        json.dump(config.to_dict(), f, indent=2)
        f.write("\n")
