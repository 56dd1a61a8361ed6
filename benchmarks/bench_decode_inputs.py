"""Host time of building one decode step's input tensors (ModelRunner._decode_inputs).

    python benchmarks/bench_decode_inputs.py [--batch 64] [--widths 16,256,512]

The CUDA-graph decode path pads every sequence's block table to the graph's width,
max_model_len / block_size (256 columns at 4k tokens, 512 at 8k), on the host at every step.
This times that function alone for ``--batch`` sequences of 180 tokens (12 blocks each) at
each width: median of 50 calls after warm-up, one torch thread, CPU only (no copies to a
device). Prints a Markdown table with date and machine.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spear.serve.model_runner import ModelRunner  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="sequences in the step (default: %(default)s)")
    p.add_argument("--widths", default="16,256,512",
                   help="block-table widths, each at least 12, the blocks a sequence uses (default: %(default)s)")
    args = p.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    if min(widths) < 12:
        p.error("--widths: each width must be at least 12 (the sequences use 12 blocks)")
    torch.set_num_threads(1)
    runner = SimpleNamespace(block_size=16, scratch_block=100_000)  # what _decode_inputs reads of the runner
    seqs = [SimpleNamespace(token_ids=list(range(180)), block_table=list(range(12 * i, 12 * i + 12)))
            for i in range(args.batch)]
    step = SimpleNamespace(chunks=[SimpleNamespace(seq=s, start=179) for s in seqs])
    print(f"Decode inputs, {datetime.date.today().isoformat()}, CPU ({platform.processor() or platform.machine()}), "
          f"torch {torch.__version__}, {args.batch} sequences\n")
    print("| table width | µs per step |\n|---:|---:|")
    for width in widths:
        for _ in range(5):
            ModelRunner._decode_inputs(runner, step, args.batch, width)
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            ModelRunner._decode_inputs(runner, step, args.batch, width)
            times.append(time.perf_counter() - t0)
        print(f"| {width} | {1e6 * statistics.median(times):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
