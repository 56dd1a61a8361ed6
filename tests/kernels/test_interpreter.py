"""Without a CUDA GPU the kernel tests must run the Triton kernels through the interpreter, not the
torch fallbacks the launchers take for CPU tensors when it is off (they would then compare the
reference with itself). tests/conftest.py sets TRITON_INTERPRET before anything imports
``spear.kernels``; this checks that it took effect whatever test ran first."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs the compiled kernels")


def test_kernels_run_through_the_interpreter(monkeypatch):
    """``INTERPRET`` is on, the kernels were decorated as interpreted functions, and a launch on CPU
    tensors really enters the interpreter (its ``run`` is counted) and computes SiLU·mul.

    Catches: ``fused._use_kernel`` reduced to ``t.is_cuda``: every CPU launch then takes the torch
    fallback, and tests/kernels/test_fused.py compares that fallback with the same reference."""
    from triton.runtime.interpreter import InterpretedFunction

    from spear.kernels import _common, fused

    assert _common.INTERPRET is True
    assert isinstance(fused._silu_mul_kernel, InterpretedFunction)
    launches = []
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches.append(self.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    out = fused.silu_mul(gate, up)
    assert launches == ["_silu_mul_kernel"]
    ref = F.silu(gate.double()) * up.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)



def test_the_top_level_conftest_turns_it_on_for_every_folder():
    """A run of tests outside tests/kernels alone (``pytest tests/serve``: the engine's fused-kernel
    tests) loads only tests/conftest.py before importing ``spear.kernels``; in a fresh process
    without TRITON_INTERPRET that conftest alone must turn the interpreter on.

    Catches: the variable set in tests/kernels/conftest.py only (the old placement), where
    ``pytest tests/serve`` compared the engine's kernels' torch fallbacks with the reference."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = "import tests.conftest, spear.kernels._common as c; assert c.INTERPRET is True, 'interpreter off'"
    res = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[2], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
