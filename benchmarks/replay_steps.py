"""Replay the steps a bench_slo run recorded (``steps.json``) against a latency table: the share of
predictions within 10% of the measured step time (its interval from the previous step's end where
the run recorded it, else its wall time), with the table as measured and with the online correction
(``spear.serve.latency.table.Correction``) fed the measured times in order.

    python benchmarks/replay_steps.py STEPS_JSON TABLE_JSON [--max-num-seqs 64] [--runs SUBSTRING]

Predictions follow the scheduler's rules (spear/serve/core/scheduler.py): a mixed step at its padded
size, a decode-only step at its decode count (``--decode-batch padded``: at its decode graph's
batch, ``graph_batch_sizes``, the rule the scheduler does not use). The schedule itself is the
recorded one: this scores the latency model on those steps, not a scheduler that would have
chosen differently with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spear.serve.latency.table import Correction, load_table, quantile  # noqa: E402
from spear.serve.model.model_runner import graph_batch_sizes  # noqa: E402

TOL = 0.10


def replay_steps(rows: list, table, decode_sizes: list[int]) -> list[tuple[int, float, float, float]]:
    """Per recorded step with decodes, in order: (kind, measured, table's prediction, corrected
    prediction); the correction learns from each step after its prediction, as the scheduler's."""
    corr, out = Correction(), []
    for decodes, _tokens, padded, context, _pred, wall, *interval in rows:
        measured = interval[0] if interval else wall  # runs before the interval column: the wall time
        if not decodes:
            continue
        if padded:
            kind, table_ms = padded, table.predict(decodes, padded, context)
        else:
            batch = next((b for b in decode_sizes if b >= decodes), decodes)  # no sizes: the decode count
            kind, table_ms = 0, table.predict(batch, 0, context)
        out.append((kind, measured, table_ms, table_ms * corr.factor(kind)))
        corr.observe(kind, table_ms, measured)
    return out


def within(pairs) -> float:
    """Share of (measured, predicted) pairs within TOL of the measured time."""
    pairs = list(pairs)
    return sum(abs(p - m) <= TOL * m for m, p in pairs) / max(len(pairs), 1)


def replay(rows: list, table, decode_sizes: list[int]) -> tuple[float, float, int]:
    """(share within TOL as measured, share within TOL corrected, steps with a prediction)."""
    steps = replay_steps(rows, table, decode_sizes)
    return within((m, t) for _, m, t, _ in steps), within((m, c) for _, m, _, c in steps), len(steps)


def by_kind(steps) -> list[tuple]:
    """Per kind of step (0: decode-only, else the padded size): steps, the median of measured / table
    - 1, the share within TOL as measured and corrected, and the 0.9- and 0.99-quantiles of
    measured / corrected - 1."""
    out = []
    for kind in sorted({k for k, *_ in steps}):
        s = [x for x in steps if x[0] == kind]
        out.append((kind, len(s), quantile([m / t - 1 for _, m, t, _ in s], 0.5), within((m, t) for _, m, t, _ in s),
                    within((m, c) for _, m, _, c in s), quantile([m / c - 1 for _, m, _, c in s], 0.9),
                    quantile([m / c - 1 for _, m, _, c in s], 0.99)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("steps", help="steps.json of a bench_slo run")
    p.add_argument("table", help="the latency table the run used (spear-latency-table JSON)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the runs' max_num_seqs (decode graph batches)")
    p.add_argument("--decode-batch", choices=["real", "padded"], default="real",
                   help="price decode-only steps at their decode count (the scheduler's rule) or at the padded "
                        "batch of their decode graph")
    p.add_argument("--runs", default="slo", help="replay the runs whose name contains this (default: slo)")
    p.add_argument("--by-kind", action="store_true", help="also a table per kind of step (decode-only, each "
                                                             "padded size)")
    args = p.parse_args(argv)
    data = json.loads(Path(args.steps).read_text())
    table = load_table(args.table)
    sizes = graph_batch_sizes(args.max_num_seqs) if args.decode_batch == "padded" else []
    print("| run | steps | within 10%, table | within 10%, corrected |\n|---|---:|---:|---:|")
    runs = {name: rows for name, rows in data["runs"].items() if args.runs in name}
    for name, rows in runs.items():
        plain, fixed, n = replay(rows, table, sizes)
        print(f"| {name} | {n} | {100 * plain:.0f}% | {100 * fixed:.0f}% |")
    if args.by_kind:
        print("\n| run | step tokens (0: decode-only) | steps | measured / table - 1, median | within 10%, table | "
              "within 10%, corrected | measured / corrected - 1, q90 / q99 |\n|---|---:|---:|---:|---:|---:|---:|")
        for name, rows in runs.items():
            for kind, n, med, plain, fixed, q90, q99 in by_kind(replay_steps(rows, table, sizes)):
                print(f"| {name} | {kind} | {n} | {100 * med:+.1f}% | {100 * plain:.0f}% | {100 * fixed:.0f}% | "
                      f"{100 * q90:+.1f}% / {100 * q99:+.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
