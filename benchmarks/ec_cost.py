"""Where the fused EC's time goes at one token: the W4 op with and without a gated rank-16 EC.

    python benchmarks/ec_cost.py                    # H200: ~30 s

Shapes and launches as the engine serves Llama-3-8B at batch 1 (K-major weights, the fused
gate/up with its SiLU·mul epilogue); RTN 4-bit, group 128, symmetric, random non-zero weights;
graph replays over weight copies beyond 2x L2, median (kernel_timing.py). With a modified copy
of the kernels on PYTHONPATH (parts of the EC left out), the difference against the full EC
places its cost (scripts/gpu_cost.sh); the results of such copies are not checked.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH, so a modified copy there wins

from kernel_timing import copies_for, time_calls  # noqa: E402

from spear.kernels import pack, pack_ec  # noqa: E402
from spear.kernels import w4a16  # noqa: E402
from spear.kernels.w4a16 import w4a16_matmul  # noqa: E402
from spear.quant.primitives import rtn  # noqa: E402

SHAPES = [("q/o", 4096, 4096, 0), ("qkv 8B", 6144, 4096, 0), ("gate_up 8B", 28672, 4096, 1),
          ("down 8B", 4096, 14336, 0)]


def main() -> int:
    print("kernels from", Path(w4a16.__file__).parent, flush=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    g = torch.Generator(device="cuda").manual_seed(0)
    for label, n, k, act in SHAPES:
        codes, scales, zeros = rtn(torch.randn(n, k, device="cuda", generator=g) * 0.02, 4, 128, symmetric=True)
        ws = [pack(codes, scales.half(), zeros, 128, symmetric=True, kmajor=True)
              for _ in range(copies_for(n * k // 2, l2))]
        r, h = 16, 16
        ec = pack_ec(torch.randn(r, k, device="cuda", generator=g) / k**0.5,
                     torch.randn(n, r, device="cuda", generator=g) * 0.02, 0.5, torch.float16,
                     torch.randn(h, r, device="cuda", generator=g) / r**0.5, torch.zeros(h, device="cuda"),
                     torch.randn(r, h, device="cuda", generator=g) / h**0.5, torch.zeros(r, device="cuda"), bound=0.5)
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        w4 = time_calls([lambda w_=w_: w4a16_matmul(x, w_, act=act) for w_ in ws])
        fused = time_calls([lambda w_=w_: w4a16_matmul(x, w_, ec=ec, act=act) for w_ in ws])
        print(f"{label:11s} {n:6d}x{k:<6d} w4 {w4:6.2f} us  fused EC r16 h16 {fused:6.2f} us  (+{fused - w4:.2f})",
              flush=True)
        del ws
    return 0


if __name__ == "__main__":
    sys.exit(main())
