"""Output heads in W8A16 (spear.kernels.w8a16) against FP16 cuBLAS, by token count.

    python benchmarks/bench_w8.py --out results/w8            # dispatched launches (H200: ~1 min)
    python benchmarks/bench_w8.py --out results/w8 --sweep    # + a launch sweep at M = 1, 4 (a few min)

For the heads of Llama-2-7B (32000 x 4096) and Llama-3-8B (128256 x 4096) and each token count
M: torch.nn.functional.linear with the fp16 weight (cuBLAS) and ``w8a16_matmul`` with the launch
``LAUNCH`` gives for M; with ``--sweep``, at M = 1 and 4, every BN x BK x num_warps of the grid
below. Random int8 weights over the full range and per-row scales; fp16 activations; every launch
checked against the fp32 reference at the real shape first (SQNR > 40 dB). Timing as in
bench_gemv.py (spear.kernels.timing): CUDA graphs cycling through weight copies beyond 2x L2,
median of replays after warm-up. GB/s: bytes of the weight as stored (int8 + fp32 scales; fp16
for cuBLAS) per second, beside the copy rate measured here. Writes results.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_timing import ceilings, copies_for, time_calls  # noqa: E402

from spear.kernels.reference import w8a16 as reference_w8a16  # noqa: E402
from spear.kernels.w8a16 import pick_config, w8a16_matmul  # noqa: E402

SHAPES = [("Llama-2-7B head", 32000, 4096), ("Llama-3-8B head", 128256, 4096)]
MS = (1, 2, 4, 8, 16, 32, 64)
# BK 64: the CUDA-core loop's activation rows skip a trip through shared memory below 32 * num_warps
# elements (spear/kernels/w8a16.py)
SWEEP = dict(BN=(16, 32, 64, 128), BK=(64, 128, 256, 512), num_warps=(2, 4, 8))
SWEEP_MS = (1, 4)


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return float(20 * torch.log10(ref.norm() / (ref - out).norm()))


def _gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json")
    p.add_argument("--ms", default=",".join(map(str, MS)), help="token counts (default: %(default)s)")
    p.add_argument("--sweep", action="store_true",
                   help=f"also time BN x BK x num_warps {tuple(SWEEP.values())} at M = {SWEEP_MS}")
    p.add_argument("--budget-s", type=float, default=900, help="stop sweeping after this many seconds")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the W8 kernel and cuBLAS are timed there)")
    ms = [int(v) for v in args.ms.split(",")]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copy_bw, _ = ceilings()
    print(f"{torch.cuda.get_device_name()}: copy rate {copy_bw / 1e9:.0f} GB/s", flush=True)
    t_start = time.time()
    rows, sweep = [], []
    for label, n, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randint(-128, 128, (n, k), device="cuda", generator=g, dtype=torch.int8)
        scale = (0.5 + torch.rand(n, device="cuda", generator=g)) * 1e-2
        w8_bytes = q.numel() + 4 * scale.numel()
        w16 = (q.float() * scale[:, None]).half()
        fp = [w16] + [w16.clone() for _ in range(copies_for(2 * w16.numel(), l2) - 1)]
        ws = [(q, scale)] + [(q.clone(), scale.clone()) for _ in range(copies_for(w8_bytes, l2) - 1)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ref = reference_w8a16(x, q, scale)

            def timed(cfg=None):
                s_ = sqnr(ref, w8a16_matmul(x, q, scale, config=cfg).float())
                if s_ < 40:
                    return dict(error=f"SQNR {s_:.1f} dB")
                us = time_calls([lambda w_=w_: w8a16_matmul(x, *w_, config=cfg) for w_ in ws])
                return dict(us=us, gbps=_gbps(w8_bytes, us))

            fp16_us = time_calls([lambda w_=w_: torch.nn.functional.linear(x, w_) for w_ in fp])
            rec = dict(m=m, shape=label, n=n, k=k, fp16_us=fp16_us, fp16_gbps=_gbps(2 * w16.numel(), fp16_us),
                       launch=pick_config(m), **{f"w8_{kk}": v for kk, v in timed().items()})
            line = f"M={m:3d} {label}: fp16 {fp16_us:7.1f} us {rec['fp16_gbps']:5.0f} GB/s"
            if "w8_us" in rec:
                line += (f" | W8 {rec['w8_us']:7.1f} us {rec['w8_gbps']:5.0f} GB/s "
                         f"({rec['w8_gbps'] * 1e9 / copy_bw:.0%} of copy) {fp16_us / rec['w8_us']:.2f}x")
            else:
                line += f" | W8 failed: {rec['w8_error']}"
            print(line, flush=True)
            rows.append(rec)
            if args.sweep and m in SWEEP_MS:
                for bn, bk, nw in itertools.product(*SWEEP.values()):
                    if time.time() > t_start + args.budget_s:
                        print("sweep budget spent", flush=True)
                        break
                    cfg = dict(BN=bn, BK=bk, num_warps=nw)
                    try:
                        r = timed(cfg)
                    except Exception as e:  # a launch that does not compile (resources) is a result
                        r = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
                    sweep.append(dict(m=m, shape=label, launch=cfg, **r))
                done = [s for s in sweep if s["m"] == m and s["shape"] == label and "us" in s]
                if done:
                    best = min(done, key=lambda s: s["us"])
                    print(f"    sweep best at M={m}: {best['launch']} {best['us']:.1f} us {best['gbps']:.0f} GB/s "
                          f"({len(done)} launches)", flush=True)
        del fp, ws, w16, q, scale
        torch.cuda.empty_cache()
    best = {}
    for m in sorted({s["m"] for s in sweep}):
        # the launch with the smallest summed time over the shapes it ran at
        per = {}
        for s in sweep:
            if s["m"] == m and "us" in s:
                per.setdefault(json.dumps(s["launch"], sort_keys=True), []).append(s["us"])
        full = {kk: sum(v) for kk, v in per.items() if len(v) == len(SHAPES)}
        if full:
            kb = min(full, key=full.get)
            best[str(m)] = dict(launch=json.loads(kb), total_us=full[kb])
            print(f"best launch at M={m} over both heads: {kb} ({full[kb]:.1f} us summed)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(
        date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
        copy_gbps=copy_bw / 1e9, rows=rows, sweep=sweep, sweep_best=best), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
