"""openk3: an open, exact and fast implementation of the Kimi K3 model family.

Main entry points::

    import openk3
    model = openk3.from_pretrained("path/to/folder")       # HF-format folder, official names
    logits = model(input_ids).logits                        # [B, T, vocab]
    model = openk3.build_model(openk3.get_preset("k3-tiny"))
"""

import importlib

_EXPORTS = {
    "generate": "openk3.generate",
    "CheckpointMismatchError": "openk3.checkpoint",
    "from_pretrained": "openk3.checkpoint",
    "save_pretrained": "openk3.checkpoint",
    "KimiK3Config": "openk3.config",
    "KimiK3VisionConfig": "openk3.config",
    "KimiLinearConfig": "openk3.config",
    "LinearAttnConfig": "openk3.config",
    "load_config": "openk3.config",
    "KimiCache": "openk3.model",
    "build_model": "openk3.model",
    "PRESETS": "openk3.presets",
    "get_preset": "openk3.presets",
}
"""Public names and the module each comes from; imported on first use (PEP 562), so ``openk3 --help`` and
other commands that need no model do not import torch."""


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None and module != f"openk3.{name}":
        return getattr(importlib.import_module(module), name)
    try:  # a submodule (openk3.generate, openk3.presets, ...), as an eager import would have bound it
        return importlib.import_module(f"openk3.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"openk3.{name}":
            raise
        raise AttributeError(f"module 'openk3' has no attribute {name!r}") from None


__version__ = "0.1.0"

__all__ = [
    "generate",
    "PRESETS",
    "CheckpointMismatchError",
    "KimiCache",
    "KimiK3Config",
    "KimiK3VisionConfig",
    "KimiLinearConfig",
    "LinearAttnConfig",
    "build_model",
    "from_pretrained",
    "get_preset",
    "load_config",
    "save_pretrained",
]
