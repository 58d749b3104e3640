"""MicroVM agent sandboxes with pause, resume, fork and snapshot, behind an E2B-compatible API (docs/sandbox.md).

Public entry points (imported on first use, so that ``openk3 --help`` stays light): :class:`SandboxManager`,
:class:`ManagerConfig`, :class:`MachineSpec`, :class:`ImageConfig`, :func:`build_image`, :func:`create_app`.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "SandboxManager": "openk3.sandbox.manager",
    "ManagerConfig": "openk3.sandbox.manager",
    "SandboxError": "openk3.sandbox.manager",
    "MachineSpec": "openk3.sandbox.vmm",
    "ImageConfig": "openk3.sandbox.image",
    "build_image": "openk3.sandbox.image",
    "create_app": "openk3.sandbox.api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'openk3.sandbox' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
