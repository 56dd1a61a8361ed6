"""Seconds to self-sample the calibration's text and its top-k teacher, by sequences per forward pass.

    python benchmarks/bench_sampling.py --device cuda --batch-sizes 64,256 --samples 512
    python benchmarks/bench_sampling.py --device cpu --batch-sizes 16,64 --samples 64

Each batch size runs ``sample_with_teacher`` (spear/compensate/teacher.py: the sampling loop the
calibration runs, the teacher recorded from it) on the FP default model without the cache, after one
untimed warm-up batch. Sequence i has its own generator, so the batch size changes no draw; only
differently batched arithmetic can round a near-tie the other way, which the last column counts
(the share of tokens equal to the first batch size's run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spear.compensate.teacher import sample_with_teacher  # noqa: E402
from spear.config import SampleConfig  # noqa: E402
from spear.eval.report import machine_label  # noqa: E402
from spear.models.loading import load_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--top-k", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if not sizes or min(sizes) < 1 or args.samples < 1:
        raise SystemExit("--batch-sizes and --samples must be positive")
    model, tok = load_model(args.model, device=args.device)

    def sync():
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()

    rows, first = [], None
    for b in sizes:
        warm = SampleConfig(n=min(b, args.samples), length=args.length, seed=args.seed + 1, batch_size=b)
        sample_with_teacher(model, tok, warm, args.top_k, progress=False, cache=False)
        sync()
        cfg = SampleConfig(n=args.samples, length=args.length, seed=args.seed, batch_size=b)
        t0 = time.perf_counter()
        ids, _ = sample_with_teacher(model, tok, cfg, args.top_k, progress=False, cache=False)
        sync()
        sec = time.perf_counter() - t0
        first = ids if first is None else first
        same = float((ids == first).float().mean())
        rows.append({"batch": b, "samples": args.samples, "length": args.length, "top_k": args.top_k,
                     "seconds": sec, "samples_per_s": args.samples / sec, "same_tokens": same})
        print(json.dumps(rows[-1]), flush=True)
    label = f"{machine_label() if args.device != 'cpu' else 'CPU'}, {datetime.date.today()}"
    print(f"\n{args.samples} self-samples of {args.length} tokens + top-{args.top_k} teacher, {label}\n")
    print("| sequences a forward | seconds | samples/s | tokens as the first row's |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['seconds']:.1f} | {r['samples_per_s']:.1f} | {100 * r['same_tokens']:.2f}% |")
    if args.json:
        args.json.write_text(json.dumps({"machine": label, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
