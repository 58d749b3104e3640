"""Official-format (Hugging Face) checkpoints: the name table and folder I/O."""

from openk3.checkpoint.io import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    checkpoint_with_tokenizer,
    from_pretrained,
    latest_checkpoint,
    load_state,
    save_pretrained,
)
from openk3.checkpoint.names import NAME_TABLE

__all__ = [
    "NAME_TABLE",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "checkpoint_with_tokenizer",
    "from_pretrained",
    "latest_checkpoint",
    "load_state",
    "save_pretrained",
]
