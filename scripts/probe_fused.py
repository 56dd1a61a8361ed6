"""Probe the fused EC for hangs and races on the GPU: each case (M, shape, layout) runs in its own
process under a timeout; a case loops the fused kernel, synchronizing after every call, and checks
the counters are re-armed and the output repeats bit for bit.
    python scripts/probe_fused.py [--calls N] [--timeout S] [--root DIR]   (DIR: a copy of the tree to import)
"""
import argparse
import os
import subprocess
import sys
import time

CASES = ([(m, 4096, 4096, 128, False) for m in (5, 7, 8, 12, 16, 24, 33, 64)]
         + [(m, 11008, 4096, 64, False) for m in (7, 16, 33)]
         + [(m, 4096, 4096, 128, True) for m in (1, 2, 4, 16, 33)])


def one(m, n, k, gs, km, calls):
    import torch
    from tests.kernels._helpers import make_ec, setup_case
    from spear.kernels.w4a16 import w4a16_matmul
    ec = make_ec(n, k, 32, 32, torch.float16, seed=1)
    x, w, b, e, expect = setup_case(m, k, n, gs, False, torch.float16, seed=m, ec=ec, kmajor=km)
    first = w4a16_matmul(x, w, b, e, ec_mode=1)
    torch.cuda.synchronize()
    err = (first.float() - expect.float()).abs().max().item()
    t0 = time.perf_counter()
    bad = 0
    for i in range(calls):
        o = w4a16_matmul(x, w, b, e, ec_mode=1)
        torch.cuda.synchronize()
        if not torch.equal(o, first) or int(w.locks.abs().sum()):
            bad += 1
    print(f"ok  M={m:3d} {n}x{k} g{gs} kmajor={km}: {calls} calls {time.perf_counter() - t0:.2f}s "
          f"maxerr {err:.3g} mismatches {bad}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--timeout", type=float, default=20)
    p.add_argument("--root", default=".")
    p.add_argument("--case", type=int)
    a = p.parse_args()
    import torch
    if not torch.cuda.is_available():
        sys.exit("probe_fused.py needs a CUDA GPU (the fused EC's counters are CUDA-only code)")
    if a.case is not None:
        one(*CASES[a.case], a.calls)
        sys.exit(0)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(a.root) + ":" + os.getcwd())
    for i, c in enumerate(CASES):
        try:
            r = subprocess.run([sys.executable, __file__, "--case", str(i), "--calls", str(a.calls)], env=env,
                               timeout=a.timeout, capture_output=True, text=True)
            print(r.stdout.strip() or f"ERR {c}: {r.stderr.strip()[-300:]}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"HANG M={c[0]} {c[1]}x{c[2]} g{c[3]} kmajor={c[4]}", flush=True)
