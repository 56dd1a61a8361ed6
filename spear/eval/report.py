"""Result rows, gap recovered, and the tables spear prints and saves."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path

from spear.fileio import write_text_atomic


@dataclass
class Row:
    method: str
    ppl: float
    memory_pct: float = 0.0  # extra bytes / quantized model bytes, in %
    extra_bytes: int = 0
    gap_recovered: float | None = None  # %, filled by fill_gap
    details: dict = field(default_factory=dict)


def gap_recovered(ppl_w: float, ppl_method: float, ppl_fp: float) -> float:
    """(ppl_W4 − ppl_method) / (ppl_W4 − ppl_FP), in %."""
    gap = ppl_w - ppl_fp
    if gap == 0:
        return float("nan")
    return 100.0 * (ppl_w - ppl_method) / gap


def fill_gap(rows: list[Row], fp: float, base: float) -> None:
    for r in rows:
        r.gap_recovered = gap_recovered(base, r.ppl, fp)


def machine_label() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"CPU {platform.machine()}, {os.cpu_count()} cores"


def markdown_table(rows: list[Row]) -> str:
    """The results table; calibrated rows add their held-out self-sample KL at the start and the end."""
    kl = any("initial_val_kl" in r.details for r in rows)
    lines = ["| method | ppl | gap recovered | extra memory |" + (" val KL start → end |" if kl else ""),
             "|---|---:|---:|---:|" + ("---:|" if kl else "")]
    for r in rows:
        gap = "—" if r.gap_recovered is None else f"{r.gap_recovered:.1f}%"
        mem = "—" if not r.extra_bytes else f"{r.memory_pct:.2f}% ({r.extra_bytes / 2**20:.2f} MiB)"
        line = f"| {r.method} | {r.ppl:.2f} | {gap} | {mem} |"
        if kl:
            d = r.details
            line += (f" {d['initial_val_kl']:.4f} → {d['val_kl']:.4f}" + (" (start kept)" if d.get("kept") == "init" else "")
                     + " |") if "initial_val_kl" in d else " — |"
        lines.append(line)
    return "\n".join(lines)


def write_report(out_dir: str | os.PathLike, name: str, rows: list[Row], header: dict) -> tuple[Path, Path]:
    """Write ``name.json`` and ``name.md`` atomically into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = {"date": date.today().isoformat(), "machine": machine_label(), **header}
    payload = {**header, "rows": [asdict(r) for r in rows]}
    md = "\n".join(f"- {k}: {v}" for k, v in header.items()) + "\n\n" + markdown_table(rows) + "\n"
    paths = (out / f"{name}.json", out / f"{name}.md")
    for path, text in zip(paths, (json.dumps(payload, indent=2), md)):
        write_text_atomic(path, text)
    return paths
