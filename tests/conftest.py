"""Shared pytest fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test module, restored afterwards: tiny models and the many small ops of the
    references gain nothing from a second thread, and on a shared machine OpenMP spinning can slow them
    tenfold. Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
