"""Count and locate the places where training code reads device data on the host (a host sync on a GPU).

On a GPU, every read of a tensor's value by Python (``.item()``, ``float(t)``, ``if t.any():``, ``.tolist()``,
``.cpu()``) and every operator whose output shape depends on the data (``nonzero``, boolean-mask indexing,
``torch.unique``, ``masked_select``, ``repeat_interleave`` with tensor repeats) makes the host wait until the
device has run everything queued before it. A training step that does this inside its forward or backward stops
the host from running ahead of the GPU, and the GPU then idles while the host launches the next kernels.

:class:`HostSyncAudit` finds them on any device, the CPU included (where they cost nothing, so they go unseen
by timing): a ``TorchDispatchMode`` sees every operator call and keeps those in :data:`SYNC_OPS` (and copies
from a non-CPU device to the CPU); the tensor methods that read values without an operator on a CPU tensor
(``tolist``, ``numpy``, ``cpu``) are wrapped for the duration of the ``with`` block. Each event is recorded with
the innermost ``openk3`` source line that caused it (or the innermost non-torch line). Operators that read
values inside another operator's C++ kernel (e.g. the CPU loop of ``grouped_mm`` over its offsets) are below
the dispatch mode and are not counted: they are no host syncs on a GPU, where those kernels read on the device.

Usage::

    with HostSyncAudit() as audit:
        loss = step()
    audit.counts()      # {"aten::_local_scalar_dense @ openk3/train/trainer.py:776": 1, ...}
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",  # .item(), float(t), int(t), bool(t), if t: ...
        "nonzero",  # torch.nonzero, torch.where(mask) with one argument (t[mask]: ``index``, below)
        "masked_select",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "repeat_interleave",  # with tensor repeats and no output_size
        "equal",
        "bincount",  # output length max(input) + 1
    }
)
"""aten operator names (no overload) that read device data on the host."""

_HOST_READS = ("tolist", "numpy", "cpu")
"""Tensor methods that read values on the host without an operator when the tensor is already on the CPU."""


def _where() -> str:
    """``file:line`` of the innermost frame in openk3 (else the innermost frame outside torch)."""
    frames = [f for f in traceback.extract_stack() if not f.filename.endswith("host_syncs.py")]
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if "/openk3/" in path:
            return f"openk3/{path.rsplit('/openk3/', 1)[1]}:{frame.lineno}"
    for frame in reversed(frames):
        if "/torch/" not in frame.filename.replace("\\", "/"):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


class HostSyncAudit(TorchDispatchMode):
    """Records each host read inside the ``with`` block as ``(what, where)`` in :attr:`events`.

    ``what`` is ``"aten::<op>"`` for an operator of :data:`SYNC_OPS` or a copy from a non-CPU device to the
    CPU, ``"Tensor.<method>"`` for :data:`_HOST_READS` (one event per call: the copy such a call makes on a GPU
    is not counted again). Operators called inside another operator's kernel are not seen (module docstring).
    Not thread-safe: the tensor methods are wrapped process-wide while the block runs.

    ``device``: where the audited code runs. On a GPU (``"cuda"``), reads of CPU tensors are no syncs and are
    not counted (e.g. AdamW's step counts kept on the host); ``None`` (default) or ``"cpu"`` counts every read,
    so a CPU run shows what would sync on a GPU.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.device = None if device is None else torch.device(device)
        self.events: list[tuple[str, str]] = []
        self._saved: dict[str, object] = {}
        self._in_read = 0  # > 0 inside a wrapped tensor method: its own copy is not a second event

    def __enter__(self):
        for name in _HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._saved.items():
                setattr(torch.Tensor, name, original)
            self._saved.clear()

    def _wrap(self, name: str, original):
        def read(tensor, *args, **kwargs):
            if not self._in_read and not self._host_local((tensor,)):
                self.events.append((f"Tensor.{name}", _where()))
            self._in_read += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._in_read -= 1

        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::", 1)[-1]
        if self._in_read or self._host_local(args):
            pass
        elif name in SYNC_OPS:
            if name != "repeat_interleave" or kwargs.get("output_size") is None:
                self.events.append((f"aten::{name}", _where()))
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_index(args):
            self.events.append((f"aten::{name} with a boolean mask", _where()))
        elif name in ("_to_copy", "copy_") and _to_host(func, args, kwargs):
            self.events.append((f"aten::{name} to cpu", _where()))
        return func(*args, **kwargs)

    def _host_local(self, args) -> bool:
        """On a GPU run, whether every tensor argument is on the CPU (reading it waits for nothing)."""
        if self.device is None or self.device.type == "cpu":
            return False
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return bool(tensors) and all(t.device.type == "cpu" for t in tensors)

    def counts(self) -> dict[str, int]:
        """``{"what @ where": count}``, most frequent first."""
        return dict(collections.Counter(f"{what} @ {where}" for what, where in self.events).most_common())

    def total(self) -> int:
        """Number of host reads recorded."""
        return len(self.events)


def _bool_index(args) -> bool:
    """Whether an ``index``/``index_put`` call has a boolean (mask) index: its shape depends on the data."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


def _to_host(func, args, kwargs) -> bool:
    """Whether a ``_to_copy``/``copy_`` call copies from a non-CPU device to the CPU."""
    if func._schema.name.endswith("copy_"):
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
    src, device = args[0], kwargs.get("device")
    return src.device.type != "cpu" and device is not None and torch.device(device).type == "cpu"
