"""The kernel benchmarks' timing protocol (bench_kernels.py, bench_gemv.py; spear.kernels.timing)
and the GPU's ceilings."""

from __future__ import annotations

import torch

from spear.kernels.timing import copies_for, profile_calls, time_calls  # noqa: F401  (the benchmarks import them from here)

DEVICE = "cuda"


def ceilings():
    """Memory and fp16-MMA ceilings measured here (an SM copy kernel: D2D memcpy uses the slower copy engines)."""
    a = torch.randn(1 << 29, device=DEVICE).half()
    b = torch.empty_like(a)
    t = time_calls([lambda: torch.neg(a, out=b)])
    bw = 4 * a.numel() / (t * 1e-6)
    x = torch.randn(8192, 8192, device=DEVICE).half()
    t = time_calls([lambda: x @ x])
    return bw, 2 * 8192**3 / (t * 1e-6)
