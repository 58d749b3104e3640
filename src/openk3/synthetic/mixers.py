"""The sequence mixers compared on the synthetic tasks: configs of one layer family, not new models.

==========  =====================================================================================
``kda``     Kimi Delta Attention: one decay rate per key channel, the delta rule (every layer)
``gdn``     Gated DeltaNet: the same KDA ops, the decay input broadcast over the channels (one per head)
``decay``   decay-only: one decay per head and no delta rule, ``S ← e^g S + β k vᵀ`` (Mamba2-like)
``mla``     softmax attention: gated MLA without positional encoding (NoPE), every layer
``hybrid``  the K3 layout: 3 KDA : 1 MLA, MLA on every 4th layer
==========  =====================================================================================

All use the K3 decay gate (lower bound −5), a full-rank output gate, dense SwiGLU FFNs, no MoE and plain
residual adds, so only the mixer differs. The KDA options are ``LinearAttnConfig.decay_per_channel`` and
``delta_rule``.
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.config import KimiLinearConfig, LinearAttnConfig

MIXERS = ("kda", "gdn", "decay", "mla", "hybrid")


@dataclass
class MixerSize:
    """Width and depth of the synthetic-task models (the same for every mixer)."""

    hidden_size: int = 128
    num_layers: int = 4
    """A multiple of 4 for ``hybrid`` (one MLA layer per 4)."""
    num_heads: int = 2
    """KDA heads and MLA heads."""
    head_dim: int = 64
    """KDA head size K = V, MLA ``qk_nope_head_dim`` and ``v_head_dim``."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MixerSize.{name}={value!r} is invalid: expected an int >= 1")


def mixer_config(mixer: str, vocab_size: int, size: MixerSize) -> KimiLinearConfig:
    """The model config of ``mixer`` (table above). Raises ``ValueError`` for an unknown mixer, or
    ``hybrid`` with a depth that is not a multiple of 4."""
    if mixer not in MIXERS:
        raise ValueError(f"unknown mixer {mixer!r}; choose one of {', '.join(MIXERS)}")
    L = size.num_layers
    if mixer == "mla":
        full = list(range(1, L + 1))
    elif mixer == "hybrid":
        if L % 4:
            raise ValueError(f"the hybrid mixer needs a multiple of 4 layers (3 KDA : 1 MLA); got {L}")
        full = list(range(4, L + 1, 4))
    else:
        full = []
    la = LinearAttnConfig(
        kda_layers=[i for i in range(1, L + 1) if i not in full],
        full_attn_layers=full,
        num_heads=size.num_heads,
        head_dim=size.head_dim,
        use_full_rank_gate=True,
        gate_lower_bound=-5.0,
        decay_per_channel=mixer not in ("gdn", "decay"),
        delta_rule=mixer != "decay",
    )
    return KimiLinearConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        num_hidden_layers=L,
        num_attention_heads=size.num_heads,
        intermediate_size=2 * size.hidden_size,
        num_experts=None,
        kv_lora_rank=size.head_dim,
        qk_nope_head_dim=size.head_dim,
        qk_rope_head_dim=16,
        v_head_dim=size.head_dim,
        mla_use_output_gate=True,
        linear_attn_config=la,
    )
