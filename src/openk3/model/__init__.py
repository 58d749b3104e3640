"""The K3 / Kimi-Linear model, one concept per file (see the README's file tree)."""

from openk3.model.cache import KDACache, KimiCache, MLACache
from openk3.model.modeling import (
    CausalLMOutput,
    KimiK3ForConditionalGeneration,
    KimiLinearForCausalLM,
    KimiLinearModel,
    build_model,
)

__all__ = [
    "CausalLMOutput",
    "KDACache",
    "KimiCache",
    "KimiK3ForConditionalGeneration",
    "KimiLinearForCausalLM",
    "KimiLinearModel",
    "MLACache",
    "build_model",
]
