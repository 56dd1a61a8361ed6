"""Kernel tests run on the CPU through Triton's interpreter unless a CUDA GPU is present
(TRITON_INTERPRET is set once, in tests/conftest.py, before anything imports ``spear.kernels``)."""

import pytest
import torch


@pytest.fixture()
def poisoned(monkeypatch):
    """Every buffer a launcher allocates starts as NaN (floats) or garbage (ints)."""
    from spear.kernels import _common

    def alloc(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.fill_(float("nan")) if dtype.is_floating_point else t.fill_(-12345)

    monkeypatch.setattr(_common, "alloc", alloc)
