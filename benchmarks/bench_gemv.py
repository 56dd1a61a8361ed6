"""Decode-path study: the W4 op's N-major and K-major layouts against FP16 cuBLAS.

    python benchmarks/bench_gemv.py --out results/gemv            # sweep (H200: ~3 min)
    python benchmarks/bench_gemv.py --out results/gemv --quick    # dispatched launches only (~30 s)

For each token count M and Llama-2-7B / Llama-3-8B layer shape, both layouts of
``spear.kernels.layout.pack`` run through ``w4a16_matmul`` as dispatched (``pick_config``),
and, without ``--quick``, the CUDA-core loop (M <= 4) over a sweep of BN, warps and split-K
against the tensor-core tiles. Same protocol as bench_kernels.py: RTN 4-bit, group 128,
asymmetric, random non-zero weights; every launch checked against the fp32 reference at the
real shape first (SQNR > 40 dB); CUDA graphs cycling through weight copies beyond 2x L2;
median of replays. Writes gemv.json (every timing) and ``launch_table.json``: per layout and
token class M = 1, 2, 4, the CUDA-core launch with the best geometric mean, and the largest M
up to which it beats the tensor-core tiles (``--table`` here, in ``bench_kernels.py`` and in
``bench_decode.py`` reads it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_timing import copies_for, time_calls  # noqa: E402

from spear.kernels import pack, reference  # noqa: E402
from spear.kernels import launch, w4a16  # noqa: E402
from spear.kernels.dequant import dequantize  # noqa: E402
# the sweep's parts live in the package (spear tune-kernels runs the same sweep); tests reach them here
from spear.kernels.tune import (GRID, GROUP, LAYOUTS, _best, _launch_entry, fma_configs, geomean,  # noqa: E402,F401
                                launch_table, sqnr, sweep_loop, tc_config)
from spear.kernels.w4a16 import pick_config, w4a16_matmul  # noqa: E402
from spear.quant.primitives import rtn  # noqa: E402

SHAPES = [("q/o", 4096, 4096), ("7B gate_up", 22016, 4096), ("7B down", 4096, 11008),
          ("8B gate_up", 28672, 4096), ("8B down", 4096, 14336)]
QUICK_SHAPES = [SHAPES[0], SHAPES[4]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ms", help="token counts (default 1,2,4,16; --quick: 1,16,512)")
    p.add_argument("--quick", action="store_true", help="two shapes, dispatched launches only")
    p.add_argument("--all-shapes", action="store_true", help="with --quick: the five shapes of the sweep")
    p.add_argument("--budget-s", type=float, default=300, help="stop sweeping after this many seconds")
    p.add_argument("--layouts", default="nmajor,kmajor", help="comma-separated: nmajor, kmajor")
    p.add_argument("--table", help="launch_table.json to dispatch with (e.g. from an earlier sweep)")
    for key, vals in GRID.items():
        p.add_argument("--" + key.replace("_", "-"), default=",".join(map(str, vals)),
                       help=f"sweep values of {key} (default: %(default)s)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.table:
        try:
            launch.use_table(args.table)
        except ValueError as e:
            p.error(f"--table: {e}")
    ms = [int(v) for v in (args.ms or ("1,16,512" if args.quick else "1,2,4,16")).split(",")]
    layouts = {name: LAYOUTS[name] for name in args.layouts.split(",")}
    grid = {key: [int(v) for v in getattr(args, key).split(",")] for key in GRID}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    t_start = time.time()
    rows = []
    for m in ms:
        for label, n, k in (QUICK_SHAPES if args.quick and not args.all_shapes else SHAPES):
            g = torch.Generator(device="cuda").manual_seed(0)
            w = torch.randn(n, k, device="cuda", generator=g) * 0.02
            codes, scales, zeros = rtn(w, 4, GROUP, symmetric=False)
            scales = scales.half()
            del w
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ref = reference.w4a16_ec(x, codes, scales, zeros, GROUP)
            base = pack(codes, scales, zeros, GROUP)
            w16 = dequantize(base, torch.float16)
            fp = [w16] + [w16.clone() for _ in range(copies_for(w16.numel() * 2, l2) - 1)]
            rec = dict(m=m, shape=label, n=n, k=k, fp16_us=time_calls([lambda w_=w_: torch.nn.functional.linear(x, w_)
                                                                       for w_ in fp]))
            del fp, w16
            for layout, kmajor in layouts.items():
                ws = [pack(codes, scales, zeros, GROUP, kmajor=kmajor)
                      for _ in range(copies_for(base.qweight.numel() * 4, l2))]

                def timed(cfg):
                    s_ = sqnr(ref, w4a16_matmul(x, ws[0], config=cfg))
                    if s_ < 40:
                        return dict(error=f"SQNR {s_:.1f} dB")
                    return dict(us=time_calls([lambda w_=w_: w4a16_matmul(x, w_, config=cfg) for w_ in ws]))

                cfg = pick_config(m, n, k, GROUP, kmajor)
                r = dict(dispatched=str(cfg), **{f"dispatched_{kk}": v for kk, v in timed(cfg).items()})
                if not args.quick and m <= 4:
                    r.update(sweep_loop(x, ws, ref, m, n, k, kmajor, grid, deadline=t_start + args.budget_s))
                rec[layout] = r
                del ws
            torch.cuda.empty_cache()
            line = f"M={m:4d} {label:11s} fp16 {rec['fp16_us']:7.1f} us"
            for layout in layouts:
                us = rec[layout].get("dispatched_us")
                line += f" | {layout} {us:7.1f} us ({rec['fp16_us'] / us:.2f}x)" if us else f" | {layout} failed"
                sw = {kk: v["us"] for kk, v in rec[layout].get("sweep", {}).items() if "us" in v}
                if sw:
                    kb = min(sw, key=sw.get)
                    line += f" best loop {sw[kb]:.1f} ({kb}), tc {rec[layout]['tc_us']:.1f}"
            print(line, flush=True)
            rows.append(rec)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv.json").write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(),
                                                   torch=torch.__version__, rows=rows), indent=1))
    table = launch_table(rows, layouts)
    if table:
        (out / "launch_table.json").write_text(json.dumps(dict(w4a16.LAUNCH, **table), indent=1))
        print("launch table:", json.dumps(table), flush=True)
    for m in ms:
        rs = [r for r in rows if r["m"] == m]
        parts = [f"{layout} {statistics.median(r['fp16_us'] / r[layout]['dispatched_us'] for r in rs):.2f}x"
                 for layout in layouts if all(r[layout].get("dispatched_us") for r in rs)]
        print(f"M={m}: median FP16 / W4 as dispatched: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
