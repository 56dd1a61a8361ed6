"""Prefill W4 path: dequantize the packed weights, then cuBLAS, against FP16 cuBLAS.

    python benchmarks/bench_dequant.py --out results/dequant        # H200: ~1 min

From ``KernelPolicy.*_cublas_min_m`` tokens on the W4 op dequantizes the packed weight and calls
cuBLAS. This splits that time into its two parts, for each packed layout (the fragment layout the
engine serves, and the N-major fallback): the dequantize kernel and the GEMM on W_hat (N, K).
Shapes: the five Llama-2-7B / Llama-3-8B layer shapes; RTN 4-bit,
group 128, asymmetric, random non-zero weights; every dequantized weight checked bit-exact
against the reference first; CUDA graphs cycling through weight copies beyond 2x L2, median of
replays (kernel_timing.py). Writes dequant.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_timing import ceilings, copies_for, time_calls  # noqa: E402

from spear.kernels import reference  # noqa: E402
from spear.kernels.layout import Layout, pack  # noqa: E402
from spear.kernels.dequant import dequantize  # noqa: E402
from spear.quant.primitives import rtn  # noqa: E402

GROUP = 128
SHAPES = [("q/o", 4096, 4096), ("7B gate_up", 22016, 4096), ("7B down", 4096, 11008),
          ("8B gate_up", 28672, 4096), ("8B down", 4096, 14336)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ms", default="512,2048,4096", help="token counts (default: %(default)s)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    ms = [int(v) for v in args.ms.split(",")]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw, _ = ceilings()
    rows = []
    for label, n, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        codes, scales, zeros = rtn(torch.randn(n, k, device="cuda", generator=g) * 0.02, 4, GROUP, symmetric=False)
        scales = scales.half()
        expect = reference.dequantize(codes, scales, zeros, GROUP).half()
        packs = {lay.value: [pack(codes, scales, zeros, GROUP, layout=lay) for _ in range(copies_for(n * k // 2, l2))]
                 for lay in Layout}
        for tag, ws in packs.items():
            if not torch.equal(dequantize(ws[0], torch.float16), expect):
                raise SystemExit(f"{label}: dequantize ({tag}) differs from the reference")
        fp = [expect] + [expect.clone() for _ in range(copies_for(n * k * 2, l2) - 1)]
        deq = {tag: time_calls([lambda w_=w_: dequantize(w_, torch.float16) for w_ in ws]) for tag, ws in packs.items()}
        floor = (n * k * 2.5 + n * (k // GROUP) * 3) / bw * 1e6  # 0.5 B read + 2 B written per weight
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            r = dict(shape=label, n=n, k=k, m=m, dequant_floor_us=floor,
                     fp16_us=time_calls([lambda w_=w_: torch.nn.functional.linear(x, w_) for w_ in fp]),
                     gemm_us=time_calls([lambda: torch.nn.functional.linear(x, expect)]))
            for tag, ws in packs.items():
                r[f"dequant_{tag}_us"] = deq[tag]
                r[f"w4_{tag}_us"] = time_calls([lambda w_=w_: torch.nn.functional.linear(
                    x, dequantize(w_, torch.float16)) for w_ in ws])
            rows.append(r)
            print(f"M={m:5d} {label:11s} fp16 {r['fp16_us']:7.1f} gemm {r['gemm_us']:7.1f} | "
                  + " | ".join(f"{tag}: dequant {r[f'dequant_{tag}_us']:6.1f} total {r[f'w4_{tag}_us']:7.1f} "
                               f"({r['fp16_us'] / r[f'w4_{tag}_us']:.2f}x)" for tag in packs)
                  + f" | dequant floor {floor:.1f} us", flush=True)
        del packs, fp
        torch.cuda.empty_cache()
    for m in ms:
        rs = [r for r in rows if r["m"] == m]
        med = {t.value: sorted(r["fp16_us"] / r[f"w4_{t.value}_us"] for r in rs)[len(rs) // 2] for t in Layout}
        print(f"M={m}: median FP16 / W4 over the shapes: " + ", ".join(f"{t} {v:.2f}x" for t, v in med.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dequant.json").write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"),
                                                      device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                      copy_bw=bw, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
