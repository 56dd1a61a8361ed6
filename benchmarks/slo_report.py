"""The acceptance floors and table of a latency-target grid run in parts: the ``results.json`` of
several ``bench_slo.py`` runs (e.g. one per density) scored together, since floors such as "a static
budget tuned on plain W4 misses once compensators are dense" compare rows of different parts.

    python benchmarks/slo_report.py --out OUT RUN1/results.json RUN2/results.json ...

Writes ``OUT/table.md`` and ``OUT/floors.md`` as ``bench_slo.py`` does; a case present in two
parts is an error (the parts must not overlap).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import slo_cases as cases  # noqa: E402
from bench_slo import markdown  # noqa: E402

def case_rows(rows: list[dict]) -> list[tuple[cases.Case, dict]]:
    """(case, row) of results rows (rows with an error are left out); a repeated case raises."""
    densities = {d.name: d for d in cases.DENSITIES}
    workloads = {w.name: w for w in cases.WORKLOADS}
    out, seen = [], set()
    for r in rows:
        if "error" in r:
            continue
        key = (r["density"], r["workload"], r["scheduler"], r["target_ms"])
        if key in seen:
            raise ValueError(f"case {key} is in more than one part")
        seen.add(key)
        sched = cases.Scheduler(r["scheduler"], r["budget"], r["scheduler"] == "slo")
        out.append((cases.Case(r["target_ms"], densities[r["density"]], workloads[r["workload"]], sched), r))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="results.json files of bench_slo.py runs")
    p.add_argument("--out", required=True, help="folder for table.md and floors.md")
    args = p.parse_args(argv)
    parts = [json.loads(Path(f).read_text()) for f in args.results]
    rows = [r for part in parts for r in part["rows"]]
    try:
        scored = case_rows(rows)
    except ValueError as exc:
        p.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = "; ".join(dict.fromkeys(part["header"] for part in parts))
    (out / "table.md").write_text(markdown(rows, header) + "\n")
    floors = cases.floors_markdown(cases.floors(scored))
    (out / "floors.md").write_text(floors)
    print(floors, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
