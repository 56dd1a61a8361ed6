"""Kernel tests run on the CPU through Triton's interpreter unless a CUDA GPU is present
(TRITON_INTERPRET is set once, in tests/conftest.py, before anything imports ``spear.kernels``)."""

import pytest
import torch


@pytest.fixture()
def poisoned():
    """Every tensor allocated uninitialized (torch.empty and kin: the launchers' outputs and
    workspaces among them) starts as NaN (floats) or its dtype's largest value (integers), so a
    kernel that leaves part of one unwritten shows. torch fills uninitialized memory so while
    deterministic algorithms are on; warn_only: ops without a deterministic variant still run."""
    assert torch.utils.deterministic.fill_uninitialized_memory, "torch's fill of uninitialized memory is off"
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


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
