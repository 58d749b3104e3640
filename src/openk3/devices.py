"""The device check every entry point shares: a CUDA device asked for where torch sees none is refused with one
line before anything is built (the commands print a ``ValueError`` as ``openk3: error: …``)."""

from __future__ import annotations

import torch


def check_device(device: str | torch.device) -> None:
    """Raise ``ValueError`` when ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``) is a
    CUDA device and ``torch.cuda.is_available()`` is False."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but torch.cuda.is_available() is False")
