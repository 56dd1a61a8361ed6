"""Kernel tests run on the CPU through Triton's interpreter unless a CUDA GPU is present.

The variable must be set before ``triton.jit`` decorates the kernels, i.e. before the
first import of ``spear.kernels``; conftest modules load before the tests beside them.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture()
def poisoned(monkeypatch):
    """Every buffer a launcher allocates starts as NaN (floats) or garbage (ints)."""
    from spear.kernels import _common

    def alloc(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.fill_(float("nan")) if dtype.is_floating_point else t.fill_(-12345)

    monkeypatch.setattr(_common, "alloc", alloc)
