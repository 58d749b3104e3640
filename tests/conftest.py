"""Shared pytest fixtures and the markers' meaning.

Markers (registered in ``pyproject.toml``): ``slow`` (over ~20 s on a 2-core CPU; ``scripts/test.sh`` leaves
them out unless ``CI=true`` or ``--full``), ``gpu`` (needs CUDA; every ``test_gpu_*`` test gets it here) and
``interpreter`` (Triton kernels in Triton's CPU interpreter; every ``test_interpreter_*`` test gets it here).
Select with ``-m``, e.g. ``python -m pytest -m "interpreter and not slow"``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest
import torch

if (
    not torch.cuda.is_available()
    and importlib.util.find_spec("triton") is not None
    and tuple(int(x) for x in importlib.metadata.version("triton").split(".")[:2]) >= (3, 9)
):
    # Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is first imported; any
    # test module may import the model, which imports the kernels, so set it before every test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Mark tests by their name's prefix: ``test_gpu_*`` → ``gpu``, ``test_interpreter_*`` → ``interpreter``."""
    for item in items:
        name = getattr(item, "originalname", item.name)
        if name.startswith("test_gpu_"):
            item.add_marker(pytest.mark.gpu)
        elif name.startswith("test_interpreter_"):
            item.add_marker(pytest.mark.interpreter)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test module, restored afterwards: tiny models and the many small ops of the
    references gain nothing from a second thread, and on a shared machine OpenMP spinning can slow them
    tenfold. Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def fill_empty_with_nan(monkeypatch) -> None:
    """From now until ``monkeypatch`` undoes it, ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty``
    return floating-point tensors filled with NaN (integer tensors as allocated): an output element a kernel
    forgets to write then shows up as NaN instead of passing on whatever memory held."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() or t.is_complex() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: fill(new_empty(self, *a, **k)))


@pytest.fixture
def nan_empty(monkeypatch):
    """:func:`fill_empty_with_nan` for one test. Kernel test modules opt in for every test with
    ``pytestmark = pytest.mark.usefixtures("nan_empty")``."""
    fill_empty_with_nan(monkeypatch)
