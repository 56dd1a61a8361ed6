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


@pytest.fixture(params=["forward", "reversed"])
def grid_order(request, monkeypatch):
    """The interpreter runs a launch's programs one after another in grid order; "reversed" runs
    them last to first, so a program that reads what another one writes shows whether it relied on
    running after it (GPU programs run concurrently, in no promised order)."""
    if request.param == "reversed":
        from tests.kernels._helpers import DEVICE

        if DEVICE == "cuda":
            pytest.skip("the interpreter's program order")
        from triton.runtime import interpreter

        builder = type(interpreter.interpreter_builder)
        forward = builder.set_grid_idx

        def reversed_idx(self, x, y, z):
            gx, gy, gz = self.grid_dim
            forward(self, gx - 1 - x, gy - 1 - y, gz - 1 - z)

        monkeypatch.setattr(builder, "set_grid_idx", reversed_idx)
    return request.param
