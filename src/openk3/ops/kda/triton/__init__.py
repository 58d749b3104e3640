"""Triton KDA kernels (GPU): chunked forward and backward, decode and verify on a state pool; see README.md here.

This package imports without Triton (:mod:`~openk3.ops.kda.triton.dispatch` decides whether the public
ops in :mod:`openk3.ops.kda` use the kernels); the entry points below import ``triton`` on first access.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

_EXPORTS = MappingProxyType(
    {
        "ChunkKDAFunction": "chunk_function",
        "chunk_kda_triton": "chunk_function",
        "fused_recurrent_kda_decode": "decode",
        "fused_recurrent_kda_triton": "decode",
        "KDAOptions": "config",
        "LaunchConfig": "config",
    }
)

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
