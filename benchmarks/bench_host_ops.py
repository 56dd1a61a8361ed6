"""Host time of the pieces of a mixed step that do not scale with the GPU.

    python benchmarks/bench_host_ops.py

* the W4 op called through the registered op (``torch.ops.spear.w4a16_ec``, the torch.compile path)
  against its body called directly (what the engine's layers do outside torch.compile), on a
  32 x 64 layer on the CPU, where the body is the small torch reference: the difference is the
  dispatcher's argument handling;
* ``ModelRunner.mixed_inputs`` for 20 decodes at a 300-token context and a 492-token chunk at 1,000.
Medians of repeated calls; prints a Markdown table with date and machine.
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

from spear.kernels import ops  # noqa: E402
from spear.kernels.layout import pack  # noqa: E402
from spear.kernels.policy import KernelPolicy  # noqa: E402
from spear.quant.primitives import rtn  # noqa: E402
from spear.serve.model.block_tables import BlockTables  # noqa: E402
from spear.serve.model.model_runner import ModelRunner  # noqa: E402
from spear.serve.core.scheduler import ScheduledChunk, SchedulerOutput  # noqa: E402


def median_us(fn, reps: int = 300, rounds: int = 5) -> float:
    fn()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - t) / reps * 1e6)
    return statistics.median(out)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    codes, scales, zeros = rtn(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) * 0.05, 4, 32, True)
    w = pack(codes, scales.half(), zeros, 32, True)
    x = torch.randn(1, 64)
    policy = KernelPolicy()
    args = (x, w.qweight, w.scales, w.zeros, w.locks, w.group_size, w.symmetric, w.layout_id, None, None, None, None,
            None, None, None, 0.0, 0.0, 0, list(policy.op_args), 0)
    registered = median_us(lambda: torch.ops.spear.w4a16_ec(*args))
    direct = median_us(lambda: ops.w4a16_ec_impl(x, w, None, None, 0, policy, 0))

    runner = ModelRunner.__new__(ModelRunner)  # only what mixed_inputs reads
    runner.block_size, runner.device, runner.cos, runner.sin = 16, torch.device("cpu"), None, None
    runner._block_tables = BlockTables(256, 9999)
    seqs = [SimpleNamespace(request_id=f"r{i}", token_ids=list(range(2000)), block_table=list(range(130 * i, 130 * i + 128)),
                            num_tokens=301 if i < 20 else 2000) for i in range(21)]
    step = SchedulerOutput([ScheduledChunk(s, 300, 1) for s in seqs[:20]] + [ScheduledChunk(seqs[20], 1000, 492)])
    inputs = median_us(lambda: runner.mixed_inputs(step), reps=50)

    machine = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    print(f"Host ops, {datetime.date.today().isoformat()}, {machine}, torch {torch.__version__}\n")
    print("| what | µs per call |\n|---|---:|")
    print(f"| W4 op through the registered op (torch.compile path) | {registered:.1f} |")
    print(f"| W4 op body called directly (the engine's layers) | {direct:.1f} |")
    print(f"| dispatcher cost | {registered - direct:.1f} |")
    print(f"| mixed_inputs: 20 decodes + a 492-token chunk | {inputs:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
