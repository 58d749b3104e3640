"""The speculative draft: an MTP / EAGLE-3-style head on a target openk3 model (``docs/speculative.md``).

One draft step at position ``t`` reads a feature ``h_t`` and the next token ``x_{t+1}`` and predicts
``x_{t+2}`` (DeepSeek-V3 MTP wiring, EAGLE-3 features; ``docs/references.md#speculative-decoding``)::

    h_t  = fc([a_t; b_t; c_t])                    # EAGLE-3: target hidden states of three layers, 3D → D
         | g_{t−1}                                # later chain steps: the draft's own previous output
    x    = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])          # 2D → D
    g_t  = one decoder layer (gated NoPE MLA + dense FFN, plain residual adds)
    q    = softmax(lm_head(shared_head.norm(g_t)))               # the target's embedding and head, shared

The taps ``a, b, c`` are the outputs of target layers :func:`feature_layers` (EAGLE-3's ``[1, L/2 − 1,
L − 4]``), read as the inputs of the next layers' ``input_layernorm`` (the residual stream in Kimi-Linear,
the AttnRes mix in K3), returned with the hidden states by
:meth:`~openk3.model.modeling.KimiLinearModel.forward_with_features` on every path (training,
:mod:`openk3.speculative`, the server's eager and compiled steps).
The draft layer attends over its own cache of earlier positions (an :class:`~openk3.model.cache.MLACache`,
rolled back by cutting it).

Parameters are named as an MTP layer of the target, ``model.layers.{L}.*`` (``L`` = the target's
``num_hidden_layers``, DeepSeek-V3's layout: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``) plus
``fc`` (EAGLE-3). The embedding and head are the target's and are not part of the draft's weights.
A draft folder holds ``config.json`` (the target's text config with ``num_nextn_predict_layers = 1`` and the
draft's settings under ``draft``) and ``model.safetensors``.

Legend: ``B`` batch, ``T`` positions, ``D`` width, ``V`` vocabulary, ``F = 3·D`` fused features,
``S`` cached + new positions.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from openk3.config import text_config_of
from openk3.model.cache import MLACache
from openk3.model.mla import MultiheadLatentAttention
from openk3.model.mlp import MLP
from openk3.model.norm import RMSNorm

DRAFT_CONFIG = "config.json"
DRAFT_WEIGHTS = "model.safetensors"


def feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's tapped layers (0-based outputs) ``[1, L//2 − 1, L − 4]``, each clamped to ``[0, L − 2]``
    (the last layer's output feeds the head, not a next layer). Raises ``ValueError`` below 2 layers."""
    if num_layers < 2:
        raise ValueError(f"a draft needs a target with at least 2 layers, got {num_layers}")
    return tuple(min(max(i, 0), num_layers - 2) for i in (1, num_layers // 2 - 1, num_layers - 4))


@dataclass(frozen=True)
class DraftConfig:
    """What a draft adds to its target's config (saved under ``draft`` in the draft's ``config.json``)."""

    feature_layers: tuple[int, ...]
    """0-based target layers whose outputs are fused by ``fc``."""
    target_vocab_size: int
    target_hidden_size: int
    target_num_hidden_layers: int
    loss: str = "lk"
    """The training loss: ``"lk"`` (−log Σ min(p, q)) or ``"kl"`` (KL(p ‖ q))."""
    ttt_steps: int = 3
    """Training-time-test unroll: draft steps per position during training."""

    def __post_init__(self) -> None:
        if self.loss not in ("lk", "kl"):
            raise ValueError(f"DraftConfig.loss must be 'lk' or 'kl', got {self.loss!r}")
        if isinstance(self.ttt_steps, bool) or not isinstance(self.ttt_steps, int) or self.ttt_steps < 1:
            raise ValueError(f"DraftConfig.ttt_steps must be an int >= 1, got {self.ttt_steps!r}")
        L = self.target_num_hidden_layers
        if not self.feature_layers or any(not 0 <= i <= L - 2 for i in self.feature_layers):
            raise ValueError(
                f"DraftConfig.feature_layers must be target layers in [0, {L - 2}], got {self.feature_layers!r}"
            )


class DraftLayer(nn.Module):
    """The MTP layer: input fusion, one decoder layer of the target's attention kind, the head's norm."""

    def __init__(self, config, num_features: int) -> None:
        super().__init__()
        D = config.hidden_size
        self.fc = nn.Linear(num_features * D, D, bias=False)
        self.enorm = RMSNorm(D, config.rms_norm_eps)
        self.hnorm = RMSNorm(D, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.input_layernorm = RMSNorm(D, config.rms_norm_eps)
        self.self_attn = MultiheadLatentAttention(config)
        self.post_attention_layernorm = RMSNorm(D, config.rms_norm_eps)
        self.mlp = MLP(config, D, config.intermediate_size)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(D, config.rms_norm_eps)


class EagleDraft(nn.Module):
    """The draft head of one target (its own weights only; the target's embedding and head are passed in).

    ``model.layers.{L}`` holds the :class:`DraftLayer`; ``L`` = the target's ``num_hidden_layers``."""

    def __init__(self, target_config, draft_config: DraftConfig) -> None:
        super().__init__()
        cfg = text_config_of(target_config)
        self.config, self.draft_config = cfg, draft_config
        self.layer_index = cfg.num_hidden_layers
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict(
            {str(self.layer_index): DraftLayer(cfg, len(draft_config.feature_layers))}
        )

    @property
    def layer(self) -> DraftLayer:
        return self.model.layers[str(self.layer_index)]

    def new_cache(self) -> MLACache:
        return MLACache()

    def fuse(self, taps_BTF: torch.Tensor) -> torch.Tensor:
        """``fc`` over the concatenated target features ``[B, T, F]`` → ``[B, T, D]``."""
        return self.layer.fc(taps_BTF)

    def forward(
        self,
        h_BTD: torch.Tensor,
        input_ids_BT: torch.Tensor,
        embed: nn.Embedding,
        cache: MLACache | None = None,
        mask_TS: torch.Tensor | None = None,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One draft step over ``T`` positions: features ``h_BTD`` (fused target features or the draft's own
        outputs) and the next tokens ``input_ids_BT``. Returns ``(g_BTD, (latent, k_pe))``: the outputs (the
        next step's features; :meth:`logits` gives the predictions) and this call's new latents.

        Attention: with ``cache``, over the cached positions then causally over the new ones (appended);
        otherwise over ``past`` (earlier latents ``([B, S₀, C], [B, S₀, r])``, may be ``None``) and the new
        positions under ``mask_TS`` (bool ``[T, S₀ + T]``, or ``[B, 1, T, S₀ + T]`` per row; True = attend;
        ``None`` = causal): the training-time-test pattern of :func:`ttt_mask`, or padded batched caches."""
        layer = self.layer
        e_BTD = layer.enorm(embed(input_ids_BT))
        x_BTD = layer.eh_proj(torch.cat([e_BTD, layer.hnorm(h_BTD)], -1))
        if cache is not None:
            a_BTD = layer.self_attn(layer.input_layernorm(x_BTD), cache)
            new = (cache.latent[:, -x_BTD.shape[1] :], cache.k_pe[:, -x_BTD.shape[1] :])
        else:
            a_BTD, new = _attend(layer.self_attn, layer.input_layernorm(x_BTD), past, mask_TS)
        g_BTD = x_BTD + a_BTD
        g_BTD = g_BTD + layer.mlp(layer.post_attention_layernorm(g_BTD))
        return g_BTD, new

    def logits(self, g_BTD: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
        """Draft logits ``[B, T, V]`` through the shared head."""
        return lm_head(self.layer.shared_head.norm(g_BTD))


def _attend(attn: MultiheadLatentAttention, x_BTD, past, mask_TS):
    """The MLA mixer over ``past`` latents plus the new positions' under ``mask_TS``; returns the output and
    the new ``(latent, k_pe)``."""
    B, T, _ = x_BTD.shape
    q_nope, q_pe = attn.query(x_BTD)
    ckv_BTd = attn.kv_a_proj_with_mqa(x_BTD)
    c_BTC = attn.kv_a_layernorm(ckv_BTd[..., : attn.kv_lora_rank])
    k_pe_BTr = ckv_BTd[..., attn.kv_lora_rank :]
    c_BSC, k_pe_BSr = c_BTC, k_pe_BTr
    if past is not None:
        c_BSC, k_pe_BSr = torch.cat([past[0], c_BTC], 1), torch.cat([past[1], k_pe_BTr], 1)
    S = c_BSC.shape[1]
    if mask_TS is None:
        mask_TS = torch.arange(S - T, S, device=x_BTD.device)[:, None] >= torch.arange(S, device=x_BTD.device)
    o_BTHv = attn.naive_attention(q_nope, q_pe, c_BSC, k_pe_BSr, mask_TS)
    o_BTP = o_BTHv.reshape(B, T, -1)
    if attn.g_proj is not None:
        o_BTP = o_BTP * torch.sigmoid(attn.g_proj(x_BTD))
    return attn.o_proj(o_BTP), (c_BTC, k_pe_BTr)


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """Training-time-test mask ``[T, (step + 1)·T]`` for step ``step`` (0 = target features) of rows
    ``0..T−1``: row ``i`` attends to step 0's positions ``≤ i`` and to its own row at steps ``1..step``
    (its earlier chain positions), exactly the context a chain step has at inference."""
    i = torch.arange(T, device=device)
    parts = [i[:, None] >= i[None, :]] + [i[:, None] == i[None, :]] * step
    return torch.cat(parts, 1)


def build_draft(
    target_config, draft_config: DraftConfig, device="cpu", dtype=torch.float32, seed=None
) -> EagleDraft:
    """A fresh draft (normal(0, ``initializer_range``) linear weights, unit norms, as the target's init)."""
    from openk3.model.init import init_weights

    draft = EagleDraft(target_config, draft_config)
    init_weights(draft, draft.config, seed)
    return draft.to(device=device, dtype=dtype)


DRAFT_LAYER_FIELDS = (
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "mla_use_output_gate",
    "intermediate_size",
    "hidden_act",
    "activation_situ_beta",
    "activation_situ_linear_beta",
)
"""The target's text-config fields a :class:`DraftLayer` is built from besides vocabulary, width and depth: the
MLA shapes and output gate, the FFN width and its activation. A draft is built from its target's config, so
a target differing in any of them gives the draft other weight shapes (a dense baseline has no ``g_proj`` and
another FFN width) or another function; :func:`check_target` compares them with the config saved beside the
draft."""


def check_target(
    draft_config: DraftConfig, target_config, trained_for: dict | None = None, name: str = "the draft"
) -> None:
    """Raise ``ValueError`` when the target is not the one the draft was trained for: vocabulary, width or
    depth differ (``draft_config``), or, given ``trained_for`` (the target text config saved with the draft,
    as a dict), any of :data:`DRAFT_LAYER_FIELDS` it states. ``name`` says which draft, for the message."""
    cfg = text_config_of(target_config)
    checks = [
        ("vocab_size", draft_config.target_vocab_size, cfg.vocab_size),
        ("hidden_size", draft_config.target_hidden_size, cfg.hidden_size),
        ("num_hidden_layers", draft_config.target_num_hidden_layers, cfg.num_hidden_layers),
    ]
    saved = trained_for or {}
    checks += [(f, saved[f], getattr(cfg, f)) for f in DRAFT_LAYER_FIELDS if f in saved]
    for field, want, have in checks:
        if want != have:
            raise ValueError(
                f"{name} was trained for a target with {field}={want}, but this target has {field}={have}; "
                "train a draft for it with `openk3 train-draft --target RUN`"
            )


def _check_weights(state: dict[str, torch.Tensor], draft: EagleDraft, path: Path) -> None:
    """Raise ``ValueError`` naming ``path`` and the first tensor (in the draft's order) that is missing from
    ``state``, has another shape, or is no weight of ``draft``: the backstop behind :func:`check_target` for a
    config that does not describe its weights (edited, or copied from another draft)."""
    want = draft.state_dict()
    for key, t in want.items():
        if key not in state:
            raise ValueError(f"{path} does not fit this target: it lacks the draft weight {key}")
        if state[key].shape != t.shape:
            raise ValueError(
                f"{path} does not fit this target: {key} has shape {list(state[key].shape)}, a draft for this "
                f"target needs {list(t.shape)}"
            )
    extra = sorted(set(state) - set(want))
    if extra:
        raise ValueError(
            f"{path} does not fit this target: {extra[0]} is no weight of a draft for this target"
        )


def save_draft(draft: EagleDraft, folder: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``folder`` (created); returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = draft.config.to_dict() if hasattr(draft.config, "to_dict") else dataclasses.asdict(draft.config)
    config["num_nextn_predict_layers"] = 1
    config["draft"] = dataclasses.asdict(draft.draft_config)
    (folder / DRAFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}, folder / DRAFT_WEIGHTS
    )
    return folder


def load_draft(folder: str | Path, target: nn.Module) -> EagleDraft:
    """The draft in ``folder`` for ``target`` (a model from :func:`~openk3.model.modeling.build_model`), on the
    target's device and dtype. Raises ``FileNotFoundError`` for a folder without a draft and ``ValueError``
    naming the file for a draft of another target (:func:`check_target` on the saved config, then every
    weight's name and shape) and for a ``config.json`` or ``model.safetensors`` that cannot be parsed
    (truncated or corrupt, as :class:`~openk3.checkpoint.io.CorruptCheckpointError` for a model)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    path, weights = folder / DRAFT_CONFIG, folder / DRAFT_WEIGHTS
    if not path.is_file() or not weights.is_file():
        raise FileNotFoundError(
            f"{folder} holds no draft ({DRAFT_CONFIG} + {DRAFT_WEIGHTS}); see `openk3 train-draft`"
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON (truncated or corrupt?): {e}") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("draft"), dict):
        raise ValueError(f"{path} is not a draft config (no 'draft' entry)")
    d = dict(raw["draft"])
    try:
        d["feature_layers"] = tuple(d["feature_layers"])
        draft_config = DraftConfig(**d)
    except KeyError as e:
        raise ValueError(f"{path} is not a draft config (its 'draft' entry lacks {e})") from e
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} holds an invalid 'draft' entry: {e}") from e
    lm = getattr(target, "language_model", target)
    check_target(draft_config, lm.config, trained_for=raw, name=f"the draft in {folder}")
    weight = lm.model.embed_tokens.weight
    draft = EagleDraft(lm.config, draft_config)
    try:
        state = load_file(weights)
    except SafetensorError as e:
        raise ValueError(f"{weights} is not a valid safetensors file (truncated or corrupt?): {e}") from e
    _check_weights(state, draft, weights)
    draft.load_state_dict(state)
    return draft.to(device=weight.device, dtype=weight.dtype).eval()
