"""The checkpoint's ``quantization_config``: which expert numerics a folder asks for.

K3's release stores its routed experts as compressed-tensors ``mxfp4-pack-quantized`` (MXFP4 weights, group
32, E8M0 scales) and leaves everything else in higher precision (attention, shared experts, router, latent
projections, dense FFN, head, vision). The config sits in the text config (``text_config`` of a K3
``config.json``, or the top level of a Kimi-Linear one) and is kept verbatim in the config's ``extra``.

:func:`expert_scheme` reads it into an :class:`ExpertScheme`; :func:`quantization_config` writes the dict for
a model whose experts openk3 packed. The field names are compressed-tensors' ``QuantizationConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openk3.config import AnyConfig, KimiK3Config, text_config_of
from openk3.quant.mxfp4 import MX_BLOCK

FORMAT = "mxfp4-pack-quantized"
QUANT_METHOD = "compressed-tensors"
IGNORED = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*block_sparse_moe\\.gate$",
    "re:.*routed_expert_(down|up)_proj$",
    "re:.*\\.mlp\\..*",
    "re:vision_tower.*",
    "re:mm_projector.*",
]
"""Modules left in higher precision: every linear layer except the routed experts."""
ACTIVATIONS = ("mxfp8", None)


@dataclass(frozen=True)
class ExpertScheme:
    """Numerics of the routed-expert GEMMs of a packed model: MXFP4 weights (always) and the input
    activations, ``"mxfp8"`` (quantised per block of 32 at run time, as QAT trains them) or ``None`` (bf16 or
    the model dtype, the official release)."""

    activations: str | None = None

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"ExpertScheme.activations={self.activations!r}: use 'mxfp8' or None")


def _fail(field: str, value: Any, want: str) -> ValueError:
    return ValueError(f"quantization_config.{field}={value!r} is not supported: expected {want}")


def _raw(config: AnyConfig) -> dict | None:
    text = text_config_of(config)
    if "quantization_config" in text.extra:
        return text.extra["quantization_config"]
    return config.extra.get("quantization_config") if isinstance(config, KimiK3Config) else None


def expert_scheme(config: AnyConfig) -> ExpertScheme | None:
    """The :class:`ExpertScheme` of ``config``'s ``quantization_config``, or ``None`` when it has none.

    Raises ``ValueError`` naming the field for a config openk3 cannot run: another ``quant_method`` or
    ``format``, weights other than 4-bit float in groups of 32, or input activations other than none or
    8-bit float in dynamic groups of 32."""
    q = _raw(config)
    if q is None:
        return None
    if not isinstance(q, dict):
        raise _fail("", type(q).__name__, "a JSON object")
    if q.get("quant_method") != QUANT_METHOD:
        raise _fail("quant_method", q.get("quant_method"), repr(QUANT_METHOD))
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _fail("config_groups", groups, "one group of MXFP4 weights")
    activations = set()
    for gname, g in groups.items():
        fmt = (g.get("format") if isinstance(g, dict) else None) or q.get("format")
        if fmt != FORMAT:
            raise _fail(f"config_groups.{gname}.format", fmt, repr(FORMAT))
        w = g.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", MX_BLOCK):
            raise _fail(f"config_groups.{gname}.weights", w, "num_bits 4, type float, group_size 32")
        a = g.get("input_activations")
        if a is None:
            activations.add(None)
        elif (a.get("num_bits"), a.get("type"), a.get("group_size"), a.get("dynamic")) == (
            8,
            "float",
            MX_BLOCK,
            True,
        ):
            activations.add("mxfp8")
        else:
            raise _fail(
                f"config_groups.{gname}.input_activations",
                a,
                "null or num_bits 8, type float, group_size 32, dynamic true (MXFP8)",
            )
    if len(activations) != 1:
        raise _fail("config_groups", sorted(map(str, activations)), "one input-activation scheme")
    return ExpertScheme(activations=activations.pop())


def quantization_config(scheme: ExpertScheme) -> dict[str, Any]:
    """The ``quantization_config`` dict of a model whose routed experts are MXFP4-packed under ``scheme``."""
    mx = {"type": "float", "symmetric": True, "group_size": MX_BLOCK, "strategy": "group"}
    weights = {"num_bits": 4, **mx, "dynamic": False, "scale_dtype": "torch.uint8"}
    acts = None
    if scheme.activations == "mxfp8":
        acts = {"num_bits": 8, **mx, "dynamic": True, "scale_dtype": "torch.uint8"}
    return {
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
                "format": FORMAT,
            }
        },
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "ignore": list(IGNORED),
    }


def set_quantization_config(config: AnyConfig, scheme: ExpertScheme | None) -> None:
    """Write (or, for ``None``, remove) ``quantization_config`` in ``config``'s text config, in place."""
    text = text_config_of(config)
    if isinstance(config, KimiK3Config):
        config.extra.pop("quantization_config", None)
    if scheme is None:
        text.extra.pop("quantization_config", None)
    else:
        text.extra["quantization_config"] = quantization_config(scheme)
