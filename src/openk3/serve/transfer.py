"""Host lists to device tensors without waiting for the device.

``torch.tensor(values, device="cuda")`` builds the tensor in pageable host memory and copies it with a
blocking copy, which PyTorch ends with a stream synchronisation: the host waits until every kernel already
queued has run, and the device then idles while the host prepares the next ones. Indexing a CUDA tensor with a
Python list does the same. :func:`to_device` copies with ``non_blocking=True`` instead: from pageable memory
CUDA stages the bytes before the call returns (so the temporary may be freed at once) and waits for nothing
on the device (``docs/references.md#one-host-wait-per-step``).
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, copied there without a host wait (no copy on a
    CPU). ``values``: a (nested) list of numbers."""
    host = torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.to(device, non_blocking=True)
