"""The whole model: ``KimiLinearModel`` (embedding → decoder layers → norm), the causal-LM head, and the K3
wrapper whose attribute names give the official ``language_model.`` prefix.

Forward contract: ``model(input_ids)`` returns :class:`CausalLMOutput` whose ``.logits`` is ``[B, T, V]``.
Optional ``cache`` (:class:`~openk3.model.cache.KimiCache`, updated in place) for incremental decoding and
``cu_seqlens`` (int64 ``[N+1]``, ``B = 1``) for packed documents. A K3 model with a vision tower also takes
``pixel_values`` and ``grid_thws`` (:mod:`openk3.model.vision`), placed at the media placeholder tokens.

Raises ``ValueError`` for non-integer ids, ids outside ``[0, vocab_size)``, or a total length beyond
``max_position_embeddings``; ``NotImplementedError`` for a cache together with ``cu_seqlens`` on MLA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from openk3.config import AnyConfig, KimiK3Config, KimiLinearConfig, text_config_of
from openk3.model.attn_res import TwoPhaseAttnRes, attn_res_mix, attn_res_sites, make_res_pair
from openk3.model.cache import KimiCache
from openk3.model.decoder import KimiDecoderLayer
from openk3.model.init import init_weights
from openk3.model.norm import RMSNorm
from openk3.model.varlen import check_cu_seqlens
from openk3.model.vision import MoonViT, PatchMergerProjector, merge_patches, place_media

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
FP32_TENSORS = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")
"""Name endings of the tensors the official checkpoint stores in F32 (KDA's convolutions, decay and output
norm, the router's bias): they stay fp32 in a low-precision model, so a bf16 load keeps their bytes."""


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    """``[B, T, vocab_size]`` in the model dtype."""
    cache: KimiCache | None = None


class KimiLinearModel(nn.Module):
    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(KimiDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        if config.uses_attn_res:
            self.output_attn_res_norm, self.output_attn_res_proj = make_res_pair(D, config.rms_norm_eps)

    @property
    def attn_res_sites(self):
        """The AttnRes mixes in forward order (:func:`~openk3.model.attn_res.attn_res_sites`)."""
        return attn_res_sites(self)

    def check_inputs(self, input_ids: torch.Tensor, cache: KimiCache | None, cu_seqlens) -> None:
        cfg = self.config
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be a [B, T] tensor, got {getattr(input_ids, 'shape', type(input_ids))}"
            )
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.numel() == 0:
            raise ValueError("input_ids is empty")
        lo, hi = torch.stack(torch.aminmax(input_ids)).tolist()  # one host sync, not two
        if lo < 0 or hi >= cfg.vocab_size:
            bad = hi if hi >= cfg.vocab_size else lo
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
        past = cache.seq_len if cache is not None else 0
        T = input_ids.shape[1]
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, input_ids.shape[0], T)
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            longest = int(lengths.max()) if lengths.numel() else 0
            if cache is not None and past:
                raise NotImplementedError("cu_seqlens with a non-empty cache is not supported")
        else:
            longest = past + T
        if longest > cfg.max_position_embeddings:
            raise ValueError(
                f"sequence length {longest} exceeds max_position_embeddings={cfg.max_position_embeddings}"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KimiCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        check_inputs: bool = True,
        two_phase_attn_res: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[B, T, D]`` (after the output AttnRes mix and the final norm).

        ``check_inputs=False`` skips :meth:`check_inputs` (one host sync) for ids the caller has checked.
        ``two_phase_attn_res``: mix by :class:`~openk3.model.attn_res.TwoPhaseAttnRes` (inference: the
        pseudo-queries of one block set scored in one pass) instead of one mix at a time.
        ``inputs_embeds`` ``[B, T, D]`` replaces the embedding lookup of ``input_ids`` (which still give the
        shape and are checked): text embeddings with media placed in them."""
        h_BTD, _ = self.forward_with_features(
            input_ids, (), cache, cu_seqlens, check_inputs, two_phase_attn_res, inputs_embeds
        )
        return h_BTD

    def forward_with_features(
        self,
        input_ids: torch.Tensor,
        feature_layers: tuple[int, ...],
        cache: KimiCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        check_inputs: bool = True,
        two_phase_attn_res: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` (same arguments) that also returns a draft's features ``[B, T, F]``
        (:mod:`openk3.model.draft`): the outputs of ``feature_layers`` as the next layers' ``input_layernorm``
        reads them (the residual stream, or the AttnRes mix in K3), concatenated in that order, a repeated
        layer repeated; ``None`` for no layers. Every draft path takes its features here: they are recorded in
        the forward itself, without module hooks, so ``torch.compile`` traces it in one graph. Raises
        ``ValueError`` for a layer without a next layer."""
        if check_inputs:
            self.check_inputs(input_ids, cache, cu_seqlens)
        if any(not 0 <= i < len(self.layers) - 1 for i in feature_layers):
            raise ValueError(f"feature layers {feature_layers} must lie in [0, {len(self.layers) - 2}]")
        tapped = {i + 1 for i in feature_layers}  # the layers whose input_layernorm input is taken
        found: dict[int, torch.Tensor] = {}  # by the tapped layer's index
        h_BTD = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        layer_caches = cache.layers if cache is not None else [None] * len(self.layers)
        if self.config.uses_attn_res:
            blocks: list[torch.Tensor] = []
            partial = h_BTD
            mix = TwoPhaseAttnRes(self.attn_res_sites) if two_phase_attn_res else attn_res_mix
            if tapped:
                mix = _recording(mix, {id(self.layers[j].self_attention_res_proj): j for j in tapped}, found)
            for layer, c in zip(self.layers, layer_caches):  # layer 0 opens a block: every later one mixes
                closed = partial if layer.opens_block else None
                partial = layer.forward_attn_res(blocks, partial, c, cu_seqlens, mix)
                if closed is not None:
                    blocks.append(closed)
            h_BTD = mix(blocks, partial, self.output_attn_res_norm, self.output_attn_res_proj)
        else:
            for j, (layer, c) in enumerate(zip(self.layers, layer_caches)):
                if j in tapped:
                    found[j] = h_BTD
                h_BTD = layer.forward_residual(h_BTD, c, cu_seqlens)
        if cache is not None:
            cache.seq_len += input_ids.shape[1]
        features = torch.cat([found[i + 1] for i in feature_layers], -1) if feature_layers else None
        return self.norm(h_BTD), features


def _recording(mix, layer_of: dict[int, int], found: dict[int, torch.Tensor]):
    """``mix`` that also keeps, in ``found[j]``, the output of every mix whose ``proj`` is layer ``j``'s
    ``self_attention_res_proj`` (``layer_of``: by the projection's ``id``): layer ``j``'s
    ``input_layernorm`` input."""

    def recorded(blocks, partial_BTD, norm, proj):
        out = mix(blocks, partial_BTD, norm, proj)
        j = layer_of.get(id(proj))
        if j is not None:
            found[j] = out
        return out

    return recorded


class KimiLinearForCausalLM(nn.Module):
    """Backbone + untied ``lm_head`` (names ``model.*``, ``lm_head.weight``)."""

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.config = config
        self.model = KimiLinearModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KimiCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        h_BTD = self.model(input_ids, cache, cu_seqlens, inputs_embeds=inputs_embeds)
        return CausalLMOutput(self.lm_head(h_BTD), cache)

    def new_cache(self) -> KimiCache:
        return KimiCache.for_config(self.config)


class KimiK3ForConditionalGeneration(nn.Module):
    """K3 top level: ``language_model`` (a :class:`KimiLinearForCausalLM`) and, when the config has a
    ``vision_config``, ``vision_tower`` (MoonViT-V2) and ``mm_projector`` (the official prefixes)."""

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        self.config = config
        self.language_model = KimiLinearForCausalLM(config.text_config)
        if config.vision_config is not None:
            self.vision_tower = MoonViT(config.vision_config)
            self.mm_projector = PatchMergerProjector(config.vision_config)

    def embed_media(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        """Text-width embeddings ``[M, hidden_size]`` of packed media (:mod:`openk3.model.vision`).

        Raises ``ValueError`` for a model without a vision tower or a grid the tower does not take."""
        if self.config.vision_config is None:
            raise ValueError(
                "this model has no vision tower (its config has no vision_config): pass text only"
            )
        x_LD = self.vision_tower(pixel_values, grid_thws)
        return self.mm_projector(merge_patches(x_LD, grid_thws, self.config.vision_config.merge_kernel_size))

    def embed_inputs(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        """Token embeddings ``[B, T, hidden_size]`` with the media placed at the placeholder tokens.

        Raises ``ValueError`` when the placeholder count differs from the media's token count."""
        media_MD = self.embed_media(pixel_values, grid_thws)
        embeds_BTD = self.language_model.model.embed_tokens(input_ids)
        return place_media(input_ids, embeds_BTD, media_MD, self.config.media_placeholder_token_id)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KimiCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        grid_thws: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """Logits ``[B, T, V]``; with ``pixel_values`` and ``grid_thws`` the media fill the placeholder tokens
        (``inputs_embeds`` instead: embeddings already built by :meth:`embed_inputs`)."""
        if (pixel_values is None) != (grid_thws is None):
            raise ValueError("pass pixel_values and grid_thws together (or neither)")
        if pixel_values is not None:
            self.language_model.model.check_inputs(input_ids, cache, cu_seqlens)
            inputs_embeds = self.embed_inputs(input_ids, pixel_values, grid_thws)
        return self.language_model(input_ids, cache, cu_seqlens, inputs_embeds=inputs_embeds)

    def new_cache(self) -> KimiCache:
        return self.language_model.new_cache()


def check_dtype(dtype) -> torch.dtype:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {[str(d) for d in SUPPORTED_DTYPES]}")
    return dtype


def build_model(
    config: AnyConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    init: bool = True,
) -> nn.Module:
    """Build the model for ``config`` (K3 wrapper for a ``kimi_k3`` config, else the causal LM).

    ``device="meta"`` builds shapes only (no memory; ``kimi-k3`` builds in seconds). Otherwise weights are
    initialised (:func:`~openk3.model.init.init_weights`, deterministic for a given ``seed``) unless
    ``init=False`` (e.g. before loading a checkpoint). Raises ``ValueError`` for an unsupported dtype.
    """
    check_dtype(dtype)
    with torch.device("meta"):
        model = (
            KimiK3ForConditionalGeneration(config)
            if isinstance(config, KimiK3Config)
            else KimiLinearForCausalLM(config)
        )
    if str(device) != "meta":
        model = model.to_empty(device=device)
        if init:
            init_weights(model, text_config_of(config), seed)
    return cast_model(model, dtype)


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters and buffers to ``dtype`` in place, keeping :data:`FP32_TENSORS` in fp32 or
    wider."""
    check_dtype(dtype)
    keep = torch.promote_types(dtype, torch.float32)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(keep if name.endswith(FP32_TENSORS) else dtype)
    return model
