"""openk3: an open, exact and fast implementation of the Kimi K3 model family.

Main entry points::

    import openk3
    model = openk3.from_pretrained("path/to/folder")       # HF-format folder, official names
    logits = model(input_ids).logits                        # [B, T, vocab]
    model = openk3.build_model(openk3.get_preset("k3-tiny"))
"""

from openk3 import generate
from openk3.checkpoint import CheckpointMismatchError, from_pretrained, save_pretrained
from openk3.config import KimiK3Config, KimiLinearConfig, LinearAttnConfig, load_config
from openk3.model import KimiCache, build_model
from openk3.presets import PRESETS, get_preset

__version__ = "0.1.0"

__all__ = [
    "generate",
    "PRESETS",
    "CheckpointMismatchError",
    "KimiCache",
    "KimiK3Config",
    "KimiLinearConfig",
    "LinearAttnConfig",
    "build_model",
    "from_pretrained",
    "get_preset",
    "load_config",
    "save_pretrained",
]
