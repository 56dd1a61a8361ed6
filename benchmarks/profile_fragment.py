"""One launch of the fragment layout's W4 GEMM (Triton, or Gluon with --gluon) for ncu to read.

    ncu --clock-control none -k regex:_w4a16 -s 2 -c 1 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio \\
        python benchmarks/profile_fragment.py --m 128 --n 4096 --k 4096 --launch 64,128,64,4,4,3
    ncu ... -k regex:_w4_gluon ... python benchmarks/profile_fragment.py --m 128 --gluon 128,128,64,4,8

Runs the launch three times (the third is the one ``-s 2 -c 1`` profiles) on an RTN W4 g128 random
layer after checking it against the fp32 reference, and prints its SQNR and CUDA-graph time beside
cuBLAS FP16 (one weight copy each: L2-resident for the smaller shapes, unlike bench_kernels.py).
``--launch`` is BM,BN,BK,split_k,num_warps,num_stages (spear.kernels.launch.TritonConfig); ``--gluon``
is BNC,BM,BK,stages,split_k (spear.kernels.launch.GluonConfig).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spear.kernels import reference  # noqa: E402
from spear.kernels.launch import GluonConfig, TritonConfig  # noqa: E402
from spear.kernels.layout import Layout, pack  # noqa: E402
from spear.kernels.timing import time_calls  # noqa: E402
from spear.kernels.tune import GROUP, random_layer, sqnr  # noqa: E402
from spear.kernels.w4a16 import w4a16_matmul  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, required=True, help="tokens")
    p.add_argument("--n", type=int, default=4096, help="output features")
    p.add_argument("--k", type=int, default=4096, help="input features")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--launch", help="the Triton kernel: BM,BN,BK,split_k,num_warps,num_stages")
    which.add_argument("--gluon", help="the Gluon kernel: BNC,BM,BK,stages,split_k")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.gluon:
        from spear.kernels.gluon_w4 import gluon_w4a16

        try:
            gcfg = GluonConfig(*(int(v) for v in args.gluon.split(",")))
        except (TypeError, ValueError) as e:
            p.error(f"--gluon: five integers BNC,BM,BK,stages,split_k ({e}); got {args.gluon!r}")
        cfg = gcfg

        def run(x, w):
            return gluon_w4a16(x, w, None, gcfg)
    else:
        try:
            cfg = TritonConfig(*(int(v) for v in args.launch.split(",")))
        except (TypeError, ValueError):
            p.error(f"--launch: six integers BM,BN,BK,split_k,num_warps,num_stages; got {args.launch!r}")

        def run(x, w):
            return w4a16_matmul(x, w, config=cfg)
    codes, scales, zeros = random_layer(args.n, args.k)
    w = pack(codes, scales, zeros, GROUP, layout=Layout.FRAGMENT)
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.float16)
    s = sqnr(reference.w4a16_ec(x, codes, scales, zeros, GROUP), run(x, w))
    for _ in range(3):
        run(x, w)
    torch.cuda.synchronize()
    w16 = reference.dequantize(codes, scales, zeros, GROUP).half()
    us = time_calls([lambda: run(x, w)])
    fp16 = time_calls([lambda: torch.nn.functional.linear(x, w16)])
    print(f"M={args.m} {args.n}x{args.k} {cfg}: {us:.1f} us, cuBLAS FP16 {fp16:.1f} us ({fp16 / us:.2f}x), "
          f"SQNR {s:.1f} dB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
