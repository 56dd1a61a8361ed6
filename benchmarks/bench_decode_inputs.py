"""Host time of building one decode step's input tensors (ModelRunner._decode_inputs).

    python benchmarks/bench_decode_inputs.py [--batch 64] [--cases 12:16,12:256,250:256,500:512] [--root DIR]

The CUDA-graph decode path gives every sequence a block-table row of the graph's width,
max_model_len / block_size (256 columns at 4k tokens, 512 at 8k), at every step. This times
that function alone for ``--batch`` sequences, each case USED:WIDTH being the blocks each
sequence uses (12 blocks: 180 tokens; 250: 4,000 tokens) and the table width: median of 50
steps after warm-up, the sequences advancing one token per step (a new block every 16 steps),
one torch thread, CPU only (no copies to a device). Prints a Markdown table with date and machine.
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



def _import_runner(root: Path):
    """ModelRunner and BlockTables (None before it existed) of the spear tree at ``root``."""
    sys.path.insert(0, str(root))
    from spear.serve.model.model_runner import ModelRunner
    try:
        from spear.serve.model.block_tables import BlockTables
    except ImportError:  # an older tree: _decode_inputs built the tables at every step
        BlockTables = None
    return ModelRunner, BlockTables


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="sequences in the step (default: %(default)s)")
    p.add_argument("--cases", default="12:16,12:256,12:512,128:256,250:256,500:512",
                   help="USED:WIDTH pairs: blocks each sequence uses, block-table width (default: %(default)s)")
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                   help="the spear tree to time, e.g. a `git worktree` of an older commit (default: this one)")
    args = p.parse_args(argv)
    ModelRunner, BlockTables = _import_runner(args.root)
    try:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
    except ValueError:
        p.error(f"--cases: expected USED:WIDTH pairs, got {args.cases!r}")
    for used, width in cases:
        if not 1 <= used <= width - 4:
            p.error(f"--cases {used}:{width}: need 1 <= USED <= WIDTH - 4 (the sequences grow by up to 4 blocks)")
    torch.set_num_threads(1)
    print(f"Decode inputs ({args.root}), {datetime.date.today().isoformat()}, CPU ({platform.processor() or platform.machine()}), "
          f"torch {torch.__version__}, {args.batch} sequences\n")
    print("| blocks used | table width | µs per step |\n|---:|---:|---:|")
    for used, width in cases:
        bs = 16
        # what _decode_inputs reads of the runner
        runner = SimpleNamespace(block_size=bs, scratch_block=100_000,
                                 _block_tables=BlockTables(width, 100_000) if BlockTables else None)
        seqs = [SimpleNamespace(request_id=str(i), token_ids=[0] * (used * bs + 1),
                                block_table=list(range(width * i, width * i + used))) for i in range(args.batch)]
        step = SimpleNamespace(chunks=[SimpleNamespace(seq=s, start=used * bs - 8) for s in seqs])
        times = []
        for it in range(55):
            for c in step.chunks:  # one token further; a new block when the position crosses one
                c.start += 1
                if c.start // bs >= len(c.seq.block_table):
                    c.seq.block_table.append(c.seq.block_table[-1] + 1)
                c.seq.token_ids.append(0)
            t0 = time.perf_counter()
            ModelRunner._decode_inputs(runner, step, args.batch, width)
            if it >= 5:
                times.append(time.perf_counter() - t0)
        print(f"| {used} | {width} | {1e6 * statistics.median(times):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
